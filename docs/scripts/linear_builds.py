"""The native linear kernel of this tree against its build at another commit, loaded side by side in one
process, on SmolLM2-135M's shapes read from memory, at several row counts.

    PYTHONPATH=$PWD python docs/scripts/linear_builds.py REV [ROWS=1,2,3,5,8,16] [ROUNDS=8] [DTYPE=bfloat16]

``REV``'s ``mechserve/model/csrc`` is extracted (``git archive``) into a temporary folder and built there
(``native.build.Kernel``, the same flags as ``linear.KERNEL``); this tree's is ``linear.library()``.  A
"step" runs the products of 30 layers of distinct weights (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536: 212 MB in bfloat16, more than the L3 cache, as a decode step reads them) and then the LM
head (49152x576).  Each round times every build at every row count in turn (interleaved, so a noisy
machine slows them alike); the figure is the minimum over the rounds, in ms, for the layers and the head.
Used for docs/benchmarks.md (issue 27, "A window's rows on an AVX2 machine").
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from mechserve.model import linear as lin

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)

rev = sys.argv[1]
rows = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,2,3,5,8,16").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 8
dtype = getattr(torch, sys.argv[4] if len(sys.argv) > 4 else "bfloat16")
torch.set_num_threads(2)

with tempfile.TemporaryDirectory() as tmp:
    archive = subprocess.run(["git", "archive", rev, "mechserve/model/csrc"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
    source = Path(tmp) / "mechserve/model/csrc" / lin.KERNEL.source.name
    builds = {rev: lin.bind(dataclasses.replace(lin.KERNEL, source=source).load()), "this tree": lin.library()}
    assert lin.enabled()
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(n, k, generator=g).to(dtype) for _ in range(30) for n, k in LAYER]
    head = torch.randn(*HEAD, generator=g).to(dtype)
    xs = {(m, k): torch.randn(m, k, generator=g).to(dtype) for m in rows for k in {k for _, k in LAYER}}
    best = {(b, m): [float("inf"), float("inf")] for b in builds for m in rows}
    for _ in range(rounds):
        for name, lib in builds.items():
            with mock.patch.object(lin, "library", lambda lib=lib: lib):
                for m in rows:
                    t0 = time.perf_counter()
                    for w in layers:
                        lin.native_linear(xs[(m, w.shape[1])], w)
                    t1 = time.perf_counter()
                    lin.native_linear(xs[(m, HEAD[1])], head)
                    t2 = time.perf_counter()
                    cell = best[(name, m)]
                    cell[0], cell[1] = min(cell[0], (t1 - t0) * 1e3), min(cell[1], (t2 - t1) * 1e3)
    print(f"{dtype}, {rounds} rounds, min ms; rows: {' '.join(map(str, rows))}")
    for name in builds:
        print(f"{name:>12} layers " + " ".join(f"{best[(name, m)][0]:7.2f}" for m in rows))
        print(f"{name:>12} head   " + " ".join(f"{best[(name, m)][1]:7.2f}" for m in rows))
