"""Speculation counted as kept, on the real backend: what the request keeps is what everything reports.

The cycle model (a 1-layer Llama whose greedy successor of ``CYCLE[i]`` is ``CYCLE[i + 1]``) continues
``PROMPT`` with ``2 7 4 6 1 3 5 ...`` and prompt lookup knows it, so with 4 guesses per window (fixed)
the first decode window proposes ``[7, 4, 6, 1]`` and the model accepts all four.  Each way of ending
the request inside that run cuts it: an EOS id, a stop id, a stop string, or ``max_tokens`` (which caps
the window before it is drafted).  In every case the step record, ``ExecutorStats``, the serving
metrics, the acceptance estimates behind the adaptive governor and ``mechserve generate``'s summary
line all count the guesses the request kept, which is what ``EngineCore`` tells the executor after
each step (``Executor.settle``).  The field case: an accepted window holding EOS printed "4 of 4
guesses accepted, 5.00 tokens per decode step" beside a trace that said 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import save_cycle_model

from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.cli.main import main
from mechserve.engine.core import EngineCore
from mechserve.entrypoints.metrics import ServingMetrics
from mechserve.executor.governor import Acceptance
from mechserve.executor.protocol import ExecutorStats
from mechserve.executor.rank_group import RankGroup
from mechserve.spec import m16_request_draft_lengths as m16

CYCLE = [3, 5, 2, 7, 4, 6, 1]
PROMPT = [*CYCLE, *CYCLE[:2]]  # continues 2, 7, 4, 6, 1, 3, 5, 2, ...
FIXED = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cycle-plain")
    save_cycle_model(path, CYCLE)
    return path


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cycle model whose EOS id is 4: the window ``[7, 4, 6, 1]`` holds its EOS."""
    path = tmp_path_factory.mktemp("cycle-eos")
    save_cycle_model(path, CYCLE, eos_token_id=4)
    return path


def run(path: Path, params: SamplingParams) -> tuple[Any, list[Any], ExecutorStats, list[tuple[str, int, int]]]:
    """``PROMPT`` through ``EngineCore`` with 4 fixed guesses; (the output, the step outputs, the executor's
    counters, every acceptance observation the governor got)."""
    core = EngineCore.open(str(path), EngineConfig(page_size=4, num_pages=32, speculative=FIXED))
    observed: list[tuple[str, int, int]] = []
    original = Acceptance.observe

    def spy(self: Acceptance, request_id: str, proposed: int, accepted: int) -> None:
        observed.append((request_id, proposed, accepted))
        original(self, request_id, proposed, accepted)

    core.add_request(PROMPT, params)
    steps = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Acceptance, "observe", spy)
        while core.has_unfinished():
            steps.append(core.step())
    (done,) = [o.outputs[0] for step in steps for o in step.finished]
    core.check_pages()
    return done, steps, core.stats(executor=True).executor, observed


def kept_counts(steps: list[Any]) -> tuple[int, int, int]:
    """(decode windows, accepted guesses, emitted ids) as the step records say."""
    windows = sum(len(s.record.drafted) for s in steps)
    accepted = sum(sum(s.record.accepted.values()) for s in steps)
    emitted = sum(len(s.record.tokens[rid]) for s in steps for rid in s.record.drafted)
    return windows, accepted, emitted


def check_kept(steps: list[Any], stats: ExecutorStats, observed: list[tuple[str, int, int]]) -> None:
    """The executor, the governor's estimates and the serving metrics count exactly what the records keep."""
    windows, accepted, emitted = kept_counts(steps)
    assert (stats.windows, stats.accepted, stats.emitted) == (windows, accepted, emitted)
    assert [(p, a) for _, p, a in observed] == [
        (p, a) for p, a in zip(windows_proposed(steps), (a for s in steps for a in s.record.accepted.values()))
    ]
    metrics = ServingMetrics()
    for s in steps:
        metrics.observe_step(s)
    assert metrics.snapshot()["spec_decode_accepted_tokens"] == accepted
    assert metrics.snapshot()["spec_decode_draft_tokens"] == stats.slots


def windows_proposed(steps: list[Any]) -> list[int]:
    """Guesses proposed per decode window: prompt lookup always fills these windows."""
    return [d for s in steps for d in s.record.drafted.values()]


def the_window(steps: list[Any]) -> Any:
    return next(s.record for s in steps if s.record.drafted.get("0"))


def test_eos_inside_an_accepted_window_counts_one_guess_not_four(eos_dir: Path) -> None:
    """The field case: the model accepts [7, 4, 6, 1]; EOS (4) ends the request after 7."""
    done, steps, stats, observed = run(eos_dir, SamplingParams(temperature=0.0, max_tokens=12))
    assert (done.token_ids, done.finish_reason, done.stop_reason) == ([2, 7, 4], "stop", None)
    window = the_window(steps)
    assert (window.drafted["0"], window.accepted["0"], window.rolled_back["0"], window.tokens["0"]) == (4, 1, 3, (7, 4))
    assert (stats.windows, stats.slots, stats.proposed, stats.accepted, stats.emitted) == (1, 4, 4, 1, 2)
    assert observed == [("0", 4, 1)]
    check_kept(steps, stats, observed)


def test_generate_prints_the_guesses_the_request_kept(eos_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = " ".join(f"w{t}" for t in PROMPT)
    rc = main(["generate", prompt, "--model", str(eos_dir), "--max-tokens", "12", "--spec-len", "4", "--spec-fixed"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "speculation (ngram): 1 of 4 guesses accepted (25%), 2.00 tokens per decode step" in out, out
    assert "4 of 4" not in out


def test_a_stop_id_inside_an_accepted_window(plain_dir: Path) -> None:
    done, steps, stats, observed = run(plain_dir, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[4]))
    assert (done.token_ids, done.finish_reason, done.stop_reason) == ([2, 7, 4], "stop", 4)
    assert the_window(steps).accepted["0"] == 1
    assert (stats.proposed, stats.accepted, stats.emitted) == (4, 1, 2) and observed == [("0", 4, 1)]
    check_kept(steps, stats, observed)


def test_a_stop_string_inside_an_accepted_window(plain_dir: Path) -> None:
    """The model accepts all four guesses and the bonus id ([7, 4, 6, 1, 3]); the string "w4" ends at 4, found
    by ``EngineCore`` after the step: the record, the counters and the governor keep 1 guess, 2 ids."""
    done, steps, stats, observed = run(plain_dir, SamplingParams(temperature=0.0, max_tokens=12, stop=["w4"]))
    assert (done.token_ids, done.finish_reason, done.stop_reason) == ([2, 7, 4], "stop", "w4")
    window = the_window(steps)
    assert (window.drafted["0"], window.accepted["0"], window.tokens["0"]) == (4, 1, (7, 4))
    assert window.finished["0"] is m16.FinishReason.STOP
    assert (stats.proposed, stats.accepted, stats.emitted) == (4, 1, 2) and observed == [("0", 4, 1)]
    check_kept(steps, stats, observed)


def test_max_tokens_caps_the_window_before_it_is_drafted(plain_dir: Path) -> None:
    """max_tokens 3: after the first id the window may carry 1 guess, not 4 (m09's cap); the counters say 1."""
    done, steps, stats, observed = run(plain_dir, SamplingParams(temperature=0.0, max_tokens=3))
    assert (done.token_ids, done.finish_reason) == ([2, 7, 4], "length")
    window = the_window(steps)
    assert (window.drafted["0"], window.accepted["0"], window.tokens["0"]) == (1, 1, (7, 4))
    assert (stats.windows, stats.slots, stats.proposed, stats.accepted, stats.emitted) == (1, 1, 1, 1, 2)
    assert observed == [("0", 1, 1)]
    check_kept(steps, stats, observed)


def test_without_a_cut_everything_accepted_is_kept(plain_dir: Path) -> None:
    """The control: nothing ends the request inside a window, so kept = the executor's verdicts."""
    done, steps, stats, observed = run(plain_dir, SamplingParams(temperature=0.0, max_tokens=11))
    assert done.token_ids == [2, 7, 4, 6, 1, 3, 5, 2, 7, 4, 6]
    assert stats.accepted == stats.proposed > 4 and stats.emitted == len(done.token_ids) - 1
    check_kept(steps, stats, observed)


class _Recording(RankGroup):
    """A rank group without processes: it records the command lists each rank would receive."""

    world_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[list[list[tuple[Any, ...]]]] = []

    def _exchange(self, messages: list[list[tuple[Any, ...]]]) -> list[Any]:
        self.sent.append(messages)
        return [None] * self.world_size

    def _ask(self, command: tuple[Any, ...]) -> Any:
        self.sent.append([self._take(0, command)])
        return ExecutorStats()

    def close(self) -> None:
        self.closed = True


def test_a_rank_group_queues_what_was_kept_for_every_rank() -> None:
    """``settle`` travels to every rank with the next round trip, after the step and before any release, so
    every rank's counters and estimates agree; an empty settle sends nothing."""
    group = _Recording()
    group.settle({})
    group.settle({"a": 1})
    group.release("a")
    group.stats()
    ((to_rank0,),) = group.sent
    assert to_rank0 == [("settle", {"a": 1}), ("release", "a"), ("stats",)]
    assert group._queues[1] == [("settle", {"a": 1}), ("release", "a")]  # rank 1 gets them with the next round
