"""``mechserve run``: run a workload (a JSON spec or ``--request`` flags) through one rung."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from mechserve.cli.errors import CliError, engine_failure
from mechserve.cli.render import IDLE, JsonView, TextView, View
from mechserve.spec import TOP
from mechserve.workload import (
    ENGINE_DEFAULTS,
    ENGINE_KEYS,
    ENGINE_LIMITS,
    REQUEST_FLAG,
    Workload,
    WorkloadError,
    build_engine,
    engine_params,
    load_rung,
    load_workload,
    rung_label,
    rung_range,
    with_engine,
    workload_from_flags,
)

# engine value -> its flag
ENGINE_FLAGS = {name: "--" + name.replace("_", "-") for name in ENGINE_KEYS}
# Why a step with nothing in it did nothing, when some request is running (m02/m03's never-fits step).
STUCK = "nothing could be scheduled for the running requests"


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mech``, ``--json`` and ``--explain``, shared by ``run`` and ``demo``."""
    parser.add_argument(
        "--mech", metavar="mNN", default=TOP, help=f"the rung to run: {rung_range()} or a full name (default: {TOP})"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per step, then the summary")
    parser.add_argument("--explain", action="store_true", help="add the engine's own sentences to every step")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechserve run`` (MECHANISMS 4.1)."""
    parser.add_argument("--spec", metavar="FILE", help="a JSON workload spec ('-' reads stdin)")
    parser.add_argument(
        "--request",
        metavar=REQUEST_FLAG,
        action="append",
        default=[],
        help="one request with a synthetic prompt (repeatable)",
    )
    for name, flag in ENGINE_FLAGS.items():
        if name in ENGINE_DEFAULTS:
            text = f"override the engine's {name} (default {ENGINE_DEFAULTS[name]}"
        else:
            text = f"set the engine's {name} (m12 or later; default: no limit"
        parser.add_argument(flag, type=int, metavar="N", help=f"{text}; at most {ENGINE_LIMITS[name]})")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the workload the arguments describe.

    Raises ``CliError`` for both or neither of ``--spec``/``--request``, an
    unreadable spec file or an engine failure, and ``WorkloadError`` for an
    invalid workload or rung.
    """
    rung = load_rung(args.mech)
    overrides = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    workload = with_engine(read_workload(args.spec, args.request), overrides, ENGINE_FLAGS)
    return execute(rung, workload, as_json=args.json, explain=args.explain)


def read_workload(spec: str | None, requests: Sequence[str]) -> Workload:
    """The workload from ``--spec FILE`` or from ``--request`` flags (exactly one of them).

    Raises ``CliError`` for both, neither, or an unreadable file, and
    ``WorkloadError`` for an invalid workload.
    """
    if spec is not None and requests:
        raise CliError("give either --spec FILE or --request flags, not both")
    if spec is None and not requests:
        raise CliError(f"nothing to run: give --spec FILE or at least one --request {REQUEST_FLAG}")
    if spec is None:
        return workload_from_flags(requests)
    return load_workload(_read_text(spec), source="stdin" if spec == "-" else spec)


def _read_text(path: str) -> str:
    """The text of ``path`` (``-`` is stdin); raises ``CliError`` if it cannot be read."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CliError(f"cannot read workload {path}: {reason}") from None


def header(rung: ModuleType, workload: Workload) -> str:
    """One line naming the rung, the engine values it takes and the number of requests."""
    params = engine_params(rung)
    used = [f"{name} {value}" for name, value in workload.engine.items() if name in params]
    parts = [f"{rung_label(rung)} {rung.TITLE}", *used, f"{len(workload.requests)} request(s)"]
    return " · ".join(parts)


def execute(rung: ModuleType, workload: Workload, *, as_json: bool, explain: bool, notes: Sequence[str] = ()) -> int:
    """Run ``workload`` on ``rung`` and print it; return 0.

    Every step is printed as it completes.  If the engine fails part-way the
    printed steps stay, no summary follows, and ``CliError`` names the
    exception and the step.  Raises ``WorkloadError`` if the rung cannot take
    the workload and ``CliError`` if the engine rejects it.
    """
    try:
        engine = build_engine(rung, workload)
    except WorkloadError:
        raise
    except ValueError as exc:
        raise CliError(f"the {rung_label(rung)} engine rejected the workload: {exc}") from exc
    view: View = JsonView(explain) if as_json else TextView(explain)
    view.start(header(rung, workload), notes)

    def show(record: object) -> None:
        view.step(record, STUCK if engine.running else IDLE)

    try:
        engine.run(on_step=show)
    except BrokenPipeError:
        raise
    except Exception as exc:  # any engine failure is reported, never a traceback (D3)
        view.flush()
        raise CliError(engine_failure(exc, engine.step_counter)) from exc
    view.finish(engine.summary())
    return 0
