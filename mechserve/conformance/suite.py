"""All five checks over random workloads: ``check_executor(target, workloads=N, seed=S)``.

Each check draws ``N`` workloads from the hypothesis strategies the tests use (``cases`` for the
real-model checks, ``strategies.mechanism_idle`` for the ladder, ``N`` per rung pair), seeded by
``S`` so a run can be repeated exactly, and runs its per-workload function on each::

    replay      replay.check_replay        cases.real_workloads
    contract    contract.check_contract    cases.real_workloads (the same workloads as replay)
    kv          kv_audit.check_kv          cases.real_workloads (the same workloads as replay)
    invariance  invariance.check_invariance (every variant; odd-numbered requests stop early at an id
                                           of their reference)      cases.invariance_workloads
    ladder      ladder.check_ladder_pair   strategies.mechanism_idle(rung), for m01 … m13

A failure does not stop the check: every workload is run, the first few failures are kept (the
workload, the error type and its one-line message) and the rest counted.  A check the target cannot
support (no K/V tensors, no references) is skipped with the reason.  Failing examples are not
shrunk: the kept workload is the one that failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from hypothesis import HealthCheck, Phase, given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

CHECKS = ("replay", "contract", "kv", "invariance", "ladder")
"""The five checks, in the order they run."""

KEEP_FAILURES = 3
"""How many failing workloads a check keeps (the rest are counted)."""

Progress = Callable[[str, int, int], None]
"""``progress(check, done, total)``: called when a check starts (done 0) and after each workload."""


@dataclass
class Failure:
    """One failing workload of a check: the workload, the error type and its one-line message."""

    workload: Any
    error: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, "message": self.message, "workload": self.workload}


@dataclass
class CheckResult:
    """One check's outcome: workloads run, engine runs and steps checked, failures, skip reason, time,
    and ``events``: how often the passing runs exercised each of ``runner.EVENTS`` (preemption,
    rollback, prefix reuse, eviction, rejection, STOP, EOS)."""

    check: str
    workloads: int = 0
    runs: int = 0
    steps: int = 0
    failed: int = 0
    failures: list[Failure] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """No workload failed (a skipped check has not failed)."""
        return self.failed == 0

    @property
    def status(self) -> str:
        return "SKIPPED" if self.skipped else "PASS" if self.passed else "FAIL"

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "status": self.status,
            "workloads": self.workloads,
            "runs": self.runs,
            "steps": self.steps,
            "failed": self.failed,
            "events": dict(self.events),
            "skipped": self.skipped,
            "seconds": round(self.seconds, 3),
            "failures": [f.to_json() for f in self.failures],
        }


@dataclass
class Report:
    """What ``check_executor`` found: one ``CheckResult`` per check run."""

    target: str
    seed: int
    workloads: int
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def summary(self) -> str:
        """One line per check: ``replay: PASS (10 workloads, 20 runs)`` and the first failure's message."""
        lines = []
        for r in self.results:
            line = f"{r.check}: {r.status} ({r.workloads} workloads, {r.runs} runs)"
            if r.skipped:
                line += f": {r.skipped}"
            elif r.failures:
                line += f": {r.failed} failed; {r.failures[0].message}"
            lines.append(line)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "seed": self.seed,
            "workloads": self.workloads,
            "passed": self.passed,
            "checks": [r.to_json() for r in self.results],
        }


def drive(strategy: st.SearchStrategy[Any], examples: int, seed: int, fn: Callable[[Any], None]) -> None:
    """Call ``fn`` on up to ``examples`` values drawn from ``strategy`` with hypothesis, seeded by ``seed``.

    No database, no deadline, no health checks, no shrinking: ``fn`` must not raise for a failing
    workload (``check_executor`` records failures itself).
    """

    @hypothesis_settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis_seed(seed)
    @given(strategy)
    def loop(value: Any) -> None:
        fn(value)

    loop()


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _stop_at(workload: Mapping[str, Any]) -> dict[str, int]:
    """Odd-numbered requests stop at their reference's id number ``max_new_tokens // 2`` (when > 0)."""
    out = {}
    for i, spec in enumerate(workload.get("requests") or []):
        n = int(spec["max_new_tokens"])
        if i % 2 and n >= 2:
            out[str(spec["request_id"])] = n // 2
    return out


def _skip_reason(target: Any, check: str) -> str | None:
    if check == "ladder":
        return None
    if target is None:
        return "no target"
    if check == "kv" and (target.kv_of is None or target.dense_kv is None):
        return "the target has no K/V tensors (kv_of) or no dense reference (dense_kv)"
    if check == "invariance" and target.greedy is None:
        return "the target has no greedy reference"
    return None


def check_executor(
    target: Any = None,
    *,
    workloads: int = 10,
    seed: int = 0,
    checks: Sequence[str] = CHECKS,
    progress: Progress | None = None,
    world_size: tuple[int, int] = (1, 2),
) -> Report:
    """Run ``checks`` (default all five) on ``workloads`` random workloads each; return the ``Report``.

    ``target`` (a ``Target``) may be None when only ``ladder`` runs.  ``world_size`` bounds the ranks
    of the drawn real-model workloads.  Raises ``ValueError`` for an unknown check name or
    ``workloads < 1``.
    """
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}; the checks are {', '.join(CHECKS)}")
    if workloads < 1:
        raise ValueError(f"workloads must be >= 1, got {workloads}")
    results = []
    for check in [c for c in CHECKS if c in checks]:
        result = CheckResult(check)
        started = time.perf_counter()
        result.skipped = _skip_reason(target, check)
        if result.skipped is None:
            _run_check(check, target, result, workloads, seed, progress, world_size)
        result.seconds = time.perf_counter() - started
        results.append(result)
    name = "spec only" if target is None else str(target.name)
    return Report(name, seed, workloads, results)


Record = Callable[[Any, Callable[[], Mapping[str, Any]]], None]


def _ladder_example(record: Record, upper: str, workload: Mapping[str, Any]) -> None:
    """One ladder-consistency example: the pair below ``upper`` on ``workload``, recorded."""
    from mechserve.conformance.ladder import check_ladder_pair

    record({"rung": upper, **workload}, lambda: check_ladder_pair(upper, workload))


def _run_check(
    check: str,
    target: Any,
    result: CheckResult,
    examples: int,
    seed: int,
    progress: Progress | None,
    world_size: tuple[int, int],
) -> None:
    def record(workload: Any, fn: Callable[[], Mapping[str, Any]]) -> None:
        try:
            stats = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            result.failed += 1
            if len(result.failures) < KEEP_FAILURES:
                result.failures.append(Failure(workload, type(exc).__name__, _one_line(exc)))
        else:
            result.runs += int(stats.get("runs", 0))
            result.steps += int(stats.get("steps", 0))
            for key, value in (stats.get("events") or {}).items():
                result.events[key] = result.events.get(key, 0) + int(value)
        result.workloads += 1
        if progress is not None:
            progress(check, result.workloads, total)

    if check == "ladder":
        from mechserve.conformance.ladder import PAIRS
        from mechserve.conformance.strategies import mechanism_idle

        total = examples * len(PAIRS)
        if progress is not None:
            progress(check, 0, total)
        for upper, _ in PAIRS:
            drive(
                mechanism_idle(upper),
                examples,
                seed,
                partial(_ladder_example, record, upper),
            )
        return

    from mechserve.conformance.cases import invariance_workloads, real_workloads

    total = examples
    if progress is not None:
        progress(check, 0, total)
    if check == "invariance":
        from mechserve.conformance.invariance import check_invariance, with_stops

        def one(w: dict[str, Any]) -> None:
            record(w, lambda: check_invariance(target, with_stops(target, w, _stop_at(w))))

        drive(invariance_workloads(target.vocab_size, world_size=world_size), examples, seed, one)
        return
    fn: Callable[[Any, Any], Mapping[str, Any]]
    if check == "replay":
        from mechserve.conformance.replay import check_replay as fn
    elif check == "contract":
        from mechserve.conformance.contract import check_contract as fn
    else:
        from mechserve.conformance.kv_audit import check_kv as fn
    drive(
        real_workloads(target.vocab_size, world_size=world_size),
        examples,
        seed,
        lambda w: record(w, lambda: fn(target, w)),
    )
