"""``mechserve bench spec-decode`` on the tiny served model: the report's shape and its exactness check (the
numbers themselves are measured on SmolLM2 by hand, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mechserve.cli.main import main


def test_bench_spec_decode_reports_every_cell_and_identical_outputs(capsys, tiny_dir: Path) -> None:
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "2", "--max-tokens", "6"]
    argv += ["--batches", "1", "2", "--configs", "ngram", "suffix-fixed", "draft", "--draft-layers", "1"]
    argv += ["--sets", "copy", "novel", "--num-pages", "64", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["cells"]) == {"copy/batch-1", "copy/batch-2", "novel/batch-1", "novel/batch-2"}
    for cell in report["cells"].values():
        assert set(cell) == {"off", "ngram", "suffix-fixed", "draft"}
        assert cell["off"]["speedup"] is None and cell["off"]["proposed"] == 0
        for name in ("ngram", "suffix-fixed", "draft"):
            r = cell[name]
            assert r["identical"], (name, r)  # greedy speculation is exact
            assert r["output_tokens"] == cell["off"]["output_tokens"] and r["target_forwards"] > 0
            # speedup is this configuration's tok/s over off's, tokens per forward its outputs per target forward
            assert r["speedup"] == pytest.approx(r["tok_s"] / cell["off"]["tok_s"], rel=0.02, abs=2e-3)
            assert r["tokens_per_forward"] == pytest.approx(r["output_tokens"] / r["target_forwards"], abs=1e-3)
        assert cell["draft"]["proposed"] > 0 and 0 <= cell["draft"]["accepted"] <= cell["draft"]["proposed"]
        # the draft model fills every window (fixed spec_len 3): a rate for each of its 3 positions, falling
        by_position = cell["draft"]["acceptance_by_position"]
        assert len(by_position) == 3 and all(0 <= a <= 1 for a in by_position)
        assert by_position == sorted(by_position, reverse=True)


def test_every_repeat_starts_with_a_suffix_proposer_that_remembers_no_earlier_answer(
    capsys, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each repeat (and each batch size) sends the same prompts: the suffix proposer's global tree forgets the
    requests that left before each, else a repeat drafts its answers from its own earlier answers."""
    from mechserve.executor.proposers_suffix import SuffixProposer

    held: list[int] = []
    forget = SuffixProposer.forget_finished

    def spy(self: SuffixProposer) -> None:
        held.append(self.cached_requests)
        forget(self)
        assert self.cached_requests == 0 and self.global_tree.nodes == 1

    monkeypatch.setattr(SuffixProposer, "forget_finished", spy)
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "2", "--max-tokens", "4", "--json"]
    argv += ["--batches", "1", "2", "--repeats", "2", "--configs", "suffix-fixed", "--sets", "novel"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["cells"]["novel/batch-2"]["suffix-fixed"]["identical"]
    # batch 1 once (the warm-up request remembered), batch 2 twice (the earlier pass's 2 requests remembered)
    assert held == [1, 2, 2]


def test_each_repeat_runs_the_configurations_in_a_rotated_order_and_reports_its_own_speedup(
    capsys, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A configuration that always ran first in a repeat (after the previous cell's last) would carry whatever
    that position costs in every figure: the order rotates each repeat, and each repeat's speedup is reported
    (its spread is the run's noise)."""
    from mechserve.bench import spec_decode

    order: list[Any] = []
    run = spec_decode.run_sessions

    def spy(llm: Any, sessions: Any, params: Any, tally: Any) -> None:
        order.append(llm)
        run(llm, sessions, params, tally)

    monkeypatch.setattr(spec_decode, "run_sessions", spy)
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "2", "--max-tokens", "3", "--json"]
    argv += ["--batches", "2", "--repeats", "4", "--configs", "ngram", "suffix-fixed", "--sets", "novel"]
    assert main(argv) == 0
    cell = json.loads(capsys.readouterr().out)["cells"]["novel/batch-2"]
    names = {id(llm): i for i, llm in enumerate(order[:3])}  # the first repeat: off, ngram, suffix-fixed
    assert [names[id(llm)] for llm in order] == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
    assert cell["off"]["speedup"] is None and cell["off"]["speedup_by_repeat"] == []
    for name in ("ngram", "suffix-fixed"):
        by_repeat = cell[name]["speedup_by_repeat"]
        assert len(by_repeat) == 4 and all(s > 0 for s in by_repeat)
        assert min(by_repeat) * 0.99 <= cell[name]["speedup"] <= max(by_repeat) * 1.01


def test_bench_spec_decode_costs_times_steps_by_rows(capsys, tiny_dir: Path) -> None:
    """``--costs``: target steps of 1 and 8 windows of 1 .. 8 rows (``executor.costs.step_inputs``), relative to
    one row at batch 1, and the static model's row and jump costs fitted to them."""
    assert main(["bench", "spec-decode", "--model", str(tiny_dir), "--costs", "--repeats", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"unit_ms", "relative", "row_cost", "jump_cost"} and report["unit_ms"] > 0
    shapes = [f"batch {b}, {m} row(s) each" for b in (1, 8) for m in (1, 2, 3, 4, 5, 6, 8)]
    assert list(report["relative"]) == shapes and report["relative"][shapes[0]] == 1.0
    assert all(v > 0 for v in report["relative"].values())


def test_bench_spec_decode_runs_multi_turn_sessions_turn_by_turn(capsys, tiny_dir: Path) -> None:
    """The chat and agent workloads: 4 turns per session, each with the earlier answers; every configuration
    answers them identically, and the kept tokens per step are reported."""
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "2", "--max-tokens", "4"]
    argv += ["--batches", "1", "2", "--configs", "suffix", "--sets", "chat", "agent", "--num-pages", "128", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["cells"]) == {f"{w}/batch-{b}" for w in ("chat", "agent") for b in (1, 2)}
    for cell in report["cells"].values():
        assert cell["suffix"]["identical"]
        assert cell["off"]["output_tokens"] == 2 * 4 * 4  # 2 sessions x 4 turns x 4 tokens (EOS aside)
        assert cell["suffix"]["tokens_per_decode_step"] >= 1.0


def test_the_shipped_workloads_are_fixed() -> None:
    from mechserve.bench.spec_workloads import workloads

    every = workloads()
    assert set(every) == {"chat", "agent", "code-edit", "summarise", "novel", "copy"}
    assert all(len(sessions) == 8 for sessions in every.values())
    assert all(len(s.turns) == 4 for s in every["chat"] + every["agent"])
    assert len({s.system for s in every["agent"]}) == 1 and "get_weather" in (every["agent"][0].system or "")
    assert workloads() == every  # nothing drawn at run time


@pytest.mark.parametrize(
    ("flag", "value"), [("--batches", "0"), ("--prompts", "9"), ("--configs", "medusa"), ("--sets", "poetry")]
)
def test_bench_spec_decode_flags_are_checked(capsys, flag: str, value: str) -> None:
    assert main(["bench", "spec-decode", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mechserve: error: ") and flag in err and err.count("\n") == 1


FAKE_SERVER = r'''
"""A stand-in for llama-server: /health, and /completion streaming n_predict ids (7s) as llama-server's events."""
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
for flag in ("-m", "-np", "-c", "-t", "-tb", "--host", "--port"):
    parser.add_argument(flag)
parser.add_argument("--version", action="store_true")
args = parser.parse_args()
if args.version:
    print("version: fake")
    sys.exit(0)
log = os.environ["FAKE_LLAMA_LOG"]


def write(entry):
    with open(log, "a") as f:
        f.write(json.dumps(entry) + "\n")


write({"started": os.getpid(), "slots": int(args.np), "context": int(args.c), "gguf": os.path.basename(args.m)})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        write({"pid": os.getpid(), "gguf": os.path.basename(args.m), "body": body})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["n_predict"]):
            self.wfile.write(b'data: {"tokens": [7], "stop": false}\n\n')
        self.wfile.write(b'data: {"tokens": [], "stop": true, "timings": {"predicted_ms": 1.0}}\n\n')


ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
'''


def test_llama_cpp_runs_beside_every_cell_on_the_same_prompts(
    capsys, tiny_dir: Path, tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--llama-cpp``: every turn ``off`` answered goes to a llama-server per GGUF with ``batch`` slots, with the
    prompt ids ``off`` saw, ``off``'s number of new ids, greedy, prompt cache on; reported per GGUF and as the
    best proposer's tok/s over llama.cpp's best.  (A fake llama-server: the tiny model has no GGUF.)"""
    import os
    import sys

    from mechserve.bench import llama_cpp
    from mechserve.bench.spec_workloads import workloads
    from mechserve.entrypoints.prompts import Chat, encode_chat

    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(llama_cpp.SERVER_ENV, str(server))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    made = []

    def gguf_for(model: str, mode: str) -> Path:
        made.append(mode)
        return tmp_path / f"tiny-{llama_cpp.MODE_GGUF[mode]}.gguf"

    monkeypatch.setattr(llama_cpp, "gguf_for", gguf_for)
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "3", "--max-tokens", "5"]
    argv += ["--batches", "1", "2", "--configs", "suffix", "--sets", "chat", "novel", "--num-pages", "128"]
    assert main([*argv, "--llama-cpp", "--llama-cpp-modes", "q8_0", "fast", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert made == ["q8_0", "fast"]
    peer = report["llama_cpp"]
    assert peer["ggufs"] == {"q8_0": "tiny-q8_0.gguf", "bf16": "tiny-bf16.gguf"} and peer["version"] == "version: fake"
    assert set(peer["cells"]) == set(report["cells"]) == {f"{w}/batch-{b}" for w in ("chat", "novel") for b in (1, 2)}
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e for e in entries if "started" in e]
    # one server per GGUF and batch size, its slots the batch, kept across workloads; all stopped at the end
    assert sorted((e["gguf"], e["slots"]) for e in starts) == sorted(
        (f"tiny-{k}.gguf", b) for k in ("q8_0", "bf16") for b in (1, 2)
    )
    for e in starts:
        with pytest.raises(ProcessLookupError):
            os.kill(e["started"], 0)
    warm_ups = [e for e in entries if "body" in e and e["body"]["prompt"] == [1, 2, 3, 4]]
    assert sorted(e["pid"] for e in warm_ups) == sorted(e["started"] for e in starts)  # LlamaServer's, one a start
    bodies = [e["body"] for e in entries if "body" in e and e["body"]["prompt"] != [1, 2, 3, 4]]  # warm-ups aside
    assert all(b["temperature"] == 0.0 and b["cache_prompt"] and b["ignore_eos"] for b in bodies)
    for key, cell in report["cells"].items():
        side = peer["cells"][key]
        off = cell["off"]
        for kind in ("q8_0", "bf16"):
            # off's requests (none answered with no id here), each with off's number of new ids
            assert side[kind]["output_tokens"] == off["output_tokens"] and side[kind]["tok_s"] > 0
            assert side[kind]["requests"] == (3 * 4 if key.startswith("chat") else 3)
            assert side[kind]["identical"] == 0  # the fake answers 7s
        best = side["best"]
        assert best["config"] == "suffix" and best["config_tok_s"] == cell["suffix"]["tok_s"]
        top = max(side[k]["tok_s"] for k in ("q8_0", "bf16"))
        assert best["llama_cpp_tok_s"] == top and best["ratio"] == pytest.approx(
            cell["suffix"]["tok_s"] / top, abs=5.1e-4
        )  # the report rounds ratios to 3 decimals
    assert sum(b["n_predict"] for b in bodies) == 2 * sum(c["off"]["output_tokens"] for c in report["cells"].values())
    # the prompts are the ids off saw (our chat template's): chat, batch 1, the first GGUF takes session 0's four
    # turns first, each prompt longer by the answer before it and the next question
    session = workloads()["chat"][0]
    first = [{"role": "system", "content": session.system}] if session.system else []
    first.append({"role": "user", "content": session.turns[0]})
    turns = [b["prompt"] for b in bodies[:4]]
    assert turns[0] == encode_chat(tiny.tokenizer, Chat(first))[1]
    assert [len(t) for t in turns] == sorted({len(t) for t in turns})


def test_llama_cpp_asked_for_but_not_built_is_one_error_before_anything_runs(
    capsys, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mechserve.bench import llama_cpp

    monkeypatch.delenv(llama_cpp.SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path / "cache"))
    argv = ["bench", "spec-decode", "--model", "smollm2", "--prompts", "1", "--sets", "novel", "--llama-cpp"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--llama-cpp: llama-server not found" in err and "make llama-cpp" in err
    # a model llama.cpp cannot run here is named, not skipped
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\nexit 0\n")
    server.chmod(0o755)
    monkeypatch.setenv(llama_cpp.SERVER_ENV, str(server))
    assert main(["bench", "spec-decode", "--model", str(tiny_dir), "--llama-cpp"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"llama.cpp runs the embedded model's GGUFs (--model smollm2) or a GGUF file, not {tiny_dir}" in err
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--llama-cpp-modes", "fast"], "--llama-cpp-modes needs --llama-cpp"),
        (["--costs", "--llama-cpp"], "--llama-cpp: not with --costs"),
        (["--mode", "q5"], "--mode"),
        (["--llama-cpp", "--llama-cpp-modes", "f16"], "--llama-cpp-modes"),
    ],
)
def test_bench_spec_decode_llama_cpp_flags_are_checked(capsys, argv: list[str], needle: str) -> None:
    assert main(["bench", "spec-decode", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mechserve: error: ") and needle in err and err.count("\n") == 1
