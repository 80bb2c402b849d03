"""``mechserve mechs``: one line per mechanism: note file, title, key question."""

from __future__ import annotations

import argparse

from mechserve.spec import RUNGS
from mechserve.workload import load_rung


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mechs`` takes no options."""


def lines() -> list[str]:
    """One line per rung of ``RUNGS``: three left-aligned columns, two spaces apart, padded to the widest entry."""
    rows = [(rung.NOTE, rung.TITLE, rung.KEY_QUESTION) for rung in map(load_rung, RUNGS)]
    note_width = max(len(note) for note, _, _ in rows)
    title_width = max(len(title) for _, title, _ in rows)
    return [f"{note:<{note_width}}  {title:<{title_width}}  {question}" for note, title, question in rows]


def run(args: argparse.Namespace) -> int:
    """Print the mechanism table."""
    print("\n".join(lines()))
    return 0
