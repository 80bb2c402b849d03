"""Pictures of traces: a timeline and page map (matplotlib) and a self-contained interactive viewer (HTML).

Every trace, from a rung's scripted executor or a real model, live or read
back from a file, can be drawn:

* ``trace.Recorder`` snapshots the engine after every step of a live run
  (``snapshot.Snapshot``: page owners, page tables, the radix tree, the text
  so far); ``trace.read_trace`` reads a ``--json`` trace or a trace
  document written by ``--viz FILE.json``;
* ``timeline.build_timeline`` says what each request did in each step;
* ``plot.write_plot`` draws the timeline above the page map (PNG, SVG, PDF);
* ``html.write_html`` writes the viewer: one HTML file, no network.

Importing this package imports neither matplotlib nor any rung; only
``mechserve.viz.plot`` needs matplotlib (``pip install 'mechserve[viz]'``).
"""

from mechserve.viz.snapshot import CACHE, RequestView, Snapshot, TreeNode, capture
from mechserve.viz.trace import FORMAT, Recorder, Trace, TraceError, parse_trace, read_trace

__all__ = [
    "CACHE",
    "FORMAT",
    "Recorder",
    "RequestView",
    "Snapshot",
    "Trace",
    "TraceError",
    "TreeNode",
    "capture",
    "parse_trace",
    "read_trace",
]
