"""Prompts in, completions out: the m11 engine driving one ``TorchExecutor`` (world size 1).

The scheduler is the top rung of the ladder, unchanged; this module only
builds its requests, sizes the page pool and turns the run into
per-request ids and text.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mechserve.backends.llama import LlamaModel
from mechserve.backends.torch_executor import TorchExecutor
from mechserve.spec import m11_parallelism as m11

# Default cap on the KV cache when the pool is sized automatically.
DEFAULT_KV_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler sizes: per-step token budget, page size, pool size (None = sized to fit), guesses per window."""

    max_step_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None
    spec_len: int = 0
    max_kv_bytes: int = DEFAULT_KV_BYTES

    def __post_init__(self) -> None:
        if self.max_step_tokens <= 0:
            raise ValueError(f"max_step_tokens must be > 0, got {self.max_step_tokens}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {self.num_pages}")
        if self.spec_len < 0:
            raise ValueError(f"spec_len must be >= 0, got {self.spec_len}")


@dataclass(frozen=True, slots=True)
class Completion:
    """One request's result: generated ids (an ending EOS id included) and their text (None without a tokenizer)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """Step records of the run, one completion per prompt (prompt order) and the engine's summary."""

    records: list[m11.StepRecord]
    completions: list[Completion]
    summary: list[dict[str, Any]]
    num_pages: int


def configure_threads() -> int:
    """Use one intra-op thread per CPU this process may run on (torch may see the host's); returns it."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    if torch.get_num_threads() > cpus:
        torch.set_num_threads(cpus)
    return torch.get_num_threads()


def auto_num_pages(
    prompt_lens: Sequence[int], max_new_tokens: int, page_size: int, model: LlamaModel, max_kv_bytes: int
) -> int:
    """Pages for every request to be resident at once, capped at ``max_kv_bytes`` of K and V.

    Never fewer than the longest single request needs, so the pool is never
    irreducible for the workload.
    """
    need = [m11.pages_for(n + max_new_tokens, page_size) for n in prompt_lens]
    a = model.arch
    page_bytes = 2 * a.num_layers * page_size * a.num_kv_heads * a.head_dim * model.dtype.itemsize
    return max(max(need), min(sum(need), max_kv_bytes // page_bytes))


def generate(
    model: LlamaModel,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    tokenizer: Any | None = None,
    eos_token_ids: Sequence[int] = (),
    config: EngineConfig | None = None,
    arrivals: Sequence[int] | None = None,
    on_step: Callable[[m11.StepRecord], None] | None = None,
) -> GenerateResult:
    """Run ``prompts`` (strings need ``tokenizer``; no chat template) through the m11 engine.

    Greedy decoding; a sampled id in ``eos_token_ids`` ends a request.
    ``arrivals`` (one per prompt, default all 0) is the step at which each
    request arrives.  ``on_step`` sees each step record as it is produced.  Raises
    ``ValueError`` for bad sizes or an empty prompt and ``m11.OutOfPages``
    when the pool cannot hold the work.
    """
    config = config or EngineConfig()
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    prompt_ids = [_encode(p, tokenizer) for p in prompts]
    arrivals = list(arrivals) if arrivals is not None else [0] * len(prompt_ids)
    if len(arrivals) != len(prompt_ids):
        raise ValueError(f"{len(arrivals)} arrival step(s) for {len(prompt_ids)} prompt(s)")
    requests = [
        m11.Request(f"r{i}", list(ids), max_new_tokens, arrival_step=step)
        for i, (ids, step) in enumerate(zip(prompt_ids, arrivals))
    ]
    num_pages = config.num_pages or auto_num_pages(
        [len(ids) for ids in prompt_ids] or [1], max_new_tokens, config.page_size, model, config.max_kv_bytes
    )
    executor = TorchExecutor(model, num_pages, config.page_size)
    for r in requests:
        executor.add_request(r.request_id, r.tokens)
    engine = m11.Engine(
        requests,
        max_step_tokens=config.max_step_tokens,
        page_size=config.page_size,
        num_pages=num_pages,
        spec_len=config.spec_len,
        world_size=1,
        executors=[executor],
        eos_token_ids=tuple(eos_token_ids),
    )

    def step_done(record: m11.StepRecord) -> None:
        for request_id in record.finished:
            executor.release(request_id)
        if on_step is not None:
            on_step(record)

    records = engine.run(step_done)
    eos = set(eos_token_ids)
    completions = []
    for r in requests:
        ids = tuple(r.output_ids)
        text = None
        if tokenizer is not None:
            shown = ids[:-1] if ids and ids[-1] in eos else ids
            text = continuation_text(tokenizer, r.tokens, shown)
        reason = r.finish_reason.value if r.finish_reason else None
        completions.append(Completion(r.request_id, tuple(r.tokens), ids, text, reason))
    return GenerateResult(records, completions, engine.summary(), num_pages)


def continuation_text(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The text ``output_ids`` add after the prompt.

    Decoding the ids alone would lose what a tokenizer's decoder puts between
    tokens (a WordPiece space, a merged byte); decode with the prompt and
    strip the prompt's own text instead.
    """
    prefix: str = tokenizer.decode(list(prompt_ids))
    full: str = tokenizer.decode([*prompt_ids, *output_ids])
    return full[len(prefix) :] if full.startswith(prefix) else str(tokenizer.decode(list(output_ids)))


def _encode(prompt: str | Sequence[int], tokenizer: Any | None) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        return list(tokenizer(prompt).input_ids)
    return [int(t) for t in prompt]
