"""Tiny random-weight Llama-family checkpoints built in the test session, and HF reference helpers.

Imported as ``tiny_checkpoints`` (``tests/`` is on ``sys.path``); ``tests/executor``, ``tests/model``
and ``tests/kv`` re-export its ``tiny`` fixture from their ``conftest.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from tiny_models import VOCAB, hf_greedy, random_prompts, save_tiny, tiny_config

from mechserve.model.llama import LlamaModel
from mechserve.model.loader import load_model

__all__ = ["VOCAB", "Tiny", "build_tiny", "hf_greedy", "random_prompts", "save_tiny", "tiny_config"]


@dataclass
class Tiny:
    path: Path
    hf: Any
    model: LlamaModel


def build_tiny(path: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Tiny:
    hf = save_tiny(path, tiny_config(model_type, **overrides), seed)
    return Tiny(path, hf, load_model(str(path), tokenizer=False).model)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """The default tiny Llama (untied head)."""
    return build_tiny(tmp_path_factory.mktemp("tiny-llama"))
