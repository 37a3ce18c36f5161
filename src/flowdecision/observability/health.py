"""Dispatch outcome counters and the health snapshot operators scrape."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "ERROR_WINDOW_S",
    "ErrorRate",
    "ErrorWindow",
    "HealthMetrics",
    "HealthSnapshot",
    "HealthStatus",
]

#: Span of the recent-error window behind :meth:`HealthMetrics.error_rate`.
ERROR_WINDOW_S = 60


class HealthStatus(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    """Point-in-time counters; field names and order are the seed's
    ``FlowDecisionHealthSnapshot``."""

    status: HealthStatus
    attempted: int
    claimed: int
    takeovers: int
    completed: int
    duplicates: int
    busy: int
    conflicts: int
    rejected: int
    lease_renewals: int
    lease_lost: int
    sink_failures: int
    ledger_failures: int
    failures: int
    cancellations: int
    in_flight: int
    average_dispatch_micros: int
    max_dispatch_micros: int
    last_success_at_ms: int | None
    last_failure_at_ms: int | None

    def to_dict(self) -> dict[str, Any]:
        """The seed's serde form (``status`` in snake_case, absent times as null)."""
        # Written out: ``dataclasses.asdict`` deep-copies field by field, and
        # /healthz builds this dict on every probe.
        return {
            "status": self.status.value,
            "attempted": self.attempted,
            "claimed": self.claimed,
            "takeovers": self.takeovers,
            "completed": self.completed,
            "duplicates": self.duplicates,
            "busy": self.busy,
            "conflicts": self.conflicts,
            "rejected": self.rejected,
            "lease_renewals": self.lease_renewals,
            "lease_lost": self.lease_lost,
            "sink_failures": self.sink_failures,
            "ledger_failures": self.ledger_failures,
            "failures": self.failures,
            "cancellations": self.cancellations,
            "in_flight": self.in_flight,
            "average_dispatch_micros": self.average_dispatch_micros,
            "max_dispatch_micros": self.max_dispatch_micros,
            "last_success_at_ms": self.last_success_at_ms,
            "last_failure_at_ms": self.last_failure_at_ms,
        }


@dataclass(frozen=True, slots=True)
class ErrorRate:
    """Dispatch outcomes over the last ``window_s`` seconds.

    ``failures`` are failures of the dispatcher's own parts (ledger, sink, lost
    lease, cancellation); ``dispatches`` also counts successes, duplicates and
    refusals of bad requests (busy, conflict, rejected), which are not failures.
    """

    window_s: int
    dispatches: int
    failures: int

    @property
    def rate(self) -> float:
        """``failures / dispatches`` (0.0 without dispatches)."""
        return self.failures / self.dispatches if self.dispatches else 0.0


class ErrorWindow:
    """Counts outcomes in one-second buckets and forgets those older than ``window_s``."""

    __slots__ = ("_buckets", "_clock", "window_s")

    def __init__(
        self, window_s: int = ERROR_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        # [second, dispatches, failures], oldest first; at most window_s entries.
        self._buckets: deque[list[int]] = deque()

    def _trim(self, now: int) -> None:
        buckets = self._buckets
        while buckets and buckets[0][0] <= now - self.window_s:
            buckets.popleft()

    def record(self, *, failed: bool) -> None:
        now = int(self._clock())
        buckets = self._buckets
        if not buckets or buckets[-1][0] != now:
            self._trim(now)
            buckets.append([now, 0, 0])
        bucket = buckets[-1]
        bucket[1] += 1
        bucket[2] += failed

    def rate(self) -> ErrorRate:
        self._trim(int(self._clock()))
        return ErrorRate(
            window_s=self.window_s,
            dispatches=sum(bucket[1] for bucket in self._buckets),
            failures=sum(bucket[2] for bucket in self._buckets),
        )


class HealthMetrics:
    """Mutable counters behind :class:`HealthSnapshot`.

    Only touched from the event loop thread, so plain ints are enough.
    """

    __slots__ = (
        "attempted",
        "busy",
        "cancellations",
        "claimed",
        "completed",
        "conflicts",
        "degraded",
        "duplicates",
        "failures",
        "in_flight",
        "last_failure_at_ms",
        "last_success_at_ms",
        "lease_lost",
        "lease_renewals",
        "ledger_failures",
        "max_dispatch_micros",
        "rejected",
        "sink_failures",
        "takeovers",
        "total_dispatch_micros",
        "window",
    )

    def __init__(self) -> None:
        self.attempted = self.claimed = self.takeovers = self.completed = 0
        self.duplicates = self.busy = self.conflicts = self.rejected = 0
        self.lease_renewals = self.lease_lost = self.sink_failures = 0
        self.ledger_failures = self.failures = self.cancellations = self.in_flight = 0
        self.total_dispatch_micros = self.max_dispatch_micros = 0
        self.last_success_at_ms = self.last_failure_at_ms = 0
        self.degraded = False
        self.window = ErrorWindow()

    def record_elapsed(self, micros: int) -> None:
        self.total_dispatch_micros += micros
        if micros > self.max_dispatch_micros:
            self.max_dispatch_micros = micros

    def record_success(self, *, duplicate: bool) -> None:
        """A completion or a duplicate: both clear the degraded flag."""
        if duplicate:
            self.duplicates += 1
        else:
            self.completed += 1
        self.degraded = False
        self.last_success_at_ms = time.time_ns() // 1_000_000
        self.window.record(failed=False)

    def record_refusal(self) -> None:
        """A request refused for itself (busy, conflict, rejected): no failure, no success."""
        self.window.record(failed=False)

    def record_failure(self) -> None:
        """Lost leases, ledger and sink failures, cancellations: set degraded."""
        self.failures += 1
        self.degraded = True
        self.last_failure_at_ms = time.time_ns() // 1_000_000
        self.window.record(failed=True)

    def error_rate(self) -> ErrorRate:
        """Failures among the dispatches of the last :data:`ERROR_WINDOW_S` seconds."""
        return self.window.rate()

    def snapshot(self) -> HealthSnapshot:
        attempted = self.attempted
        return HealthSnapshot(
            status=HealthStatus.DEGRADED if self.degraded else HealthStatus.HEALTHY,
            attempted=attempted,
            claimed=self.claimed,
            takeovers=self.takeovers,
            completed=self.completed,
            duplicates=self.duplicates,
            busy=self.busy,
            conflicts=self.conflicts,
            rejected=self.rejected,
            lease_renewals=self.lease_renewals,
            lease_lost=self.lease_lost,
            sink_failures=self.sink_failures,
            ledger_failures=self.ledger_failures,
            failures=self.failures,
            cancellations=self.cancellations,
            in_flight=self.in_flight,
            average_dispatch_micros=self.total_dispatch_micros // attempted if attempted else 0,
            max_dispatch_micros=self.max_dispatch_micros,
            last_success_at_ms=self.last_success_at_ms or None,
            last_failure_at_ms=self.last_failure_at_ms or None,
        )
