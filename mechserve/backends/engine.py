"""Prompts in, completions out: the m12 engine driving one ``TorchExecutor`` (world size 1).

The scheduler is the top rung of the ladder, unchanged; this module only
builds its requests, sizes and checks the page pool and turns the run into
per-request ids and text.  A run has two phases, so that nothing large is
allocated for work that cannot be done::

    Generation(model, prompts, ...)   tokenize; size the pool (num_pages, kv_memory or
                                      automatic); refuse a KV cache larger than the
                                      budget or the available memory (KVMemoryError);
                                      build the m12 engine: its door rejects what can
                                      never be served (too long for the model, never fits)
    Generation.allocate()             allocate the KV cache (run does it if not done)
    Generation.run(on_step)           run, collect completions

``generate(...)`` does both.  The long-lived, step-at-a-time engine that
``LLM``, ``mechserve generate`` and ``mechserve run --backend torch`` drive is
``mechserve.engine_core.EngineCore``; it shares this module's pool sizing
(``size_pool``), memory check (``check_kv_memory``) and cache allocation
(``new_executor``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mechserve.backends.llama import LlamaModel
from mechserve.backends.speculative import MAX_SPEC_LEN, SpeculativeConfig
from mechserve.backends.torch_executor import TorchExecutor
from mechserve.spec import m12_admission_control as m12

# Cap on the KV cache when the pool is sized automatically (no num_pages, no kv_memory).
DEFAULT_KV_BYTES = 2 << 30
# A long-lived engine's automatic pool holds at most this many positions (or one full context, if larger).
AUTO_MAX_POSITIONS = 16_384
# vLLM's chunked-prefill default; a smaller budget splits a long prompt into many slower steps.
DEFAULT_MAX_STEP_TOKENS = 2048
# The spec's page pool keeps Python bookkeeping per slot; the workload limits of the CLI.
MAX_PAGES = 1_000_000
MAX_SLOTS = 16_777_216
MEMINFO = "/proc/meminfo"


class KVMemoryError(ValueError):
    """The KV cache would not fit: over the ``kv_memory`` budget, over the available memory, or its
    allocation failed.  ``sized_by`` says what chose ``num_pages``: ``"num_pages"``, ``"kv_memory"``
    or ``"auto"``."""

    def __init__(self, message: str, *, kv_bytes: int, num_pages: int, sized_by: str) -> None:
        super().__init__(message)
        self.kv_bytes = kv_bytes
        self.num_pages = num_pages
        self.sized_by = sized_by


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler sizes.

    ``max_step_tokens``: per-step token budget; ``page_size``: positions per
    page; ``num_pages``: the pool (None = sized: from ``kv_memory`` when
    given, else enough for every request at once, capped at ``max_kv_bytes``
    but never fewer than the longest request needs); ``spec_len``: guesses
    per decode window; ``kv_memory``: a KV budget in bytes that the cache
    must fit; ``max_model_len``: the longest prompt + output a request may
    have (None = the model's ``max_position_embeddings``); ``check_memory``:
    refuse a cache larger than the available memory (``/proc/meminfo``);
    ``prefix_caching``: reuse and publish prompt pages (vLLM's
    ``enable_prefix_caching``); ``hold_shared_prefix``: with prefix caching,
    admit a request only once the prompt prefix it shares with a running
    request is cached, so that the shared part is computed once (m12's
    option, SGLang's in-batch prefix caching); ``max_running`` / ``max_waiting``: m12's
    limits on running and waiting requests (None = no limit);
    ``speculative``: what drafts the guesses (``SpeculativeConfig``; its
    ``num_speculative_tokens`` becomes ``spec_len``, which must then be 0 or
    equal to it).  ``spec_len > 0`` without ``speculative`` is prompt lookup.
    ``world_size``: tensor-parallel ranks (``EngineCore`` only; > 1 runs rank
    processes, see ``mechserve.backends.rank_group``).
    """

    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS
    page_size: int = 16
    num_pages: int | None = None
    spec_len: int = 0
    max_kv_bytes: int = DEFAULT_KV_BYTES
    kv_memory: int | None = None
    max_model_len: int | None = None
    check_memory: bool = True
    prefix_caching: bool = True
    hold_shared_prefix: bool = True
    max_running: int | None = None
    max_waiting: int | None = None
    speculative: SpeculativeConfig | None = None
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.max_step_tokens <= 0:
            raise ValueError(f"max_step_tokens must be > 0, got {self.max_step_tokens}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {self.num_pages}")
        if not 0 <= self.spec_len <= MAX_SPEC_LEN:
            raise ValueError(f"spec_len must be in [0, {MAX_SPEC_LEN}], got {self.spec_len}")
        if self.kv_memory is not None and self.kv_memory <= 0:
            raise ValueError(f"kv_memory must be > 0, got {self.kv_memory}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.max_running is not None and self.max_running <= 0:
            raise ValueError(f"max_running must be > 0, got {self.max_running}")
        if self.max_waiting is not None and self.max_waiting <= 0:
            raise ValueError(f"max_waiting must be > 0, got {self.max_waiting}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size <= 0:
            raise ValueError(f"world_size must be an integer > 0, got {self.world_size!r}")
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")
            k = self.speculative.num_speculative_tokens
            if self.spec_len not in (0, k):
                raise ValueError(f"spec_len {self.spec_len} differs from speculative.num_speculative_tokens {k}")
            object.__setattr__(self, "spec_len", k)

    def speculative_config(self) -> SpeculativeConfig | None:
        """``speculative``, or prompt lookup with ``spec_len`` guesses when only ``spec_len`` is set (None: off)."""
        if self.speculative is not None or self.spec_len == 0:
            return self.speculative
        return SpeculativeConfig(method="ngram", num_speculative_tokens=self.spec_len)


@dataclass(frozen=True, slots=True)
class Completion:
    """One request's result: generated ids (an ending EOS id included) and their text (None without a
    tokenizer); ``rejected`` is the door's reason (then nothing was generated)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None
    rejected: str | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """A request the door refused: its id, the ``RejectReason`` name and the numbers behind it."""

    request_id: str
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """Step records of the run, one completion per prompt (prompt order) and the engine's summary."""

    records: list[m12.StepRecord]
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


def draft_page_bytes(draft: LlamaModel | None, page_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes a draft model's KV adds to one page (0 without a draft model): its pages mirror the target's."""
    return 0 if draft is None else page_bytes(draft, page_size, dtype)


def _draft_for(model: LlamaModel, spec: SpeculativeConfig | None) -> LlamaModel | None:
    """The draft model ``spec`` names (None unless its method is ``"draft"``), loaded next to ``model``."""
    if spec is None or spec.method != "draft" or spec.draft_model is None:
        return None
    from pathlib import Path

    from mechserve.backends.speculative import load_draft_model

    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    return load_draft_model(spec.draft_model, model, target_path=Path(source) if source else None)


def page_bytes(model: LlamaModel, page_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one KV page: K and V, every layer, ``page_size`` positions."""
    a = model.arch
    itemsize = (dtype or model.dtype).itemsize
    return 2 * a.num_layers * page_size * a.num_kv_heads * a.head_dim * itemsize


def available_memory(meminfo: str | None = None) -> int | None:
    """``MemAvailable`` in bytes from ``meminfo`` (default ``MEMINFO``); None where it cannot be read (not Linux)."""
    try:
        with open(meminfo or MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``12.3 GiB``, ``512.0 MiB``, ``64 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def max_pages(page_size: int) -> int:
    """The most pages a pool of ``page_size`` may have (``MAX_PAGES``, ``MAX_SLOTS`` slots)."""
    return max(1, min(MAX_PAGES, MAX_SLOTS // page_size))


def auto_num_pages(
    prompt_lens: Sequence[int],
    max_new_tokens: int,
    page_size: int,
    model: LlamaModel,
    max_kv_bytes: int,
    max_model_len: int | None = None,
) -> int:
    """Pages for every request to be resident at once, capped at ``max_kv_bytes`` of K and V.

    A request needs its largest frontier, prompt + ``max_new_tokens`` - 1
    positions (never more than ``max_model_len``; the door refuses longer
    ones).  Never fewer than the longest single request needs, so the pool is
    never irreducible for the workload, and never more than ``max_pages``.
    """
    limit = max_model_len if max_model_len is not None else 1 << 62
    need = [m12.pages_for(max(1, min(n + max(max_new_tokens - 1, 0), limit)), page_size) for n in prompt_lens]
    pages = max(max(need), min(sum(need), max_kv_bytes // page_bytes(model, page_size)))
    return min(pages, max_pages(page_size))


class _DeferredExecutor:
    """The rank executor the engine is built with before the KV cache exists; ``inner`` is set by ``run``."""

    def __init__(self) -> None:
        self.inner: TorchExecutor | None = None

    def execute(self, plan: tuple[m12.PlanItem, ...]) -> tuple[m12.Outcome, ...]:
        if not plan:
            return ()
        assert self.inner is not None, "the KV cache was never allocated"
        return tuple(self.inner.execute(plan))


class Generation:
    """One run, prepared: prompts through m12's door, the pool sized and its memory checked.

    Nothing large is allocated until ``run``.  Raises ``ValueError`` for bad
    sizes, ``KVMemoryError`` when the KV cache of the chosen pool exceeds
    ``config.kv_memory`` or the available memory.  ``rejections`` lists what
    the door refused (those requests never run).
    """

    def __init__(
        self,
        model: LlamaModel,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        tokenizer: Any | None = None,
        eos_token_ids: Sequence[int] = (),
        config: EngineConfig | None = None,
        arrivals: Sequence[int] | None = None,
        draft_model: LlamaModel | None = None,
    ) -> None:
        self.model = model
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        prompt_ids = [_encode(p, tokenizer) for p in prompts]
        arrivals = list(arrivals) if arrivals is not None else [0] * len(prompt_ids)
        if len(arrivals) != len(prompt_ids):
            raise ValueError(f"{len(arrivals)} arrival step(s) for {len(prompt_ids)} prompt(s)")
        if config.world_size != 1:
            raise ValueError("Generation runs one rank; use EngineCore (LLM, mechserve generate) for world_size > 1")
        self.max_model_len = config.max_model_len or model_context(model)
        self.draft_model = draft_model if draft_model is not None else _draft_for(model, config.speculative)
        self.num_pages, self.sized_by = self._size_pool([len(ids) for ids in prompt_ids], max_new_tokens)
        self.page_bytes = page_bytes(model, config.page_size) + draft_page_bytes(self.draft_model, config.page_size)
        self.kv_bytes = self.num_pages * self.page_bytes
        self._check_memory()
        self.requests = [
            m12.Request(f"r{i}", list(ids), max_new_tokens, arrival_step=step)
            for i, (ids, step) in enumerate(zip(prompt_ids, arrivals))
        ]
        self._executor = _DeferredExecutor()
        self.engine = m12.Engine(
            self.requests,
            max_step_tokens=config.max_step_tokens,
            page_size=config.page_size,
            num_pages=self.num_pages,
            spec_len=config.spec_len,
            world_size=1,
            executors=[self._executor],
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            prefix_caching=config.prefix_caching,
            hold_shared_prefix=config.hold_shared_prefix,
            max_running=config.max_running,
            max_waiting=config.max_waiting,
        )
        self.rejections = [
            Rejection(r.request_id, r.reject_reason.value, self._reject_detail(r))
            for r in self.requests
            if r.reject_reason is not None
        ]

    def _size_pool(self, prompt_lens: list[int], max_new_tokens: int) -> tuple[int, str]:
        c = self.config
        if c.num_pages is not None or c.kv_memory is not None:
            return size_pool(self.model, c)
        lens = prompt_lens or [1]
        return (
            auto_num_pages(lens, max_new_tokens, c.page_size, self.model, c.max_kv_bytes, self.max_model_len),
            "auto",
        )

    def _check_memory(self) -> None:
        """Raise ``KVMemoryError`` if the cache exceeds ``kv_memory`` or the available memory."""
        check_kv_memory(self.config, self.num_pages, self.kv_bytes, self.sized_by)

    def _reject_detail(self, r: m12.Request) -> str:
        reason = r.reject_reason
        if reason is m12.RejectReason.TOO_LONG:
            return (
                f"a prompt of {r.prompt_len} token(s) + {r.max_new_tokens} new token(s) = "
                f"{r.prompt_len + r.max_new_tokens}, over the model's context of {self.max_model_len} positions"
            )
        if reason is m12.RejectReason.NEVER_FITS:
            need = m12.pages_for(r.prompt_len + r.max_new_tokens - 1, self.config.page_size)
            return f"needs {need} pages of {self.config.page_size} positions, the pool has {self.num_pages}"
        if reason is m12.RejectReason.EMPTY_PROMPT:
            return "the prompt has no tokens"
        return str(reason.value if reason else "")

    def run(self, on_step: Callable[[m12.StepRecord], None] | None = None) -> GenerateResult:
        """Allocate the KV cache (``allocate``) and run the engine to the end.

        ``on_step`` sees each step record as it is produced.  Raises
        ``KVMemoryError`` if torch cannot allocate the cache; an engine or
        executor failure part-way propagates (the engine's ``step_counter``
        names the step).
        """
        self.allocate()

        def step_done(record: m12.StepRecord) -> None:
            if self._executor.inner is not None:
                for request_id in (*record.finished, *record.aborted):
                    self._executor.inner.release(request_id)
            if on_step is not None:
                on_step(record)

        records = self.engine.run(step_done)
        return GenerateResult(records, self._completions(), self.engine.summary(), self.num_pages)

    def allocate(self) -> None:
        """Allocate the KV cache and register the accepted requests, once; nothing if no request
        needs a token.  Raises ``KVMemoryError`` if torch cannot allocate the cache."""
        accepted = [r for r in self.requests if r.reject_reason is None]
        if self._executor.inner is not None or not any(r.max_new_tokens > 0 for r in accepted):
            return
        self._executor.inner = executor = self._new_executor()
        for r in accepted:
            executor.add_request(r.request_id, r.tokens)

    def _new_executor(self) -> TorchExecutor:
        return new_executor(
            self.model,
            self.num_pages,
            self.config.page_size,
            sized_by=self.sized_by,
            speculative=self.config.speculative,
            draft_model=self.draft_model,
        )

    def _completions(self) -> list[Completion]:
        eos = set(self.eos_token_ids)
        completions = []
        for r in self.requests:
            ids = tuple(r.output_ids)
            text = None
            if self.tokenizer is not None:
                shown = ids[:-1] if ids and ids[-1] in eos else ids
                text = continuation_text(self.tokenizer, r.tokens, shown)
            reason = r.finish_reason.value if r.finish_reason else None
            rejected = r.reject_reason.value if r.reject_reason else None
            completions.append(Completion(r.request_id, tuple(r.tokens), ids, text, reason, rejected))
        return completions


def generate(
    model: LlamaModel,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    tokenizer: Any | None = None,
    eos_token_ids: Sequence[int] = (),
    config: EngineConfig | None = None,
    arrivals: Sequence[int] | None = None,
    on_step: Callable[[m12.StepRecord], None] | None = None,
    draft_model: LlamaModel | None = None,
) -> GenerateResult:
    """Run ``prompts`` (strings need ``tokenizer``; no chat template) through the m12 engine.

    Greedy decoding; a sampled id in ``eos_token_ids`` ends a request.
    ``arrivals`` (one per prompt, default all 0) is the step at which each
    request arrives.  ``on_step`` sees each step record as it is produced.
    A request the door refuses (longer than the model's context, or never
    fitting the pool) gets a completion with ``rejected`` set and no ids.
    With ``config.speculative`` method ``"draft"``, ``draft_model`` (else
    loaded from the config's spec) drafts the guesses.
    Raises ``ValueError`` for bad sizes and ``KVMemoryError`` when the KV
    cache does not fit.
    """
    run = Generation(
        model,
        prompts,
        max_new_tokens,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        config=config,
        arrivals=arrivals,
        draft_model=draft_model,
    )
    return run.run(on_step)


def size_pool(model: LlamaModel, config: EngineConfig, max_model_len: int | None = None) -> tuple[int, str]:
    """``(num_pages, sized_by)`` for a pool that serves requests not known in advance.

    ``config.num_pages`` when given; else as many pages as ``config.kv_memory``
    bytes hold; else ``auto``: ``config.max_kv_bytes`` (capped at half the
    available memory) or ``AUTO_MAX_POSITIONS`` positions (at least one
    ``max_model_len`` request), whichever is less.  Never more than
    ``max_pages``.  Raises ``KVMemoryError`` when ``kv_memory`` holds no page.
    """
    c = config
    per_page = page_bytes(model, c.page_size)
    if c.num_pages is not None:
        return c.num_pages, "num_pages"
    if c.kv_memory is not None:
        pages = c.kv_memory // per_page
        if pages < 1:
            raise KVMemoryError(
                f"a KV budget of {format_bytes(c.kv_memory)} holds no page: one page of {c.page_size} "
                f"positions takes {format_bytes(per_page)}",
                kv_bytes=per_page,
                num_pages=1,
                sized_by="kv_memory",
            )
        return min(pages, max_pages(c.page_size)), "kv_memory"
    budget = c.max_kv_bytes
    available = available_memory() if c.check_memory else None
    if available is not None:
        budget = min(budget, available // 2)
    positions = max(AUTO_MAX_POSITIONS, max_model_len or 0)
    pages = min(max(1, budget // per_page), m12.pages_for(positions, c.page_size))
    return min(pages, max_pages(c.page_size)), "auto"


def check_kv_memory(config: EngineConfig, num_pages: int, kv_bytes: int, sized_by: str) -> None:
    """Raise ``KVMemoryError`` if ``kv_bytes`` exceed ``config.kv_memory`` or (``check_memory``) the available memory."""
    budget, where = config.kv_memory, "the KV budget"
    if config.check_memory:
        available = available_memory()
        if available is not None and (budget is None or available < budget):
            budget, where = available, "available memory"
    if budget is not None and kv_bytes > budget:
        raise KVMemoryError(
            f"KV cache of {format_bytes(kv_bytes)} for {num_pages} pages does not fit in "
            f"{format_bytes(budget)} of {where}",
            kv_bytes=kv_bytes,
            num_pages=num_pages,
            sized_by=sized_by,
        )


def new_executor(
    model: LlamaModel, num_pages: int, page_size: int, *, sized_by: str = "num_pages", **kwargs: Any
) -> TorchExecutor:
    """A ``TorchExecutor`` with its KV cache allocated (``kwargs`` go to it).

    Raises ``KVMemoryError`` (naming ``sized_by``) if torch cannot allocate the cache.
    """
    try:
        return TorchExecutor(model, num_pages, page_size, **kwargs)
    except (RuntimeError, MemoryError) as exc:
        if not is_allocation_failure(exc):
            raise
        kv_bytes = num_pages * page_bytes(model, page_size)
        raise KVMemoryError(
            f"could not allocate the KV cache of {format_bytes(kv_bytes)} for {num_pages} pages ({first_line(exc)})",
            kv_bytes=kv_bytes,
            num_pages=num_pages,
            sized_by=sized_by,
        ) from exc


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is torch (or Python) failing to allocate memory."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "alloc" in str(exc).lower()


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, at most 200 characters."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    line = lines[0].strip()
    return line if len(line) <= 200 else line[:197] + "..."


def continuation_text(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The text ``output_ids`` add after the prompt.

    Decoding the ids alone would lose what a tokenizer's decoder puts between
    tokens (a WordPiece space, a merged byte); decode with the prompt and
    strip the prompt's own text instead.
    """
    prefix: str = tokenizer.decode(list(prompt_ids))
    full: str = tokenizer.decode([*prompt_ids, *output_ids])
    return full[len(prefix) :] if full.startswith(prefix) else str(tokenizer.decode(list(output_ids)))


def model_context(model: LlamaModel) -> int | None:
    """The model's ``max_position_embeddings`` (None if its config has none)."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _encode(prompt: str | Sequence[int], tokenizer: Any | None) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        return list(tokenizer(prompt).input_ids)
    return [int(t) for t in prompt]
