"""One row per request, one column per step: what each request did in each step, read off the trace.

A cell is one of ``palette.CELLS``::

    waiting      arrived but not admitted (known only from snapshots: max_running holds it back)
    stalled      admitted and not finished, but given no tokens this step
    prefill      computed a prompt chunk (or recomputed after a preemption)
    decode       a decode window without drafts
    accepted     a decode window whose drafts were all accepted
    rolled_back  a decode window that rolled back at least one draft
    preempted    lost its pages this step

and marks sit on top: admitted, reused (a cached prefix was adopted),
finished, rejected, aborted.  A decode window is recognised by its
``drafted`` entry from m09 on (every decode window has one, even with no
drafts); before m09 it is a one-token step of a request that has sampled
since its last preemption.  The static picture and the viewer draw the same
``Timeline``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mechserve.viz.palette import CELL_CODE, MARKS
from mechserve.viz.trace import Trace

NONE = CELL_CODE["none"]
WAITING = CELL_CODE["waiting"]
STALLED = CELL_CODE["stalled"]
PREFILL = CELL_CODE["prefill"]
DECODE = CELL_CODE["decode"]
ACCEPTED = CELL_CODE["accepted"]
ROLLED_BACK = CELL_CODE["rolled_back"]
PREEMPTED = CELL_CODE["preempted"]


@dataclass
class Timeline:
    """``cells[row][column]``: a cell code per request and step; ``tokens``: the tokens it computed there.

    ``marks`` maps a mark name (``palette.MARKS``) to ``(row, column)``
    pairs; ``steps`` are the columns' step numbers.
    """

    requests: list[str]
    steps: list[int]
    cells: list[list[int]]
    tokens: list[list[int]]
    marks: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The timeline as JSON-ready lists (for the viewer)."""
        return {
            "cells": self.cells,
            "tokens": self.tokens,
            "marks": {name: [list(p) for p in pairs] for name, pairs in self.marks.items()},
        }


def build_timeline(trace: Trace) -> Timeline:
    """The ``Timeline`` of ``trace`` (snapshots, when present, add the waiting cells)."""
    ids = trace.request_ids()
    row = {rid: i for i, rid in enumerate(ids)}
    width = len(trace.records)
    cells = [[NONE] * width for _ in ids]
    tokens = [[0] * width for _ in ids]
    marks: dict[str, list[tuple[int, int]]] = {name: [] for name, _, _ in MARKS}
    running: set[str] = set()  # admitted and not yet left
    decoding: set[str] = set()  # has sampled since its last preemption (decode detection before m09)
    with_drafts = any("drafted" in record for record in trace.records)
    for col, record in enumerate(trace.records):

        def mark(name: str, rid: object, col: int = col) -> None:
            marks[name].append((row[str(rid)], col))

        for rid, _reason in record.get("rejected", ()):
            mark("rejected", rid)
        for rid in record.get("admitted", ()):
            running.add(str(rid))
            mark("admitted", rid)
        for rid in record.get("reused", {}):
            mark("reused", rid)
        drafted, rolled_back = record.get("drafted", {}), record.get("rolled_back", {})
        for rid, n in record.get("executed", {}).items():
            r = row[rid]
            tokens[r][col] = n
            decode = rid in drafted if with_drafts else rid in decoding and n == 1
            if not decode:
                cells[r][col] = PREFILL
            elif rolled_back.get(rid, 0) > 0:
                cells[r][col] = ROLLED_BACK
            else:
                cells[r][col] = ACCEPTED if drafted.get(rid, 0) > 0 else DECODE
        for rid in record.get("preempted", ()):
            cells[row[str(rid)]][col] = PREEMPTED
            decoding.discard(str(rid))
        decoding.update(record.get("sampled", {}))
        if trace.snapshots is not None:
            for rid, view in trace.snapshots[col].requests.items():
                if cells[row[rid]][col] == NONE:
                    cells[row[rid]][col] = WAITING if view.state == "WAITING" else STALLED
        else:
            for rid in running:
                if cells[row[rid]][col] == NONE:
                    cells[row[rid]][col] = STALLED
        for name in ("finished", "aborted"):
            for rid in record.get(name, ()):
                mark(name, rid)
                running.discard(str(rid))
    steps = [int(record["step"]) for record in trace.records]
    return Timeline(ids, steps, cells, tokens, marks)
