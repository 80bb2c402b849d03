"""Speculative decoding: its configuration, the draft model, and how far it pays to speculate.

The spec (m09) decides how many guesses a decode window carries, ``draft_len = min(spec_len,
max_new_tokens - generated - 1)``, and commits the verdict (m12: rollback, tail-page free, the cut at
the first EOS or stop id).  Behind the boundary the executor fills the window with guesses and
verifies them exactly (``torch_executor``); in front of it, the control side may choose the next
step's ``spec_len``::

    SpeculativeConfig            method "ngram" (prompt lookup) or "draft" (a smaller model with the
                                 same vocabulary), num_speculative_tokens (the most guesses per
                                 window: spec_len), n-gram bounds, adaptive
    proposers.NgramProposer      guesses from the request's own ids (no model)
    proposers.DraftModelProposer guesses from a draft model whose KV lives in its own pages, indexed
                                 by the same page tables (paging, prefix reuse, rollback and
                                 preemption apply to it unchanged)
    Acceptance                   per-request estimate of how often a guess is accepted
    Governor                     (adaptive) the spec_len for the next step, between 0 and
                                 num_speculative_tokens: guesses cost target rows (and draft
                                 forwards) and pay only when accepted

Why the control side: the boundary requires every planned position to be computed and written, so a
window the proposer cannot fill still costs its rows.  ``EngineCore`` therefore asks, before each
step, how many guesses each caught-up request's proposer has and how often its guesses were accepted,
and sets the engine's ``spec_len`` to what the expected speedup favours (``Governor``).  At batch 1
the window is then exactly the proposal, so proposing nothing costs a plain decode step; with
several requests one ``spec_len`` serves them all (a per-request cap would need a spec change).

Draft models are written ``MODEL[:layers=N]``: ``smollm2:layers=4`` keeps the first 4 of SmolLM2's 30
layers (sharing the target's weights when the target is the same model); a directory names any
Llama-family checkpoint with the same vocabulary.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechserve.workload import ENGINE_LIMITS

METHODS = ("ngram", "draft")
MAX_SPEC_LEN = ENGINE_LIMITS["spec_len"]  # guesses per window: the CLI's limit, for every entry point
_LAYERS = re.compile(r"^(?P<model>.+?)(?::layers=(?P<layers>\d+))?$")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """What speculates and how far (vLLM's ``speculative_config``).

    ``method``: ``"ngram"`` (prompt lookup: the longest suffix n-gram, ``ngram_min`` <= n <=
    ``ngram_max``, found earlier in the request's own tokens) or ``"draft"`` (``draft_model``, a
    ``MODEL[:layers=N]`` spec, e.g. ``"smollm2:layers=4"``).  ``num_speculative_tokens`` is the
    engine's ``spec_len``: the most guesses per decode window.  ``adaptive``: before each step the
    control side lowers ``spec_len`` (down to 0) to what the acceptance so far and the proposals at
    hand pay for (``Governor``); off, every window carries ``num_speculative_tokens`` guesses (a
    short proposal is padded).  Raises ``ValueError`` for a bad value.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 3
    draft_model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= MAX_SPEC_LEN:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPEC_LEN}], got {self.num_speculative_tokens!r}"
            )
        if not isinstance(self.ngram_min, int) or self.ngram_min < 1:
            raise ValueError(f"ngram_min must be an integer >= 1, got {self.ngram_min!r}")
        if not isinstance(self.ngram_max, int) or self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max must be an integer >= ngram_min ({self.ngram_min}), got {self.ngram_max!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError('method "draft" needs a draft_model, e.g. "smollm2:layers=4"')
        if self.method == "ngram" and self.draft_model:
            raise ValueError(f'draft_model {self.draft_model!r} is given but method is "ngram"; use method="draft"')
        if self.draft_model:
            parse_draft_model(self.draft_model)


def parse_draft_model(spec: str) -> tuple[str, int | None]:
    """``"MODEL[:layers=N]"`` as ``(MODEL, N or None)``; ``ValueError`` for an empty model or ``N < 1``."""
    m = _LAYERS.match(spec.strip())
    if m is None or not m.group("model"):
        raise ValueError(f"draft model must be MODEL[:layers=N], e.g. smollm2:layers=4, got {spec!r}")
    layers = m.group("layers")
    if layers is not None and int(layers) < 1:
        raise ValueError(f"draft model {spec!r}: layers must be >= 1")
    return m.group("model"), int(layers) if layers is not None else None


def load_draft_model(
    spec: str, target: Any, *, target_path: Path | None = None, target_tokenizer: Any | None = None
) -> Any:
    """The draft ``LlamaModel`` for ``spec`` (``MODEL[:layers=N]``) next to the ``target`` ``LlamaModel``.

    When ``MODEL`` resolves to ``target_path`` (the target's checkpoint directory), the draft shares
    the target's weights (``layers=N`` keeps the first N layers); otherwise it is loaded in the
    target's dtype.  Raises ``ValueError`` when ``N`` exceeds the model's layers or the vocabularies
    differ (size, or the tokenizers' token -> id maps), ``ModelLoadError`` when it cannot be loaded.
    """
    from mechserve.backends.models import load_model, resolve_model

    name, layers = parse_draft_model(spec)
    if target_path is not None and _same_path(resolve_model(name), target_path):
        base, tokenizer = target, None
    else:
        loaded = load_model(name, dtype=target.dtype, tokenizer=target_tokenizer is not None)
        base, tokenizer = loaded.model, loaded.tokenizer
    if layers is not None and layers > base.arch.num_layers:
        raise ValueError(f"draft model {spec!r}: layers={layers}, but the model has {base.arch.num_layers}")
    draft = base.truncated(layers) if layers is not None else base
    check_vocabulary(draft, target, tokenizer, target_tokenizer, spec)
    return draft


def check_vocabulary(draft: Any, target: Any, draft_tok: Any, target_tok: Any, spec: str) -> None:
    """Raise ``ValueError`` unless ``draft`` can propose ids for ``target``: the same vocabulary size and,
    when both tokenizers are known, the same token -> id map."""
    dv, tv = draft.arch.vocab_size, target.arch.vocab_size
    if dv != tv:
        raise ValueError(f"draft model {spec!r} has a vocabulary of {dv} ids, the target {tv}: they must share it")
    if draft_tok is not None and target_tok is not None and draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(f"draft model {spec!r} has a different tokenizer: the draft must share the target's")


def _same_path(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def weight_share(draft: Any, target: Any) -> tuple[float, float]:
    """``(layers, head)``: the draft's decoder-layer and LM-head weights as fractions of the target's
    whole per-step weight read (layers + head), the cost model's unit of a batch-1 decode step."""

    def sizes(m: Any) -> tuple[int, int]:
        layer = sum(t.numel() for t in (m.layers[0].qkv, m.layers[0].o, m.layers[0].gate_up, m.layers[0].down))
        return layer * m.arch.num_layers, m.lm_head.numel()

    dl, dh = sizes(draft)
    tl, th = sizes(target)
    return dl / (tl + th), dh / (tl + th)


@dataclass(slots=True)
class _Record:
    """Decayed counts of one request's accepted and rejected guesses."""

    accepted: float = 0.0
    rejected: float = 0.0


class Acceptance:
    """Per-request acceptance estimates: ``alpha``, the chance that the next guess is accepted.

    ``(accepted + 1) / (accepted + rejected + 2)`` over counts that decay by ``decay`` per decode
    window (a window's first rejection counts once; guesses after it were never judged).  A window
    with nothing proposed only decays them, so a request that stopped proposing drifts back to 0.5
    and is tried again.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self._records: dict[str, _Record] = {}

    def rate(self, request_id: str) -> float:
        r = self._records.get(request_id)
        return 0.5 if r is None else (r.accepted + 1.0) / (r.accepted + r.rejected + 2.0)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """One decode window's verdict: ``accepted`` of the ``proposed`` guesses."""
        r = self._records.setdefault(request_id, _Record())
        r.accepted = r.accepted * self.decay + accepted
        r.rejected = r.rejected * self.decay + (1.0 if accepted < proposed else 0.0)

    def release(self, request_id: str) -> None:
        self._records.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request about to draft: ``cap`` guesses allowed (spec_len and its length cap), ``available``
    guesses its proposer has (prompt lookup: the match's length; a draft model: ``cap``) and its
    acceptance estimate ``alpha``."""

    cap: int
    available: int
    alpha: float


class Governor:
    """Chooses the engine's ``spec_len`` for the next step: the one the expected speedup favours.

    The spec gives every caught-up request the same ``draft_len = min(spec_len, cap)``, and the
    boundary makes the executor compute every position of a window, so a guess the proposer does
    not have is computed anyway (a pad, almost never accepted).  For each ``k`` in ``0..max_k``::

        tokens(k) = sum over requests of  1 + alpha + ... + alpha ** g,   g = min(k, cap, available)
        cost(k)   = step_cost(sum of (1 + min(k, cap)))   +   draft_costs for k rounds
        choose the k with the largest tokens(k) / cost(k)   (ties: the smaller k)

    ``step_cost(M) = 1 + jump_cost * [M > 1] + row_cost * (M - 1)`` in units of a one-row decode
    step: on a CPU a one-row step runs matrix-vector kernels and a second row switches to
    matrix-matrix kernels (the jump); after that each row is cheap until compute catches up with
    the weight reads.  ``draft_costs[j]`` is the cost of draft round ``j + 1`` (a draft model's own
    forwards; none for prompt lookup).  Defaults: SmolLM2-135M in float32 on the 2-core CPU
    (``python -m mechserve.bench.spec_decode --costs`` measures them).
    """

    def __init__(self, row_cost: float = 0.05, jump_cost: float = 0.45, draft_costs: Sequence[float] = ()) -> None:
        self.row_cost = row_cost
        self.jump_cost = jump_cost
        self.draft_costs = tuple(draft_costs)

    def step_cost(self, rows: int) -> float:
        """A target step of ``rows`` rows, in units of a one-row step."""
        return 1.0 + (self.jump_cost if rows > 1 else 0.0) + self.row_cost * max(0, rows - 1)

    def choose(self, candidates: Sequence[Candidate], max_k: int) -> int:
        """The ``spec_len`` in ``0..max_k`` with the best expected tokens per unit of cost (0 without candidates)."""
        if not candidates or max_k <= 0:
            return 0
        best, best_rate = 0, 0.0
        for k in range(max_k + 1):
            tokens = 0.0
            rows = 0
            for c in candidates:
                g = min(k, c.cap, c.available)
                tokens += sum(c.alpha**j for j in range(g + 1))
                rows += 1 + min(k, c.cap)
            drafts = sum(self.draft_costs[: min(k, max(c.cap for c in candidates))])
            rate = tokens / (self.step_cost(rows) + drafts)
            if rate > best_rate * (1.0 + 1e-9):
                best, best_rate = k, rate
        return best


def draft_governor(draft: Any, target: Any, max_k: int) -> Governor:
    """A ``Governor`` whose draft rounds cost what ``draft``'s weights cost next to ``target``'s
    (``weight_share``): round 1 adds the draft's LM head rows (its layers run anyway, to keep its
    KV), every later round a whole draft step."""
    layers, head = weight_share(draft, target)
    return Governor(draft_costs=(head, *([layers + head] * max(0, max_k - 1))))


__all__ = [
    "METHODS",
    "Acceptance",
    "Candidate",
    "Governor",
    "SpeculativeConfig",
    "check_vocabulary",
    "draft_governor",
    "load_draft_model",
    "parse_draft_model",
    "weight_share",
]
