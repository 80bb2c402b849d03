"""Issue 27 item 4: the governor prices what speculation really costs, measured on the loaded model.

``executor.costs``: the static cost model (the prior, in one-row steps) and the measured one (seconds per
target step by rows and per draft call by windows and rounds: a calibration when the executor is built, then
every decode step it runs).  Every test here injects the clock (a synthetic one that only moves when the
model or the head computes), so each decision is reproducible; none asserts a wall-clock time.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoints import Tiny, random_prompts
from tiny_engines import HEAD_PROMPTS, greedy_sequences, train_tiny_head
from tiny_models import save_cycle_model

from executor.test_spec_decode import CYCLE, PROMPT, drain, loaded
from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.api.proposers import PROPOSERS
from mechserve.engine.core import EngineCore
from mechserve.executor.costs import MeasuredCosts, StaticCosts, calibration_shapes
from mechserve.executor.governor import Candidate, Governor
from mechserve.executor.proposers_eagle import EagleProposer
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.model import eagle
from mechserve.model.eagle import EagleHead
from mechserve.model.llama import LlamaModel
from mechserve.model.loader import load_model


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cycle(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    """A 1-layer Llama whose greedy successor of ``CYCLE[i]`` is ``CYCLE[i + 1]``: prompt lookup's perfect case."""
    path = tmp_path_factory.mktemp("cycle")
    save_cycle_model(path, CYCLE)
    return load_model(str(path), tokenizer=False).model


class Clock:
    """A synthetic clock (seconds): it moves only when something advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def memory_bound(rows: int) -> float:
    """A step whose rows are almost free (weight reads dominate): 10 ms, +2 ms for a second row, +0.1 ms a row."""
    return 0.010 + (0.002 if rows > 1 else 0.0) + 0.0001 * (rows - 1)


def compute_bound(rows: int) -> float:
    """A step that costs its rows: 10 ms a row."""
    return 0.010 * rows


def timed_forward(model: Any, clock: Clock, cost: Callable[[int], float], monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.forward`` advances ``clock`` by ``cost(rows)`` (its rows: the step's input ids)."""
    forward = model.forward

    def forward_timed(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        clock.now += cost(int(input_ids.numel()))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_timed)


# The cost models ---------------------------------------------------------------------------------------------------


def test_static_costs_are_one_row_steps_with_a_jump_and_per_round_drafts() -> None:
    costs = StaticCosts(row_cost=0.05, jump_cost=0.45, draft_costs=(0.2, 0.3))
    assert costs.step(1) == 1.0 and costs.step(2) == pytest.approx(1.5) and costs.step(9) == pytest.approx(1.85)
    assert costs.draft(0, 3) == 0.0 and costs.draft(2, 1) == pytest.approx(0.5) and costs.draft(5, 8) == 0.5
    assert Governor(0.05, 0.45).step_cost(9) == pytest.approx(1.85)


def test_measured_costs_converge_on_noisy_steps_with_stalls() -> None:
    """Calibrated, then the machine runs 1.5x slower with 10% noise and 5% of its steps stalled 20x: the
    estimate (the calibrated curve times the interquartile mean of the recent ratios to it) is the new cost,
    at the row counts run, between them and past them (the fitted slope)."""
    rng = random.Random(3)
    costs = MeasuredCosts(StaticCosts())
    measured = (1, 2, 3, 5, 8, 16, 24, 40)
    for rows in measured:
        costs.calibrated(rows, memory_bound(rows) * rng.uniform(0.97, 1.03))
    for _ in range(60):
        for rows in measured:
            noise = 20.0 if rng.random() < 0.05 else rng.uniform(0.9, 1.1)
            costs.observe_step(rows, 1.5 * memory_bound(rows) * noise)
    for rows in (1, 2, 4, 12, 33, 40, 64):
        assert costs.step(rows) == pytest.approx(1.5 * memory_bound(rows), rel=0.06), rows


def test_measured_costs_follow_a_lasting_change() -> None:
    """The machine gets twice as slow: half a window of steps later the estimate has moved, a window later it is
    the new cost, at the row count run and at the others (not left at stale prices)."""
    costs = MeasuredCosts(StaticCosts(), recent=8)
    costs.calibrated(8, 0.010)
    costs.calibrated(40, 0.030)
    for _ in range(8):
        costs.observe_step(8, 0.010)
    for _ in range(4):
        costs.observe_step(8, 0.020)
    assert costs.step(8) == pytest.approx(0.015)
    for _ in range(4):
        costs.observe_step(8, 0.020)
    assert costs.step(8) == pytest.approx(0.020) and costs.step(40) == pytest.approx(0.060)


def test_measured_costs_before_and_between_measurements() -> None:
    """Nothing measured: the prior's units.  One-row steps measured only: the prior's shape (its jump) in
    seconds, and draft rounds never measured are the prior's in measured one-row steps.  Draft rounds
    interpolate between measured window counts and rounds (through zero rounds)."""
    prior = StaticCosts(row_cost=0.05, jump_cost=0.45, draft_costs=(0.25,) * 4)
    costs = MeasuredCosts(prior)
    assert not costs.measured and costs.step(5) == prior.step(5) and costs.draft(2, 1) == pytest.approx(0.5)
    costs.observe_step(1, 0.008)
    assert costs.step(2) == pytest.approx(0.008 * 1.5) and costs.draft(2, 8) == pytest.approx(0.004)
    costs.observe_draft(1, 2, 0.004)
    costs.observe_draft(8, 2, 0.012)
    assert costs.draft(1, 1) == pytest.approx(0.002)  # half of 2 rounds, through (0, 0)
    assert costs.draft(4, 1) == pytest.approx(0.008)  # extended by the last segment
    assert costs.draft(2, 4) == pytest.approx(0.004 + 0.008 * 3 / 7)  # between 1 and 8 windows
    assert costs.draft(2, 16) == pytest.approx(0.012) and costs.draft(0, 8) == 0.0
    with pytest.raises(ValueError, match="window and recent must be at least 1"):
        MeasuredCosts(window=0)


def test_a_stall_at_the_rows_being_run_keeps_the_next_rows_price() -> None:
    """Measured on a batch-8 run: 8-row steps, then a stall while 7 requests decoded (7-row steps 30% slower).
    A ratio kept per row count priced the 8th row at nothing (the 7-row price rose past the old 8-row one, and the
    curve never falls), and a guess row was drafted.  One ratio for all: the rows keep the calibration's relative
    prices through the stall."""
    costs = MeasuredCosts(recent=64)
    for rows, ms in ((1, 24.0), (5, 38.0), (8, 47.0), (9, 55.0), (12, 66.0), (16, 83.0)):
        costs.calibrated(rows, ms / 1e3)
    for _ in range(40):
        costs.observe_step(8, 0.047)
    for _ in range(30):
        costs.observe_step(7, 1.3 * costs._base(7))
    assert costs.step(8) - costs.step(7) > 0.002
    level = costs.level()
    assert 1.0 < level <= 1.3
    assert costs.step(8) - costs.step(7) == pytest.approx(level * (0.047 - costs._base(7)))  # 3 ms, not 0
    assert costs.step(9) - costs.step(8) == pytest.approx(level * 0.008)  # the 9th row: 8 ms


def test_only_rows_outside_the_calibrated_ones_join_the_shape() -> None:
    """A row count between two calibrated ones is priced on the line between them (its steps move the ratio);
    one past them joins the shape at its seconds over the ratio, refined by later steps (the interquartile mean
    of the last ``window``), until a calibration names it."""
    costs = MeasuredCosts(window=4)
    costs.calibrated(1, 0.010)
    costs.calibrated(9, 0.030)
    costs.observe_step(5, 0.040)  # the line says 0.020: the ratio is 2 now
    assert 5 not in costs.shape and costs.level() == pytest.approx(2.0) and costs.step(9) == pytest.approx(0.060)
    for seconds in (0.100, 0.140, 0.100, 0.100):
        costs.observe_step(17, seconds)  # at a ratio of 2: 0.050, 0.070, 0.050, 0.050 in the calibration's terms
    assert costs.shape[17] == pytest.approx(0.050) and costs.step(17) == pytest.approx(0.100)
    costs.calibrated(17, 0.040)
    assert costs.step(17) == pytest.approx(0.080)


def test_without_a_calibration_a_slower_machine_reprices_every_row_count() -> None:
    """Tensor-parallel ranks measure online only: each row count joins the curve at its first steps, and later
    steps at any row count move the one ratio.  Found in review: the ratio stayed at 1 when every row count had
    joined, so after a slowdown seen at 1 row the 5-row step kept its old price and 4 guesses at 5% looked worth
    their rows."""
    costs = MeasuredCosts()
    for _ in range(20):
        costs.observe_step(1, 0.020)
    for _ in range(5):
        costs.observe_step(5, 0.030)
    for _ in range(100):
        costs.observe_step(1, 0.040)
    assert costs.level() == pytest.approx(2.0)
    assert costs.step(1) == pytest.approx(0.040) and costs.step(5) == pytest.approx(0.060)
    assert costs.step(2) == pytest.approx(0.045)  # on the line from 1 to 5 rows, at the new ratio
    assert Governor(costs=costs).decide([Candidate(4, 4, 0.05)], 4) == (0, [None])


def test_a_joined_row_count_is_priced_by_its_first_steps_then_moves_with_the_ratio() -> None:
    costs = MeasuredCosts(window=3, recent=4)
    costs.calibrated(8, 0.050)
    costs.observe_step(16, 0.070)
    costs.observe_step(16, 0.090)
    costs.observe_step(16, 0.080)
    assert costs.shape[16] == pytest.approx(0.080) and costs.level() == 1.0  # the join left the ratio alone
    for _ in range(4):
        costs.observe_step(16, 0.160)  # from now on ratios to the curve: 2
    assert costs.shape[16] == pytest.approx(0.080) and costs.level() == pytest.approx(2.0)
    assert costs.step(8) == pytest.approx(0.100) and costs.step(16) == pytest.approx(0.160)


@pytest.mark.parametrize("prior", [StaticCosts(0.05, -0.075), StaticCosts(0.05, 0.45), StaticCosts(0.0, -0.5)])
def test_the_step_curve_never_falls_outside_the_measured_row_counts(prior: StaticCosts) -> None:
    """Below the smallest measured row count and past the largest the prior gives the shape; a prior whose second
    row is cheaper than the first (a fitted negative jump) must not make the curve fall (found in review)."""
    for measured in ((1,), (2,), (4,), (3, 9)):
        costs = MeasuredCosts(prior)
        for rows in measured:
            costs.calibrated(rows, 0.010 * rows)
        prices = [costs.step(rows) for rows in range(1, 24)]
        assert prices == sorted(prices), (prior, measured)


def test_the_step_curve_never_falls_with_more_rows() -> None:
    costs = MeasuredCosts()
    for rows, s in ((1, 0.010), (8, 0.015), (16, 0.013), (24, 0.020)):
        costs.observe_step(rows, s)
    assert costs.step(16) == pytest.approx(0.015) and costs.step(12) == pytest.approx(0.015)


def test_calibration_shapes_cover_every_batch_1_window_and_the_first_guess_rows_of_a_batch() -> None:
    """Batch 1: every window of 1 .. max_k + 1 rows (up to 8, then max_k + 1 only).  Batch 8: one row each, then
    1, 2 and 4 guess rows among them (the 9th row starts a tile of the AVX2 kernel and costs twice the next ones),
    then whole windows."""
    one = [(m,) for m in range(1, 6)]
    assert [sum(s) for s in calibration_shapes(4)] == [1, 2, 3, 4, 5, 8, 9, 10, 12, 16, 24, 40]
    assert calibration_shapes(4)[:6] == [*one, (1,) * 8]
    assert calibration_shapes(4)[6:9] == [(2,) + (1,) * 7, (2, 2) + (1,) * 6, (2,) * 4 + (1,) * 4]
    assert [sum(s) for s in calibration_shapes(1)] == [1, 2, 8, 9, 10, 12, 16]
    assert calibration_shapes(2, batch=1) == [(1,), (2,), (3,)]
    assert calibration_shapes(1, batch=2) == [(1,), (2,), (1, 1), (2, 1), (2, 2)]  # 4 guesses: more than 2 x 1
    assert [sum(s) for s in calibration_shapes(64)] == [*range(1, 9), 65, 8, 9, 10, 12, 16, 24, 520]


# The governor on measured costs ------------------------------------------------------------------------------------


def measured(step: Callable[[int], float], round_s: float = 0.0) -> MeasuredCosts:
    costs = MeasuredCosts()
    for rows in (1, 2, 3, 5, 8, 16, 24, 40):
        costs.observe_step(rows, step(rows))
    if round_s:
        for n in (1, 8):
            for r in range(1, 5):
                costs.observe_draft(n, r, round_s * r)
    return costs


def test_the_governor_speculates_where_measured_costs_say_it_pays() -> None:
    cheap_rows = Governor(costs=measured(memory_bound))
    assert cheap_rows.choose([Candidate(4, 4, 0.5)], 4) > 0
    assert cheap_rows.choose([Candidate(4, 4, 0.5)] * 8, 4) > 0
    # rows that cost what they compute: 1 + a + ... + a^k < k + 1 rows, whatever a < 1
    dear_rows = Governor(costs=measured(compute_bound))
    assert dear_rows.choose([Candidate(4, 4, 0.9)], 4) == 0 and dear_rows.choose([Candidate(4, 4, 0.9)] * 8, 4) == 0
    # a draft round dearer than what its acceptance earns: off; a cheap one: on
    dear_draft = Governor(costs=measured(memory_bound, round_s=0.004))  # 40% of a step a round
    assert dear_draft.choose([Candidate(4, 4, 0.5)], 4) == 0
    assert dear_draft.choose([Candidate(4, 4, 0.95)], 4) > 0  # a head that is almost always right still pays
    cheap_draft = Governor(costs=measured(memory_bound, round_s=0.0002))
    assert cheap_draft.choose([Candidate(4, 4, 0.5)], 4) > 0


def test_the_margin_keeps_a_marginal_gain_off() -> None:
    """A guess worth 1% more tokens per second than plain decoding is not taken (the margin, 3%)."""
    costs = StaticCosts(row_cost=0.0, jump_cost=0.0, draft_costs=(0.485,))
    assert Governor(costs=costs).choose([Candidate(1, 1, 0.5)], 1) == 0  # 1.5 / 1.485 = 1.01
    assert Governor(costs=costs, margin=0.0).choose([Candidate(1, 1, 0.5)], 1) == 1


# The executor measures ---------------------------------------------------------------------------------------------


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def engine_run(model: LlamaModel, executor: TorchExecutor | None, prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:
    """``prompts`` through EngineCore (on ``executor``, else without speculation): outputs and step records."""
    spec = executor.speculative if executor is not None else None
    config = EngineConfig(page_size=4, num_pages=64, speculative=spec)
    core = EngineCore(loaded(model, Path("/nonexistent")), config, executor=executor)
    for p in prompts:
        core.add_request(list(p), PARAMS)
    records = [o.record for o in drain(core)]
    return [list(r.output_ids) for r in core.scheduler.spec_engine.requests], records


def test_the_calibration_measures_the_loaded_models_steps(cycle: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    timed_forward(cycle, clock, memory_bound, monkeypatch)
    ex = TorchExecutor(cycle, 64, 4, speculative=NGRAM, clock=clock)
    assert isinstance(ex.governor.costs, MeasuredCosts) and ex.costs is ex.governor.costs
    calibrated = (1, 2, 3, 4, 5, 8, 9, 10, 12, 16, 24, 40)
    assert ex.costs.steps == {rows: pytest.approx(memory_bound(rows)) for rows in calibrated}
    assert ex.costs.drafts == {}  # prompt lookup has no rounds to calibrate: measured as it proposes
    fixed = TorchExecutor(cycle, 64, 4, speculative=SpeculativeConfig(adaptive=False), clock=clock)
    uncalibrated = TorchExecutor(cycle, 64, 4, speculative=NGRAM, clock=clock, calibrate=False)
    assert fixed.costs is None and isinstance(uncalibrated.costs, MeasuredCosts) and not uncalibrated.costs.steps


def test_the_online_estimate_follows_the_executors_timed_steps(
    cycle: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every decode step's rows and time reach the estimate: calibrated, then the machine gets twice as slow;
    the two requests decode one row each per step (rows cost what they compute: no guesses), and 2-row steps
    are then priced at the new cost, and so are the row counts not run since the calibration (a stale price
    would make 3 rows look cheaper than 2)."""
    clock = Clock()
    slow = [1.0]
    timed_forward(cycle, clock, lambda rows: slow[0] * compute_bound(rows), monkeypatch)
    ex = TorchExecutor(cycle, 64, 4, speculative=NGRAM, clock=clock)
    slow[0] = 2.0
    prompts = [PROMPT, [*CYCLE[3:], *CYCLE[:4]]]
    got, _ = engine_run(cycle, ex, prompts)
    assert got == engine_run(cycle, None, prompts)[0]
    assert ex.costs is not None and ex.stats().proposed == 0
    assert ex.costs.step(2) == pytest.approx(2.0 * compute_bound(2))
    assert ex.costs.step(3) == pytest.approx(2.0 * compute_bound(3))
    assert ex.costs.step(40) == pytest.approx(2.0 * compute_bound(40))


@pytest.mark.parametrize("cost, drafts", [(memory_bound, True), (compute_bound, False)])
def test_prompt_lookup_speculates_only_where_the_measured_rows_pay(
    cycle: LlamaModel, monkeypatch: pytest.MonkeyPatch, cost: Callable[[int], float], drafts: bool
) -> None:
    """A perfect copier (the cycle model continues its prompt): rows almost free, it drafts whole windows;
    rows that cost what they compute, it never drafts (no guess can earn its row).  Same output either way."""
    clock = Clock()
    timed_forward(cycle, clock, cost, monkeypatch)
    ex = TorchExecutor(cycle, 64, 4, speculative=NGRAM, clock=clock)
    prompts = [PROMPT] * 3
    got, records = engine_run(cycle, ex, prompts)
    assert got == engine_run(cycle, None, prompts)[0]
    drafted = [d for rec in records for d in rec.drafted.values()]
    assert (max(drafted) == 4) if drafts else (max(drafted, default=0) == 0)


@pytest.mark.parametrize("cost, asked", [(memory_bound, True), (compute_bound, False)])
def test_the_proposer_is_not_asked_where_no_guess_could_pay(
    cycle: LlamaModel, monkeypatch: pytest.MonkeyPatch, cost: Callable[[int], float], asked: bool
) -> None:
    """Rows that cost what they compute: not even a window full of guesses kept every time could pay
    (``Governor.may_pay``), so ``advise`` answers 0 without asking the proposer what it has; rows almost free:
    it asks.  Same output either way."""
    clock = Clock()
    timed_forward(cycle, clock, cost, monkeypatch)
    ex = TorchExecutor(cycle, 64, 4, speculative=NGRAM, clock=clock)
    calls: list[int] = []
    available = ex.proposer.available

    def counted(*args: Any) -> int:
        calls.append(1)
        return available(*args)

    monkeypatch.setattr(ex.proposer, "available", counted)
    prompts = [PROMPT] * 2
    got, _ = engine_run(cycle, ex, prompts)
    assert got == engine_run(cycle, None, prompts)[0]
    assert bool(calls) == asked and (ex.stats().proposed > 0) == asked


def test_a_given_governor_with_measured_costs_is_fed(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    timed_forward(tiny.model, clock, memory_bound, monkeypatch)
    costs = MeasuredCosts()
    ex = TorchExecutor(tiny.model, 64, 4, speculative=NGRAM, governor=Governor(costs=costs), clock=clock)
    assert ex.costs is costs and not costs.steps  # given: not calibrated, but measured online
    engine_run(tiny.model, ex, random_prompts([7, 5], seed=2))
    assert costs.steps and all(costs.steps[r] == pytest.approx(memory_bound(r)) for r in costs.steps)


# The EAGLE head's rounds -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    sequences = greedy_sequences(tiny.model, HEAD_PROMPTS, 24)
    return train_tiny_head(tiny.model, tmp_path_factory.mktemp("eagle-head"), sequences)


def test_eagle_gets_a_governor_that_prices_its_rounds(tiny: Tiny, head: Path) -> None:
    """Before anything is measured each round costs the head's layer and its LM head rows next to a target step:
    not free, the same every round, cheaper with FR-Spec's subset of the vocabulary."""
    found = eagle.find(tiny.model, head)
    governors = [
        PROPOSERS["eagle"].new_governor(EagleProposer(tiny.model, found, vocab), None, tiny.model, 4)
        for vocab in (0, 8)
    ]
    whole, subset = (g.costs for g in governors)
    assert isinstance(whole, StaticCosts) and isinstance(subset, StaticCosts)
    assert len(whole.draft_costs) == 4 and len(set(whole.draft_costs)) == 1
    assert 0 < subset.draft_costs[0] < whole.draft_costs[0]


def timed_head(clock: Clock, round_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """``EagleHead.draft`` advances ``clock`` by ``round_s`` per round."""
    original = EagleHead.draft

    def draft_timed(self: EagleHead, *args: Any, **kwargs: Any) -> torch.Tensor:
        steps = kwargs["steps"] if "steps" in kwargs else args[-1]
        clock.now += round_s * steps
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EagleHead, "draft", draft_timed)


@pytest.mark.parametrize("round_s, pays", [(0.008, False), (0.0002, True)])
def test_the_head_runs_only_where_its_measured_rounds_pay(
    tiny: Tiny, head: Path, monkeypatch: pytest.MonkeyPatch, round_s: float, pays: bool
) -> None:
    """A target step of ~10 ms, rows almost free: a head round of 8 ms costs more than a guess accepted half the
    time earns (the estimate before any verdict), so the head never runs; at 0.2 ms it drafts.  The calibration
    timed its rounds; greedy output is the same either way."""
    clock = Clock()
    timed_forward(tiny.model, clock, memory_bound, monkeypatch)
    timed_head(clock, round_s, monkeypatch)
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, eagle_head=str(head))
    ex = TorchExecutor(tiny.model, 64, 4, speculative=spec, clock=clock)
    assert ex.costs is not None
    assert ex.costs.drafts == {n: {r: pytest.approx(r * round_s) for r in (1, 2, 3)} for n in (1, 8)}
    prompts = random_prompts([7, 5, 9], seed=12)
    got, _ = engine_run(tiny.model, ex, prompts)
    assert got == engine_run(tiny.model, None, prompts)[0]
    assert (ex.stats().proposed > 0) == pays


def test_static_costs_by_environment(cycle: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MECHSERVE_SPEC_COSTS=static``: the method's fixed prices, nothing timed (the same decisions on every
    run); another value is refused naming the variable."""
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")
    ex = TorchExecutor(cycle, 64, 4, speculative=NGRAM)
    assert ex.costs is None and isinstance(ex.governor.costs, StaticCosts)
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "guessed")
    with pytest.raises(ValueError, match="MECHSERVE_SPEC_COSTS must be one of measured, static, got 'guessed'"):
        TorchExecutor(cycle, 64, 4, speculative=NGRAM)
