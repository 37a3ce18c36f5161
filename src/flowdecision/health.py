"""Dispatch outcome counters and the health snapshot operators scrape."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

__all__ = ["HealthMetrics", "HealthSnapshot", "HealthStatus"]


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
        out = asdict(self)
        out["status"] = self.status.value
        return out


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
    )

    def __init__(self) -> None:
        self.attempted = self.claimed = self.takeovers = self.completed = 0
        self.duplicates = self.busy = self.conflicts = self.rejected = 0
        self.lease_renewals = self.lease_lost = self.sink_failures = 0
        self.ledger_failures = self.failures = self.cancellations = self.in_flight = 0
        self.total_dispatch_micros = self.max_dispatch_micros = 0
        self.last_success_at_ms = self.last_failure_at_ms = 0
        self.degraded = False

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

    def record_failure(self) -> None:
        """Lost leases, ledger and sink failures, cancellations: set degraded."""
        self.failures += 1
        self.degraded = True
        self.last_failure_at_ms = time.time_ns() // 1_000_000

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
