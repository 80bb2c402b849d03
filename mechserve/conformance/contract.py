"""Check 2, the executor contract, measured on every step of a real run.

``CheckedExecutor`` wraps one rank executor.  Around each ``execute(plan)``::

    before   every planned slot (position -> (page, offset) of every placement), in every layer,
             K and V, is poisoned: NaN where every verdict keeps the position (a chunk, the known
             positions of a decode window), 0.0 in a decode window's guess slots; then the whole
             cache is snapshotted
    execute  the wrapped executor runs the plan
    after    the answer:  one outcome per item, in plan order, for the planned request and start
                          position; executed tokens = planned tokens; reported writes = placements;
                          acceptance in [0, drafted] for a decode window (drafted = num_tokens - 1)
                          and 0 otherwise; accepted + 1 ids for a sampling item and none otherwise,
                          each inside the vocabulary
             the tensors: every planned slot the step keeps was written in every layer (no NaN left;
                          for a guess slot, not bitwise the poison), and every other slot is bit for
                          bit what it was (nothing else was written: no shared prefix page, no
                          neighbour, no stale position)

The slots a step keeps are all of a prefill or recompute chunk and, of a decode window, the last
known position and the guesses the executor accepted.  The guesses it rejects are rolled back by the
control side in the same step and rewritten before anyone reads them, so an executor may skip
computing them (say, guess slots its proposer left empty, or guesses after the first mismatch) even
though it reports them among its writes; ``strict=True`` demands every placement.  A skipped slot gets its
content from before the poisoning back, so the check leaves the cache exactly as the executor would
have without it.  Guess slots are poisoned with a finite value because attention gathers such a slot
(masked, as padding) in the same step, and a masked NaN still poisons its row through ``0 · NaN``;
a NaN in a kept slot means the executor read it before writing it, which is loud on purpose.

The writes are measured from the tensors the executor actually wrote, not from what it reports.  A
violation raises ``ContractViolation``, a subclass of the boundary's own ``BoundaryViolation``, from
inside ``execute``: the engine never sees the outcomes, so (m10 N15) nothing of the step is committed.
A cache that is not floating point is not poisoned: a planned slot counts as written when it changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mechserve.conformance.errors import ContractViolation
from mechserve.conformance.runner import events, run_workload
from mechserve.conformance.target import KV
from mechserve.spec.m16_request_draft_lengths import Outcome, PlanItem


def check_outcomes(
    plan: Sequence[PlanItem], outcomes: Sequence[Outcome], *, vocab_size: int | None = None, where: str = ""
) -> None:
    """The message half of the contract (the module docstring's "the answer"); ``ContractViolation``.

    ``where`` prefixes the message (e.g. ``"step 3, rank 0: "``).
    """
    prefix = f"contract: {where}"
    if len(outcomes) != len(plan):
        raise ContractViolation(f"{prefix}{len(outcomes)} outcome(s) for {len(plan)} plan item(s)")
    for i, (item, out) in enumerate(zip(plan, outcomes)):
        rid = item.request_id
        if out.request_id != rid:
            raise ContractViolation(
                f"{prefix}outcome {i} is for {out.request_id!r} where {rid!r} was planned (outcomes must follow plan order)"
            )
        if out.start_position != item.start_position:
            raise ContractViolation(
                f"{prefix}{rid}: outcome starts at {out.start_position}, planned {item.start_position}"
            )
        if out.executed_tokens != item.num_tokens:
            raise ContractViolation(
                f"{prefix}{rid}: executed {out.executed_tokens} token(s), planned {item.num_tokens}"
            )
        if tuple(out.writes) != tuple(item.placements):
            raise ContractViolation(f"{prefix}{rid}: reported writes differ from the planned placements")
        drafted = item.num_tokens - 1 if item.decode else 0
        a = out.accepted_draft_tokens
        if not 0 <= a <= drafted:
            kind = f"{drafted} drafted" if item.decode else "not a decode window"
            raise ContractViolation(f"{prefix}{rid}: acceptance {a} outside [0, {drafted}] ({kind})")
        want = a + 1 if item.sample else 0
        if len(out.token_ids) != want:
            raise ContractViolation(f"{prefix}{rid}: {len(out.token_ids)} token id(s) appended, expected {want}")
        bad = [
            t for t in out.token_ids if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size)
        ]
        if bad:
            raise ContractViolation(f"{prefix}{rid}: appended id {bad[0]!r} is not a token id of the vocabulary")


def _slots(plan: Sequence[PlanItem]) -> list[tuple[PlanItem, int, int, int]]:
    """``(item, position, page, offset)`` of every placement, plan order."""
    return [(item, pos, page, off) for item in plan for pos, page, off in item.placements]


def _holder(plan: Sequence[PlanItem], page: int, offset: int, page_size: int) -> str:
    """Which planned request's page table holds ``page`` (and the position there), for a message."""
    for item in plan:
        if page in item.page_table:
            pos = item.page_table.index(page) * page_size + offset
            return f"; it backs {item.request_id}'s position {pos}"
    return ""


def kept(item: PlanItem, outcome: Outcome | None, *, strict: bool = False) -> int:
    """How many leading placements of ``item`` the step keeps (and the executor must write).

    All of them for a chunk that is not a decode window (or with ``strict``); of a decode window, its
    known positions and the ``accepted_draft_tokens`` guesses ``outcome`` accepted.
    """
    if strict or not item.decode or outcome is None:
        return item.num_tokens
    return min(item.num_tokens, len(item.token_ids) + max(0, outcome.accepted_draft_tokens))


def sure(plan: Sequence[PlanItem]) -> list[bool]:
    """Per placement (``_slots`` order): kept whatever the verdicts are (not a guess of a decode window)."""
    return [not item.decode or i < len(item.token_ids) for item in plan for i in range(len(item.placements))]


def _index(plan: Sequence[PlanItem]) -> tuple[torch.Tensor, torch.Tensor]:
    slots = _slots(plan)
    return (
        torch.tensor([s[2] for s in slots], dtype=torch.int64),
        torch.tensor([s[3] for s in slots], dtype=torch.int64),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of its width, so that equality is bitwise (NaN equals itself)."""
    if not t.dtype.is_floating_point:
        return t
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
    return t.contiguous().view(width)


def poison(plan: Sequence[PlanItem], kv: KV) -> tuple[KV, bool]:
    """Poison the planned slots of a floating-point cache in place; return their old content and whether
    it was poisoned.

    A slot every verdict keeps gets NaN (read before it is written, it turns its reader into NaN); a
    guess slot gets 0.0, because an executor may skip it and attention still gathers it (masked), where
    NaN would leak through ``0 · NaN``.  A non-floating-point cache is left as it is.
    """
    pages, offsets = _index(plan)
    original = (kv[0][:, pages, offsets].clone(), kv[1][:, pages, offsets].clone())
    if not all(t.dtype.is_floating_point for t in kv) or not len(pages):
        return original, False
    nan = torch.tensor(sure(plan), dtype=torch.bool)
    for t in kv:
        t[:, pages[nan], offsets[nan]] = float("nan")
        t[:, pages[~nan], offsets[~nan]] = 0.0
    return original, True


def check_writes(
    plan: Sequence[PlanItem],
    kv: KV,
    before: KV,
    *,
    poisoned: bool,
    outcomes: Sequence[Outcome] | None = None,
    strict: bool = False,
    where: str = "",
) -> None:
    """The tensor half of the contract (the module docstring's "the tensors"); ``ContractViolation``.

    ``kv``: the cache after the step, ``before``: its snapshot taken after ``poison`` (both
    [L, P, S, ...] per side); ``poisoned``: whether ``poison`` poisoned it.  A planned slot counts as
    written when it holds no NaN (NaN-poisoned) or differs bitwise from ``before`` in some element (the
    others).  ``outcomes`` (checked by ``check_outcomes`` first) say which guesses were accepted, hence
    which slots must be written (``kept``; all of them without ``outcomes`` or with ``strict``).
    """
    prefix = f"contract: {where}"
    slots = _slots(plan)
    pages, offsets = _index(plan)
    required = torch.tensor(
        [
            i < kept(item, outcomes[n] if outcomes is not None else None, strict=strict)
            for n, item in enumerate(plan)
            for i in range(len(item.placements))
        ],
        dtype=torch.bool,
    )
    nan = torch.tensor(sure(plan), dtype=torch.bool) & poisoned
    for side, t, snap in (("K", kv[0], before[0]), ("V", kv[1], before[1])):
        layers, num_pages, page_size = t.shape[:3]
        if slots:
            now = t[:, pages, offsets].reshape(layers, len(slots), -1)
            then = snap[:, pages, offsets].reshape(layers, len(slots), -1)
            unchanged = (_bits(now) == _bits(then)).all(-1)  # [L, n]
            unwritten = torch.where(nan, torch.isnan(now).any(-1), unchanged) & required
            if bool(unwritten.any()):
                layer, i = (int(x) for x in torch.nonzero(unwritten)[0])
                item, pos, page, off = slots[i]
                raise ContractViolation(
                    f"{prefix}{item.request_id}: planned position {pos} (page {page}, offset {off}) "
                    f"was not written (layer {layer} {side})"
                )
        same = (_bits(t) == _bits(snap)).reshape(layers, num_pages, page_size, -1).all(-1)  # [L, P, S]
        changed = ~same
        if slots:
            changed[:, pages, offsets] = False
        if bool(changed.any()):
            layer, page, off = (int(x) for x in torch.nonzero(changed)[0])
            raise ContractViolation(
                f"{prefix}slot (page {page}, offset {off}) was written but no plan item placed a position there "
                f"(layer {layer} {side}){_holder(plan, page, off, page_size)}"
            )


def unpoison(plan: Sequence[PlanItem], kv: KV, before: KV, original: KV) -> None:
    """Give every planned slot the executor left as poisoned (a skipped, rejected guess) its old content,
    layer by layer, so the cache is what the executor would have left without the check."""
    pages, offsets = _index(plan)
    if not len(pages):
        return
    for t, snap, old in zip(kv, before, original):
        now, then = t[:, pages, offsets], snap[:, pages, offsets]
        n = now.shape[0], now.shape[1]
        left = (_bits(now) == _bits(then)).reshape(*n, -1).all(-1)  # [L, n]
        if bool(left.any()):
            now[left] = old[left]
            t[:, pages, offsets] = now


class CheckedExecutor:
    """A rank executor under the contract check (module docstring); other attributes pass through.

    ``kv_of(inner)`` gives the K/V tensors to measure ([L, P, S, ...]); None checks the answers only.
    ``rank`` and the step count (one ``execute`` per engine step) name where a violation happened;
    ``vocab_size`` (optional) bounds the appended ids; ``strict`` demands a write for every placement,
    also for the guesses the step rejects (module docstring).
    """

    def __init__(
        self,
        inner: Any,
        kv_of: Callable[[Any], KV] | None = None,
        *,
        rank: int = 0,
        vocab_size: int | None = None,
        strict: bool = False,
    ) -> None:
        self.inner = inner
        self.kv_of = kv_of
        self.rank = rank
        self.vocab_size = vocab_size
        self.strict = strict
        self.steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        """Poison, run the wrapped executor, check; returns its outcomes or raises ``ContractViolation``."""
        where = f"step {self.steps}, rank {self.rank}: "
        self.steps += 1
        kv = self.kv_of(self.inner) if self.kv_of is not None and plan else None
        if kv is None:
            outcomes = tuple(self.inner.execute(plan))
            check_outcomes(plan, outcomes, vocab_size=self.vocab_size, where=where)
            return outcomes
        original, poisoned = poison(plan, kv)
        before = (kv[0].clone(), kv[1].clone())
        outcomes = tuple(self.inner.execute(plan))
        check_outcomes(plan, outcomes, vocab_size=self.vocab_size, where=where)
        check_writes(plan, kv, before, poisoned=poisoned, outcomes=outcomes, strict=self.strict, where=where)
        unpoison(plan, kv, before, original)
        return outcomes


def check_contract(target: Any, workload: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """Check 2 on one workload: run it with every rank under ``CheckedExecutor`` (``strict`` as there).

    Raises ``ContractViolation`` at the first violation.  Returns ``{"runs": 1, "steps": …, "events": …}``.
    """
    run = run_workload(
        target,
        workload,
        wrap=lambda rank, ex: CheckedExecutor(ex, target.kv_of, rank=rank, vocab_size=target.vocab_size, strict=strict),
    )
    return {"runs": 1, "steps": len(run.records), "events": events(run.records)}
