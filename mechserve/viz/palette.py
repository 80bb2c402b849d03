"""The colours shared by the static pictures and the interactive viewer, so that both read the same.

A timeline cell is one request in one step; a page-map cell is one page
after one step.  Request colours are spread around the hue circle by the
golden angle, so neighbouring requests never look alike, at a lightness
that keeps them apart from the dark cache colour and the pale free colour.
"""

from __future__ import annotations

import colorsys

# Timeline cell kinds, in code order: (name, colour, legend label).
CELLS: tuple[tuple[str, str, str], ...] = (
    ("none", "#ffffff", ""),
    ("waiting", "#cfd4da", "waiting (arrived, not admitted)"),
    ("stalled", "#f6e3a1", "running, not scheduled"),
    ("prefill", "#4c78a8", "prefill chunk"),
    ("decode", "#59a14f", "decode"),
    ("accepted", "#1d6b2f", "decode, every draft accepted"),
    ("rolled_back", "#f28e2b", "decode, drafts rolled back"),
    ("preempted", "#e15759", "preempted"),
)
CELL_CODE = {name: code for code, (name, _, _) in enumerate(CELLS)}

# Timeline marks: (name, colour, legend label).
MARKS: tuple[tuple[str, str, str], ...] = (
    ("admitted", "#111111", "admitted"),
    ("reused", "#17becf", "prefix reused from the cache"),
    ("finished", "#111111", "finished"),
    ("rejected", "#d62728", "rejected at the door"),
    ("aborted", "#9467bd", "aborted"),
)

FREE_COLOR = "#eef0f3"
CACHE_COLOR = "#3b4a5c"
EVICTED_COLOR = "#d62728"
GOLDEN_ANGLE = 137.50776405


def request_color(index: int) -> str:
    """The colour of the ``index``-th request of a trace, as ``#rrggbb``."""
    hue = (index * GOLDEN_ANGLE) % 360 / 360
    r, g, b = colorsys.hls_to_rgb(hue, 0.62, 0.62)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def rgb(color: str) -> tuple[float, float, float]:
    """``#rrggbb`` as three floats in ``[0, 1]``."""
    return (int(color[1:3], 16) / 255, int(color[3:5], 16) / 255, int(color[5:7], 16) / 255)
