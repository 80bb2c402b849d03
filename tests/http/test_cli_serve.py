"""``mechserve serve`` (a real subprocess on a free port) and ``mechserve bench serve`` (the Poisson client)."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_support import TINY_NAME

from mechserve.bench.serve_client import arrivals, percentile
from mechserve.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_serve_runs_as_a_command_until_interrupted(tiny_dir: Path) -> None:
    port = free_port()
    argv = ["serve", "--model", str(tiny_dir), "--served-model-name", TINY_NAME, "--port", str(port)]
    argv += ["--page-size", "4", "--num-pages", "64", "--api-key", "k3y", "--max-waiting", "8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mechserve", *argv], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        banner = process.stderr.readline() if process.stderr else ""
        assert f"serving '{TINY_NAME}' on http://127.0.0.1:{port}" in banner, banner
        # what it holds: the weights by format, the KV pool's bytes and how they were sized (issue 30)
        assert "weights " in banner and "(float32 " in banner, banner
        assert "KV pool 128.0 KiB: 64 pages of 4 positions (num_pages)" in banner, banner
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k3y"}
        body = {"model": TINY_NAME, "prompt": "w1 w2 w3", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30).json()
        assert reply["usage"]["completion_tokens"] == 5
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=30)
    assert code == 0


def test_serve_errors_are_one_line_and_status_2(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "serve", "--model", str(tmp_path / "no-such-model"))
    assert code == 2 and err.startswith("mechserve: error: ") and err.count("\n") == 1
    code, _, err = run_cli(capsys, "serve", "--port", "70000")
    assert code == 2 and "--port" in err
    code, _, err = run_cli(capsys, "serve", "--max-waiting", "0")
    assert code == 2 and "--max-waiting" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, _, err = run_cli(capsys, "serve", "--model", str(tiny_dir), "--port", port, "--num-pages", "8")
    assert code == 2 and f"cannot bind 127.0.0.1:{port}" in err


def test_importing_the_cli_imports_neither_torch_nor_the_server_stack() -> None:
    code = "import sys, mechserve.cli.main as m; sys.exit(any(x in sys.modules for x in ('torch', 'fastapi', 'httpx')))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# mechserve bench serve ---------------------------------------------------------------------------------------------


def test_bench_serve_reports_throughput_and_percentiles(capsys, tiny_server) -> None:
    argv = ["bench", "serve", "--url", tiny_server.url, "--num-requests", "12", "--rate", "200"]
    code, out, err = run_cli(capsys, *argv, "--input-len", "6", "--output-len", "5", "--seed", "3")
    assert code == 0, err
    report = json.loads(out)
    assert report["completed"] == 12 and report["failed"] == 0 and report["errors"] == {}
    assert report["total_output_tokens"] == 12 * 5 and report["total_input_tokens"] >= 12 * 6
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    for name in ("ttft", "itl", "e2el"):
        assert 0 < report[f"p50_{name}_ms"] <= report[f"p99_{name}_ms"]
    code, out, _ = run_cli(capsys, *argv, "--endpoint", "chat", "--max-concurrency", "3", "--output-len", "3")
    assert code == 0 and json.loads(out)["completed"] == 12 and json.loads(out)["max_concurrency"] == 3


def test_bench_serve_multi_tenant_sends_each_tenants_system_prompt_as_a_shared_prefix(capsys, tiny_server) -> None:
    from mechserve.bench.serve_client import BenchConfig, multi_tenant_prompts

    config = BenchConfig(workload="multi-tenant", num_requests=40, tenants=3, system_len=16, input_len=4, seed=5)
    prompts = multi_tenant_prompts(config)
    assert len(prompts) == 40 and prompts == multi_tenant_prompts(config)  # seeded
    heads = {" ".join(p.split()[:8]) for p in prompts}  # every system prompt has at least 8 words
    assert 1 < len(heads) <= 3
    argv = ["bench", "serve", "--url", tiny_server.url, "--num-requests", "6", "--workload", "multi-tenant"]
    code, out, err = run_cli(capsys, *argv, "--tenants", "2", "--system-len", "12", "--output-len", "3")
    assert code == 0, err
    report = json.loads(out)
    assert report["workload"] == "multi-tenant" and report["completed"] == 6 and report["total_output_tokens"] == 18


def test_bench_serve_counts_refusals_and_reports_an_unreachable_server(capsys, tiny_server) -> None:
    argv = ["bench", "serve", "--url", tiny_server.url, "--num-requests", "3", "--output-len", "600"]
    code, out, _ = run_cli(capsys, *argv, "--model", TINY_NAME)
    assert code == 0 and json.loads(out)["errors"] == {"400": 3}  # 600 tokens do not fit the 512-token context
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    code, _, err = run_cli(capsys, "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--num-requests", "1")
    assert code == 2 and "cannot benchmark" in err


def test_arrivals_are_a_poisson_process() -> None:
    times = list(arrivals(rate=50.0, count=4000, duration=None, rng=random.Random(0)))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0 and len(times) == 4000
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.002  # exponential gaps of mean 1/rate
    assert abs(percentile(gaps, 50) - 0.693 / 50) < 0.002  # median ln 2 / rate
    assert list(arrivals(float("inf"), 5, None, random.Random(0))) == [0.0] * 5
    assert max(arrivals(10.0, 10_000, 2.0, random.Random(0))) <= 2.0


def test_serve_takes_the_speculation_flags(capsys, tiny_dir: Path) -> None:
    """``--spec-method``/``--draft-model``/``--spec-len``/``--spec-fixed`` build the engine's ``SpeculativeConfig``
    (generate's flags); a bad combination is one error line before anything loads.  The shared-prefix hold
    is on unless ``--no-hold-shared-prefix``, output caching unless ``--no-output-caching``."""
    from mechserve.cli.main import parse
    from mechserve.cli.serve import _engine, _speculation

    base = ["serve", "--model", str(tiny_dir), "--num-pages", "16", "--page-size", "4"]
    args = parse([*base, "--draft-model", f"{tiny_dir}:layers=1", "--spec-len", "2", "--spec-fixed"])
    llm = _engine(args)
    spec = llm.core.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("draft", 2, False)
    assert "draft model" in _speculation(llm.core) and "fixed" in _speculation(llm.core)
    plain = _engine(parse(["serve", "--model", str(tiny_dir), "--num-pages", "16"])).core
    assert plain.speculative is None and plain.scheduler.spec_engine.hold_shared_prefix is True
    unheld = _engine(parse(["serve", "--model", str(tiny_dir), "--num-pages", "16", "--no-hold-shared-prefix"]))
    assert unheld.core.scheduler.spec_engine.hold_shared_prefix is False
    # output caching (m13) is on unless --no-output-caching
    assert plain.scheduler.spec_engine.output_caching is True and plain.config.output_caching is True
    uncached = _engine(parse(["serve", "--model", str(tiny_dir), "--num-pages", "16", "--no-output-caching"]))
    assert uncached.core.scheduler.spec_engine.output_caching is False
    code, _, err = run_cli(capsys, "serve", "--spec-method", "draft")
    assert code == 2 and "--draft-model" in err and err.count("\n") == 1


def test_serve_takes_vllms_names(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    """``vllm serve``'s spellings set our settings: the positional model, --max-num-seqs, --max-num-batched-tokens,
    --block-size, --no-enable-prefix-caching, --tensor-parallel-size/-tp and --chat-template (a file)."""
    from mechserve.cli.main import parse
    from mechserve.cli.serve import _engine

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}w100 {{ m['content'] }} {% endfor %}w101")
    argv = ["serve", str(tiny_dir), "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--block-size", "4"]
    argv += ["--no-enable-prefix-caching", "-tp", "1", "--num-pages", "32", "--chat-template", str(template)]
    llm = _engine(parse(argv))
    config = llm.core.config
    assert (config.max_running, config.max_step_tokens, config.page_size, config.prefix_caching) == (3, 64, 4, False)
    assert config.world_size == 1 and llm.model_name == str(tiny_dir)
    assert llm.core.tokenizer.chat_template == template.read_text()
    ours = _engine(parse(["serve", "--model", str(tiny_dir), "--max-running", "3", "--num-pages", "32"]))
    assert ours.core.config.max_running == 3 and ours.core.config.prefix_caching is True
    same = parse(["serve", str(tiny_dir), "--model", str(tiny_dir), "--max-num-seqs", "3", "--max-running", "3"])
    assert _engine(same).core.config.max_running == 3  # both names with one value are fine


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "a", "--model", "b"], "MODEL (the positional model) a and --model b set the same thing"),
        (["serve", "--max-num-seqs", "8", "--max-running", "4"], "--max-num-seqs 8 and --max-running 4 set the same"),
        (["serve", "--max-num-batched-tokens", "64", "--max-step-tokens", "32"], "--max-num-batched-tokens 64 and"),
        (["serve", "--tensor-parallel-size", "2", "--world-size", "1"], "--tensor-parallel-size 2 and --world-size 1"),
        (["serve", "-tp", "2", "--world-size", "1"], "--tensor-parallel-size 2 and --world-size 1"),
        (["serve", "--block-size", "8", "--page-size", "4"], "--block-size 8 and --page-size 4"),
        (
            ["serve", "--enable-prefix-caching", "--no-prefix-caching"],
            "--enable-prefix-caching and --no-prefix-caching",
        ),
        (["serve", "--max-num-seqs", "0"], "--max-num-seqs: must be > 0"),
        (["serve", "--chat-template", "no/such/file.jinja"], "cannot read the chat template file 'no/such/file.jinja'"),
    ],
)
def test_two_names_with_two_values_are_one_error(capsys, argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_chat_template_that_cannot_render_is_refused_at_startup(capsys, tiny_dir: Path) -> None:
    code, _, err = run_cli(
        capsys, "serve", str(tiny_dir), "--num-pages", "8", "--chat-template", "{{ raise_exception('x') }}"
    )
    assert (
        code == 2
        and err.startswith("mechserve: error: --chat-template: the chat template cannot render")
        and err.count("\n") == 1
    )


def test_serve_takes_a_request_body_cap(capsys) -> None:
    from mechserve.cli.main import parse

    assert parse(["serve", "--max-request-bytes", "1MiB"]).max_request_bytes == 1 << 20
    assert parse(["serve"]).max_request_bytes == 4 << 20
    code, _, err = run_cli(capsys, "serve", "--max-request-bytes", "lots")
    assert code == 2 and "--max-request-bytes" in err


def test_an_endless_chat_template_file_is_refused_with_its_limit(capsys, tmp_path: Path) -> None:
    """``--chat-template /dev/zero`` read until memory ran out; a file is read up to its limit and no further."""
    big = tmp_path / "big.jinja"
    big.write_text("{{ x }}" + " " * (1 << 20))
    for path in ("/dev/zero", str(big)):
        code, _, err = run_cli(capsys, "serve", "--chat-template", path)
        assert code == 2 and err.count("\n") == 1, err
        assert f"cannot read the chat template file '{path}': it is over 1 MiB" in err


def test_serve_takes_the_response_store_size_and_open_objects(capsys, tiny_dir: Path) -> None:
    """Issue 29's two server options: the Responses store's bound, and JSON Schema's open objects."""
    from mechserve.cli.main import parse
    from mechserve.cli.serve import DEFAULT_STORED_RESPONSES, _engine
    from mechserve.http.responses_api import MAX_STORED_RESPONSES

    assert DEFAULT_STORED_RESPONSES == MAX_STORED_RESPONSES == parse(["serve"]).max_stored_responses
    assert parse(["serve", "--max-stored-responses", "5"]).max_stored_responses == 5
    code, _, err = run_cli(capsys, "serve", "--max-stored-responses", "0")
    assert code == 2 and "--max-stored-responses" in err
    closed = _engine(parse(["serve", "--model", str(tiny_dir), "--num-pages", "16"])).core.config
    assert closed.allow_additional_properties is False
    flag = ["serve", "--model", str(tiny_dir), "--num-pages", "16", "--allow-additional-properties"]
    assert _engine(parse(flag)).core.config.allow_additional_properties is True


def test_serve_kv_events_endpoint_errors_are_one_line(capsys, tiny_dir: Path) -> None:
    for bad in ("foo", "tcp://nohost", "tcp://*:99999", "udp://*:5"):
        code, _, err = run_cli(capsys, "serve", "--model", str(tiny_dir), "--kv-events-endpoint", bad)
        assert code == 2 and "--kv-events-endpoint" in err and err.count("\n") == 1, err
    code, _, err = run_cli(capsys, "serve", "--model", str(tiny_dir), "--kv-events-endpoint", "tcp://256.0.0.1:5")
    assert code == 2 and "cannot bind the KV event endpoint" in err and err.count("\n") == 1, err
