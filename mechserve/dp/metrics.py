"""The API server's ``/metrics`` over data-parallel replicas: each replica's series under vLLM's ``engine`` label.

Every replica keeps its own ``ServingMetrics`` (``engine="0"``, ``"1"``, ...: the engine gauges,
counters and histograms, fed by its engine thread as in one process).  ``FleetMetrics`` holds the API
server's own series (HTTP requests, the process) and, on each scrape, the families every live replica
answered to a ``Query("metrics")`` (``refresh``), joined family by family, as vLLM's API server shows its
DP engines' series side by side.  A replica that is down keeps its last counters and histograms (what it
did; counters never go back) but not its gauges (``down``): ``vllm:num_requests_running`` and the KV usage of
a process that is gone would report work that no longer exists.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mechserve.dp.wire import Family
from mechserve.entrypoints.metrics import HttpMetrics, process_collectors


class _Replicas(Collector):
    """A prometheus_client collector: the replicas' latest families, one family per name."""

    def __init__(self, size: int) -> None:
        self.latest: list[Sequence[Family]] = [() for _ in range(size)]

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for families in self.latest:
            for f in families:
                metric = merged.get(f.name)
                if metric is None:
                    metric = merged[f.name] = Metric(f.name, f.documentation, f.type, f.unit)
                for s in f.samples:
                    metric.add_sample(s.name, s.labels, s.value)
        return list(merged.values())


class FleetMetrics:
    """The metrics of ``size`` replicas serving ``model_name``: ``render`` after ``refresh``; ``observe_http``
    for the server's middleware.  ``refresher`` (set by ``DataParallelLLM``) asks the replicas."""

    def __init__(self, model_name: str, size: int) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        process_collectors(self.registry)
        self.http = HttpMetrics(self.registry)
        self._replicas = _Replicas(size)
        self.registry.register(self._replicas)
        self.refresher: Callable[[], Awaitable[None]] | None = None

    def update(self, index: int, families: Sequence[Family]) -> None:
        """Replica ``index``'s families as it answered them now."""
        self._replicas.latest[index] = families

    def down(self, index: int) -> None:
        """Replica ``index`` is down: keep its counters and histograms as last answered, drop its gauges (its
        running and waiting requests and its pages went with its process)."""
        latest = self._replicas.latest
        latest[index] = [f for f in latest[index] if f.type != "gauge"]

    async def refresh(self) -> None:
        """Ask every live replica for its families (``refresher``)."""
        if self.refresher is not None:
            await self.refresher()

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.http.observe(handler, method, status, seconds)

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples over every replica whose labels include ``labels`` (0 if none)."""
        total = 0.0
        for families in self._replicas.latest:
            for f in families:
                for s in f.samples:
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                        total += s.value
        return total

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """``(body, content type)`` as ``ServingMetrics.render``: the server's series and every replica's."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type
