"""``mechserve bench run`` end to end on a tiny random model, ``bench spec`` on 1k requests, and bad flags.

The runs check what is computed and written (schema, greedy agreement with transformers, prefix
caching computing fewer prompt tokens, trace identity); speed is never asserted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mechserve.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from tiny_models import save_tiny, tiny_config

RUN_FIELDS = {"engine", "variant", "mode", "settings", "metrics", "peak_rss_bytes", "useful_gflops_per_s", "mfu"}
METRICS = {
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{s}_{k}_ms" for s in ("mean", "p50", "p99") for k in ("ttft", "tpot", "itl", "e2el")),
}
ENGINE_STATS = {
    "steps",
    "tokens_per_step",
    "preemptions",
    "prefix_hit_rate",
    "acceptance_rate",
    "scheduler_time_s",
    "forward_time_s",
    "prefill_tokens_computed",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench-tiny")
    save_tiny(path, tiny_config())
    return path


def _bench(tmp_path: Path, tiny_dir: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    code = main(["bench", "run", "--model", str(tiny_dir), "--quick", "--out", str(out), *extra])
    assert code == 0
    return json.loads((out / "results.json").read_text())


def test_bench_run_quick_end_to_end(tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _bench(
        tmp_path, tiny_dir, "--workload", "throughput,prefix", "--engine", "mechserve,hf,llama-cpp", "--size", "num=6"
    )
    said = capsys.readouterr()
    err = said.err
    assert "llama-cpp skipped: llama.cpp runs the embedded model's GGUFs (--model smollm2) or a GGUF file" in err
    assert doc["skipped"][0]["engine"] == "llama-cpp"
    assert {"cpu", "cpus", "torch_threads"} <= doc["machine"].keys()
    assert doc["versions"]["torch"] and "commit" in doc["git"]
    roof = doc["roofline"]["exact"]
    assert roof["matmul"]["peak_gflops"] > 0 and roof["prefill"]["mfu"] > 0 and roof["decode"]["mfu"] > 0
    assert roof["read_bandwidth_gb_per_s"] > 0 and roof["matmul"]["engine_gflops_by_rows"]
    runs = doc["workloads"]["throughput"]["runs"]
    assert doc["workloads"]["throughput"]["params"]["num"] == 6 and runs[0]["metrics"]["completed"] == 6
    assert {(r["engine"], r["mode"]) for r in runs} == {("mechserve", "exact"), ("hf", "exact")}
    for r in runs:
        assert r.keys() >= RUN_FIELDS and r["metrics"].keys() >= METRICS
        assert (
            r["metrics"]["total_output_tokens"]
            == sum(len(o) for o in r["outputs"])
            == doc["workloads"]["throughput"]["runs"][0]["metrics"]["total_output_tokens"]
        )
    ms = next(r for r in runs if r["engine"] == "mechserve")
    assert ms["engine_stats"].keys() >= ENGINE_STATS
    # each step's time inside the forward (one forward per step here), and what else the machine ran meanwhile
    st = ms["engine_stats"]
    assert len(st["forward_time_series_s"]) == len(st["step_time_series_s"]) == st["steps"]
    assert all(0 <= f < s for f, s in zip(st["forward_time_series_s"], st["step_time_series_s"]))
    assert sum(st["forward_time_series_s"]) == pytest.approx(st["forward_time_s"])
    assert st["other_cores"] >= 0 and st["steal_cores"] >= 0
    # the decode step at the run's typical batch beside its roofline, in the JSON and as a line
    line = ms["roofline"]
    assert 1 <= line["batch"] <= 6 and line["context"] > 0 and line["bytes"] > 0 and line["flops"] > 0
    assert line["roofline_s"] == max(line["memory_s"], line["compute_s"]) > 0
    assert line["measured_over_roofline"] == pytest.approx(line["measured_s"] / line["roofline_s"])
    assert f"roofline throughput/exact/default: decode step at batch {line['batch']}, context" in said.out
    assert all("roofline" not in r for r in runs if r["engine"] == "hf")
    # each mechserve run in a process of its own (issue 30): its peaks are its own, loading included
    assert 0 < ms["peak_rss_bytes"] <= ms["process_peak_rss_bytes"]
    # continuous batching under the spec computes exactly transformers' greedy ids (fp32)
    cmp = doc["workloads"]["throughput"]["comparisons"]
    assert cmp["mechserve[exact,default] vs hf[exact] greedy agreement"]["identical_requests"] == 1.0
    prefix = {r["variant"]: r for r in doc["workloads"]["prefix"]["runs"] if r["engine"] == "mechserve"}
    on, off = prefix["prefix-cache"]["engine_stats"], prefix["no-prefix-cache"]["engine_stats"]
    assert (
        on["prefill_tokens_computed"]
        < off["prefill_tokens_computed"]
        == doc["workloads"]["prefix"]["runs"][0]["metrics"]["total_input_tokens"]
    )
    assert on["prefix_hit_rate"] > 0 and off["prefix_hit_rate"] == 0
    # m12's shared-prefix hold (on by default): the 128-token system prompt once, then each 8-token suffix
    assert prefix["prefix-cache"]["settings"]["hold_shared_prefix"] is True
    assert on["prefill_tokens_computed"] == 128 + 6 * 8
    assert off["prefill_tokens_computed"] == 6 * (128 + 8)
    cmp = doc["workloads"]["prefix"]["comparisons"]
    assert cmp["mechserve[exact] prefill computed prefix-cache/no-prefix-cache"] == (128 + 6 * 8) / (6 * 136)
    assert cmp["mechserve[exact] TTFT p50 no-prefix-cache/prefix-cache"] > 0
    for png in ("throughput.png", "latency.png", "tokens_per_step.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000


@pytest.mark.slow
def test_bench_run_every_workload_and_mode(tmp_path: Path, tiny_dir: Path) -> None:
    doc = _bench(tmp_path, tiny_dir, "--workload", "throughput,latency,prefix,spec", "--mode", "exact,fast")
    assert set(doc["roofline"]) == {"exact", "fast"}
    spec = doc["workloads"]["spec"]
    assert {r["variant"] for r in spec["runs"] if r["engine"] == "mechserve"} == {"no-spec", "ngram-4"}
    assert any("fast vs exact greedy agreement" in k for k in spec["comparisons"])


def test_bench_spec_on_1k_matches_the_reference_rung(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "spec", "--sizes", "1k", "--out", str(tmp_path)]) == 0
    assert "identical to m11" in capsys.readouterr().out
    report = json.loads((tmp_path / "spec-scale.json").read_text())
    entry = report["sizes"]["1k"]
    assert entry["requests"] == 1000 and entry["identical_to_reference"] and entry["steps"] > 0
    assert (tmp_path / "spec-step-times.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "run", "--engine", "mechserve,nope"],
        ["bench", "run", "--workload", "bogus"],
        ["bench", "run", "--mode", "turbo"],
        ["bench", "run", "--max-step-tokens", "0"],
        ["bench", "run", "--max-step-tokens", "99999999999"],
        ["bench", "run", "--spec-len", "0"],
        ["bench", "run", "--spec-len", "-1"],
        ["bench", "run", "--spec-len", "abc"],
        ["bench", "run", "--spec-len", "999999999999"],  # once ran for minutes instead of refusing
        ["bench", "run", "--size", "num=0"],
        ["bench", "run", "--threads", "0"],
        ["bench", "run", "--size", "nope=3", "--no-plots"],
        ["bench", "spec", "--sizes", "5k"],
        ["bench", "spec", "--reference", "m99", "--sizes", "1k"],
    ],
)
def test_bad_flags_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


def test_bench_spec_len_adds_a_speculative_variant_with_the_same_greedy_ids(tmp_path: Path, tiny_dir: Path) -> None:
    doc = _bench(
        tmp_path,
        tiny_dir,
        "--workload",
        "throughput",
        "--size",
        "num=4",
        "--spec-len",
        "3",
        "--no-roofline",
        "--no-plots",
    )
    runs = {(r["engine"], r["variant"]): r for r in doc["workloads"]["throughput"]["runs"]}
    assert set(runs) == {("mechserve", "default"), ("mechserve", "ngram-3"), ("hf", "default")}
    assert runs["mechserve", "ngram-3"]["outputs"] == runs["mechserve", "default"]["outputs"]
    assert (
        runs["mechserve", "ngram-3"]["engine_stats"]["steps"] <= runs["mechserve", "default"]["engine_stats"]["steps"]
    )
    cmp = doc["workloads"]["throughput"]["comparisons"]
    assert cmp["mechserve[exact,ngram-3] vs hf[exact] greedy agreement"]["identical_requests"] == 1.0


# The assistant's turn rendered as the generation prompt (w3) then its text, as real chat templates do.
TURNS_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}w3 {{ m['content'] }} w2 "
    "{% else %}w1 {{ m['content'] }} w2 {% endif %}{% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import save_word_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("bench-chat")
    save_tiny(path, tiny_config())
    save_word_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TURNS_TEMPLATE
    tok.save_pretrained(path)
    return path


def test_bench_multiturn_reuses_the_answers_side_by_side(
    tmp_path: Path, chat_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Conversations of 3 turns, 2 interleaved, in four configurations in one run: with output caching, turn
    2 and 3 compute only what the previous turn never computed plus less than one block; without it, the
    whole previous answer again; the answers are the same everywhere."""
    doc = _bench(tmp_path, chat_dir, "--workload", "multiturn", "--no-roofline", "--size", "output_len=20")
    err = capsys.readouterr().err
    assert "hf skipped on the multiturn workload" in err
    entry = doc["workloads"]["multiturn"]
    assert entry["params"]["turns"] == 3 and entry["params"]["num"] == 2
    runs = {r["variant"]: r for r in entry["runs"]}
    assert set(runs) == {"output-caching", "no-output-caching", "output-caching+ngram-4", "no-output-caching+ngram-4"}
    on, off = runs["output-caching"], runs["no-output-caching"]
    assert [t["turn"] for t in on["turns"]] == [1, 2, 3] and all(t["conversations"] == 2 for t in on["turns"])
    for a, b in zip(on["turns"][1:], off["turns"][1:]):
        assert a["retokenized"] == 1.0 and a["within_one_block"] is True
        assert a["prefill_computed"] < b["prefill_computed"] and a["reused"] > b["reused"]
        assert a["prefill_computed"] < a["new_tokens"] + 16 <= b["prefill_computed"] + 16
        assert a["p50_ttft_ms"] > 0 and a["p99_ttft_ms"] >= a["p50_ttft_ms"]
    assert (
        on["turns"][0]["new_tokens"] is None
        and on["turns"][0]["prefill_computed"] == off["turns"][0]["prefill_computed"]
    )
    assert (on["settings"]["output_caching"], off["settings"]["output_caching"]) == (True, False)
    assert runs["output-caching+ngram-4"]["settings"]["spec_len"] == 4
    for r in entry["runs"]:  # every turn of every conversation, with the answers it got
        assert len(r["requests"]) == 6 and all(len(q["output_ids"]) == 20 for q in r["requests"])
    cmp = entry["comparisons"]
    assert cmp["every configuration gave the same answers [exact]"] is True
    assert cmp["target met: turn >= 2 prefill = new + < 1 block [exact,output-caching]"] is True
    assert cmp["prefill computed on/off [exact,on turn 2]"] < 1
    assert (tmp_path / "out" / "multiturn.png").stat().st_size > 1000


def test_the_serve_workload_serves_each_mode_as_it_is_named() -> None:
    """Regression: the serve workload started every mode but exact as plain bfloat16, so its q4_1 and q8_0
    reports measured the fast mode under their names.  The server's command line is checked (and that the
    serve CLI accepts it)."""
    import argparse

    from mechserve.bench.run import _serve_command
    from mechserve.cli.serve import add_arguments

    args = argparse.Namespace(model="smollm2", device="cpu", compile=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    want = {"exact": ("float32", None), "fast": ("bfloat16", None), "q4_1": ("bfloat16", "q4_1")}
    want["q8_0"] = ("bfloat16", "q8_0")
    for mode, (dtype, quantization) in want.items():
        cmd = _serve_command(args, mode, 8123)
        assert cmd[1:4] == ["-m", "mechserve.cli.main", "serve"]
        parsed = parser.parse_args(cmd[4:])
        assert (parsed.dtype, parsed.quantization, parsed.port) == (dtype, quantization, 8123)
