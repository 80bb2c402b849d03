"""``docs/scripts/issue28_tables.py``: the issue's tables from a results file (every cell traced to the
record it comes from), the ``bench run`` command lines it starts (each accepted by ``bench run``'s own
parser), and its refusals."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from mechserve.bench import run as bench_run

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "scripts" / "issue28_tables.py"


def _load():
    spec = importlib.util.spec_from_file_location("issue28_tables", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load()


def _run(engine: str, mode: str, tput: float, ttft_ms: float, tpot_ms: float, roof: dict | None = None) -> dict:
    r = {
        "engine": engine,
        "mode": mode,
        "variant": "default",
        "metrics": {"output_throughput": tput, "p50_ttft_ms": ttft_ms, "p50_tpot_ms": tpot_ms},
    }
    if roof is not None:
        r["roofline"] = roof
    return r


ROOF = {
    "batch": 32,
    "context": 300,
    "bytes": 300e6,
    "flops": 8e9,
    "roofline_s": 0.02,
    "bound": "compute",
    "measured_s": 0.03,
    "measured_over_roofline": 1.5,
    "run_steps": 12,
    "run_step_s": 0.04,
    "run_over_roofline": 2.0,
}


def _doc() -> dict:
    return {
        "machine": {"cpu": "EPYC", "torch_threads": 2, "load_average_at_start": [0.5], "load_average_at_end": [1.0]},
        "git": {"commit": "abc", "dirty": False},
        "workloads": {
            "throughput": {
                "runs": [
                    _run("mechserve", "fast", 400.0, 2500.0, 50.0, ROOF),
                    _run("mechserve", "fast", 999.0, 1.0, 1.0) | {"variant": "ngram-4"},  # not the default: left out
                    _run("llama-cpp", "fast", 160.0, 3800.0, 60.0),
                    _run("llama-cpp", "exact", 120.0, 5400.0, 60.0),
                    _run("hf", "fast", 100.0, 9000.0, 90.0),
                    _run("mechserve", "exact", 150.0, 7000.0, 70.0),  # no roofline line, no hf run
                ]
            },
            "latency": {
                "runs": [
                    _run(
                        "mechserve",
                        "q8_0",
                        10.0,
                        287.0,
                        5.5,
                        {**ROOF, "batch": 1, "context": 544, "bytes": 150e6, "run_step_s": 0.005},
                    ),
                    _run("llama-cpp", "q8_0", 10.0, 529.0, 7.0),
                ]
            },
        },
        "roofline": {"fast": {"decode_rooflines": [ROOF]}},
    }


def test_the_mixed_table_sets_each_mode_beside_llama_cpps_same_and_best() -> None:
    lines = tables.mixed_table(_doc())
    assert "llama.cpp's best (BF16, 160.0)" in lines[0]
    rows = {line.split(" | ")[0]: line for line in lines[2:]}
    assert list(rows) == ["| exact", "| fast"]  # in the order; modes mechserve did not run are absent
    assert rows["| fast"] == (
        "| fast | 400.0 | 160.0 | 100.0 | 2.50x | 2.5 / 3.8 | 32 @ 300 | 20.0 (compute) | 30.0 (1.50x) | "
        "40.0 (2.00x, 12 steps) |"
    )
    assert rows["| exact"] == "| exact | 150.0 | 120.0 | - | 0.94x | 7.0 / 5.4 | - | - | - | - |"


def test_the_batch_1_table_gives_the_effective_read_rate_of_the_runs_own_steps() -> None:
    lines = tables.batch1_table(_doc())
    assert lines[2] == (
        "| q8_0 / Q8_0 | 5.5 | 7.0 | 287 | 529 | 1 @ 544 | 20.0 (compute) | 30.0 (1.50x) | 5.0 (2.00x, 12 steps) "
        "| 30.0 |"  # 150 MB in 5 ms
    )
    assert len(lines) == 3
    # a run that recorded its steps' forward and the machine's other load shows both beside its steps
    doc = _doc()
    doc["workloads"]["latency"]["runs"][0]["roofline"] |= {"run_forward_s": 0.0042, "other_cores": 0.61}
    assert "| 5.0 (2.00x, 12 steps; forward 4.2; others 0.61 cores) |" in tables.batch1_table(doc)[2]


def test_the_fixed_steps_and_the_header() -> None:
    text = tables.tables(_doc())
    assert text.startswith("EPYC, 2 threads; load average at start [0.5], at end [1.0]; commit abc (dirty: False)")
    assert "| fast | batch 32 @ 300 | 300 | 8.00 | 20.0 (compute) | 30.0 | 1.50x |" in text


def test_an_empty_results_file_gives_the_headers_only() -> None:
    assert [len(t) for t in (tables.mixed_table({}), tables.batch1_table({}), tables.fixed_steps_table({}))] == [
        2,
        2,
        2,
    ]


def test_run_starts_commands_that_bench_run_accepts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    started: list[list[str]] = []

    def fake(cmd: list[str]) -> subprocess.CompletedProcess:
        started.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps(_doc()))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(tables.subprocess, "run", fake)
    tables.main(["--run", str(tmp_path / "r"), "--threads", "1,2", "--", "--quick"])
    parser = argparse.ArgumentParser()
    bench_run.add_arguments(parser)
    for n, cmd in zip((1, 2), started, strict=True):
        assert cmd[1:5] == ["-m", "mechserve", "bench", "run"]
        args = parser.parse_args(cmd[5:])
        assert (args.workload, args.engine) == (["latency", "throughput"], ["mechserve", "hf", "llama-cpp"])
        assert args.mode == ["exact", "fast", "q4_1", "q8_0"] and not args.no_roofline
        assert (args.threads, args.quick, args.out) == (n, True, tmp_path / "r" / f"threads-{n}")
        assert "| fast | 400.0 |" in (args.out / "issue28_tables.md").read_text()
    assert capsys.readouterr().out.count("| fast | 400.0 |") == 2


def test_a_failed_bench_run_stops_with_its_status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tables.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 3))
    with pytest.raises(SystemExit) as e:
        tables.main(["--run", str(tmp_path)])
    assert e.value.code == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give either --run DIR or results.json files"),
        (["--run", "d", "r.json"], "give either --run DIR or results.json files"),
        (["r.json", "--threads", "2"], "--threads and arguments after -- go with --run"),
        (["--run", "d", "--threads", "0"], "--threads takes positive integers"),
        (["--run", "d", "--threads", "a"], "--threads takes positive integers"),
        (["missing.json"], "cannot read missing.json"),
    ],
)
def test_bad_arguments_exit_2_naming_them(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        tables.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
