"""``serve --data-parallel-size N`` (issue 26, item 3): N engine-core processes behind one API server.

Greedy outputs through two replicas equal one engine's under every routing policy; streaming, aborts,
``n > 1``, structured outputs, stop strings, logprobs and the Responses and Messages endpoints work
through them; no page is left behind on any replica (asked over its socket); a replica killed
mid-stream ends its requests with an error naming it while the other keeps serving; bad flags are
refused before anything loads.  Each replica is a real process (``python -m mechserve.dp.replica``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import save_chatml_byte_model
from server_support import TINY_NAME, Served, serving

from mechserve.api.config import EngineConfig
from mechserve.dp.client import DataParallelLLM, replica_config

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [  # shared prefixes, so the cache-reading policies have something to read
    "The quick brown fox jumps over the lazy dog and then",
    "The quick brown fox jumps over the lazy dog and later",
    "A completely different beginning of a sentence that goes",
    "The quick brown fox jumps over the lazy cat",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8,",
    "A completely different beginning of a sentence which",
]


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level ChatML model: any text is tokens, grammars compile, chat templates render."""
    return save_chatml_byte_model(tmp_path_factory.mktemp("dp-byte"))


def start(model: Path, policy: str = "precise", **engine: Any) -> DataParallelLLM:
    engine.setdefault("page_size", 4)
    engine.setdefault("num_pages", 512)
    engine.setdefault("max_waiting", 64)
    config = EngineConfig(**engine)
    return DataParallelLLM(
        str(model), data_parallel_size=2, config=config, model_name=TINY_NAME, routing_policy=policy, threads=2
    )


@pytest.fixture(scope="module")
def dp(byte_dir: Path) -> Iterator[Served]:
    """Two replicas behind one server, routed by precise (the default)."""
    with serving(start(byte_dir)) as served:
        yield served


@pytest.fixture(scope="module")
def reference(byte_dir: Path) -> Any:
    """One in-process engine on the same model: what every request must give alone."""
    from mechserve.entrypoints.llm import LLM

    return LLM(str(byte_dir), page_size=4, num_pages=512)


def on_loop(served: Served, coroutine: Any) -> Any:
    """Run ``coroutine`` on the server's event loop (where the client lives) and return its result."""
    llm = served.llm
    assert isinstance(llm, DataParallelLLM) and llm._loop is not None
    return asyncio.run_coroutine_threadsafe(coroutine, llm._loop).result(60)


def wait_idle_pages(served: Served, timeout: float = 30.0) -> list[Any]:
    """Every live replica's pool once it holds no request (asked over its socket), its check passed."""
    deadline = time.monotonic() + timeout
    while True:
        pages = on_loop(served, served.llm.replica_pages())  # type: ignore[attr-defined]
        if all(p.idle for p in pages):
            assert all(p.problem is None for p in pages), pages
            return pages
        assert time.monotonic() < deadline, f"the replicas did not become idle: {pages}"
        time.sleep(0.05)


def complete(url: str, prompt: str, **body: Any) -> httpx.Response:
    payload = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(url + "/v1/completions", json=payload, timeout=120)


def greedy_text(reference: Any, prompt: str, **sampling: Any) -> list[str]:
    from mechserve.api.params import SamplingParams

    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 8)
    (out,) = reference.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
    return [c.text for c in out.outputs]


async def _batch(url: str, prompts: list[str], **body: Any) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        payloads = [{"model": TINY_NAME, "prompt": p, "max_tokens": 8, "temperature": 0, **body} for p in prompts]
        return await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in payloads))


def engine_samples(url: str, name: str) -> dict[str, float]:
    """``engine label -> value`` of one sample name in ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["engine"]] = sample.value
    return out


def running_gauges(text: str) -> dict[str, float]:
    """``engine label -> vllm:num_requests_running`` in a ``/metrics`` body."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["engine"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:num_requests_running"
    }


# Greedy parity, every policy --------------------------------------------------------------------------------------


def test_dp2_greedy_outputs_equal_one_engine_under_precise(dp: Served, reference: Any) -> None:
    responses = asyncio.run(_batch(dp.url, PROMPTS * 2))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    for prompt, r in zip(PROMPTS * 2, responses):
        assert [c["text"] for c in r.json()["choices"]] == greedy_text(reference, prompt), prompt
    wait_idle_pages(dp)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "least_loaded"])
def test_dp2_greedy_outputs_equal_one_engine_under_each_policy(byte_dir: Path, reference: Any, policy: str) -> None:
    with serving(start(byte_dir, policy)) as served:
        responses = asyncio.run(_batch(served.url, PROMPTS))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        for prompt, r in zip(PROMPTS, responses):
            assert [c["text"] for c in r.json()["choices"]] == greedy_text(reference, prompt), (policy, prompt)
        if policy == "round_robin":  # the rotation used both replicas, each its own engine
            prompt_tokens = engine_samples(served.url, "vllm:prompt_tokens_total")
            assert set(prompt_tokens) == {"0", "1"} and all(v > 0 for v in prompt_tokens.values()), prompt_tokens
        for pages in wait_idle_pages(served):
            assert pages.private == 0 and pages.free + pages.cached == pages.total


def test_precise_routes_a_shared_prefix_to_the_replica_that_holds_it(dp: Served) -> None:
    """The second request of a long shared prefix goes where the first one's KV events said it is cached."""
    llm = dp.llm
    assert isinstance(llm, DataParallelLLM)
    prefix = "Shared system prompt: you are a careful assistant who answers briefly. " * 3
    assert complete(dp.url, prefix + "First question?").status_code == 200
    wait_idle_pages(dp)
    time.sleep(0.2)  # the step's Load (with its KV events) has arrived
    before = engine_samples(dp.url, "vllm:prefix_cache_hits_total")
    assert complete(dp.url, prefix + "Second question?").status_code == 200
    after = engine_samples(dp.url, "vllm:prefix_cache_hits_total")
    decision = [e["decision"] for e in llm.fleet.log if "decision" in e][-1]
    assert decision["rule"] == "longest_prefix" and decision["matched"] >= len(prefix) // 2, decision
    chosen = str(decision["replica"])
    assert after[chosen] - before.get(chosen, 0.0) == decision["matched"]  # what the events said is what it hit


# Everything one engine does ---------------------------------------------------------------------------------------


def test_streaming_n2_logprobs_and_stop_strings_through_dp2(dp: Served, reference: Any) -> None:
    prompt = PROMPTS[0]
    expected = greedy_text(reference, prompt, max_tokens=12, n=2, logprobs=2)
    body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": 2}
    texts = {0: "", 1: ""}
    finish: dict[int, str] = {}
    with httpx.stream("POST", dp.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        lines = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line)["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice.get("logprobs"):
                assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    assert [texts[0], texts[1]] == expected and finish == {0: "length", 1: "length"}
    # a stop string cuts the text as one engine cuts it
    full = expected[0]
    stop = full[3:5] if len(full) >= 5 else full[-1:]
    r = complete(dp.url, prompt, max_tokens=12, stop=[stop])
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == greedy_text(reference, prompt, max_tokens=12, stop=[stop])[0]
    assert choice["finish_reason"] == "stop"


def test_structured_output_chat_responses_and_messages_through_dp2(dp: Served) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": "give me JSON"}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    r = httpx.post(dp.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["a"], int)
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}
    r = httpx.post(dp.url + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = httpx.post(
        dp.url + "/v1/responses", json={"model": TINY_NAME, "input": "hello", "max_output_tokens": 6}, timeout=60
    )
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
    messages = {"model": TINY_NAME, "max_tokens": 6, "messages": [{"role": "user", "content": "hello"}]}
    r = httpx.post(dp.url + "/v1/messages", json=messages, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = httpx.post(dp.url + "/v1/messages", json={**messages, "stream": True}, timeout=60)
    assert r.status_code == 200 and "message_stop" in r.text


def test_metrics_carry_each_replicas_series_under_the_engine_label(dp: Served) -> None:
    asyncio.run(_batch(dp.url, PROMPTS[:4]))
    text = httpx.get(dp.url + "/metrics", timeout=30).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        for engine in ("0", "1"):
            assert f'{name}{{engine="{engine}",model_name="{TINY_NAME}"}}' in text, (name, engine)
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, two engines
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"}' in text
    assert httpx.get(dp.url + "/health", timeout=10).status_code == 200


def test_unseeded_sampling_differs_between_replicas_and_seeded_does_not(byte_dir: Path) -> None:
    """The same prompt sent twice at temperature 1, unseeded, one copy to each replica (round robin): the two
    replicas' samplers are seeded apart (``replica_config``: seed + index), so the draws differ as two draws
    of one engine do.  With one seed everywhere both replicas' first unseeded request sampled the same text
    (the trial of issue 26 found it).  A seeded request gives the same text on either replica."""
    llm = start(byte_dir, "round_robin")
    with serving(llm) as served:
        unseeded = [complete(served.url, PROMPTS[0], max_tokens=16, temperature=1.0, ignore_eos=True) for _ in range(2)]
        seeded = [complete(served.url, PROMPTS[0], max_tokens=16, temperature=1.0, seed=11) for _ in range(2)]
    assert all(r.status_code == 200 for r in unseeded + seeded), [r.text for r in unseeded + seeded]
    replicas = [e["decision"]["replica"] for e in llm.fleet.log if "decision" in e]
    assert replicas == [0, 1, 0, 1], replicas
    texts = [r.json()["choices"][0]["text"] for r in unseeded]
    assert texts[0] != texts[1], texts
    assert seeded[0].json()["choices"][0]["text"] == seeded[1].json()["choices"][0]["text"]


def test_replica_config_moves_only_the_seed() -> None:
    config = EngineConfig(page_size=4, num_pages=64, seed=5, spec_len=2)
    assert [replica_config(config, i) for i in range(3)] == [config.replace(seed=s) for s in (5, 6, 7)]
    assert replica_config(config.replace(seed=None), 1).seed is None  # unseeded: each replica seeds itself


# No page leaked across the router ----------------------------------------------------------------------------------


def test_no_page_leaked_across_the_router_after_a_mixed_run_with_aborts(dp: Served) -> None:
    async def mixed() -> None:
        async with httpx.AsyncClient(timeout=120) as client:

            async def aborted(i: int) -> None:
                body = {"model": TINY_NAME, "prompt": PROMPTS[i % 6], "max_tokens": 400, "stream": True}
                body |= {"ignore_eos": True, "n": 1 + i % 2}
                async with client.stream("POST", dp.url + "/v1/completions", json=body) as s:
                    async for _ in s.aiter_lines():
                        break  # the first chunk, then the client goes away

            async def finished(i: int) -> None:
                r = await client.post(
                    dp.url + "/v1/completions",
                    json={"model": TINY_NAME, "prompt": PROMPTS[i % 6], "max_tokens": 6, "n": 1 + i % 3},
                )
                assert r.status_code == 200, r.text

            async def refused() -> None:
                r = await client.post(
                    dp.url + "/v1/completions", json={"model": TINY_NAME, "prompt": "x" * 5000, "max_tokens": 4}
                )
                assert r.status_code == 400, r.text

            await asyncio.gather(*(aborted(i) for i in range(6)), *(finished(i) for i in range(6)), refused())

    asyncio.run(mixed())
    pages = wait_idle_pages(dp)
    assert len(pages) == 2
    for p in pages:  # nothing held by a request; the rest free or in the prefix cache
        assert p.private == 0 and p.free + p.cached == p.total, p


def test_without_prefix_caching_every_replicas_free_pages_equal_its_total(byte_dir: Path) -> None:
    with serving(start(byte_dir, "round_robin", prefix_caching=False)) as served:
        with httpx.stream(
            "POST",
            served.url + "/v1/completions",
            json={"model": TINY_NAME, "prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True, "stream": True},
            timeout=60,
        ) as s:
            for _ in s.iter_lines():
                break
        responses = asyncio.run(_batch(served.url, PROMPTS, n=2))
        assert all(r.status_code == 200 for r in responses)
        for p in wait_idle_pages(served):
            assert p.free == p.total, p


# A replica killed mid-stream ---------------------------------------------------------------------------------------


def test_a_replica_killed_mid_stream_ends_its_requests_with_an_error_and_the_other_keeps_serving(
    byte_dir: Path,
) -> None:
    llm = start(byte_dir, "round_robin", prefix_caching=False)
    with serving(llm) as served:
        victim_pid = llm.replica_pids()[0]
        long = {"model": TINY_NAME, "prompt": PROMPTS[2], "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        plain_result: dict[str, httpx.Response] = {}
        running_before: dict[str, float] = {}

        async def run() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                lines: list[str] = []
                # round robin: the stream goes to replica 0; of the two plain requests one goes to each
                async with client.stream("POST", served.url + "/v1/completions", json={**long, "stream": True}) as s:
                    assert s.status_code == 200
                    plains = [asyncio.ensure_future(client.post(served.url + "/v1/completions", json=long))]
                    plains.append(asyncio.ensure_future(client.post(served.url + "/v1/completions", json=long)))
                    async for line in s.aiter_lines():
                        lines.append(line)
                        if len(lines) == 1:
                            while len(llm._requests) < 3:  # both plain requests are placed
                                await asyncio.sleep(0.01)
                            scrape = (await client.get(served.url + "/metrics")).text  # the victim at work
                            running_before.update(running_gauges(scrape))
                            os.kill(victim_pid, signal.SIGKILL)
                done, pending = await asyncio.wait(plains, return_when=asyncio.FIRST_COMPLETED)
                plain_result["on_victim"] = done.pop().result()
                for task in pending:
                    task.cancel()
                return lines

        lines = asyncio.run(run())
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "replica 0" in error["message"] and str(victim_pid) in error["message"], error
        r = plain_result["on_victim"]
        assert r.status_code == 503 and "replica 0" in r.json()["error"]["message"], r.text
        health = httpx.get(served.url + "/health", timeout=10)
        assert health.status_code == 503 and "replica 0" in health.json()["error"]["message"], health.text
        for i in range(4):  # the survivor takes everything, at once
            r = complete(served.url, PROMPTS[i])
            assert r.status_code == 200, r.text
        (survivor,) = wait_idle_pages(served)
        assert survivor.free == survivor.total, survivor
        assert llm.running and llm.error is None
        # /metrics: the dead replica keeps its counters but reports no gauge (it was running the stream when
        # last asked; its gauge must not say so for ever), the survivor's gauges go on
        assert running_before.get("0", 0) >= 1, running_before
        assert running_gauges(httpx.get(served.url + "/metrics", timeout=30).text) == {"1": 0.0}
        assert engine_samples(served.url, "vllm:prompt_tokens_total")["0"] > 0


# Flags ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--routing-policy", "round_robin"], "--routing-policy"),
        (["-dp", "2", "--threads", "1"], "--threads 1"),
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["-dp", "2", "--routing-policy", "oracle"], "--routing-policy"),
        (["-dp", "2", "-tp", "2"], "--tensor-parallel-size"),
    ],
)
def test_bad_data_parallel_flags_are_refused_with_one_line(byte_dir: Path, flags: list[str], named: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mechserve", "serve", str(byte_dir), "--port", "0", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], done.stderr


def test_dp1_is_the_in_process_engine(byte_dir: Path) -> None:
    from mechserve.cli import serve
    from mechserve.cli.main import build_parser
    from mechserve.entrypoints.async_llm import AsyncLLM

    args = build_parser().parse_args(["serve", str(byte_dir), "-dp", "1", "--num-pages", "64", "--page-size", "4"])
    serve.check_data_parallel(args)
    llm = serve._engine(args)
    try:
        assert type(llm) is AsyncLLM
    finally:
        llm.core.close()


# The offline API -------------------------------------------------------------------------------------------------


def test_llm_data_parallel_size_2_gives_one_engines_greedy_outputs(byte_dir: Path, reference: Any) -> None:
    from mechserve.api.params import SamplingParams
    from mechserve.entrypoints.llm import LLM, RequestsRejected

    with LLM(str(byte_dir), data_parallel_size=2, page_size=4, num_pages=512) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == [greedy_text(reference, p)[0] for p in PROMPTS]
        assert [o.prompt for o in outs] == PROMPTS
        with pytest.raises(RequestsRejected) as caught:  # one refused, the others complete
            llm.generate([PROMPTS[0], "x" * 5000], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert list(caught.value.errors) == [1] and caught.value.outputs[0] is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"data_parallel_size": 0}, "data_parallel_size"), ({"routing_policy": "precise"}, "data_parallel_size > 1")],
)
def test_llm_refuses_bad_data_parallel_keywords(byte_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    from mechserve.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=message):
        LLM(str(byte_dir), **kwargs)
