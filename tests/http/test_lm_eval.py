"""A real evaluation client: EleutherAI's ``lm-eval`` against ``mechserve serve`` scores what its own ``hf`` model scores.

Two tasks ship with the tests (``tests/data/lm_eval``: a task YAML and a JSONL dataset each, read
offline, no dataset hub): ``mechserve_mc``, multiple choice scored by log-likelihood, and
``mechserve_gen``, greedy ``generate_until``.  lm-eval runs each twice on SmolLM2-135M in float32:
through its ``local-completions`` model (the server's ``/v1/completions``, the tokenizer being
SmolLM2's own) and through its ``hf`` model (transformers on the same weights).  The log-likelihood
of every choice agrees within 1e-4, every greedy generation is identical, and so are the scores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"
SERVED = "smollm2"


@pytest.fixture(scope="module")
def lm_eval_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Offline, with the datasets cache in a temporary folder (set before ``datasets`` is imported)."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(
        HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("hf-datasets")), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"
    )
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def weights() -> Path:
    from mechserve.model.checkpoint import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """``mechserve serve smollm2`` (vLLM's positional model) on a free port, stopped with Ctrl-C at the end."""
    from mechserve.http import bind_socket

    probe = bind_socket()
    port = probe.getsockname()[1]
    probe.close()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mechserve", "serve", SERVED, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else "the server exited"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)


def evaluate(model: str, model_args: str, task: str) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of one shipped task, with every sample logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = Path.cwd()
    os.chdir(TASKS)  # the YAMLs name their JSONL files relative to their folder
    try:
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[task],
            task_manager=TaskManager(include_path=str(TASKS)),
            batch_size=1,
            log_samples=True,
            device="cpu",
        )
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def run(lm_eval_env: None, weights: Path, server: str) -> Callable[[str, str], dict[str, Any]]:
    """``run(model, task)``: lm-eval's result for ``"hf"`` or ``"server"`` (each pair computed once)."""
    done: dict[tuple[str, str], dict[str, Any]] = {}
    args = {
        "hf": ("hf", f"pretrained={weights},dtype=float32"),
        "server": (
            "local-completions",
            f"model={SERVED},base_url={server}/v1/completions,tokenizer_backend=huggingface,tokenizer={weights},"
            "num_concurrent=1,max_retries=1,tokenized_requests=True",
        ),
    }

    def get(which: str, task: str) -> dict[str, Any]:
        if (which, task) not in done:
            done[which, task] = evaluate(*args[which], task)
        return done[which, task]

    return get


def by_doc(result: dict[str, Any], task: str) -> dict[int, dict[str, Any]]:
    return {sample["doc_id"]: sample for sample in result["samples"][task]}


def test_generate_until_scores_and_generations_equal_hfs(run) -> None:
    ours, theirs = run("server", "mechserve_gen"), run("hf", "mechserve_gen")
    mine, reference = by_doc(ours, "mechserve_gen"), by_doc(theirs, "mechserve_gen")
    assert sorted(mine) == sorted(reference) == list(range(6))
    for doc_id, sample in reference.items():
        assert mine[doc_id]["resps"] == sample["resps"], doc_id  # the greedy continuations, token for token
        assert mine[doc_id]["filtered_resps"] == sample["filtered_resps"], doc_id
    score = "exact_match,first_word"
    assert ours["results"]["mechserve_gen"][score] == theirs["results"]["mechserve_gen"][score]
    print(
        f"\nmechserve_gen exact_match: server {ours['results']['mechserve_gen'][score]}, hf {theirs['results']['mechserve_gen'][score]}"
    )


def test_loglikelihood_scores_equal_hfs_within_1e_4_per_item(run) -> None:
    ours, theirs = run("server", "mechserve_mc"), run("hf", "mechserve_mc")
    mine, reference = by_doc(ours, "mechserve_mc"), by_doc(theirs, "mechserve_mc")
    assert sorted(mine) == sorted(reference) == list(range(8))
    for doc_id, sample in reference.items():
        got = [choice[0] for choice in mine[doc_id]["resps"]]  # one (log-likelihood, is_greedy) per choice
        want = [choice[0] for choice in sample["resps"]]
        assert len(got) == len(want) == 4
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, want):
            assert abs(ll - ref_ll) <= 1e-4, (doc_id, ll, ref_ll)
            assert greedy == ref_greedy, doc_id
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["mechserve_mc"][metric] == theirs["results"]["mechserve_mc"][metric], metric
    print(
        "\nmechserve_mc acc / acc_norm: server "
        f"{ours['results']['mechserve_mc']['acc,none']} / {ours['results']['mechserve_mc']['acc_norm,none']}, hf "
        f"{theirs['results']['mechserve_mc']['acc,none']} / {theirs['results']['mechserve_mc']['acc_norm,none']}"
    )
