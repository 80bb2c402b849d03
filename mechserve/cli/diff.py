"""``mechserve diff mA mB``: what one rung adds to another, as a unified diff of their sources."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.text import Text

from mechserve.workload import load_rung, rung_label

_STYLES = (("+++", "bold"), ("---", "bold"), ("@@", "cyan"), ("+", "green"), ("-", "red"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Two rungs and the number of context lines."""
    parser.add_argument("old", metavar="RUNG_A", help="the rung to diff from, e.g. m04")
    parser.add_argument("new", metavar="RUNG_B", help="the rung to diff to, e.g. m05")
    parser.add_argument("-U", "--context", type=int, default=3, metavar="N", help="context lines (default 3)")


def source(rung: ModuleType) -> tuple[str, list[str]]:
    """The repository-relative path and the lines of a rung's source file."""
    path = Path(rung.__file__ or "")
    return f"mechserve/spec/{path.name}", path.read_text(encoding="utf-8").splitlines(keepends=True)


def diff_lines(old: ModuleType, new: ModuleType, context: int = 3) -> list[str]:
    """The unified diff of two rungs' sources, one string per line (no line ends)."""
    (old_name, old_lines), (new_name, new_lines) = source(old), source(new)
    diff = difflib.unified_diff(old_lines, new_lines, old_name, new_name, n=context)
    return [line.rstrip("\n") for line in diff]


def colour(line: str) -> Text:
    """A diff line styled by kind: green additions, red removals, cyan hunk headers."""
    style = next((style for prefix, style in _STYLES if line.startswith(prefix)), "")
    return Text(line, style=style)


def run(args: argparse.Namespace) -> int:
    """Print the coloured diff (plain when stdout is not a terminal), or one line saying there is none.

    Raises ``WorkloadError`` for an unknown rung.
    """
    old, new = load_rung(args.old), load_rung(args.new)
    console = Console(file=sys.stdout, highlight=False)
    text = Text("\n").join(colour(line) for line in diff_lines(old, new, max(args.context, 0)))
    if text.plain:
        console.print(text, soft_wrap=True)
    elif old is new:
        console.print(
            f"{rung_label(old)} and {rung_label(new)} are the same rung ({old.__name__}): nothing to diff",
            soft_wrap=True,
        )
    else:
        console.print(f"{rung_label(old)} and {rung_label(new)} have identical sources", soft_wrap=True)
    return 0
