"""The tiny model with a word tokenizer, and the rigged model (``tests/tiny_engines.py``)."""

from tiny_engines import tiny, tiny_dir, tiny_hf

__all__ = ["tiny", "tiny_dir", "tiny_hf"]
