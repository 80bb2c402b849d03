"""Building and loading the C++ kernels (``build``); the kernels themselves live beside their users."""
