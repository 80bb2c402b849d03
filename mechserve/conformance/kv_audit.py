"""Check 3, the KV audit: what the pages hold is what a dense forward computes.

After every step of a real run, for every rank and every RUNNING request with ``computed > 0`` (and
every request that finished in the step, through the page table of its last plan item)::

    tokens   = (prompt ids + output ids)[:computed]            the ids at positions 0 .. computed-1
    paged    = K/V[:, page_table[p // page_size], p % page_size] for p < computed     [L, computed, ...]
    dense    = target.dense_kv(tokens)                          no paging, no cache, one sequence
    |paged - dense| <= atol + rtol * |dense|  elementwise (NaN in dense: no reference, skipped)

and likewise for every block of the radix cache (its page against the dense K/V of the token prefix
its key chain spells: prompt ids, and with m13's output caching generated ids too), referenced or not.  Positions at or past ``computed`` are not audited: after a
rollback they still hold the rejected guesses' K/V, which nobody reads (the next step rewrites them
before attending), so stale state there is harmless by design.  What the audit proves is that prefix
sharing (a page read by several requests), rollback (the frontier moved back) and preemption (state
recomputed into new pages) never leave a request reading state that differs from its own tokens.

Dense forwards are the expensive part, so the auditor copies the paged K/V after each step (only when
they changed since its last copy) and compares once the run is over, with one dense forward per
longest token sequence (a shorter sequence is compared against the prefix of a longer one: K/V at
position p depend only on tokens 0..p).  Mismatches are reported for the earliest step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mechserve.conformance.errors import ConformanceError, KVMismatch
from mechserve.conformance.runner import RealRun, events, run_workload
from mechserve.spec import m16_request_draft_lengths as m16


@dataclass
class _Copy:
    """Paged K/V of positions ``[start, len(tokens))`` of ``tokens`` as read after ``step`` on ``rank``."""

    step: int
    rank: int
    label: str
    tokens: tuple[int, ...]
    start: int
    slots: list[tuple[int, int]]
    k: torch.Tensor
    v: torch.Tensor


class KVAuditor:
    """Collects paged K/V after each step (``snapshot``, an ``on_step`` hook) and checks them (``verify``).

    ``atol``/``rtol`` default to the target's.  ``positions`` counts the (rank, position) pairs
    compared by ``verify``.
    """

    def __init__(self, target: Any, *, atol: float | None = None, rtol: float | None = None) -> None:
        if target.kv_of is None or target.dense_kv is None:
            raise ConformanceError(f"target {target.name!r} has no kv_of or dense_kv: the KV audit cannot run")
        self.target = target
        self.atol = target.atol if atol is None else atol
        self.rtol = target.rtol if rtol is None else rtol
        self.copies: list[_Copy] = []
        self._last: dict[tuple[str, int, tuple[int, ...]], _Copy] = {}
        self.positions = 0

    def snapshot(self, run: RealRun, record: m16.StepRecord) -> None:
        """Copy every running request's and every cache block's paged K/V, on every rank.

        A request that finished in this step has given its pages back, but nothing has written
        them since: it is read through the page table its last plan item carried.
        """
        engine = run.engine
        ps = engine.pool.page_size
        plan = run.exchanges[-1].plan if run.exchanges and run.exchanges[-1].step == record.step else ()
        last_tables = {item.request_id: item.page_table for item in plan}
        live = [(r, r.page_table) for r in engine.running]
        live += [
            (r, last_tables[r.request_id])
            for r in engine.requests
            if r.request_id in record.finished and r.request_id in last_tables and r.state is m16.RequestState.FINISHED
        ]
        for rank, ex in enumerate(run.executors):
            k, v = self.target.kv_of(ex)
            for r, table in live:
                if r.computed > 0:
                    tokens = tuple([*r.tokens, *r.output_ids][: r.computed])
                    slots = [(table[p // ps], p % ps) for p in range(r.computed)]
                    self._copy(record.step, rank, r.request_id, tokens, 0, slots, k, v)
            for tokens, page in _cache_blocks(engine.cache):
                start = len(tokens) - ps
                self._copy(record.step, rank, f"cache page {page}", tokens, start, [(page, o) for o in range(ps)], k, v)

    def _copy(
        self,
        step: int,
        rank: int,
        label: str,
        tokens: tuple[int, ...],
        start: int,
        slots: list[tuple[int, int]],
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        pages = torch.tensor([s[0] for s in slots], dtype=torch.int64)
        offsets = torch.tensor([s[1] for s in slots], dtype=torch.int64)
        pages, offsets = pages.to(k.device), offsets.to(k.device)
        # advanced indexing copies; the copies are kept on the host, where the dense reference is
        kc, vc = k[:, pages, offsets].cpu(), v[:, pages, offsets].cpu()
        key = (label, rank, tokens)
        last = self._last.get(key)
        if last is not None and last.slots == slots and torch.equal(last.k, kc) and torch.equal(last.v, vc):
            return
        copy = _Copy(step, rank, label, tokens, start, slots, kc, vc)
        self._last[key] = copy
        self.copies.append(copy)

    def verify(self) -> int:
        """Compare every copy with the dense reference; raise ``KVMismatch`` for the earliest bad step.

        Returns the number of (rank, position) pairs compared (also added to ``positions``).
        """
        dense = _DenseCache(self.target.dense_kv)
        dense.prepare([c.tokens for c in self.copies])
        count = 0
        for c in sorted(self.copies, key=lambda c: c.step):
            dk, dv = dense.get(c.tokens)
            for side, got, want in (("K", c.k, dk[:, c.start :]), ("V", c.v, dv[:, c.start :])):
                want = want.to(torch.float32)
                got = got.to(torch.float32)
                bad = (got - want).abs() > self.atol + self.rtol * want.abs()
                bad &= ~torch.isnan(want)
                bad |= torch.isnan(got) & ~torch.isnan(want)
                flat = bad.reshape(bad.shape[0], bad.shape[1], -1).any(-1)  # [L, n]
                if bool(flat.any()):
                    positions = flat.any(0).nonzero()
                    i = int(positions[0])
                    layer = int(flat[:, i].nonzero()[0])
                    err = float((got[layer, i] - want[layer, i]).abs().nan_to_num(float("inf")).max())
                    page, off = c.slots[i]
                    raise KVMismatch(
                        f"kv: after step {c.step}, rank {c.rank}, {c.label}: {side} at position {c.start + i} "
                        f"(page {page}, offset {off}), layer {layer}, differs from a dense forward over the same "
                        f"{len(c.tokens)} token(s) by {err:.3g} (tolerance {self.atol:g} + {self.rtol:g}·|dense|)"
                    )
            count += len(c.slots)
        self.positions += count
        return count


def _cache_blocks(cache: Any) -> list[tuple[tuple[int, ...], int]]:
    """``(token prefix through the block, page)`` for every node of m13's radix cache (prompt and generated ids)."""
    out: list[tuple[tuple[int, ...], int]] = []
    stack: list[tuple[tuple[int, ...], Mapping[Any, Any]]] = [((), cache.root)]
    while stack:
        prefix, children = stack.pop()
        for key, node in children.items():
            tokens = prefix + tuple(key.block_tokens)
            out.append((tokens, node.block))
            stack.append((tokens, node.children))
    return out


class _DenseCache:
    """Dense K/V per longest token sequence; a shorter sequence reads a longer one's prefix."""

    def __init__(self, dense_kv: Any) -> None:
        self.dense_kv = dense_kv
        self.full: list[tuple[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]] = []
        self.found: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, sequences: Sequence[tuple[int, ...]]) -> None:
        for seq in sorted(set(sequences), key=len, reverse=True):
            self.get(seq)

    def get(self, seq: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self.found.get(seq)
        if hit is not None:
            return hit
        n = len(seq)
        for full, (k, v) in self.full:
            if len(full) >= n and full[:n] == seq:
                hit = (k[:, :n], v[:, :n])
                break
        else:
            k, v = self.dense_kv(list(seq))
            self.full.append((seq, (k, v)))
            hit = (k, v)
        self.found[seq] = hit
        return hit


def check_kv(target: Any, workload: Mapping[str, Any]) -> dict[str, Any]:
    """Check 3 on one workload: run it, copying the paged K/V after every step, then audit them all.

    Raises ``KVMismatch`` for the earliest mismatch (also when the run itself failed later: the
    corruption is the better diagnosis); otherwise the run's own error, if any.  Returns
    ``{"runs": 1, "steps": …, "positions": …, "events": …}``.
    """
    auditor = KVAuditor(target)
    try:
        run = run_workload(target, workload, on_step=auditor.snapshot)
    except Exception:
        auditor.verify()
        raise
    positions = auditor.verify()
    return {"runs": 1, "steps": len(run.records), "positions": positions, "events": events(run.records)}
