"""``mechserve conform``: check the torch executor against the spec on random workloads.

Runs the five conformance checks (``mechserve.conformance``: replay, contract, kv, invariance,
ladder) on ``--workloads N`` workloads each, drawn by the hypothesis strategies the tests use and
seeded by ``--seed``, with a progress bar on stderr; then prints one table row per check (workloads,
engine runs, steps checked, result, time) and the first failures, or with ``--json`` one JSON
object.  Exit status 0 when every check passed, 1 when one failed, 2 (one ``mechserve: error: ...``
line) for a usage error or a model that cannot be loaded.

Importing this module imports neither torch nor hypothesis; ``--checks ladder`` never needs torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from mechserve.cli.errors import CliError
from mechserve.cli.parser import Bounded

HELP = "check the torch executor against the spec: replay, contract, KV audit, invariance, ladder"
CHECKS = ("replay", "contract", "kv", "invariance", "ladder")
EXIT_FAILED = 1
EVENT_WORDS = {
    "preempted": "preemptions",
    "rolled_back": "rollbacks",
    "reused": "prefix reuses",
    "evicted": "evicted pages",
    "rejected": "rejections",
    "stopped": "stop-id finishes",
    "eos": "EOS finishes",
}
MAX_WORKLOADS = 100_000


def check_list(text: str) -> tuple[str, ...]:
    """An argparse ``type=``: comma-separated names from ``CHECKS`` (at least one), in ``CHECKS`` order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"name at least one check of {', '.join(CHECKS)}")
    for name in names:
        if name not in CHECKS:
            raise argparse.ArgumentTypeError(f"unknown check {name!r}; the checks are {', '.join(CHECKS)}")
    return tuple(c for c in CHECKS if c in names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2",
        help="the model the torch executor runs: 'smollm2' (the embedded SmolLM2-135M, default), "
        "'tiny' (a built-in random 2-layer model: seconds), a local Hugging Face model directory or a GGUF file "
        "(its reference: transformers on the file's weights decoded to float32)",
    )
    parser.add_argument(
        "--workloads",
        type=Bounded(int, ge=1, le=MAX_WORKLOADS),
        default=10,
        metavar="N",
        help="random workloads per check (default 10)",
    )
    parser.add_argument(
        "--seed", type=Bounded(int, ge=0, le=2**32 - 1), default=0, metavar="S", help="hypothesis seed (default 0)"
    )
    parser.add_argument(
        "--checks",
        type=check_list,
        default=CHECKS,
        metavar="LIST",
        help=f"comma-separated checks to run (default all: {','.join(CHECKS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _load_target(model: str) -> Any:
    """The conformance target for ``--model``; ``CliError`` when torch is missing or loading fails."""
    try:
        import torch
    except ModuleNotFoundError:
        raise CliError(
            "the replay, contract, kv and invariance checks need torch: pip install 'mechserve[torch]' "
            "(or run --checks ladder)"
        ) from None
    from mechserve.api.errors import ModelLoadError
    from mechserve.conformance.target import TINY, load_target
    from mechserve.engine.executors import configure_threads

    if model == TINY:
        torch.set_num_threads(1)  # a 2-layer model gains nothing from more, and loses much on a busy machine
    else:
        configure_threads()
    try:
        return load_target(model)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run the checks and print the report; returns 0 (all passed) or 1 (a check failed).

    Raises ``CliError`` when hypothesis or torch is missing or the model cannot be loaded.
    """
    try:
        import hypothesis  # noqa: F401  (the workloads are hypothesis strategies)
    except ModuleNotFoundError:
        raise CliError("conform draws its workloads with hypothesis: pip install hypothesis") from None
    from rich.console import Console

    from mechserve.conformance.suite import check_executor

    checks = tuple(args.checks)
    target = _load_target(args.model) if set(checks) - {"ladder"} else None
    with _progress(Console(stderr=True)) as progress:
        report = check_executor(target, workloads=args.workloads, seed=args.seed, checks=checks, progress=progress)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        _print_report(report, Console())
    return 0 if report.passed else EXIT_FAILED


class _progress:
    """A rich progress bar (one task per check) on ``console``, as a ``check_executor`` callback.

    Shown only when ``console`` is a terminal (rich would leave a blank line in a log or a pipe).
    """

    def __init__(self, console: Any) -> None:
        self.enabled = bool(console.is_terminal)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("{task.description:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> Callable[[str, int, int], None]:
        if self.enabled:
            self.bar.start()
        return self.update

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.stop()

    def update(self, check: str, done: int, total: int) -> None:
        if check not in self.tasks:
            self.tasks[check] = self.bar.add_task(check, total=total)
        self.bar.update(self.tasks[check], completed=done, total=total)


def exercised(report: Any) -> dict[str, int]:
    """What the real runs exercised, per event: replay, contract and kv run the same workloads, so
    the most any of them saw, plus what invariance saw."""
    seen: dict[str, int] = {}
    same = [r.events for r in report.results if r.check in ("replay", "contract", "kv")]
    other = [r.events for r in report.results if r.check == "invariance"]
    for key in dict.fromkeys(k for events in same + other for k in events):
        seen[key] = max((e.get(key, 0) for e in same), default=0) + sum(e.get(key, 0) for e in other)
    return seen


def _print_report(report: Any, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"mechserve conform: {report.target} · seed {report.seed} · {report.workloads} workloads per check"
    )
    for name, justify in (
        ("check", "left"),
        ("workloads", "right"),
        ("runs", "right"),
        ("steps", "right"),
        ("result", "left"),
        ("time", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in report.results:
        if r.skipped:
            result = f"[yellow]SKIPPED[/yellow] ({r.skipped})"
        elif r.passed:
            result = "[green]PASS[/green]"
        else:
            result = f"[red]FAIL[/red] ({r.failed} of {r.workloads})"
        table.add_row(r.check, str(r.workloads), str(r.runs), str(r.steps), result, f"{r.seconds:.1f}s")
    console.print(table)
    seen = exercised(report)
    if any(seen.values()):
        parts = ", ".join(f"{value} {EVENT_WORDS.get(key, key)}" for key, value in seen.items())
        console.print(Text(f"the real runs exercised: {parts}"), highlight=False, soft_wrap=True)
    for r in report.results:
        for f in r.failures[:1]:
            console.print(Text.assemble((r.check, "red"), f": {f.message}"), highlight=False, soft_wrap=True)
            console.print(Text(f"  workload: {json.dumps(f.workload)}"), highlight=False, soft_wrap=True)
    sys.stdout.flush()
