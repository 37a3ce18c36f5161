"""Prometheus metrics: one private :class:`CollectorRegistry` per app.

* every :class:`~flowdecision.health.HealthSnapshot` counter, read at scrape
  time, as ``flowdecision_dispatch_<name>_total``;
* ``flowdecision_dispatch_in_flight`` and ``flowdecision_healthy`` gauges, the
  last success/failure times, and the dispatcher's max dispatch time;
* ``flowdecision_dispatch_duration_seconds{outcome}``, a histogram of
  ``POST /v1/decisions`` dispatch latency by outcome;
* ``flowdecision_http_requests_total{method,route,status}``; a client that
  disconnected before its answer is counted with status ``499``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..health import HealthMetrics, HealthSnapshot

__all__ = ["CONTENT_TYPE_LATEST", "HEALTH_COUNTERS", "ServiceMetrics"]

#: Snapshot fields exported as counters, with their help text.
HEALTH_COUNTERS: dict[str, str] = {
    "attempted": "Dispatches started.",
    "claimed": "Claims won (new claims and takeovers).",
    "takeovers": "Claims won on an expired or released lease (attempt > 1).",
    "completed": "Decisions accepted by the sink and completed in the ledger.",
    "duplicates": "Dispatches of already-completed decisions (not resubmitted).",
    "busy": "Dispatches refused because another owner holds a live lease.",
    "conflicts": "Dispatches refused because the id is bound to different content.",
    "rejected": "Dispatches refused for a non-production branch or an empty id.",
    "lease_renewals": "Lease renewals while a sink ran.",
    "lease_lost": "Dispatches cancelled because the lease could not be renewed.",
    "sink_failures": "Dispatches whose sink raised.",
    "ledger_failures": "Dispatches whose ledger failed.",
    "failures": "Failed dispatches (lease lost, ledger, sink, cancellation).",
    "cancellations": "Dispatches cancelled from outside.",
}

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class _HealthCollector(Collector):
    def __init__(
        self, snapshot: Callable[[], HealthSnapshot | None], healthy: Callable[[], bool]
    ) -> None:
        self._snapshot = snapshot
        self._healthy = healthy

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot() or HealthMetrics().snapshot()
        for name, help_text in HEALTH_COUNTERS.items():
            yield CounterMetricFamily(
                f"flowdecision_dispatch_{name}", help_text, value=getattr(snap, name)
            )
        yield GaugeMetricFamily(
            "flowdecision_dispatch_in_flight", "Dispatches in progress.", value=snap.in_flight
        )
        yield GaugeMetricFamily(
            "flowdecision_healthy",
            "1 while /healthz says healthy, 0 while degraded (from the last probes).",
            value=1 if self._healthy() else 0,
        )
        yield GaugeMetricFamily(
            "flowdecision_dispatch_max_seconds",
            "Longest dispatch since start.",
            value=snap.max_dispatch_micros / 1e6,
        )
        yield GaugeMetricFamily(
            "flowdecision_last_success_timestamp_seconds",
            "Unix time of the last completion or duplicate (0 if none).",
            value=(snap.last_success_at_ms or 0) / 1000,
        )
        yield GaugeMetricFamily(
            "flowdecision_last_failure_timestamp_seconds",
            "Unix time of the last failed dispatch (0 if none).",
            value=(snap.last_failure_at_ms or 0) / 1000,
        )


class ServiceMetrics:
    """The app's registry and the metrics the app itself records."""

    def __init__(
        self,
        snapshot: Callable[[], HealthSnapshot | None],
        *,
        healthy: Callable[[], bool] = lambda: True,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_HealthCollector(snapshot, healthy))
        self.dispatch_seconds = Histogram(
            "flowdecision_dispatch_duration_seconds",
            "Latency of POST /v1/decisions dispatches, by outcome.",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http_requests = Counter(
            "flowdecision_http_requests",
            "HTTP requests served, by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )

    def observe_dispatch(self, outcome: str, seconds: float) -> None:
        self.dispatch_seconds.labels(outcome).observe(seconds)

    def count_request(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(method, route, str(status)).inc()

    def exposition(self) -> bytes:
        return bytes(_generate_latest(self.registry))
