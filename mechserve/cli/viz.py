"""``mechserve viz``: draw a saved trace; and the ``--viz`` / ``--plot`` flags of ``demo``, ``run`` and ``generate``.

::

    mechserve viz TRACE [--html out.html] [--png out.png] [--svg out.svg]
    mechserve demo --viz out.html          # the interactive viewer of a live run
    mechserve demo --viz trace.json        # the full trace document, for `mechserve viz` later
    mechserve run ... --plot out.png       # timeline above page map (.png, .svg or .pdf)

``TRACE`` is a ``--json`` trace (``-`` reads stdin), which holds the steps
but not the page pool, or a trace document written by ``--viz FILE.json``,
which holds both.  A live run records one snapshot of the engine per step,
so its pictures have every panel.  Problems are one ``mechserve: error:``
line and exit status 2, like every command; the files written are named on
stderr, so ``--json`` output stays pure.  Importing this module imports
neither matplotlib nor torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from mechserve.cli.errors import CliError
from mechserve.viz.trace import Recorder, Trace, TraceError, read_trace

HELP = "draw a trace: a timeline and page map (--png, --svg) or an interactive viewer (--html)"
VIZ_SUFFIXES = (".html", ".json")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mechserve viz``."""
    parser.add_argument(
        "trace",
        metavar="TRACE",
        help="a --json trace of demo/run/generate, or a trace document written by --viz FILE.json ('-' reads stdin)",
    )
    parser.add_argument("--html", metavar="FILE", help="write the interactive viewer (one self-contained HTML file)")
    parser.add_argument("--png", metavar="FILE", help="write the timeline above the page map as a PNG")
    parser.add_argument("--svg", metavar="FILE", help="write the same picture as an SVG")


def run(args: argparse.Namespace) -> int:
    """Read the trace and write what was asked for; return 0.

    Raises ``CliError`` when nothing is asked for, the trace cannot be read
    or is not a trace, matplotlib is missing for a picture, or a file
    cannot be written.
    """
    if not (args.html or args.png or args.svg):
        raise CliError("nothing to write: give --html FILE, --png FILE and/or --svg FILE")
    for flag, suffixes in (("html", (".html", ".htm")), ("png", (".png",)), ("svg", (".svg",))):
        path = getattr(args, flag)
        if path and Path(path).suffix.lower() not in suffixes:
            raise CliError(f"--{flag} {path}: the file must end in {suffixes[0]}")
    if args.png or args.svg:
        _require_matplotlib("--png" if args.png else "--svg")
    try:
        trace = read_trace(args.trace)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    what = "the timeline and page map" if trace.snapshots is not None else "the timeline (the trace has no pool)"
    if args.html:
        _write(args.html, "the interactive viewer", lambda path: _html(trace, path))
    for flag, fmt in (("png", "png"), ("svg", "svg")):
        path = getattr(args, flag)
        if path:
            _write(path, what, partial(_plot, trace, fmt=fmt))
    return 0


# The flags of demo, run and generate ------------------------------------------------------------------------------


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """``--viz FILE`` and ``--plot FILE``, shared by ``demo``, ``run`` and ``generate``."""
    parser.add_argument(
        "--viz",
        metavar="FILE",
        help="also write the run as an interactive viewer (FILE.html) or as a trace document "
        "for 'mechserve viz' (FILE.json)",
    )
    parser.add_argument(
        "--plot", metavar="FILE", help="also draw the run's timeline and page map (FILE.png, .svg or .pdf)"
    )


@dataclass(frozen=True)
class VizOutputs:
    """What ``--viz`` and ``--plot`` asked a run to write (both None: nothing)."""

    viz: str | None = None
    plot: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VizOutputs:
        """The outputs the flags name, checked before anything runs.

        Raises ``CliError`` for a suffix the flag does not take, or
        ``--plot`` without matplotlib.
        """
        viz, plot = getattr(args, "viz", None), getattr(args, "plot", None)
        if viz is not None and Path(viz).suffix.lower() not in VIZ_SUFFIXES:
            raise CliError(f"--viz {viz}: the file must end in .html (the viewer) or .json (a trace document)")
        if plot is not None:
            if Path(plot).suffix.lower() not in PLOT_SUFFIXES:
                raise CliError(f"--plot {plot}: the file must end in .png, .svg or .pdf")
            _require_matplotlib("--plot")
        return cls(viz, plot)

    def recorder(
        self, engine: Any, title: str, decode: Callable[[Sequence[int]], str] | None = None
    ) -> Recorder | None:
        """A ``Recorder`` of ``engine`` if anything is to be written, else None."""
        return Recorder(engine, title=title, decode=decode) if self.viz or self.plot else None

    def write(
        self,
        recorder: Recorder | None,
        summary: Sequence[Mapping[str, Any]] | None,
        outputs: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Write what was asked for from ``recorder``'s run (``summary`` None: the run failed part-way).

        Raises ``CliError`` if a file cannot be written.
        """
        if recorder is None:
            return
        trace = recorder.trace(summary, outputs)
        if self.viz and self.viz.lower().endswith(".json"):
            _write(self.viz, "the trace document", lambda path: _write_text(path, trace.dumps()))
        elif self.viz:
            _write(self.viz, "the interactive viewer", lambda path: _html(trace, path))
        if self.plot:
            _write(self.plot, "the timeline and page map", lambda path: _plot(trace, path, None))


def _require_matplotlib(flag: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise CliError(f"{flag} needs matplotlib: pip install 'mechserve[viz]'") from None


def _html(trace: Trace, path: str) -> None:
    from mechserve.viz.html import write_html

    write_html(trace, path)


def _plot(trace: Trace, path: str, fmt: str | None) -> None:
    from mechserve.viz.plot import write_plot

    write_plot(trace, path, fmt=fmt)


def _write_text(path: str, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")


def _write(path: str, what: str, write: Callable[[str], None]) -> None:
    """Run ``write(path)``, then name the file on stderr; ``CliError`` if it fails."""
    try:
        write(path)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CliError(f"cannot draw {path}: {exc}") from None
    print(f"wrote {path}: {what}", file=sys.stderr, flush=True)
