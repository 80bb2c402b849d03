"""Serving metrics through ``prometheus_client``, under vLLM's names, fed by each step and each request's end.

The engine thread feeds ``ServingMetrics`` after every step (``observe_step`` with the
``StepOutput``, ``observe_engine`` with ``EngineCore.stats()``) and at every request event
(``observe_ttft``, ``observe_itl``, ``observe_finished`` with the ``RequestOutput``); ``render``
may be called from any thread (prometheus_client's metrics are thread-safe).  Each
``ServingMetrics`` owns its own ``CollectorRegistry``, never the process-wide one, so several
servers in one process do not clash.

Names, meanings, labels (``model_name``, ``engine``) and buckets are vLLM v1's
(``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``), so its Grafana dashboard
(``examples/observability/prometheus_grafana/grafana.json``) reads them unchanged::

    gauges      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
                (and vLLM's older name vllm:gpu_cache_usage_perc)
    counters    vllm:prompt_tokens, vllm:generation_tokens, vllm:num_preemptions,
                vllm:prefix_cache_queries, vllm:prefix_cache_hits (tokens), vllm:request_success
                (finished_reason), vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens,
                vllm:spec_decode_num_accepted_tokens, vllm:spec_decode_num_accepted_tokens_per_pos (position)
    histograms  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (and the older
                vllm:time_per_output_token_seconds, the same observations),
                vllm:request_time_per_output_token_seconds, vllm:e2e_request_latency_seconds,
                vllm:request_queue_time_seconds, vllm:request_inference_time_seconds,
                vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds,
                vllm:request_prompt_tokens, vllm:request_generation_tokens,
                vllm:request_max_num_generation_tokens, vllm:request_params_n,
                vllm:request_params_max_tokens, vllm:iteration_tokens_total

HTTP requests per endpoint, under the names vLLM's server exposes through
``prometheus-fastapi-instrumentator`` (``observe_http``, fed by ``mechserve.http.instrument``):
``http_requests_total{handler, method, status}`` (``handler``: the route's path template, such as
``/v1/responses/{response_id}``; ``status``: ``2xx``, ``4xx``, ...) and
``http_request_duration_seconds{handler, method}`` (until the last byte of the body, a stream's too).

Ours, under ``mechserve:``: KV pages by owner (``kv_pages_total``/``free``/``cached``/``private``),
requests refused at the door by reason (``request_rejected``), generated tokens per second over
the last ``RATE_WINDOW`` seconds and engine steps; and prometheus_client's process, platform and
garbage-collector collectors (``process_*``, ``python_*``).

Meanings: a request's phases are vLLM's (``RequestMetrics``): queue = arrival to admission,
prefill = admission to first token, decode = first token to end, inference = prefill + decode,
e2e = arrival to end, the arrival being when the front end submitted it.  Each of a request's
``n`` samples counts as one finished request (vLLM v1 runs them as ``n`` child requests);
``request_max_num_generation_tokens`` is the longest sample of a request.  The KV usage is the
fraction of pages a live request holds (its own, or cached pages in its page table); cached
pages no request uses are evictable and count as free, as in vLLM.  Prefix-cache queries are the
prompt tokens of admitted requests and hits those served from the cache (a request preempted and
recomputed is not counted again).  A "draft" is a decode window that carried at least one guess.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder

from mechserve.api.outputs import ABORT, LENGTH, STOP
from mechserve.spec.m16_request_draft_lengths import RejectReason

RATE_WINDOW = 10.0  # seconds of history behind the tokens/s gauge
LABELS = ("model_name", "engine")
# vLLM v1's buckets.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = (STOP, LENGTH, ABORT)
HTTP_LABELS = ("handler", "method", "status")
# prometheus-fastapi-instrumentator's default latency buckets (vLLM's server uses its defaults).
HTTP_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)


def process_collectors(registry: CollectorRegistry) -> None:
    """prometheus_client's process, platform and garbage-collector collectors, in ``registry``."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class HttpMetrics:
    """HTTP requests per endpoint, under the names vLLM's server exposes (``http_requests_total``,
    ``http_request_duration_seconds``), in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "http_requests", "Total number of requests by method, status and handler.", HTTP_LABELS, registry=registry
        )
        self.duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler.",
            HTTP_LABELS[:2],
            buckets=HTTP_BUCKETS,
            registry=registry,
        )

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request answered (any thread): ``handler`` its route's path template, ``status`` its code
        (counted as ``2xx``, ``4xx``, ...), ``seconds`` from its arrival to the last byte of its body."""
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.duration.labels(handler, method).observe(seconds)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServingMetrics:
    """The Prometheus metrics of one served model, in a registry of their own.

    ``model_name`` labels every vLLM and mechserve series; ``max_model_len`` (positions) bounds
    the token-count histograms' buckets.  ``observe_*`` are called by the engine thread;
    ``render`` and ``snapshot`` from anywhere.
    """

    def __init__(
        self,
        model_name: str = "",
        max_model_len: int | None = None,
        *,
        process: bool = True,
        engine: str = "0",
        http: bool = True,
    ) -> None:
        self.model_name = model_name
        self.engine = engine
        self.registry = CollectorRegistry()
        if process:
            process_collectors(self.registry)
        labels = (model_name, engine)
        tokens = buckets_1_2_5(max_model_len or 8192)
        self._families: dict[str, Any] = {}

        def family(kind: type, name: str, doc: str, extra: Sequence[str] = (), **kw: Any) -> Any:
            metric = kind(name, doc, [*LABELS, *extra], registry=self.registry, **kw)
            self._families[name] = metric
            return metric if extra else metric.labels(*labels)

        def gauge(name: str, doc: str) -> Any:
            return family(Gauge, name, doc)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Any:
            return family(Counter, name, doc, extra)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return family(Histogram, name, doc, buckets=buckets)

        self._labels = labels
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.kv_usage_old = gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name of vllm:kv_cache_usage_perc)."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", extra=("finished_reason",)
        )
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", extra=("position",)
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.tpot_old = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (vLLM's older name of vllm:inter_token_latency_seconds).",
            ITL_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS
        )
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS
        )
        self.pages_total = gauge("mechserve:kv_pages_total", "KV cache pages in the pool.")
        self.pages_free = gauge("mechserve:kv_pages_free", "KV cache pages on the free list.")
        self.pages_cached = gauge(
            "mechserve:kv_pages_cached", "KV cache pages owned by the prefix cache (unreferenced ones are evictable)."
        )
        self.pages_private = gauge("mechserve:kv_pages_private", "KV cache pages a request owns (not shared).")
        self.rejected = counter(
            "mechserve:request_rejected", "Requests refused at the door, by reason.", extra=("reason",)
        )
        self.steps = counter("mechserve:engine_steps", "Engine steps run.")
        self.http = HttpMetrics(self.registry) if http else None
        if self.http is not None:
            self._families["http_requests"] = self.http.requests
        for finish in FINISH_REASONS:  # present from the start, as in vLLM, so a dashboard finds every series
            self.success.labels(*labels, finish)
        for reject in RejectReason:
            self.rejected.labels(*labels, reject.value)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (time, generation tokens) per step
        self._started = time.perf_counter()
        rate = family(
            Gauge,
            "mechserve:generation_tokens_per_second",
            f"Generated tokens per second over the last {RATE_WINDOW:g} s.",
        )
        rate.set_function(self.tokens_per_second)

    # Fed by the engine thread -------------------------------------------------------------------------------------

    def observe_step(self, out: Any, now: float | None = None) -> None:
        """Count one engine step (a ``StepOutput``: its m14 record, the prompt tokens it admitted, its
        prefix-cache hits and the preemptions that dropped computed state)."""
        now = time.perf_counter() if now is None else now
        record = out.record
        generated = sum(len(ids) for ids in record.tokens.values())
        prompt_tokens = sum(out.prompt_tokens.values())
        self.steps.inc()
        self.generation_tokens.inc(generated)
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(out.prefix_hits)
        self.preemptions.inc(out.preemptions)
        executed = sum(record.executed.values())
        if executed:
            self.iteration_tokens.observe(executed)
        for rid, drafted in record.drafted.items():
            if drafted <= 0:
                continue
            accepted = record.accepted.get(rid, 0)
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(*self._labels, str(position)).inc()
        for _, reason in record.rejected:
            self.rejected.labels(*self._labels, reason.value).inc()
        with self._lock:
            self._recent.append((now, generated))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()

    def observe_engine(self, stats: Any) -> None:
        """The engine's state (an ``EngineStats``): requests running and waiting, pages by owner and in use."""
        pages = stats.pages
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.pages_total.set(pages.total)
        self.pages_free.set(pages.free)
        self.pages_cached.set(pages.cached)
        self.pages_private.set(pages.private)
        usage = pages.in_use / pages.total if pages.total else 0.0
        self.kv_usage.set(usage)
        self.kv_usage_old.set(usage)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: Iterable[float]) -> None:
        for s in seconds:
            self.itl.observe(s)
            self.tpot_old.observe(s)

    def observe_finished(self, output: Any, arrival: float, now: float, max_tokens: int | None = None) -> None:
        """One request ended (a ``RequestOutput``, submitted by its front end at ``arrival``, ended at ``now``;
        seconds of ``time.perf_counter()``): one finish per sample, its phases and token counts once."""
        m = output.metrics
        samples = output.outputs
        for sample, times in zip(samples, (*m.token_times, *([()] * len(samples)))):
            self.success.labels(*self._labels, sample.finish_reason or ABORT).inc()
            self.request_generation.observe(len(sample.token_ids))
            self.request_tpot.observe((times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0)
        self.e2e.observe(now - arrival)
        if m.scheduled_time is not None:
            self.queue_time.observe(max(m.scheduled_time - arrival, 0.0))
            self.inference_time.observe(now - m.scheduled_time)
        if m.prefill_time is not None:
            self.prefill_time.observe(m.prefill_time)
        if m.first_token_time is not None:
            self.decode_time.observe(now - m.first_token_time)
        self.request_prompt.observe(len(output.prompt_token_ids))
        self.request_max_generation.observe(max((len(s.token_ids) for s in samples), default=0))
        self.params_n.observe(len(samples))
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request answered (``HttpMetrics.observe``); nothing without ``http``."""
        if self.http is not None:
            self.http.observe(handler, method, status, seconds)

    async def refresh(self) -> None:
        """Nothing to fetch: the engine thread feeds these metrics (``FleetMetrics`` asks its replicas)."""

    # Read from anywhere -------------------------------------------------------------------------------------------

    def tokens_per_second(self, now: float | None = None) -> float:
        """Generation tokens per second over the last ``RATE_WINDOW`` seconds (or since start, if shorter)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            span = min(RATE_WINDOW, max(now - self._started, 1e-9))
            return sum(n for t, n in self._recent if t >= now - span) / span

    def value(self, name: str, **labels: str) -> float:
        """The value of one sample (``vllm:prompt_tokens_total``, ``..._count``), 0 if it has none yet."""
        found = self.registry.get_sample_value(name, {"model_name": self.model_name, "engine": self.engine, **labels})
        return 0.0 if found is None else found

    def by_label(self, family: str, label: str) -> dict[str, float]:
        """``label value -> count`` of a labelled counter (``vllm:request_success``, ``finished_reason``)."""
        out: dict[str, float] = {}
        for metric in self._families[family].collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and label in sample.labels:
                    out[sample.labels[label]] = sample.value
        return out

    def snapshot(self) -> dict[str, Any]:
        """The main values as a plain dict (tests, reports): counts as ints, rates as floats."""
        v = self.value
        queries, hits = v("vllm:prefix_cache_queries_total"), v("vllm:prefix_cache_hits_total")
        drafted, accepted = (
            v("vllm:spec_decode_num_draft_tokens_total"),
            v("vllm:spec_decode_num_accepted_tokens_total"),
        )
        counts = {
            "steps": v("mechserve:engine_steps_total"),
            "prompt_tokens": v("vllm:prompt_tokens_total"),
            "generation_tokens": v("vllm:generation_tokens_total"),
            "preemptions": v("vllm:num_preemptions_total"),
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "spec_decode_drafts": v("vllm:spec_decode_num_drafts_total"),
            "spec_decode_draft_tokens": drafted,
            "spec_decode_accepted_tokens": accepted,
            "running": v("vllm:num_requests_running"),
            "waiting": v("vllm:num_requests_waiting"),
            "pages_total": v("mechserve:kv_pages_total"),
            "pages_free": v("mechserve:kv_pages_free"),
            "pages_cached": v("mechserve:kv_pages_cached"),
            "pages_private": v("mechserve:kv_pages_private"),
            "ttft_count": v("vllm:time_to_first_token_seconds_count"),
            "itl_count": v("vllm:inter_token_latency_seconds_count"),
            "e2e_count": v("vllm:e2e_request_latency_seconds_count"),
        }
        return {
            **{k: int(x) for k, x in counts.items()},
            "kv_cache_usage": v("vllm:kv_cache_usage_perc"),
            "finished": {k: int(x) for k, x in self.by_label("vllm:request_success", "finished_reason").items() if x},
            "rejected": {k: int(x) for k, x in self.by_label("mechserve:request_rejected", "reason").items() if x},
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
            "generation_tokens_per_second": self.tokens_per_second(),
        }

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """``(body, content type)`` of every metric in the format ``accept`` asks for (an HTTP ``Accept``
        header: OpenMetrics if it asks for it, else Prometheus' text format)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type
