"""``ServingMetrics``: prometheus_client families under vLLM's names, what they count, and a vLLM dashboard's queries.

The dashboard check takes the PromQL of vLLM's published Grafana dashboard and asserts that every
series it selects is exposed by a running server's ``/metrics`` with the labels it filters and
groups by, after a few requests.
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import httpx
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from server_support import TINY_NAME

from mechserve.api.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.metrics import ServingMetrics, buckets_1_2_5
from mechserve.spec.m16_request_draft_lengths import RejectReason

# The PromQL of vLLM's Grafana dashboard, taken verbatim (one entry per distinct query; the quantile
# panels' 0.95/0.9/0.5 variants select the same series as their 0.99 one).
# Source: vllm-project/vllm examples/observability/prometheus_grafana/grafana.json as published on
# https://docs.vllm.ai/en/latest/examples/observability/prometheus_grafana/ (page dated 2026-09-23).
DASHBOARD = (
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:request_time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:request_time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:request_time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
)
# The dashboard's model picker: label_values({__name__=~"vllm:.*"},model_name).
# The older version of the same dashboard in the repository (examples/online_serving/prometheus_grafana/
# grafana.json at commit 004f771f3a6b49597546b05c7d83686d1e121fa0) differs in two panels: it reads the
# inter-token latency under vLLM's older name and the KV usage under its older name.
DASHBOARD_OLDER = (
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
)
SELECTOR = re.compile(r'(vllm:[a-z0-9_:]+)\{model_name="\$model_name"\}')
GROUPING = re.compile(r"sum by\((\w+)\)")


def scrape(url: str) -> dict[str, list[dict[str, str]]]:
    """``sample name -> the label sets it has`` of a server's ``/metrics``, parsed by prometheus_client."""
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


def test_a_vllm_dashboards_queries_find_their_series(tiny_server) -> None:
    client = tiny_server.client()
    client.completions.create(model=TINY_NAME, prompt="w1 w2 w3", max_tokens=4, temperature=0, n=2)
    for _ in client.completions.create(model=TINY_NAME, prompt="w4 w5", max_tokens=3, temperature=0, stream=True):
        pass
    series = scrape(tiny_server.url)
    vllm_models = {
        labels.get("model_name") for name, sets in series.items() if name.startswith("vllm:") for labels in sets
    }
    assert vllm_models == {TINY_NAME}  # the model picker offers exactly the served name
    found = []
    for query in (*DASHBOARD, *DASHBOARD_OLDER):
        names = SELECTOR.findall(query)
        assert names, query
        for name in names:
            mine = [labels for labels in series.get(name, ()) if labels.get("model_name") == TINY_NAME]
            assert mine, f"{name} (from {query!r}) is not exposed"
            for group in GROUPING.findall(query):
                assert all(group in labels for labels in mine), (name, group)
            found.append(name)
    assert len(set(found)) == 28  # every selector of both versions was read
    assert {labels["finished_reason"] for labels in series["vllm:request_success_total"]} >= {"stop", "length", "abort"}


def test_every_vllm_name_we_measure_is_exposed_with_process_metrics(tiny_server) -> None:
    tiny_server.client().completions.create(model=TINY_NAME, prompt="w1 w2", max_tokens=3, temperature=0)
    series = scrape(tiny_server.url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "vllm:request_max_num_generation_tokens_count",
        "vllm:request_params_n_count",
        "vllm:request_params_max_tokens_count",
        "vllm:iteration_tokens_total_count",
        "mechserve:kv_pages_total",
        "mechserve:kv_pages_free",
        "mechserve:kv_pages_cached",
        "mechserve:kv_pages_private",
        "mechserve:request_rejected_total",
        "mechserve:generation_tokens_per_second",
        "mechserve:engine_steps_total",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "python_info",
    ):
        assert name in series, name
    assert {"model_name": TINY_NAME, "engine": "0"} in series["vllm:num_requests_running"]
    openmetrics = httpx.get(tiny_server.url + "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


def record(**fields: object) -> SimpleNamespace:
    base: dict[str, object] = dict(
        tokens={}, executed={}, preempted=(), reused={}, drafted={}, accepted={}, rejected=()
    )
    return SimpleNamespace(**{**base, **fields})


def step(record: SimpleNamespace, prompt_tokens: dict[str, int] | None = None, **counts: int) -> SimpleNamespace:
    """A ``StepOutput``'s fields the metrics read."""
    fields: dict[str, object] = {"prefix_hits": 0, "preemptions": 0, **counts}
    return SimpleNamespace(record=record, prompt_tokens=prompt_tokens or {}, **fields)


def test_a_step_counts_tokens_cache_hits_drafts_and_refusals() -> None:
    m = ServingMetrics('model "q"\n', 64, process=False)
    rec = record(
        tokens={"a": (1, 2, 3), "b": (4,)},
        executed={"a": 3, "b": 10},
        reused={"b": 8},
        drafted={"a": 2, "b": 0},  # b's window carried no guess: not a draft
        accepted={"a": 2, "b": 0},
        rejected=(("c", RejectReason.OVERLOADED),),
    )
    m.observe_step(step(rec, {"b": 10}, prefix_hits=8))
    snap = m.snapshot()
    assert snap["generation_tokens"] == 4 and snap["prompt_tokens"] == 10 and snap["steps"] == 1
    assert (snap["prefix_cache_queries"], snap["prefix_cache_hits"], snap["prefix_cache_hit_rate"]) == (10, 8, 0.8)
    assert (snap["spec_decode_drafts"], snap["spec_decode_draft_tokens"], snap["spec_decode_accepted_tokens"]) == (
        1,
        2,
        2,
    )
    assert m.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert m.value("vllm:iteration_tokens_total_count") == 1 and m.value("vllm:iteration_tokens_total_sum") == 13
    assert snap["rejected"] == {"OVERLOADED": 1}
    body, _ = m.render()
    assert b'model_name="model \\"q\\"\\n"' in body  # prometheus_client escapes the label value


def test_a_finished_request_gives_vllms_phases_and_per_sample_counts() -> None:
    m = ServingMetrics("m", 100, process=False)
    times = RequestMetrics(
        arrival_time=10.0,
        scheduled_time=10.5,
        first_token_time=11.0,
        finished_time=13.0,
        token_times=((11.0, 12.0, 13.0), (11.0,)),
    )
    samples = [
        CompletionOutput(0, "abc", [1, 2, 3], "length"),
        CompletionOutput(1, "a", [1], "stop"),
    ]
    m.observe_finished(
        RequestOutput("r", "p", [5, 6, 7, 8], samples, True, times), arrival=9.75, now=13.0, max_tokens=3
    )
    v = m.value
    assert v("vllm:e2e_request_latency_seconds_sum") == 3.25  # from the front end's arrival
    assert v("vllm:request_queue_time_seconds_sum") == 0.75
    assert v("vllm:request_prefill_time_seconds_sum") == 0.5
    assert v("vllm:request_decode_time_seconds_sum") == 2.0
    assert v("vllm:request_inference_time_seconds_sum") == 2.5
    assert v("vllm:request_success_total", finished_reason="length") == 1
    assert v("vllm:request_success_total", finished_reason="stop") == 1
    assert v("vllm:request_generation_tokens_count") == 2 and v("vllm:request_generation_tokens_sum") == 4
    assert v("vllm:request_max_num_generation_tokens_sum") == 3  # the longest sample, once
    assert v("vllm:request_prompt_tokens_sum") == 4 and v("vllm:request_params_n_sum") == 2
    assert v("vllm:request_params_max_tokens_sum") == 3
    assert v("vllm:request_time_per_output_token_seconds_sum") == 1.0  # (13 - 11) / 2, and 0 for one token
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_the_metrics_count_the_steps_preemptions() -> None:
    """Which preemptions count is the scheduler's call (``Scheduler.step``, tests/engine/test_scheduler.py)."""
    m = ServingMetrics("m", process=False)
    m.observe_step(step(record(preempted=("a", "b", "c")), preemptions=1))
    assert m.snapshot()["preemptions"] == 1
    m.observe_step(step(record(preempted=("a", "b")), preemptions=2))
    assert m.snapshot()["preemptions"] == 3


def test_each_server_has_its_own_registry() -> None:
    """Two servers in one process: no duplicate-timeseries error, separate counts, the global registry untouched."""
    before = {m.name for m in REGISTRY.collect()}
    a, b = ServingMetrics("a"), ServingMetrics("b")
    a.observe_step(step(record(tokens={"x": (1, 2)})))
    assert a.snapshot()["generation_tokens"] == 2 and b.snapshot()["generation_tokens"] == 0
    assert {m.name for m in REGISTRY.collect()} == before


def test_speculative_drafts_are_counted(make_llm, reference) -> None:
    prompt = [1, 2, 3] * 6

    async def main() -> tuple[object, dict]:
        async with make_llm(spec_len=3) as llm:
            out = await llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))
            return out, llm.metrics.snapshot()

    out, snap = asyncio.run(main())
    assert out.outputs[0].token_ids == reference(prompt, max_tokens=30).outputs[0].token_ids
    assert snap["spec_decode_draft_tokens"] > 0 and snap["spec_decode_drafts"] > 0
    assert 0 <= snap["spec_decode_accepted_tokens"] <= snap["spec_decode_draft_tokens"]
    assert snap["generation_tokens"] == 30


def test_a_draft_model_speculates_behind_the_async_engine(make_llm, reference, tiny_dir) -> None:
    """``speculative_config`` (a dict with vLLM's names) reaches the engine: the tiny model's first layer drafts,
    greedy output is the plain output, and the drafts show in the metrics."""
    prompt = [5, 9, 2, 7] * 3
    config = {"method": "draft", "num_speculative_tokens": 2, "model": f"{tiny_dir}:layers=1", "adaptive": False}

    async def main() -> tuple[object, dict]:
        async with make_llm(speculative_config=config) as llm:
            assert llm.core.speculative is not None and llm.core.speculative.method == "draft"
            out = await llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
            return out, llm.metrics.snapshot()

    out, snap = asyncio.run(main())
    assert out.outputs[0].token_ids == reference(prompt, max_tokens=12).outputs[0].token_ids
    assert snap["spec_decode_draft_tokens"] > 0


def test_kv_usage_is_the_fraction_of_pages_running_requests_hold() -> None:
    """Cached pages no request uses are evictable, so free for vLLM's gauge (``PageUsage.in_use``:
    tests/engine/test_scheduler.py); both names carry the same value."""
    from mechserve.engine.scheduler import PageUsage

    m = ServingMetrics("m", process=False)
    m.observe_engine(SimpleNamespace(running=2, waiting=1, pages=PageUsage(total=64, free=40, cached=20, shared=4)))
    snap = m.snapshot()
    assert (snap["running"], snap["waiting"], snap["pages_private"], snap["pages_cached"]) == (2, 1, 4, 20)
    assert snap["kv_cache_usage"] == m.value("vllm:gpu_cache_usage_perc") == (4 + 4) / 64
