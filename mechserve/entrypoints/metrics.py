"""Serving metrics in Prometheus' text format, from step records and request timings (standard library only).

The engine thread feeds ``ServingMetrics`` after every step (``observe_step``)
and at every request event (``observe_ttft``, ``observe_itl``,
``observe_finished``); ``render`` may be called from any thread.  Names
follow vLLM's (``vllm:time_to_first_token_seconds`` becomes
``mechserve:time_to_first_token_seconds``), buckets too::

    counters    prompt/generation tokens, preemptions, prefix-cache queries/hits (tokens),
                spec-decode drafted/accepted tokens, requests finished (by reason) and rejected (by reason)
    gauges      running/waiting requests, KV pages used/free/cached/total, prefix-cache hit rate,
                spec acceptance rate, generation tokens/s over the last ``RATE_WINDOW`` seconds
    histograms  time to first token, inter-token latency, end-to-end latency (seconds)

The prefix-cache hit rate is reused prompt tokens over the prompt tokens of
admitted requests; a request preempted and recomputed is not counted again.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PREFIX = "mechserve:"
RATE_WINDOW = 10.0  # seconds of history behind the tokens/s gauge
# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class Histogram:
    """A cumulative Prometheus histogram with fixed upper bounds (``+Inf`` is implied)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The ``_bucket`` (cumulative), ``_sum`` and ``_count`` samples."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else _number(bound)
            out.append(f'{name}_bucket{{{labels}{"," if labels else ""}le="{le}"}} {running}')
        suffix = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{suffix} {_number(self.sum)}", f"{name}_count{suffix} {self.count}"]


class ServingMetrics:
    """Counters, gauges and histograms of one served model; thread-safe (one lock)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()  # by finish reason
        self.rejected: Counter[str] = Counter()  # by door reason
        self.gauges: dict[str, float] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._recent: deque[tuple[float, int]] = deque()  # (time, generation tokens) per step
        self._started = time.perf_counter()

    # Fed by the engine thread -------------------------------------------------------------------------------------

    def observe_step(self, out: Any, now: float | None = None) -> None:
        """Count one engine step (a ``StepOutput``: its m13 record, the prompt tokens it admitted, its
        prefix-cache hits and the preemptions that dropped computed state)."""
        now = time.perf_counter() if now is None else now
        record = out.record
        generated = sum(len(ids) for ids in record.tokens.values())
        prompt_tokens = sum(out.prompt_tokens.values())
        with self._lock:
            c = self.counters
            c["steps"] += 1
            c["generation_tokens"] += generated
            c["prompt_tokens"] += prompt_tokens
            c["preemptions"] += out.preemptions
            c["prefix_cache_queries"] += prompt_tokens
            c["prefix_cache_hits"] += out.prefix_hits
            c["spec_decode_draft_tokens"] += sum(record.drafted.values())
            c["spec_decode_accepted_tokens"] += sum(record.accepted.values())
            for _, reason in record.rejected:
                self.rejected[reason.value] += 1
            self._recent.append((now, generated))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()

    def observe_engine(self, stats: Any) -> None:
        """The engine's state (an ``EngineStats``): requests running and waiting, pages by owner."""
        pages = stats.pages
        self.set_gauges(
            {
                "running": stats.running,
                "waiting": stats.waiting,
                "pages_total": pages.total,
                "pages_free": pages.free,
                "pages_cached": pages.cached,
                "pages_used": pages.private,
            }
        )

    def set_gauges(self, gauges: Mapping[str, float]) -> None:
        with self._lock:
            self.gauges.update(gauges)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: Iterable[float]) -> None:
        with self._lock:
            for s in seconds:
                self.itl.observe(s)

    def observe_finished(self, finish_reasons: Iterable[str | None], e2e: float) -> None:
        """One request ended: one count per sample's finish reason, one end-to-end latency."""
        with self._lock:
            for reason in finish_reasons:
                self.finished[reason or "unknown"] += 1
            self.e2e.observe(e2e)

    # Read from anywhere -------------------------------------------------------------------------------------------

    def tokens_per_second(self, now: float | None = None) -> float:
        """Generation tokens per second over the last ``RATE_WINDOW`` seconds (or since start, if shorter)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            span = min(RATE_WINDOW, max(now - self._started, 1e-9))
            return sum(n for t, n in self._recent if t >= now - span) / span

    def snapshot(self) -> dict[str, Any]:
        """Every value as a plain dict (for tests and ``--json`` reports)."""
        rate = self.tokens_per_second()
        with self._lock:
            c = self.counters
            return {
                **dict(c),
                **self.gauges,
                "finished": dict(self.finished),
                "rejected": dict(self.rejected),
                "prefix_cache_hit_rate": _ratio(c["prefix_cache_hits"], c["prefix_cache_queries"]),
                "spec_decode_acceptance_rate": _ratio(c["spec_decode_accepted_tokens"], c["spec_decode_draft_tokens"]),
                "generation_tokens_per_second": rate,
                "ttft_count": self.ttft.count,
                "itl_count": self.itl.count,
            }

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        snap = self.snapshot()
        label = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            out.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}", *samples])

        def one(name: str, kind: str, help_text: str, value: float) -> None:
            metric(name, kind, help_text, [f"{PREFIX}{name}{{{label}}} {_number(value)}"])

        for name, key, help_text in _GAUGES:
            one(name, "gauge", help_text, snap.get(key, 0))
        one(
            "prefix_cache_hit_rate",
            "gauge",
            "Reused prompt tokens / prompt tokens admitted.",
            snap["prefix_cache_hit_rate"],
        )
        one(
            "spec_decode_acceptance_rate",
            "gauge",
            "Accepted / drafted speculative tokens.",
            snap["spec_decode_acceptance_rate"],
        )
        one(
            "generation_tokens_per_second",
            "gauge",
            f"Generated tokens per second over the last {RATE_WINDOW:g} s.",
            snap["generation_tokens_per_second"],
        )
        for name, key, help_text in _COUNTERS:
            one(f"{name}_total", "counter", help_text, snap.get(key, 0))
        for name, counts, key, help_text in (
            ("request_success", snap["finished"], "finished_reason", "Requests' samples ended, by finish reason."),
            ("request_rejected", snap["rejected"], "reason", "Requests refused at the door, by reason."),
        ):
            samples = [f'{PREFIX}{name}_total{{{label},{key}="{_escape(k)}"}} {v}' for k, v in sorted(counts.items())]
            metric(f"{name}_total", "counter", help_text, samples)
        with self._lock:
            for name, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Time from submission to the first token."),
                ("inter_token_latency_seconds", self.itl, "Time between two steps that gave a sample tokens."),
                ("e2e_request_latency_seconds", self.e2e, "Time from submission to the end of the request."),
            ):
                metric(name, "histogram", help_text, hist.lines(PREFIX + name, label))
        return "\n".join(out) + "\n"


_GAUGES = (
    ("num_requests_running", "running", "Requests running (admitted, including preempted ones)."),
    ("num_requests_waiting", "waiting", "Requests accepted and waiting to be admitted."),
    ("kv_pages_total", "pages_total", "KV cache pages in the pool."),
    ("kv_pages_used", "pages_used", "KV cache pages owned by running requests."),
    ("kv_pages_free", "pages_free", "KV cache pages on the free list."),
    ("kv_pages_cached", "pages_cached", "KV cache pages owned by the prefix cache (unreferenced ones are evictable)."),
)
_COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("generation_tokens", "generation_tokens", "Generated tokens."),
    ("num_preemptions", "preemptions", "Requests preempted (their computed state dropped, to be recomputed)."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    ("spec_decode_num_draft_tokens", "spec_decode_draft_tokens", "Speculative tokens drafted."),
    ("spec_decode_num_accepted_tokens", "spec_decode_accepted_tokens", "Speculative tokens accepted."),
    ("engine_steps", "steps", "Engine steps run."),
)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
