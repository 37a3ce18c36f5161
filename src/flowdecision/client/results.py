"""What the client's calls return: frozen dataclasses, one per answer of the service.

:class:`SubmitResult` (``POST /v1/decisions``), :class:`DecisionState`
(``GET /v1/decisions/{id}``), :class:`ServiceHealth` (``GET /healthz``) and
:class:`OutboxPage` of :class:`OutboxItem` (``GET /v1/outbox``). They are built
from the answers in :mod:`.decode`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..identity import ExecutionIdentity, ResultReceipt
from ..model import DecisionRequest

__all__ = [
    "DecisionState",
    "OutboxItem",
    "OutboxPage",
    "Outcome",
    "ServiceHealth",
    "SubmitResult",
]


class Outcome(StrEnum):
    """What became of a submitted decision. Both mean the decision is in."""

    SUBMITTED = "submitted"  # this request's dispatch handed it to the sink (201)
    DUPLICATE = "duplicate"  # it was already completed; nothing was submitted again (200)


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """The answer to ``submit``: 201 ``submitted`` or 200 ``duplicate``."""

    outcome: Outcome
    decision_id: str
    #: The claim's fencing token: 1 for the first claim, higher after a release or takeover.
    attempt: int | None
    #: The digest-only result receipt (the stored one for a duplicate).
    receipt: ResultReceipt | None
    #: The service's ``X-Request-Id`` for the answering request (for its logs).
    request_id: str | None
    #: HTTP requests this call made (1 without retries).
    tries: int = 1

    @property
    def submitted(self) -> bool:
        """True when this call's dispatch submitted the decision to the sink."""
        return self.outcome is Outcome.SUBMITTED


@dataclass(frozen=True, slots=True)
class DecisionState:
    """``GET /v1/decisions/{id}``: the claim record (never its owner)."""

    decision_id: str
    state: str  # "pending" or "completed" (a newer service may add states)
    attempts: int
    request_hash: str
    lease_expires_at_ms: int | None
    completed_at_ms: int | None
    execution_identity: ExecutionIdentity | None
    receipt: ResultReceipt | None
    request_id: str | None

    @property
    def completed(self) -> bool:
        return self.state == "completed"


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    """``GET /healthz``: ``healthy`` (HTTP 200) or ``degraded`` (HTTP 503), with every counter."""

    status: str
    #: The whole snapshot as the service sent it (counters, timings, and any newer members).
    snapshot: Mapping[str, Any]
    request_id: str | None

    @property
    def healthy(self) -> bool:
        return self.status == "healthy"


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One accepted decision in the outbox, in commit order."""

    seq: int
    decision_id: str
    request_hash: str
    first_attempt: int
    highest_attempt: int
    accepted_at_ms: int
    request: DecisionRequest


@dataclass(frozen=True, slots=True)
class OutboxPage:
    """``GET /v1/outbox``: ask again with ``after=next_after`` while ``has_more``."""

    entries: tuple[OutboxItem, ...]
    next_after: int
    has_more: bool
    request_id: str | None
