"""The tiny model with a word tokenizer, an EAGLE head for it, and the rigged model (``tests/tiny_engines.py``)."""

from tiny_engines import tiny, tiny_dir, tiny_head, tiny_hf

__all__ = ["tiny", "tiny_dir", "tiny_head", "tiny_hf"]
