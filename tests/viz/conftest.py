"""Fixtures of the viz tests: recorded traces of the demo and other workloads, and ``mechserve`` run in-process."""

from __future__ import annotations

import io
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mechserve.cli.demo import DEMO_WORKLOAD
from mechserve.cli.main import main
from mechserve.viz.trace import Recorder, Trace
from mechserve.workload import Workload, build_engine, load_rung, parse_workload

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "data" / "examples").glob("*.json"))


def record(workload: dict[str, Any] | Workload, mech: str = "m12") -> Trace:
    """Run ``workload`` (a JSON spec or a parsed one) on rung ``mech`` with a ``Recorder``; return the trace."""
    parsed = workload if isinstance(workload, Workload) else parse_workload(workload)
    engine = build_engine(load_rung(mech), parsed)
    recorder = Recorder(engine, title=f"{mech} test")
    engine.run(on_step=recorder)
    return recorder.trace(engine.summary())


def example(name: str) -> dict[str, Any]:
    """The workload of ``tests/data/examples/<name>*.json``."""
    (path,) = [p for p in EXAMPLES if p.name.startswith(name)]
    return json.loads(path.read_text())["workload"]


def many_requests(n: int = 200, seed: int = 0) -> dict[str, Any]:
    """``n`` requests arriving four per step, a third sharing a prefix, some drafting: preemption and eviction."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prefix = [1, 2, 3, 4, 5, 6, 7, 8] if i % 3 == 0 else [9, 9, 9, 9]
        request: dict[str, Any] = {
            "request_id": f"req{i:03d}",
            "tokens": prefix + [rng.randrange(10, 1000) for _ in range(rng.randrange(2, 20))],
            "max_new_tokens": rng.randrange(1, 12),
            "arrival_step": i // 4,
        }
        if i % 5 == 0:
            request["accept_script"] = [1, 0, 2]
        requests.append(request)
    engine = {"max_step_tokens": 64, "page_size": 4, "num_pages": 48, "spec_len": 2, "max_running": 24}
    return {"engine": engine, "requests": requests}


@pytest.fixture(scope="session")
def demo_trace() -> Trace:
    """The demo workload on the top rung, recorded."""
    return record(DEMO_WORKLOAD)


@pytest.fixture(scope="session")
def big_trace() -> Trace:
    """200 requests on the top rung, recorded."""
    return record(many_requests())


@dataclass
class Result:
    """What one in-process ``mechserve`` invocation returned and printed."""

    code: int
    out: str
    err: str


Cli = Callable[..., Result]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """``cli("viz", ..., stdin=None)`` runs ``mechserve`` in-process and returns a ``Result``."""

    def run(*argv: str, stdin: str | None = None) -> Result:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code = main(list(argv))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def spec_path(tmp_path: Path) -> Callable[[dict[str, Any]], str]:
    """``spec_path(workload)`` writes the workload as JSON and returns its path."""
    counter = iter(range(1_000_000))

    def write(workload: dict[str, Any]) -> str:
        path = tmp_path / f"workload-{next(counter)}.json"
        path.write_text(json.dumps(workload))
        return str(path)

    return write


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved 2-layer random Llama with a word-level tokenizer (``w0`` .. ``w127``); needs torch."""
    from tiny_models import save_tiny, save_word_tokenizer, tiny_config

    path = tmp_path_factory.mktemp("viz-tiny")
    save_tiny(path, tiny_config())
    save_word_tokenizer(path)
    return path
