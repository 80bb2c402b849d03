"""The tiny random-weight checkpoints of the torch tests (``tests/tiny_checkpoints.py``)."""

from tiny_checkpoints import tiny

__all__ = ["tiny"]
