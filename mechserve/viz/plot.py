"""Static pictures of a trace (matplotlib): the timeline above the page map, sharing the step axis.

::

    r0  ▶[6 ][3 ]■               timeline: a row per request, a column per step,
    r1       ▶[4 ][2 ]■          coloured by what the request did (palette.CELLS),
    r2            ▶[6 ][4 ][4 ]… marks for admitted / reused / finished / rejected / aborted
    ────────────────────────────
    p0  [r0][C ][C ][C ]…        page map: a row per page, a column per step, coloured
    p1  [r0][  ][  ][  ]…        by the owner after the step (free, cache, a request); × evicted

Both panels are drawn as images (``imshow``), not one patch per cell, so 200
requests over hundreds of steps render in about a second; labels, cell
numbers and owner names appear only where the cells are large enough to
hold them.  A trace without snapshots (a ``--json`` file) or from a rung
without a page pool gets the timeline alone and a note saying why.
Importing this module imports matplotlib (and numpy); nothing else in
``mechserve.viz`` does.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from mechserve.viz.palette import CACHE_COLOR, CELLS, EVICTED_COLOR, FREE_COLOR, MARKS, request_color, rgb
from mechserve.viz.snapshot import CACHE
from mechserve.viz.timeline import Timeline, build_timeline
from mechserve.viz.trace import Trace

FORMATS = (".png", ".svg", ".pdf")
DPI = 120
# Cells at most this many rows / columns get their numbers and names written in them.
LABEL_ROWS, LABEL_COLS = 24, 40
# Every row gets its label up to this many rows; beyond it, about this many labels in all.
ALL_TICKS, MAX_TICKS = 48, 40


def figure(trace: Trace, panels: tuple[str, ...] = ("timeline", "pages")) -> Figure:
    """The picture of ``trace``: the chosen panels (``timeline``, ``pages``), top to bottom.

    Raises ``ValueError`` for an unknown panel or a trace without steps.
    """
    unknown = set(panels) - {"timeline", "pages"}
    if unknown or not panels:
        raise ValueError(f"unknown panel(s) {sorted(unknown)}; choose from timeline, pages")
    if not trace.records:
        raise ValueError("the trace has no step to draw")
    timeline = build_timeline(trace)
    note = trace.unavailable()["pages"] if "pages" in panels else None
    shown = [p for p in panels if not (p == "pages" and note)]
    heights = [_timeline_height(len(timeline.requests)) if p == "timeline" else _pages_height(trace) for p in shown]
    cols = len(trace.records)
    width = min(16.0, max(7.5, 3.5 + 0.45 * cols))
    fig = Figure(figsize=(width, sum(heights) + 1.0 + (0.4 if note else 0)), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(shown), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    for ax, panel in zip(axes, shown):
        if panel == "timeline":
            draw_timeline(ax, timeline)
        else:
            draw_pages(ax, trace)
    axes[-1].set_xlabel("step")
    _step_ticks(axes[-1], timeline.steps)
    chars = int(width * 12.5)  # about what one line of 10-point text holds
    lines = textwrap.wrap(trace.title, width=chars) if trace.title else []
    requests = f"{len(timeline.requests)} request(s)"
    lines.append(f"{cols} step(s)" if requests in trace.title else f"{requests} · {cols} step(s)")
    if note:
        lines += textwrap.wrap(f"No page map: {note}.", width=chars)
    fig.suptitle("\n".join(lines), fontsize=10, x=0.01, ha="left")
    return fig


def write_plot(
    trace: Trace, path: str | Path, panels: tuple[str, ...] = ("timeline", "pages"), fmt: str | None = None
) -> None:
    """Save the picture of ``trace`` to ``path`` as ``fmt`` (``png``, ``svg`` or ``pdf``; default: the suffix's).

    The file carries no creation date or software version, so regenerating
    an unchanged trace gives the same bytes.  Raises ``ValueError`` for
    another format, and ``OSError`` if the file cannot be written.
    """
    fmt = (fmt or Path(path).suffix.lstrip(".")).lower()
    if f".{fmt}" not in FORMATS:
        raise ValueError(f"{path}: a picture must be one of {', '.join(FORMATS)}")
    fig = figure(trace, panels)
    metadata: dict[str, Any] = {"Software": None} if fmt == "png" else {"Date": None, "Creator": None}
    fig.savefig(path, format=fmt, dpi=DPI, metadata=metadata)


def _timeline_height(rows: int) -> float:
    return min(10.0, max(1.4, 0.34 * rows + 0.6)) if rows <= ALL_TICKS else min(10.0, 0.05 * rows + 1.0)


def _pages_height(trace: Trace) -> float:
    pages = trace.snapshots[0].num_pages if trace.snapshots else 0
    return min(8.0, max(1.4, 0.26 * pages + 0.6)) if pages <= ALL_TICKS else min(8.0, 0.02 * pages + 2.0)


def _step_ticks(ax: Any, steps: list[int]) -> None:
    """About 30 labelled columns at most, every 1, 2, 5, 10, 20, 50, ... steps."""
    need = len(steps) / 30
    every = next(n * 10**k for k in range(12) for n in (1, 2, 5) if n * 10**k >= need)
    cols = list(range(0, len(steps), every))
    ax.set_xticks(cols, [str(steps[c]) for c in cols], fontsize=8)


def _row_ticks(ax: Any, labels: list[str]) -> None:
    every = 1 if len(labels) <= ALL_TICKS else math.ceil(len(labels) / MAX_TICKS)
    rows = list(range(0, len(labels), every))
    size = 8 if len(labels) <= ALL_TICKS else 6
    ax.set_yticks(rows, [_short(labels[r], 12) for r in rows], fontsize=size)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _grid(ax: Any, rows: int, cols: int) -> None:
    """White lines between cells, where cells are big enough to show them."""
    if rows <= 2 * ALL_TICKS and cols <= 120:
        ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=1.2 if rows <= ALL_TICKS else 0.4)
        ax.tick_params(which="minor", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _marker_size(ax: Any, rows: int, cols: int) -> float:
    """A marker size (points) that fits in one cell of ``ax``."""
    box = ax.get_position()
    fig_w, fig_h = ax.figure.get_size_inches()
    cell = min(box.width * fig_w / max(cols, 1), box.height * fig_h / max(rows, 1)) * 72
    return max(2.0, min(9.0, 0.45 * cell))


def draw_timeline(ax: Any, timeline: Timeline) -> None:
    """Draw ``timeline`` on ``ax``: cells as an image, marks on top, a legend of what appears."""
    rows, cols = len(timeline.requests), len(timeline.steps)
    colors = np.array([rgb(color) for _, color, _ in CELLS])
    codes = np.array(timeline.cells, dtype=np.int64).reshape(rows, cols)
    ax.imshow(colors[codes], aspect="auto", interpolation="nearest", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
    _grid(ax, rows, cols)
    _row_ticks(ax, timeline.requests)
    ax.set_ylabel("request")
    size = _marker_size(ax, rows, cols)
    if rows <= LABEL_ROWS and cols <= LABEL_COLS:
        for r, row in enumerate(timeline.tokens):
            for c, n in enumerate(row):
                if n:
                    ax.text(c, r, str(n), ha="center", va="center", fontsize=7, color="white", fontweight="bold")
    style = {
        "admitted": dict(marker=">", dx=-0.36, dy=0.0),
        "reused": dict(marker="o", dx=0.3, dy=-0.22),
        "finished": dict(marker="|", dx=0.42, dy=0.0),
        "rejected": dict(marker="x", dx=0.0, dy=0.0),
        "aborted": dict(marker="X", dx=0.0, dy=0.0),
    }
    handles: list[Artist] = [
        Patch(color=color, label=label)
        for code, (_, color, label) in enumerate(CELLS)
        if code and (codes == code).any()
    ]
    for name, color, label in MARKS:
        points = timeline.marks.get(name) or []
        if not points:
            continue
        s: dict[str, Any] = style[name]
        xs = [c + s["dx"] for _, c in points]
        ys = [r + s["dy"] for r, _ in points]
        if name == "finished":  # an end cap on the cell's right edge
            ax.vlines(xs, [y - 0.42 for y in ys], [y + 0.42 for y in ys], colors=color, linewidth=2.5, zorder=3)
        else:
            edge = {"edgecolors": "black"} if name == "reused" else {}
            ax.scatter(xs, ys, s=size**2, marker=s["marker"], c=color, linewidths=1.5, zorder=3, **edge)
        handles.append(Line2D([], [], linestyle="", marker=s["marker"], color=color, label=label, markeredgewidth=2))
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)


def draw_pages(ax: Any, trace: Trace) -> None:
    """Draw the page map of ``trace`` (it must have snapshots with a pool) on ``ax``."""
    assert trace.snapshots is not None
    ids = trace.request_ids()
    index = {rid: i for i, rid in enumerate(ids)}
    pages, cols = trace.snapshots[0].num_pages, len(trace.snapshots)
    palette = np.array([rgb(FREE_COLOR), rgb(CACHE_COLOR)] + [rgb(request_color(i)) for i in range(len(ids))])
    codes = np.zeros((pages, cols), dtype=np.int64)
    for c, snap in enumerate(trace.snapshots):
        column = [0 if o is None else 1 if o is CACHE else 2 + index[o] for o in snap.owners or ()]
        codes[: len(column), c] = column
    ax.imshow(palette[codes], aspect="auto", interpolation="nearest", extent=(-0.5, cols - 0.5, pages - 0.5, -0.5))
    _grid(ax, pages, cols)
    _row_ticks(ax, [str(p) for p in range(pages)])
    ax.set_ylabel("page (owner after the step)")
    if pages <= LABEL_ROWS and cols <= LABEL_COLS:
        for c, snap in enumerate(trace.snapshots):
            for p, o in enumerate(snap.owners or ()):
                if o is not None:
                    text, color = ("C", "white") if o is CACHE else (_short(o, 4), "black")
                    ax.text(c, p, text, ha="center", va="center", fontsize=7, color=color)
    evicted = [(c, p) for c, record in enumerate(trace.records) for p in record.get("evicted", ())]
    handles: list[Artist] = [
        Patch(color=FREE_COLOR, label="free"),
        Patch(color=CACHE_COLOR, label="cache (published block)"),
    ]
    if len(ids) <= 10:
        used = {o for snap in trace.snapshots for o in snap.owners or () if isinstance(o, str)}
        handles += [Patch(color=request_color(index[rid]), label=f"{rid}'s page") for rid in ids if rid in used]
    else:
        handles.append(Patch(color=request_color(0), label="a request's page (one colour each)"))
    if evicted:
        size = _marker_size(ax, pages, cols)
        ax.scatter(
            [c for c, _ in evicted],
            [p for _, p in evicted],
            s=size**2,
            marker="x",
            c=EVICTED_COLOR,
            linewidths=2,
            zorder=3,
        )
        handles.append(Line2D([], [], linestyle="", marker="x", color=EVICTED_COLOR, label="evicted in this step"))
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(pages - 0.5, -0.5)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
