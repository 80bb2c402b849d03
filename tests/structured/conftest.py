"""A tiny random Llama with a byte-level tokenizer (``tiny_models.save_byte_tokenizer``): any text is a
token string, so its constrained outputs can be parsed, while its unconstrained ones are noise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from tiny_models import BYTE_VOCAB, save_byte_tokenizer, save_tiny, tiny_config

from mechserve.api.config import EngineConfig
from mechserve.engine.core import EngineCore
from mechserve.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-bytes")
    save_tiny(path, tiny_config(vocab_size=BYTE_VOCAB, eos_token_id=0, bos_token_id=0), seed=3)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def byte_model(byte_dir: Path) -> LoadedModel:
    """The byte-level tiny model, EOS id 0."""
    loaded = load_model(str(byte_dir))
    return LoadedModel(loaded.path, loaded.model, loaded.tokenizer, (0,))


def byte_core(loaded: LoadedModel, **config: Any) -> EngineCore:
    """An ``EngineCore`` on the byte model (page size 4, 256 pages unless given)."""
    config.setdefault("page_size", 4)
    config.setdefault("num_pages", 256)
    return EngineCore(loaded, EngineConfig(**config))


@pytest.fixture(scope="session")
def tiny_word(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with the word tokenizer (``w0`` .. ``w127``), which llguidance cannot read."""
    from tiny_models import save_word_tokenizer

    path = tmp_path_factory.mktemp("tiny-words")
    save_tiny(path, tiny_config())
    save_word_tokenizer(path)
    return load_model(str(path))
