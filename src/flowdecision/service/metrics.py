"""Prometheus metrics: one private :class:`CollectorRegistry` per app.

* every :class:`~flowdecision.observability.health.HealthSnapshot` counter, read at scrape
  time, as ``flowdecision_dispatch_<name>_total``;
* ``flowdecision_dispatch_in_flight`` and ``flowdecision_healthy`` gauges, the
  last success/failure times, and the dispatcher's max dispatch time;
* ``flowdecision_dispatch_duration_seconds{outcome}``, a histogram of
  ``POST /v1/decisions`` dispatch latency by outcome;
* the outbox's relay cursors (``flowdecision_relay_lag_rows{relay}``,
  ``..._lag_seconds``, ``..._position``, ``..._delivered_rows``, ``..._leased``,
  ``..._parked_rows``, ``..._held_rows``, ``..._parked_oldest_seconds``),
  read from the outbox's store at scrape time (at most once a second), so
  relays running elsewhere show too;
* ``flowdecision_relay_state{relay,state}``: the in-service relay's state;
* approval holds: ``flowdecision_held_decisions`` and
  ``flowdecision_held_oldest_seconds``, read from the ledger at scrape time
  (at most once a second, like the cursors), and
  ``flowdecision_hold_notifications_total{result}`` (``sent``, ``failed``,
  ``dropped``: the webhook told of new holds, ``hold_notify_url``);
* ``flowdecision_http_requests_total{method,route,status}``; a client that
  disconnected before its answer is counted with status ``499``.

Several workers (``serve --workers N``) run prometheus_client's multiprocess
mode: the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` to a directory of its
own for the run, every worker's metrics live in files there, and ``/metrics``
from any worker shows the totals of all of them (counters of a worker that
exited included). The dispatcher's health counters are kept in each process's
memory; in that mode each worker publishes them to the shared files once a
second and before it answers a scrape, so another worker's share of a total
is at most a second old. Gauges: ``in_flight`` is the sum over live workers,
``healthy`` the minimum (0 if any live worker is degraded), the maximum and
timestamps the maximum.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client import values as _values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ..observability.health import HealthMetrics, HealthSnapshot
from ..sinks.cursor import CursorState
from ..sinks.relay import RelayStatus

__all__ = [
    "CONTENT_TYPE_LATEST",
    "HEALTH_COUNTERS",
    "HOLD_GAUGES",
    "MULTIPROC_ENV",
    "HoldFigures",
    "ServiceMetrics",
    "multiprocess_dir",
]

#: prometheus_client's variable naming the directory of multiprocess mode's files.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The shared metrics directory if this process runs in multiprocess mode, else None.

    prometheus_client picks its value storage when it is first imported, so
    the variable only counts if it was set by then (the supervisor sets it
    before it starts the workers).
    """
    path = os.environ.get(MULTIPROC_ENV)
    if path and _values.ValueClass is not _values.MutexValue:
        return path
    return None


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

#: Labelled request counters cached per (method, route, status), at most this many.
_CHILD_CACHE_MAX = 1024

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


_GAUGE_HELP = {
    "in_flight": "Dispatches in progress.",
    "healthy": "1 while /healthz says healthy, 0 while degraded (from the last probes).",
    "max_seconds": "Longest dispatch since start.",
    "last_success": "Unix time of the last completion or duplicate (0 if none).",
    "last_failure": "Unix time of the last failed dispatch (0 if none).",
}


def _gauge_values(snap: HealthSnapshot, healthy: bool) -> dict[str, tuple[str, float]]:
    """The health gauges: key -> (metric name, value)."""
    return {
        "in_flight": ("flowdecision_dispatch_in_flight", snap.in_flight),
        "healthy": ("flowdecision_healthy", 1 if healthy else 0),
        "max_seconds": ("flowdecision_dispatch_max_seconds", snap.max_dispatch_micros / 1e6),
        "last_success": (
            "flowdecision_last_success_timestamp_seconds",
            (snap.last_success_at_ms or 0) / 1000,
        ),
        "last_failure": (
            "flowdecision_last_failure_timestamp_seconds",
            (snap.last_failure_at_ms or 0) / 1000,
        ),
    }


_GaugeMode = Literal["livesum", "livemin", "max"]

#: How each health gauge combines across workers in multiprocess mode.
_GAUGE_MODES: dict[str, _GaugeMode] = {
    "in_flight": "livesum",
    "healthy": "livemin",
    "max_seconds": "max",
    "last_success": "max",
    "last_failure": "max",
}


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
        for key, (name, value) in _gauge_values(snap, self._healthy()).items():
            yield GaugeMetricFamily(name, _GAUGE_HELP[key], value=value)


class _SharedHealth:
    """The health metrics in multiprocess mode: published to the shared files."""

    def __init__(
        self,
        snapshot: Callable[[], HealthSnapshot | None],
        healthy: Callable[[], bool],
        registry: CollectorRegistry,
    ) -> None:
        self._snapshot = snapshot
        self._healthy = healthy
        self._counters = {
            name: Counter(f"flowdecision_dispatch_{name}", help_text, registry=registry)
            for name, help_text in HEALTH_COUNTERS.items()
        }
        self._published = dict.fromkeys(HEALTH_COUNTERS, 0)
        snap = HealthMetrics().snapshot()
        self._gauges = {
            key: Gauge(
                name, _GAUGE_HELP[key], registry=registry, multiprocess_mode=_GAUGE_MODES[key]
            )
            for key, (name, _value) in _gauge_values(snap, True).items()
        }

    def publish(self) -> None:
        """Write this process's current counts and gauges to the shared files."""
        snap = self._snapshot() or HealthMetrics().snapshot()
        for name, counter in self._counters.items():
            value = getattr(snap, name)
            delta = value - self._published[name]
            if delta > 0:  # counters only grow; a restarted worker starts a new file
                counter.inc(delta)
                self._published[name] = value
        for key, (_name, value) in _gauge_values(snap, self._healthy()).items():
            self._gauges[key].set(value)


#: The outbox's relay cursors, labelled by relay name: key -> (metric name, help).
RELAY_GAUGES: dict[str, tuple[str, str]] = {
    "lag_rows": (
        "flowdecision_relay_lag_rows",
        "Outbox rows after the relay's cursor (newest seq - cursor).",
    ),
    "lag_seconds": (
        "flowdecision_relay_lag_seconds",
        "Age of the oldest outbox row the relay has not delivered (0 when caught up).",
    ),
    "position": (
        "flowdecision_relay_position",
        "The relay's cursor: the seq of the last row its sink accepted.",
    ),
    "delivered": (
        "flowdecision_relay_delivered_rows",
        "Rows delivered through the relay's cursor since it was created.",
    ),
    "leased": ("flowdecision_relay_leased", "1 while a running relay holds the cursor's lease."),
    "parked_rows": (
        "flowdecision_relay_parked_rows",
        "Outbox rows the relay parked: its sink refused them; they wait for an operator.",
    ),
    "held_rows": (
        "flowdecision_relay_held_rows",
        "Outbox rows held behind a parked row of their run (delivered once it is "
        "retried or skipped).",
    ),
    "parked_seconds": (
        "flowdecision_relay_parked_oldest_seconds",
        "Age of the oldest row the relay parked (0 when none is).",
    ),
}
#: The in-service relay (``serve --relay-to``): 1 for the state it is in, by state.
RELAY_STATE = (
    "flowdecision_relay_state",
    "The in-service relay's state (1 for the current one): delivering, idle, retrying, "
    "backing_off (its sink looks down), opening (its sink cannot be opened yet), "
    "waiting_for_lease, starting or stopped.",
)
RELAY_STATES = (
    "starting",
    "opening",
    "waiting_for_lease",
    "delivering",
    "idle",
    "retrying",
    "backing_off",
    "stopped",
)


#: Approval holds, read from the ledger: key -> (metric name, help).
HOLD_GAUGES: dict[str, tuple[str, str]] = {
    "count": ("flowdecision_held_decisions", "Decisions held for an operator's approval."),
    "oldest": (
        "flowdecision_held_oldest_seconds",
        "How long the oldest held decision has waited for approval (0 when none is).",
    ),
}
#: ``(held decisions, the oldest one's wait in seconds)``, or None before the first read.
HoldFigures = tuple[int, float]


class _HoldsCollector(Collector):
    def __init__(self, holds: Callable[[], HoldFigures | None]) -> None:
        self._holds = holds

    def collect(self) -> Iterator[Metric]:
        figures = self._holds()
        if figures is None:
            return
        for (name, help_text), value in zip(HOLD_GAUGES.values(), figures, strict=True):
            yield GaugeMetricFamily(name, help_text, value=value)


def _relay_values(state: CursorState) -> dict[str, float]:
    return {
        "lag_rows": state.lag_rows,
        "lag_seconds": state.lag_seconds,
        "position": state.position,
        "delivered": state.delivered,
        "leased": 1 if state.leased else 0,
        "parked_rows": state.parked_rows,
        "held_rows": state.held_rows,
        "parked_seconds": state.parked_seconds,
    }


def _state_values(own: RelayStatus | None) -> list[tuple[str, str, float]]:
    """``(relay, state, 1 or 0)`` for every state of the in-service relay (none without)."""
    if own is None:
        return []
    return [(own.name, state, 1.0 if own.state == state else 0.0) for state in RELAY_STATES]


class _RelayCollector(Collector):
    def __init__(
        self,
        cursors: Callable[[], Sequence[CursorState]],
        own_relay: Callable[[], RelayStatus | None],
    ) -> None:
        self._cursors = cursors
        self._own_relay = own_relay

    def collect(self) -> Iterator[Metric]:
        states = list(self._cursors())
        for key, (name, help_text) in RELAY_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["relay"])
            for state in states:
                family.add_metric([state.name], _relay_values(state)[key])
            yield family
        own = GaugeMetricFamily(*RELAY_STATE, labels=["relay", "state"])
        for relay, relay_state, value in _state_values(self._own_relay()):
            own.add_metric([relay, relay_state], value)
        yield own


class ServiceMetrics:
    """The app's registry and the metrics the app itself records."""

    def __init__(
        self,
        snapshot: Callable[[], HealthSnapshot | None],
        *,
        healthy: Callable[[], bool] = lambda: True,
        cursors: Callable[[], Sequence[CursorState]] = lambda: (),
        own_relay: Callable[[], RelayStatus | None] = lambda: None,
        holds: Callable[[], HoldFigures | None] = lambda: None,
    ) -> None:
        #: The shared directory in multiprocess mode (several workers), else None.
        self.shared_dir = multiprocess_dir()
        own = self.registry = CollectorRegistry(auto_describe=True)
        self._shared_health: _SharedHealth | None = None
        self._cursors = cursors
        self._own_relay = own_relay
        self._holds = holds
        self._relay_gauges: dict[str, Gauge] = {}
        self._relay_state: Gauge | None = None
        self._hold_gauges: dict[str, Gauge] = {}
        if self.shared_dir is None:
            self.registry.register(_HealthCollector(snapshot, healthy))
            self.registry.register(_RelayCollector(cursors, own_relay))
            self.registry.register(_HoldsCollector(holds))
        else:
            # Metrics write to the shared files whatever registry holds them; a
            # scrape reads every worker's files instead of this process's values.
            own = CollectorRegistry()
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry, path=self.shared_dir)  # type: ignore[no-untyped-call]
            self._shared_health = _SharedHealth(snapshot, healthy, own)
            # Every worker reads the same cursor table: the freshest (largest) value wins.
            self._relay_gauges = {
                key: Gauge(name, help_text, ["relay"], registry=own, multiprocess_mode="max")
                for key, (name, help_text) in RELAY_GAUGES.items()
            }
            self._relay_state = Gauge(
                *RELAY_STATE, ["relay", "state"], registry=own, multiprocess_mode="max"
            )
            # Every worker reads the same ledger: the freshest (largest) value wins too.
            self._hold_gauges = {
                key: Gauge(name, help_text, registry=own, multiprocess_mode="max")
                for key, (name, help_text) in HOLD_GAUGES.items()
            }
        self.dispatch_seconds = Histogram(
            "flowdecision_dispatch_duration_seconds",
            "Latency of POST /v1/decisions dispatches, by outcome.",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.http_requests = Counter(
            "flowdecision_http_requests",
            "HTTP requests served, by method, route template and status.",
            ["method", "route", "status"],
            registry=own,
        )
        self.hold_notifications = Counter(
            "flowdecision_hold_notifications",
            "Notifications of new approval holds to hold_notify_url, by result: sent, "
            "failed (after the webhook retries) or dropped (the queue was full).",
            ["result"],
            registry=own,
        )
        self._request_children: dict[tuple[str, str, int], Counter] = {}
        self._dispatch_children: dict[str, Histogram] = {}

    def observe_dispatch(self, outcome: str, seconds: float) -> None:
        child = self._dispatch_children.get(outcome)
        if child is None:  # outcomes are the service's own codes: a small fixed set
            child = self._dispatch_children[outcome] = self.dispatch_seconds.labels(outcome)
        child.observe(seconds)

    def count_request(self, method: str, route: str, status: int) -> None:
        key = (method, route, status)
        child = self._request_children.get(key)
        if child is None:
            # ``labels()`` builds and validates a key and takes a lock on every call;
            # the labelled child is cached instead (bounded: the method is the client's).
            child = self.http_requests.labels(method, route, str(status))
            if len(self._request_children) < _CHILD_CACHE_MAX:
                self._request_children[key] = child
        child.inc()

    def publish(self) -> None:
        """In multiprocess mode, write the health counters to the shared files (else no-op)."""
        if self._shared_health is not None:
            self._shared_health.publish()
            for state in self._cursors():
                for key, value in _relay_values(state).items():
                    self._relay_gauges[key].labels(state.name).set(value)
            if self._relay_state is not None:
                for relay, relay_state, value in _state_values(self._own_relay()):
                    self._relay_state.labels(relay, relay_state).set(value)
            figures = self._holds()
            if figures is not None:
                for gauge, value in zip(self._hold_gauges.values(), figures, strict=True):
                    gauge.set(value)

    def exposition(self) -> bytes:
        self.publish()  # this worker's share is exact; the others' at most a second old
        return bytes(_generate_latest(self.registry))
