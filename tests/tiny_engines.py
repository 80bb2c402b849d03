"""Models for the EngineCore, LLM and torch CLI tests: a tiny random Llama with a word tokenizer, and a rigged model.

Imported as ``tiny_engines`` (``tests/`` is on ``sys.path``); the folders that use its fixtures
re-export them from their ``conftest.py``.

The rigged model is a real 1-layer Llama whose attention and MLP write
nothing and whose head maps each token's one-hot embedding to a chosen
successor, so greedy decoding follows a fixed sequence through the real
executor: with a toy tokenizer whose tokens are multi-character strings
(``ABC``, ``DEF``, ``GHI``) or pieces of one UTF-8 character, it produces
exactly the text a test needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from tiny_models import (
    CHAT_TEMPLATE,
    VOCAB,
    hf_greedy,
    random_prompts,
    save_successor_model,
    save_tiny,
    save_word_tokenizer,
    tiny_config,
    words,
)

from mechserve.api.config import EngineConfig
from mechserve.engine.core import EngineCore
from mechserve.model.loader import LoadedModel, load_model

# Re-exported for the test modules.
__all__ = ["CHAT_TEMPLATE", "VOCAB", "hf_greedy", "random_prompts", "save_tiny", "tiny_config", "words"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A saved tiny Llama with a word-level tokenizer (``w0`` .. ``w127``, id = number) and a chat template."""
    path = tmp_path_factory.mktemp("tiny-llm")
    hf = save_tiny(path, tiny_config())
    save_word_tokenizer(path)
    return path, hf


@pytest.fixture(scope="session")
def tiny(tiny_dir: tuple[Path, Any]) -> LoadedModel:
    """The tiny model, loaded once (its EOS ids are empty: it never stops early)."""
    return load_model(str(tiny_dir[0]))


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir: tuple[Path, Any]) -> Any:
    return tiny_dir[1]


def with_eos(loaded: LoadedModel, eos: Sequence[int]) -> LoadedModel:
    """``loaded`` with other EOS ids (the weights are shared)."""
    return LoadedModel(loaded.path, loaded.model, loaded.tokenizer, tuple(eos))


def core(loaded: LoadedModel, **config: Any) -> EngineCore:
    """An ``EngineCore`` on ``loaded`` (page size 4, 64 pages unless given)."""
    config.setdefault("page_size", 4)
    config.setdefault("num_pages", 64)
    return EngineCore(loaded, EngineConfig(**config))


def byte_core(loaded: LoadedModel, **config: Any) -> EngineCore:
    """An ``EngineCore`` on the byte-level tiny model of ``tests/structured`` (page size 4, 256 pages unless given)."""
    config.setdefault("page_size", 4)
    config.setdefault("num_pages", 256)
    return EngineCore(loaded, EngineConfig(**config))


def drain(c: EngineCore, limit: int = 10_000) -> list[Any]:
    """Step ``c`` until it is idle; return the StepOutputs."""
    outs = []
    while c.has_unfinished():
        outs.append(c.step())
        assert len(outs) < limit, "the engine did not finish"
    return outs


# The toy tokenizer and the rigged model ------------------------------------------------------------------------------


class ToyTokenizer:
    """Tokens are byte strings; ``decode`` joins them and decodes UTF-8 with replacement (as byte-level BPE does).

    Id 0 is ``<eos>``, a special token (skipped unless ``skip_special_tokens=False``).
    """

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = [b"<eos>", *pieces]
        self.eos_token_id = 0
        self.all_special_ids = [0]

    def __len__(self) -> int:
        return len(self.pieces)

    def id(self, piece: bytes | str) -> int:
        return self.pieces.index(piece.encode() if isinstance(piece, str) else piece)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i in self.all_special_ids)]
        return b"".join(self.pieces[i] for i in kept).decode("utf-8", errors="replace")


def rigged(path: Path, tokenizer: ToyTokenizer, successor: Mapping[int, int], eos: Sequence[int] = ()) -> LoadedModel:
    """A real 1-layer Llama whose greedy choice after token ``i`` is ``successor[i]`` (else ``i`` itself)
    (``save_successor_model``), with ``tokenizer`` and the EOS ids ``eos``."""
    vocab = max(16, 2 * ((len(tokenizer) + 1) // 2))
    save_successor_model(path, successor, vocab, max_position_embeddings=256)
    model = load_model(str(path), tokenizer=False).model
    return LoadedModel(path, model, tokenizer, tuple(eos))
