"""mechserve: an LLM serving engine whose scheduler is an executable specification."""

__version__ = "0.1.0"
