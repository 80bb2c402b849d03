"""Models for the EngineCore, LLM and torch CLI tests: a tiny random Llama with a word tokenizer, a rigged model,
and EAGLE draft heads trained in seconds on a tiny model's own outputs.

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

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
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

from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.model import eagle
from mechserve.model.eagle_train import TrainSettings, draft_vocab, record, train_head
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


def answer(
    c: EngineCore, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
) -> tuple[list[list[int]], list[Any]]:
    """Every prompt (ids) submitted to ``c`` at once with its ``params`` (one for all, or one each), run until idle:
    the output ids in prompt order and the step records; checks that every page came back."""
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [c.add_request(list(p), sp) for p, sp in zip(prompts, each)]
    outs = drain(c)
    done = {o.request_id: list(o.outputs[0].token_ids) for out in outs for o in out.finished}
    c.check_pages()
    return [done[i] for i in ids], [out.record for out in outs]


def drafted_and_accepted(records: Sequence[Any]) -> tuple[int, int]:
    """Guesses drafted and accepted over ``records`` (the step records' ``drafted`` / ``accepted``)."""
    return (
        sum(sum(r.drafted.values()) for r in records),
        sum(sum(r.accepted.values()) for r in records),
    )


# EAGLE heads trained in seconds ------------------------------------------------------------------------------------


def greedy_sequences(
    model: Any, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """Each prompt with ``model``'s greedy continuation of ``max_tokens`` ids (teacher-forced forwards, no engine)."""
    found = []
    for p in prompts:
        ids = list(p)
        for _ in range(max_tokens):
            ids.append(int(record(model, ids, len(ids) - 1).labels[-1]))
        found.append((list(p), ids[len(p) :]))
    return found


def train_tiny_head(
    model: Any,
    directory: Path,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    steps: int = 60,
    window: int = 4,
    spec_len: int = 3,
    chosen: bool = False,
) -> Path:
    """An EAGLE head for ``model`` (a ``LlamaModel``) trained in seconds on ``sequences`` (prompt ids, output ids:
    the model's own outputs, as ``train-draft`` trains on them), written into ``directory`` as ``train-draft``
    writes one; returns ``directory``.

    ``chosen``: the guesses are trained toward the ids the outputs hold rather than the model's argmax, with the
    cross-entropy weighted as the regression: for outputs a grammar chose (structured outputs), where a random
    model's argmax is almost never allowed, so that guesses are accepted and verification is tested over them.
    """
    data = [record(model, [*p, *o], len(p) - 1) for p, o in sequences if o]
    if chosen:
        for r in data:
            nxt = torch.tensor(r.ids[r.first + 1 :], dtype=torch.int64)  # the id that followed each row
            r.labels[: len(nxt)] = nxt
    settings = TrainSettings(
        window=window, spec_len=spec_len, batch_size=8, steps=steps, lr=3e-3, cls_weight=1.0 if chosen else 0.1
    )
    head = eagle.EagleHead(eagle.HeadConfig.of(model, window))
    head.init_weights(0)
    train_head(head, eagle.Shared(model), data, settings, math.inf, lambda line: None)
    eagle.save(directory, head, draft_vocab(data, model.arch.vocab_size), model, eagle.model_fingerprint(model), {})
    return directory


def eagle_spec(head: Path, k: int = 3, **extra: Any) -> SpeculativeConfig:
    """``--spec-method eagle`` with the head in ``head``: ``k`` guesses per window, fixed (not adaptive)."""
    return SpeculativeConfig(method="eagle", num_speculative_tokens=k, adaptive=False, eagle_head=str(head), **extra)


HEAD_PROMPTS = random_prompts([6, 9, 4, 11, 7, 5, 8, 10, 12, 6, 3, 9], seed=71)


@pytest.fixture(scope="session")
def tiny_head(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head for ``tiny`` trained in seconds on its greedy continuations of ``HEAD_PROMPTS`` (24 ids each)."""
    sequences = greedy_sequences(tiny.model, HEAD_PROMPTS, 24)
    return train_tiny_head(tiny.model, tmp_path_factory.mktemp("tiny-head"), sequences)


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
