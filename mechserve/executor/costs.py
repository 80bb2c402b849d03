"""What a target step and a draft round cost: the cost models the governor (``governor.Governor``) prices guesses with.

A speculative window pays only when the tokens it keeps outweigh what it costs: target rows (every guess is a
row of the step) and the proposer's draft rounds.  Two cost models answer ``step(rows)`` (one target step of
``rows`` rows) and ``draft(rounds, windows)`` (``rounds`` draft rounds for ``windows`` windows), in any unit
as long as both use the same one::

    StaticCosts     a fixed model in units of a one-row decode step: ``row_cost``, ``jump_cost`` and
                    ``draft_costs`` per round (a draft model's weight share, an EAGLE head's; the prior)
    MeasuredCosts   seconds measured on the loaded model in its mode (dtype, GGUF blocks, threads, device):
                    a short calibration when the executor is built (``calibrate``: target steps of 1 .. 8 x
                    (max_k + 1) rows, the proposer's draft rounds at 1 and 8 windows) and then every decode
                    step the executor runs (``TorchExecutor`` times its proposal and its target step: the
                    online estimate), each kept as the median of its last ``WINDOW`` measurements per row
                    count / per (windows, rounds)

Why both: the calibration measures every row count the governor may choose before it chooses (an online
estimate alone only sees the row counts it already chose, so a wrong prior would never be corrected: a
governor that priced a guess row too high would never run one), and it runs in the engine's own mode, so
bf16, q8_0 and q4_1 are priced as they run; the online estimate then follows what calibration cannot see (the
requests' real context lengths, the executor's own per-row work around the forward, the machine's load).
Both are cheap: the calibration is ~30 target forwards and ~25 draft calls on a scratch cache (well under a
second for SmolLM2 on 2 cores), the online estimate two clock reads per step.  Robustness: a median, not a
mean (a step stalled by another process, or by a garbage collection, does not move it), over a short
window (it follows a lasting change within ``WINDOW // 2 + 1`` steps of that row count), and the step curve
is made non-decreasing in rows.

Estimates between measured points are linear interpolations; beyond the largest measured row count the
step cost grows with the least-squares slope of the measured multi-row steps (with fewer than two of
them, and below the smallest measurement, it follows the prior's shape through the nearest one).  Draft rounds: per measured window count a curve in rounds through (0, 0),
interpolated between window counts; none measured yet: the prior's rounds in units of the measured
one-row step.  Tests inject the clock (``TorchExecutor(clock=...)``) or the observations, never a bound on
wall-clock time.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class CostModel(Protocol):
    """What the governor asks: a target step of ``rows`` rows, and ``rounds`` draft rounds for ``windows``
    windows, both in one unit (seconds, or one-row steps)."""

    def step(self, rows: int) -> float: ...

    def draft(self, rounds: int, windows: int) -> float: ...


@dataclass(frozen=True, slots=True)
class StaticCosts:
    """A fixed cost model in units of a one-row decode step (the prior).

    ``step(M) = 1 + jump_cost * [M > 1] + row_cost * (M - 1)``: on a CPU a one-row step runs matrix-vector
    kernels and a second row switches to matrix-matrix kernels (the jump); after that each row is cheap
    until compute catches up with the weight reads.  ``draft_costs[j]``: draft round ``j + 1`` (whatever the
    number of windows).  The defaults were measured for SmolLM2-135M in float32 on the 2-core CPU; the
    engine measures its own (``MeasuredCosts``).
    """

    row_cost: float = 0.05
    jump_cost: float = 0.45
    draft_costs: tuple[float, ...] = ()

    def step(self, rows: int) -> float:
        """A target step of ``rows`` rows, in one-row steps."""
        return 1.0 + (self.jump_cost if rows > 1 else 0.0) + self.row_cost * max(0, rows - 1)

    def draft(self, rounds: int, windows: int) -> float:
        """``rounds`` draft rounds (the first ``rounds`` of ``draft_costs``; 0 past their end)."""
        return float(sum(self.draft_costs[: max(0, rounds)]))


def _interpolate(points: Mapping[int, float], x: float) -> float | None:
    """The piecewise-linear curve through ``points`` at ``x`` (``min(points) <= x <= max(points)``), else None."""
    xs = sorted(points)
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for lo, hi in zip(xs, xs[1:]):
        if lo <= x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[xs[0]]


class MeasuredCosts:
    """Seconds per target step by rows and per draft call by (windows, rounds), measured (module docstring).

    ``observe_step(rows, seconds)`` and ``observe_draft(windows, rounds, seconds)`` add a measurement; a key's
    estimate is the median of its last ``window`` measurements (``steps``, ``drafts``).  ``step`` and ``draft``
    answer for any key; before any step was measured they answer the ``prior``'s numbers (one-row steps), and
    draft rounds not measured yet are the prior's in units of the measured one-row step.  Raises
    ``ValueError`` for a ``window`` below 1.
    """

    WINDOW = 15

    def __init__(self, prior: StaticCosts | None = None, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window!r}")
        self.prior = prior or StaticCosts()
        self.window = window
        self.steps: dict[int, float] = {}  # rows -> seconds (the median)
        self.drafts: dict[int, dict[int, float]] = {}  # windows -> rounds -> seconds (the median)
        self._seen: dict[tuple[int, int], deque[float]] = {}  # (windows or 0 for a step, rows or rounds) -> last
        self._curve: dict[int, float] | None = None  # ``steps`` made non-decreasing (cached)

    def _median(self, key: tuple[int, int], seconds: float) -> float:
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self.window)
        seen.append(max(0.0, float(seconds)))
        return statistics.median(seen)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A target step of ``rows`` rows took ``seconds``."""
        if rows > 0:
            self.steps[rows] = self._median((0, rows), seconds)
            self._curve = None

    def observe_draft(self, windows: int, rounds: int, seconds: float) -> None:
        """A proposal of ``rounds`` rounds for ``windows`` drafting windows took ``seconds``."""
        if windows > 0 and rounds > 0:
            self.drafts.setdefault(windows, {})[rounds] = self._median((windows, rounds), seconds)

    @property
    def measured(self) -> bool:
        """Whether any target step was measured (the answers are seconds, not the prior's units)."""
        return bool(self.steps)

    def _monotone(self) -> dict[int, float]:
        if self._curve is None:
            curve: dict[int, float] = {}
            top = 0.0
            for rows in sorted(self.steps):
                top = max(top, self.steps[rows])
                curve[rows] = top
            self._curve = curve
        return self._curve

    def step(self, rows: int) -> float:
        """A target step of ``rows`` rows: seconds (the prior's one-row steps before any measurement)."""
        curve = self._monotone()
        if not curve:
            return self.prior.step(rows)
        found = _interpolate(curve, rows)
        if found is not None:
            return found
        xs = sorted(curve)
        if rows < xs[0]:  # below every measurement: the prior's shape through the smallest one
            return curve[xs[0]] * self.prior.step(rows) / self.prior.step(xs[0])
        multi = [x for x in xs if x > 1]
        if len(multi) < 2:  # one multi-row point at most: the prior's shape through the largest one
            return curve[xs[-1]] * self.prior.step(rows) / self.prior.step(xs[-1])
        slope = max(0.0, statistics.linear_regression(multi, [curve[x] for x in multi]).slope)
        return curve[xs[-1]] + slope * (rows - xs[-1])

    def _rounds(self, per_round: Mapping[int, float], rounds: int) -> float:
        """One window count's curve in rounds, through (0, 0), extended by its last segment's slope."""
        points = {0: 0.0, **per_round}
        found = _interpolate(points, rounds)
        if found is not None:
            return found
        xs = sorted(points)
        lo, hi = xs[-2], xs[-1]
        return points[hi] + max(0.0, (points[hi] - points[lo]) / (hi - lo)) * (rounds - hi)

    def draft(self, rounds: int, windows: int) -> float:
        """``rounds`` draft rounds for ``windows`` windows: seconds (the prior's, in measured one-row steps, for a
        proposer never measured)."""
        if rounds <= 0 or windows <= 0:
            return 0.0
        if not self.drafts:
            unit = self.step(1) if self.measured else 1.0
            return self.prior.draft(rounds, windows) * unit
        counts = sorted(self.drafts)
        below = [n for n in counts if n <= windows]
        above = [n for n in counts if n >= windows]
        if not below or not above:  # outside the measured window counts: the nearest one
            n = above[0] if above else below[-1]
            return self._rounds(self.drafts[n], rounds)
        lo, hi = below[-1], above[0]
        a, b = self._rounds(self.drafts[lo], rounds), self._rounds(self.drafts[hi], rounds)
        return a if hi == lo else a + (b - a) * (windows - lo) / (hi - lo)

    def table(self) -> dict[str, Any]:
        """The measurements in milliseconds, for reports (``bench spec-decode --costs``)."""
        return {
            "step_ms_by_rows": {rows: round(s * 1e3, 3) for rows, s in sorted(self.steps.items())},
            "draft_ms_by_windows_and_rounds": {
                n: {r: round(s * 1e3, 3) for r, s in sorted(per.items())} for n, per in sorted(self.drafts.items())
            },
        }


# Calibration -------------------------------------------------------------------------------------------------------


def step_inputs(
    model: Any, windows: int, rows_each: int, context: int, page_size: int, kv_dtype: Any = None
) -> tuple[Any, ...]:
    """A scratch target step: ``windows`` decode windows of ``rows_each`` rows each after ``context`` cached
    positions, in a fresh cache of its own.  Returns ``(input_ids [T] int64, positions [T] int64, cache, batch,
    logit_rows [T] int64)``, ``T = windows * rows_each``, the arguments of ``Model.forward``."""
    import torch

    from mechserve.kv.paged import Span, build_attention_batch

    per = (context + rows_each) // page_size + 1
    cache = model.new_cache(windows * per, page_size, kv_dtype)
    spans: list[Any] = []
    slots: list[int] = []
    ids: list[int] = []
    positions: list[int] = []
    for i in range(windows):
        table = tuple(range(i * per, (i + 1) * per))
        spans.append(Span(len(ids), context, rows_each, table))
        for j in range(rows_each):
            slots.append(table[(context + j) // page_size] * page_size + (context + j) % page_size)
            ids.append(100 + j)
            positions.append(context + j)
    a = model.arch
    batch = build_attention_batch(spans, slots, page_size, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows)
    return torch.tensor(ids), torch.tensor(positions), cache, batch, torch.arange(len(ids))


def calibration_shapes(max_k: int, batch: int = 8) -> list[tuple[int, int]]:
    """The (windows, rows each) steps ``calibrate`` times: 1 and ``batch`` windows of 1, 2, 3 and ``max_k + 1``
    rows."""
    rows = sorted({1, 2, 3, max_k + 1} - {r for r in (2, 3) if r > max_k + 1})
    return [(b, m) for b in sorted({1, batch}) for m in rows]


def calibrate(
    model: Any,
    proposer: Any,
    costs: MeasuredCosts,
    *,
    max_k: int,
    page_size: int,
    kv_dtype: Any = None,
    hidden: bool = False,
    clock: Callable[[], float],
    repeats: int = 3,
    batch: int = 8,
    context: int = 128,
) -> None:
    """Measure ``model``'s target steps (``calibration_shapes``) and ``proposer``'s draft rounds into ``costs``.

    Each shape runs once untimed (first-call allocations), then ``repeats`` timed rounds, interleaved; the
    median of each goes to ``costs``.  A step is timed up to its argmax's ids on the host (a device step has
    finished).  ``hidden``: the forward also returns its hidden states (an EAGLE target).  The proposer's
    rounds are timed through its optional ``calibrate(windows, rounds)`` (a representative draft of ``rounds``
    guesses for ``windows`` windows; the EAGLE head has one), for 1 and ``batch`` windows and 1 .. ``max_k``
    rounds; a proposer without one is measured online only.
    """
    shapes = calibration_shapes(max_k, batch)
    inputs = {s: step_inputs(model, *s, context, page_size, kv_dtype) for s in shapes}
    probe = getattr(proposer, "calibrate", None)
    drafts = [(n, r) for n in sorted({1, batch}) for r in range(1, max_k + 1)] if probe is not None else []
    step_times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    draft_times: dict[tuple[int, int], list[float]] = {d: [] for d in drafts}
    for timed in [False] + [True] * repeats:
        for s in shapes:
            began = clock()
            model.forward(*inputs[s], **({"hidden_out": []} if hidden else {})).argmax(-1).tolist()
            if timed:
                step_times[s].append(clock() - began)
        for n, r in drafts:
            began = clock()
            probe(n, r)
            if timed:
                draft_times[(n, r)].append(clock() - began)
    by_rows: dict[int, list[float]] = {}
    for (b, m), times in step_times.items():
        by_rows.setdefault(b * m, []).append(statistics.median(times))
    for rows, medians in by_rows.items():
        costs.observe_step(rows, statistics.median(medians))
    for (n, r), times in draft_times.items():
        costs.observe_draft(n, r, statistics.median(times))


__all__ = ["CostModel", "MeasuredCosts", "StaticCosts", "calibrate", "calibration_shapes", "step_inputs"]
