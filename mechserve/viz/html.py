"""The interactive viewer: one self-contained HTML file per trace, plain JS and CSS inlined, no network.

The page embeds the trace document (``Trace.to_document``) in a
``<script type="application/json" id="trace-data">`` tag, together with the
``Timeline`` cells and the palette, so it works from ``file://`` on a
machine without internet.  It shows, for the step under the slider (keys:
←/→, h/l, Home/End, space plays):

* the step's non-empty fields and the engine's sentences (``explain``);
* the timeline (a canvas; click a column to jump there);
* the page pool as a grid of pages, each free, a request's or the cache's,
  with the pages whose owner changed outlined and evicted ones marked;
* the radix tree of published blocks (page, tokens or text, who uses it);
* each live request's page table, cache pages shown shared;
* the text so far per request (real-model runs) or the token ids so far.

Panels a trace cannot fill (a ``--json`` trace has no pool) say so instead
(``Trace.unavailable``).  The JS and CSS live beside this module in
``assets/``; there is no build step.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from mechserve.viz.palette import CACHE_COLOR, CELLS, EVICTED_COLOR, FREE_COLOR, MARKS, request_color
from mechserve.viz.timeline import build_timeline
from mechserve.viz.trace import Trace

# Request colours repeat after this many; enough that neighbours never share one.
REQUEST_COLORS = 64

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="mechserve viz">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<header>
  <h1><span id="title"></span><span class="meta" id="meta"></span></h1>
  <div class="controls">
    <button id="first" title="first step (Home)">«</button>
    <button id="prev" title="previous step (← or h)">◀</button>
    <input id="slider" type="range" min="0" max="0" value="0" step="1" aria-label="step">
    <button id="next" title="next step (→ or l)">▶</button>
    <button id="last" title="last step (End)">»</button>
    <button id="play" title="play (space)">▶ play</button>
    <span id="step-label"></span>
    <span class="keys">keys: ← → (or h l) step · Home End · space plays</span>
  </div>
</header>
<main>
  <section class="wide"><h2>Timeline</h2>
    <div id="timeline-wrap"><canvas id="timeline"></canvas></div>
    <div class="legend" id="timeline-legend"></div>
  </section>
  <section><h2>This step</h2><dl id="fields"></dl><ul id="explain"></ul></section>
  <section><h2>Page pool</h2><div id="pool"></div><div id="pool-counts"></div></section>
  <section><h2>Radix tree of published blocks</h2><div id="tree" class="scroll"></div></section>
  <section class="wide"><h2>Page tables</h2><div id="tables" class="scroll"></div></section>
  <section class="wide"><h2>Output so far</h2><div id="text" class="scroll"></div></section>
</main>
<script type="application/json" id="trace-data">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""


def _asset(name: str) -> str:
    return resources.files("mechserve.viz").joinpath("assets", name).read_text(encoding="utf-8")


def viewer_data(trace: Trace) -> dict[str, Any]:
    """What the page embeds: the trace document, its timeline, the palette and the unavailable panels."""
    doc = trace.to_document()
    doc["timeline"] = build_timeline(trace).to_json()
    doc["palette"] = {
        "cells": [list(cell) for cell in CELLS],
        "marks": [list(mark) for mark in MARKS],
        "free": FREE_COLOR,
        "cache": CACHE_COLOR,
        "evicted": EVICTED_COLOR,
        "requests": [request_color(i) for i in range(REQUEST_COLORS)],
    }
    doc["unavailable"] = trace.unavailable()
    return doc


def render_html(trace: Trace) -> str:
    """The viewer page for ``trace`` as one HTML string (no external reference of any kind)."""
    # `<` never appears raw inside the JSON, so no `</script>` in a prompt can end the data early.
    data = json.dumps(viewer_data(trace), ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return PAGE.format(
        title=html.escape(trace.title or "mechserve trace"), css=_asset("viewer.css"), js=_asset("viewer.js"), data=data
    )


def write_html(trace: Trace, path: str | Path) -> None:
    """Write the viewer page for ``trace`` to ``path``; ``OSError`` if it cannot be written."""
    Path(path).write_text(render_html(trace), encoding="utf-8")
