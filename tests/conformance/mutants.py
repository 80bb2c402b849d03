"""Deliberately broken executors, engines and rungs: the planted faults the checks must catch.

Executors (``TorchExecutor`` subclasses, each wrong in exactly one way; every other field of their
answers is what the real executor would say):

* ``OneSlotOff``        writes the last position of every item one slot further on, reports the plan
* ``OverReports``       reports one accepted guess more than it drafted (outside ``[0, drafted]``)
* ``AcceptsWrongGuess`` accepts one more guess than matched the model, inside ``[0, drafted]``
* ``OutOfOrder``        returns a step's outcomes in reverse plan order
* ``SkipsToken``        never writes the last position of an item, but reports it written
* ``CorruptsPrefix``    scribbles on the page holding position 0 when an item starts past it
* ``ForgetsRollback``   does not rewrite a position it wrote before (it forgets that a rollback or a
                        preemption invalidated it), though it reports the write
* ``LeavesRejectedKV``  the correct executor, named for the benign case: rejected guesses' K/V stay in
                        the slots past the frontier, which nobody reads
* ``SkipsRejectedGuesses`` does not write the slots of the guesses it rejects (allowed unless strict)
* ``LiesAboutTokens``   reports a sampled id other than the one the model chose

Engines (for replay): ``NewestFirst`` schedules the running requests newest first.  Rungs (for the
ladder): ``m09_drafting_at_zero`` drafts a guess at ``spec_len`` 0; ``m12_admits_backwards`` records
its admissions in reverse order.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch

from mechserve.executor.torch_executor import TorchExecutor
from mechserve.spec import m09_speculative_decode as m09
from mechserve.spec import m12_admission_control as m12
from mechserve.spec import m16_request_draft_lengths as m16
from mechserve.spec.m16_request_draft_lengths import Outcome, PlanItem


class OneSlotOff(TorchExecutor):
    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        total = self.cache.num_pages * self.page_size
        moved = []
        for item in plan:
            pos, page, off = item.placements[-1]
            flat = (page * self.page_size + off + 1) % total
            shifted = (pos, flat // self.page_size, flat % self.page_size)
            moved.append(dataclasses.replace(item, placements=(*item.placements[:-1], shifted)))
        outs = super().execute(tuple(moved))
        return tuple(dataclasses.replace(o, writes=item.placements) for o, item in zip(outs, plan))


class OverReports(TorchExecutor):
    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        outs = []
        for item, o in zip(plan, super().execute(plan)):
            if item.decode:
                a = item.num_tokens  # one more than it drafted; a + 1 ids, so only the count is wrong
                ids = (o.token_ids + (o.token_ids[-1],) * (a + 1))[: a + 1]
                o = dataclasses.replace(o, accepted_draft_tokens=a, token_ids=ids)
            outs.append(o)
        return tuple(outs)


def _repeat_last(history: Any, num: int) -> list[int]:
    return [history[-1]] * num


class AcceptsWrongGuess(TorchExecutor):
    """Guesses by repeating the last id (always all of them), then claims one more accepted than matched."""

    def __init__(self, model: Any, num_pages: int, page_size: int, **kwargs: Any) -> None:
        super().__init__(model, num_pages, page_size, proposer=_repeat_last, **kwargs)

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        outs = []
        for item, o in zip(plan, super().execute(plan)):
            a = o.accepted_draft_tokens
            if item.decode and a < item.num_tokens - 1:
                guess = item.token_ids[-1]
                o = dataclasses.replace(o, accepted_draft_tokens=a + 1, token_ids=(guess,) * (a + 1) + o.token_ids[-1:])
            outs.append(o)
        return tuple(outs)


class OutOfOrder(TorchExecutor):
    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        return tuple(reversed(super().execute(plan)))


class _KeepsSlots(TorchExecutor):
    """Restores, after the real step, the slots ``kept(plan)`` names: as if it never wrote them."""

    def kept(self, plan: tuple[PlanItem, ...]) -> list[tuple[int, int]]:
        raise NotImplementedError

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        slots = self.kept(plan)
        pages = torch.tensor([p for p, _ in slots], dtype=torch.int64)
        offsets = torch.tensor([o for _, o in slots], dtype=torch.int64)
        k, v = self.cache.k[:, pages, offsets].clone(), self.cache.v[:, pages, offsets].clone()
        outs = super().execute(plan)
        self.cache.k[:, pages, offsets] = k
        self.cache.v[:, pages, offsets] = v
        return outs


class SkipsToken(_KeepsSlots):
    def kept(self, plan: tuple[PlanItem, ...]) -> list[tuple[int, int]]:
        return [item.placements[-1][1:] for item in plan]


class ForgetsRollback(_KeepsSlots):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written: dict[str, dict[int, tuple[int, int]]] = {}

    def kept(self, plan: tuple[PlanItem, ...]) -> list[tuple[int, int]]:
        slots = []
        for item in plan:
            mine = self.written.setdefault(item.request_id, {})
            for pos, page, off in item.placements:
                if mine.get(pos) == (page, off):
                    slots.append((page, off))
                mine[pos] = (page, off)
        return slots


class SkipsRejectedGuesses(TorchExecutor):
    """Leaves the slots of the guesses it rejects as they were: allowed (the step rolls them back), not strict."""

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        k, v = self.cache.k.clone(), self.cache.v.clone()
        outs = super().execute(plan)
        for item, o in zip(plan, outs):
            if item.decode:
                for _, page, off in item.placements[len(item.token_ids) + o.accepted_draft_tokens :]:
                    self.cache.k[:, page, off] = k[:, page, off]
                    self.cache.v[:, page, off] = v[:, page, off]
        return outs


class CorruptsPrefix(TorchExecutor):
    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        outs = super().execute(plan)
        for item in plan:
            if item.start_position >= self.page_size:
                self.cache.k[0, item.page_table[0], 0] += 1.0
        return outs


class LeavesRejectedKV(TorchExecutor):
    """Exactly the real executor: it never clears a rejected guess's slot."""


class LiesAboutTokens(TorchExecutor):
    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        vocab = self.model.arch.vocab_size
        outs = []
        for o in super().execute(plan):
            if o.token_ids:
                o = dataclasses.replace(o, token_ids=(*o.token_ids[:-1], (o.token_ids[-1] + 1) % vocab))
            outs.append(o)
        return tuple(outs)


class NewestFirst(m16.Engine):
    """A "real engine" whose scheduler walks the running requests newest first."""

    def _schedule(self) -> list[tuple[m16.Request, int]]:
        self.running.reverse()
        try:
            return super()._schedule()
        finally:
            self.running.reverse()


class _DraftsAtZero(m09.Engine):
    def _draft(self) -> None:
        super()._draft()
        for r in self.running:
            if self.spec_len == 0 and r.generated >= 1 and r.computed == r.target - 1:
                r.draft_len = min(1, r.max_new_tokens - r.generated - 1)


class _AdmitsBackwards(m12.Engine):
    def _admit(self, finished: dict[str, m12.FinishReason]) -> list[str]:
        return list(reversed(super()._admit(finished)))


def _rung(base: types.ModuleType, engine: type) -> types.ModuleType:
    module = types.ModuleType(base.__name__)
    module.__dict__.update({k: v for k, v in vars(base).items() if not k.startswith("__")})
    module.Engine = engine  # type: ignore[attr-defined]
    return module


m09_drafting_at_zero = _rung(m09, _DraftsAtZero)
m12_admits_backwards = _rung(m12, _AdmitsBackwards)
