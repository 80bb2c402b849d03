"""One mechserve benchmark run in a fresh process, so that its peak memory is its own.

``run_fresh(spec)`` starts ``python -m mechserve.bench.fresh`` with the run as JSON on stdin (``FreshRun``:
model, mode, the workload's name, sizes and seed, the variant, the runner's settings, threads).  The
child loads the model in that mode only, makes the workload, runs ``runners.MechserveRunner.run`` and
writes the ``RunResult`` as one JSON line on stdout.  Its ``peak_rss_bytes`` is the child's peak
resident set during the run (reset after the warm-up, as llama-server's is measured): the model, its
KV pool, the interpreter with torch and transformers, and the run, and nothing of any other mode or
engine; ``process_peak_rss_bytes`` is the child's peak over its whole life, loading included.

Before issue 30 every run was measured in the harness's own process, which held every mode's model
and transformers' models at once: the q4_1 and q8_0 runs reported 2.6 GiB there against 0.9 GiB
measured alone (docs/benchmarks.md, "Memory").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class FreshRun:
    """What a child process runs: ``model`` in ``mode`` on workload ``workload`` (``make_workload``'s name,
    ``quick``, ``seed`` and size overrides ``sizes``) as ``variant``, with ``MechserveRunner``'s engine
    settings ``config`` (an ``EngineConfig`` as ``dataclasses.asdict`` gives it) and ``spec_len``, on
    ``threads`` torch threads."""

    model: str
    mode: str
    workload: str
    variant: str
    threads: int
    quick: bool = False
    seed: int = 0
    sizes: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    spec_len: int | None = None


def run_fresh(spec: FreshRun, timeout: float | None = None) -> Any:
    """The ``RunResult`` of ``spec`` run in a fresh process.  Raises ``OSError`` with the child's last
    message when it fails."""
    from mechserve.bench.runners import RunResult
    from mechserve.bench.timings import RequestTiming

    done = subprocess.run(
        [sys.executable, "-m", "mechserve.bench.fresh"],
        input=json.dumps(asdict(spec)),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise OSError(
            f"the {spec.mode} run of {spec.workload} failed in its process: {said[-1] if said else done.returncode}"
        )
    raw = json.loads(lines[-1])
    raw["timings"] = [RequestTiming(t["prompt_len"], t["arrival"], tuple(t["token_times"])) for t in raw["timings"]]
    return RunResult(**raw)


def _child() -> int:
    spec = FreshRun(**json.loads(sys.stdin.read()))
    import torch

    from mechserve.api.config import EngineConfig, SpeculativeConfig
    from mechserve.bench.runners import MODES, MechserveRunner, peak_rss
    from mechserve.bench.workloads import make_workload
    from mechserve.engine.executors import configure_threads
    from mechserve.model.loader import load_model

    configure_threads()
    torch.set_num_threads(spec.threads)
    dtype, quantization = MODES[spec.mode]
    loaded = load_model(spec.model, dtype=dtype, tokenizer=False, quantization=quantization)
    sizes: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.sizes.items()}
    workload = make_workload(spec.workload, loaded.model.arch.vocab_size, quick=spec.quick, seed=spec.seed, **sizes)
    loading_peak = peak_rss()  # before the run resets the peak
    settings = dict(spec.config)
    if settings.get("speculative") is not None:
        settings["speculative"] = SpeculativeConfig(**settings["speculative"])
    config = EngineConfig(**settings)
    result = MechserveRunner(loaded, spec.mode, config, spec_len=spec.spec_len).run(workload, spec.variant)
    peaks = [p for p in (loading_peak, result.peak_rss_bytes) if p is not None]
    result.process_peak_rss_bytes = max(peaks) if peaks else None
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child())
