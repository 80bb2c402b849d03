"""What a target step and a draft round cost: the cost models the governor (``governor.Governor``) prices guesses with.

A speculative window pays only when the tokens it keeps outweigh what it costs: target rows (every guess is a
row of the step) and the proposer's draft rounds.  Two cost models answer ``step(rows)`` (one target step of
``rows`` rows) and ``draft(rounds, windows)`` (``rounds`` draft rounds for ``windows`` windows), in any unit
as long as both use the same one::

    StaticCosts     a fixed model in units of a one-row decode step: ``row_cost``, ``jump_cost`` and
                    ``draft_costs`` per round (a draft model's weight share, an EAGLE head's; the prior)
    MeasuredCosts   seconds measured on the loaded model in its mode (dtype, GGUF blocks, threads, device):
                    a short calibration when the executor is built (``calibrate``: target steps of 1 .. max_k + 1
                    rows in one window; ``batch`` windows of one row, with 1, 2 and 4 guess rows among them, and
                    of 2, 3 and max_k + 1 rows each; the proposer's draft rounds at 1 and ``batch`` windows) and
                    then every decode step the executor runs (``TorchExecutor`` times its proposal and its target
                    step: the online estimate: the calibrated curve scaled by the recent steps' ratio to it; draft
                    calls as the interquartile mean of their last ``WINDOW`` measurements)

Limit (measured): under heavy contention (load average ~20 on 2 cores, a niced process) the calibration's
wall times are dominated by preemption (a 1-row step timed at 3 s, as dear as 24 rows), and process CPU time
is no better (spinning OpenMP threads: 1 .. 16 rows all equal); the online ratios then correct only the row
counts the engine runs.  Calibrate on a machine that is not oversubscribed.

Why both: the calibration measures every row count the governor may choose before it chooses (an online
estimate alone only sees the row counts it already chose, so a wrong prior would never be corrected: a
governor that priced a guess row too high would never run one), and it runs in the engine's own mode, so
bf16, q8_0 and q4_1 are priced as they run; the online estimate then follows what calibration cannot see (the
requests' real context lengths, the executor's own per-row work around the forward, the machine's load).
Both are cheap: the calibration is ~60 target forwards and ~40 draft calls on scratch caches at ``spec_len`` 4
(4.2 s for SmolLM2 in bfloat16 on 2 cores; 12 shapes, up to 16 at larger ``spec_len``, the largest dearer), the online estimate two clock reads per step.  Robustness: the mean of the
middle half of the recent measurements, not of all of them (a step stalled by another process, or by a
garbage collection, does not move it), over a short window (it follows a lasting change within a few dozen
steps), and the step curve is made non-decreasing in rows.

Why one ratio for every row count, and never one per row count: the recent steps mostly run one or two row counts
(the batch's, and the batch's plus a few guesses), and a ratio kept per row count would mix times.  Measured (a
batch-8 run on 2 cores): a stall of a few dozen 7-row steps raised the 7-row price by a third while the 8-row price
kept its ratio from before the stall, so the non-decreasing curve priced the 8th row at nothing and the governor
drafted a guess row that cost ~4 ms on text whose guesses were kept a third of the time.  The relative prices of
row counts, which are all the governor weighs, therefore come from the calibration alone, which times them side by
side; it times every row count a batch-1 window can have, and the first guess rows beside a batch of ``batch``
windows, because the rows there do not cost alike (measured in bfloat16 on an AVX2 CPU: 8 -> 9 rows +7 ms, each
further row to 12 +3.5 ms: the linear kernel's tiles take 4 rows, and a 9th starts a tile).

Estimates between measured points are linear interpolations; beyond the largest measured row count the
step cost grows with the least-squares slope of the measured multi-row steps (with fewer than two of
them, and below the smallest measurement, it follows the prior's shape through the nearest one).  Draft rounds: per measured window count a curve in rounds through (0, 0),
interpolated between window counts; none measured yet: the prior's rounds in units of the measured
one-row step.  Tests inject the clock (``TorchExecutor(clock=...)``) or the observations, never a bound on
wall-clock time.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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


def _interpolate(points: Mapping[int, float], x: float, xs: Sequence[int] | None = None) -> float | None:
    """The piecewise-linear curve through ``points`` at ``x`` (``min(points) <= x <= max(points)``), else None;
    ``xs``: ``sorted(points)``, for a caller that keeps it (the segment is found by bisection)."""
    xs = sorted(points) if xs is None else xs
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return points[xs[i]]
    lo, hi = xs[i - 1], xs[i]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def _iq_mean(values: Sequence[float]) -> float:
    """The mean of the middle half of ``values`` (not empty): robust to a few outliers either way."""
    ordered = sorted(values)
    cut = len(ordered) // 4
    return statistics.fmean(ordered[cut : len(ordered) - cut])


class MeasuredCosts:
    """Seconds per target step by rows and per draft call by (windows, rounds), measured (module docstring).

    Target steps: ``calibrated(rows, seconds)`` sets the curve's shape (``shape``: the calibration's seconds
    by rows); ``observe_step(rows, seconds)`` adds a step the executor ran, as its ratio to the shape (between
    two calibrated row counts, to the interpolated curve).  A row count outside the calibrated ones (every row
    count, without a calibration: tensor-parallel ranks) joins the shape at its first ``window`` steps' seconds
    over the ratio of their time (their interquartile mean; those steps leave the ratio as it is), and from then
    on its steps are ratios to the curve like any other.  A step of ``rows`` rows is the shape's curve times the
    interquartile mean of the last ``recent`` ratios, whatever their row counts: a machine that got busier, or
    contexts longer than the calibration's, raise every row count at once, and the relative prices stay the
    calibration's (the module docstring says why); the result never falls with more rows.  Without a calibration
    the relative prices are the first steps' at each row count, as measured at different times: a row count first
    run during a stall keeps the stall's price.  Draft calls: the interquartile mean of the key's last ``window`` measurements
    (``observe_draft``; ``drafts``).  Before any step was measured ``step`` and ``draft`` answer the ``prior``'s
    numbers (one-row steps), and draft rounds not measured yet are the prior's in units of the measured one-row
    step.  Raises ``ValueError`` for a ``window`` or ``recent`` below 1.
    """

    WINDOW = 15
    RECENT = 64

    def __init__(self, prior: StaticCosts | None = None, window: int = WINDOW, recent: int = RECENT) -> None:
        if window < 1 or recent < 1:
            raise ValueError(f"window and recent must be at least 1, got {window!r} and {recent!r}")
        self.prior = prior or StaticCosts()
        self.window = window
        self.shape: dict[int, float] = {}  # rows -> seconds, as calibrated (or joined online)
        self.drafts: dict[int, dict[int, float]] = {}  # windows -> rounds -> seconds (the estimate)
        self._recent: deque[float] = deque(maxlen=recent)  # seconds / shape of the last steps
        self._seen: dict[tuple[int, int], deque[float]] = {}  # (windows, rounds) -> the last draft calls
        self._joined: dict[int, deque[float]] = {}  # rows the calibration lacks -> their first seconds / ratio
        self._span: tuple[int, int] | None = None  # the smallest and largest calibrated row counts
        self._level: float | None = None  # the recent ratio (cached)
        # the shape made non-decreasing, by rows, its row counts in order and its slope (``_base``; rebuilt when
        # the shape changes)
        self._curve: dict[int, float] | None = None
        self._xs: list[int] = []
        self._slope: float | None = None

    def _estimate(self, key: tuple[int, int], seconds: float) -> float:
        """Add ``seconds`` to the key's last measurements; their interquartile mean."""
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self.window)
        seen.append(max(0.0, float(seconds)))
        return _iq_mean(seen)

    def calibrated(self, rows: int, seconds: float) -> None:
        """A target step of ``rows`` rows took ``seconds`` in the calibration: the shape of the curve."""
        if rows > 0:
            self.shape[rows] = max(float(seconds), 1e-12)
            self._joined.pop(rows, None)
            self._curve = None
            lo, hi = self._span or (rows, rows)
            self._span = (min(lo, rows), max(hi, rows))

    def observe_step(self, rows: int, seconds: float) -> None:
        """A target step of ``rows`` rows took ``seconds`` (online)."""
        if rows <= 0:
            return
        seconds = max(float(seconds), 1e-12)
        joined = self._joined.get(rows)
        span = self._span
        inside = joined is None and span is not None and span[0] <= rows <= span[1]
        if inside or (joined is not None and len(joined) >= self.window):  # on the curve: a ratio to it
            self._recent.append(seconds / self._base(rows))
        else:  # outside the calibrated row counts: joins the shape, in the calibration's terms: at the current ratio
            level = self.level()
            if joined is None:
                joined = self._joined[rows] = deque(maxlen=self.window)
            joined.append(seconds / level)
            self.shape[rows] = _iq_mean(joined)
            self._recent.append(level)
            self._curve = None
        self._level = None

    def observe_draft(self, windows: int, rounds: int, seconds: float) -> None:
        """A proposal of ``rounds`` rounds for ``windows`` drafting windows took ``seconds``."""
        if windows > 0 and rounds > 0:
            self.drafts.setdefault(windows, {})[rounds] = self._estimate((windows, rounds), seconds)

    @property
    def measured(self) -> bool:
        """Whether any target step was measured (the answers are seconds, not the prior's units)."""
        return bool(self.shape)

    @property
    def steps(self) -> dict[int, float]:
        """The estimate at every row count measured (calibrated or run), in seconds."""
        return {rows: self.step(rows) for rows in sorted(self.shape)}

    def level(self) -> float:
        """The recent steps' ratio to the shape: the interquartile mean of the last ``recent`` (1 without any)."""
        if self._level is None:
            self._level = _iq_mean(self._recent) if self._recent else 1.0
        return self._level

    def _base(self, rows: int) -> float:
        """The shape's curve at ``rows``: interpolated between its row counts, made non-decreasing; past the
        largest, the least-squares slope of its multi-row counts (the prior's shape with fewer than two);
        below the smallest, the prior's shape; never below a smaller row count's value nor above a larger one's."""
        curve = self._curve
        if curve is None:  # asked several times per step (``Governor.rates``), changed only by a new row count
            curve, top = {}, 0.0
            for x in sorted(self.shape):
                top = max(top, self.shape[x])
                curve[x] = top
            self._curve = curve
            self._xs = list(curve)
            multi = [x for x in self._xs if x > 1]
            self._slope = (
                max(0.0, statistics.linear_regression(multi, [curve[x] for x in multi]).slope)
                if len(multi) >= 2
                else None
            )
        xs = self._xs
        found = _interpolate(curve, rows, xs)
        if found is not None:
            return found
        if rows < xs[0]:
            return min(curve[xs[0]], curve[xs[0]] * self._prior_shape(rows) / self._prior_shape(xs[0]))
        if self._slope is None:
            return max(curve[xs[-1]], curve[xs[-1]] * self._prior_shape(rows) / self._prior_shape(xs[-1]))
        return curve[xs[-1]] + self._slope * (rows - xs[-1])

    def _prior_shape(self, rows: int) -> float:
        """The prior's step at ``rows``, never below its one-row step (a prior fitted with a negative jump would
        make a second row cheaper than the first)."""
        return max(self.prior.step(1), self.prior.step(rows))

    def step(self, rows: int) -> float:
        """A target step of ``rows`` rows: seconds (the prior's one-row steps before any measurement)."""
        if not self.shape:
            return self.prior.step(rows)
        return self._base(rows) * self.level()

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
    positions, in a fresh cache of its own (``window_inputs`` with ``[rows_each] * windows``)."""
    return window_inputs(model, [rows_each] * windows, context, page_size, kv_dtype)


def window_inputs(
    model: Any, rows: Sequence[int], context: int, page_size: int, kv_dtype: Any = None
) -> tuple[Any, ...]:
    """A scratch target step: one decode window per entry of ``rows``, of that many rows, each after ``context``
    cached positions, in a fresh cache of its own.  Returns ``(input_ids [T] int64, positions [T] int64, cache,
    batch, logit_rows [T] int64)``, ``T = sum(rows)``, the arguments of ``Model.forward``."""
    import torch

    from mechserve.kv.paged import Span, build_attention_batch

    per = (context + max(rows)) // page_size + 1
    cache = model.new_cache(len(rows) * per, page_size, kv_dtype)
    spans: list[Any] = []
    slots: list[int] = []
    ids: list[int] = []
    positions: list[int] = []
    for i, count in enumerate(rows):
        table = tuple(range(i * per, (i + 1) * per))
        spans.append(Span(len(ids), context, count, table))
        for j in range(count):
            slots.append(table[(context + j) // page_size] * page_size + (context + j) % page_size)
            ids.append((100 + j) % model.arch.vocab_size)
            positions.append(context + j)
    a = model.arch
    batch = build_attention_batch(
        spans, slots, page_size, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows
    )
    return torch.tensor(ids), torch.tensor(positions), cache, batch, torch.arange(len(ids))


def calibration_shapes(max_k: int, batch: int = 8) -> list[tuple[int, ...]]:
    """The steps ``calibrate`` times, as the rows of each window: one window of 1 .. ``min(max_k + 1, 8)`` rows and
    of ``max_k + 1`` (every window batch 1 runs at the usual ``spec_len`` of up to 7; two of the AVX2 kernel's
    4-row tiles); ``batch`` windows of one row, then with 1, 2 and 4 guess rows among them (at most
    ``batch * max_k``), then of 2, 3 and ``max_k + 1`` rows each.  12 steps at ``max_k = 4``, 16 at 64."""
    shapes: list[tuple[int, ...]] = [(m,) for m in sorted({*range(1, min(max_k + 1, 8) + 1), max_k + 1})]
    if batch > 1:
        shapes.append((1,) * batch)
        for extra in (1, 2, 4):
            if extra <= batch * max_k:
                rows = [1] * batch
                for i in range(extra):
                    rows[i % batch] += 1
                shapes.append(tuple(rows))
        shapes += [(m,) * batch for m in sorted({2, 3, max_k + 1}) if m <= max_k + 1]
    return list(dict.fromkeys(shapes))


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
    repeats: int = 4,
    batch: int = 8,
    context: int = 128,
) -> None:
    """Measure ``model``'s target steps (``calibration_shapes``) and ``proposer``'s draft rounds into ``costs``.

    Each shape runs once untimed (first-call allocations), then ``repeats`` timed rounds, interleaved; the
    median of each goes to ``costs`` (the shape of the curve: the online ratio then adds the load the engine
    really runs under; where two shapes have as many rows in all, the smaller median).  Not the fastest: on a 2-core VM the fastest of 4 (and of 20) strayed by up to a fifth
    from the typical step, one row count up and the next down, which made guess rows look free or dear at
    random; the median of interleaved rounds kept the row counts' order.  A step is timed up to its argmax's ids
    on the host (a device step has finished).  ``hidden``: the forward also returns its hidden states (an EAGLE target).  The proposer's
    rounds are timed through its optional ``calibrate(windows, rounds)`` (a representative draft of ``rounds``
    guesses for ``windows`` windows; the EAGLE head has one), for 1 and ``batch`` windows and 1 .. ``max_k``
    rounds; a proposer without one is measured online only.
    """
    shapes = calibration_shapes(max_k, batch)
    inputs = {s: window_inputs(model, s, context, page_size, kv_dtype) for s in shapes}
    probe: Callable[[int, int], None] | None = getattr(proposer, "calibrate", None)
    drafts = [(n, r) for n in sorted({1, batch}) for r in range(1, max_k + 1)] if probe is not None else []
    step_times: dict[tuple[int, ...], list[float]] = {s: [] for s in shapes}
    draft_times: dict[tuple[int, int], list[float]] = {d: [] for d in drafts}
    for timed in [False] + [True] * repeats:
        for s in shapes:
            began = clock()
            model.forward(*inputs[s], **({"hidden_out": []} if hidden else {})).argmax(-1).tolist()
            if timed:
                step_times[s].append(clock() - began)
        for n, r in drafts:
            assert probe is not None
            began = clock()
            probe(n, r)
            if timed:
                draft_times[(n, r)].append(clock() - began)
    by_rows: dict[int, list[float]] = {}
    for shape, times in step_times.items():
        by_rows.setdefault(sum(shape), []).append(statistics.median(times))
    for rows, typical in by_rows.items():
        costs.calibrated(rows, min(typical))
    for (n, r), times in draft_times.items():
        costs.observe_draft(n, r, statistics.median(times))


__all__ = [
    "CostModel", "MeasuredCosts", "StaticCosts", "calibrate", "calibration_shapes", "step_inputs", "window_inputs",
]  # fmt: skip
