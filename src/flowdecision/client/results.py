"""What the client's calls return: frozen dataclasses, one per answer of the service.

:class:`SubmitResult` (``POST /v1/decisions``), :class:`DecisionState`
(``GET /v1/decisions/{id}``), :class:`ServiceHealth` (``GET /healthz``) and
:class:`OutboxPage` of :class:`OutboxItem` (``GET /v1/outbox``). They are built
from the answers in :mod:`.decode`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

from ..core.bodies import (
    ApprovalBody,
    BulkActionBody,
    DecisionStateBody,
    OutboxEntryBody,
    OutboxPageBody,
    OutcomeBody,
    outbox_entry_body,
)
from ..core.identity import ExecutionIdentity, ResultReceipt
from ..core.model import DecisionRequest
from ..ledger.states import AuditEntry, decision_state_body

__all__ = [
    "ApprovalResult",
    "BulkActionResult",
    "DecisionState",
    "OutboxItem",
    "OutboxPage",
    "Outcome",
    "ServiceHealth",
    "SubmitResult",
]


class Outcome(StrEnum):
    """What became of a submitted decision. ``submitted`` and ``duplicate`` mean the
    decision is in; ``held`` that it waits for an operator's approval (approval holds)."""

    SUBMITTED = "submitted"  # this request's dispatch handed it to the sink (201)
    DUPLICATE = "duplicate"  # it was already completed; nothing was submitted again (200)
    HELD = "held"  # held for approval: recorded, nothing sent yet (202)


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """The answer to ``submit``: 201 ``submitted``, 200 ``duplicate`` or 202 ``held``."""

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
    #: While ``held``: when the hold expires (None: never).
    hold_expires_at_ms: int | None = None

    @property
    def held(self) -> bool:
        """True when the decision waits for an operator's approval (``wait()`` for it)."""
        return self.outcome is Outcome.HELD

    @property
    def submitted(self) -> bool:
        """True when this call's dispatch submitted the decision to the sink."""
        return self.outcome is Outcome.SUBMITTED

    def to_dict(self) -> OutcomeBody:
        """The service's answer body (``DispatchOutcome.to_dict()``'s shape)."""
        body: OutcomeBody = {
            "outcome": self.outcome.value,
            "decision_id": self.decision_id,
            "attempt": self.attempt,
            "receipt": self.receipt.to_dict() if self.receipt else None,
        }
        if self.held:
            body["state"] = "held"
            body["hold_expires_at_ms"] = self.hold_expires_at_ms
        return body


@dataclass(frozen=True, slots=True)
class ApprovalResult:
    """The answer to ``approve``: the approved decision's dispatch (``submitted``, or
    ``duplicate`` when an earlier approval delivered it) and the audit entry written
    (None then)."""

    decision: SubmitResult
    audit: AuditEntry | None

    def to_dict(self) -> ApprovalBody:
        """The service's answer body (``ApprovalOutcome.to_dict()``'s shape)."""
        body: Any = dict(self.decision.to_dict())
        body["audit"] = None if self.audit is None else self.audit.to_dict()
        return cast(ApprovalBody, body)


@dataclass(frozen=True, slots=True)
class BulkActionResult:
    """The answer to ``approve_run`` / ``reject_run``: every held decision of a run acted
    on, each in its own transaction."""

    action: str
    #: The audit entries written, one per decision acted on.
    audit: tuple[AuditEntry, ...]
    #: ``(decision_id, why)`` of each held decision the action could not take.
    refused: tuple[tuple[str, str], ...]
    #: ``approve_run``: each approved decision's answer (empty for ``reject_run``).
    outcomes: tuple[ApprovalResult, ...]
    request_id: str | None

    def to_dict(self) -> BulkActionBody:
        """The service's answer body (the CLI's ``--json`` shape too)."""
        body: BulkActionBody = {
            "action": self.action,  # type: ignore[typeddict-item]
            "audit": [entry.to_dict() for entry in self.audit],  # type: ignore[misc]
            "refused": [{"decision_id": d, "error": e} for d, e in self.refused],
        }
        if self.action == "approve":
            body["outcomes"] = [outcome.to_dict() for outcome in self.outcomes]
        return body


@dataclass(frozen=True, slots=True)
class DecisionState:
    """``GET /v1/decisions/{id}``: the claim record (never its owner)."""

    decision_id: str
    state: str  # "pending", "completed" or "tombstoned" (a newer service may add states)
    attempts: int
    request_hash: str
    lease_expires_at_ms: int | None
    completed_at_ms: int | None
    execution_identity: ExecutionIdentity | None
    receipt: ResultReceipt | None
    request_id: str | None
    #: While ``held``: when the hold expires (None: never).
    hold_expires_at_ms: int | None = None
    #: Once ``rejected``: when.
    rejected_at_ms: int | None = None

    @property
    def held(self) -> bool:
        """Waiting for an operator's approval (approval holds)."""
        return self.state == "held"

    @property
    def completed(self) -> bool:
        """Completed, including a tombstone (completed, then pruned with its receipt's
        digest kept), as the ledger's ``Tombstoned`` is a ``Completed``."""
        return self.state in ("completed", "tombstoned")

    def to_dict(self) -> DecisionStateBody:
        """The service's answer body (``LedgerEntry.to_dict()``'s shape)."""
        body = decision_state_body(
            self.decision_id,
            self.state,
            self.attempts,
            self.request_hash,
            self.execution_identity,
            self.receipt,
        )
        if self.lease_expires_at_ms is not None:
            body["lease_expires_at_ms"] = self.lease_expires_at_ms
        if self.completed:
            body["completed_at_ms"] = self.completed_at_ms
        if self.held:
            body["hold_expires_at_ms"] = self.hold_expires_at_ms
        if self.state == "rejected":
            body["rejected_at_ms"] = self.rejected_at_ms
        return body


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
    #: The W3C trace context of the dispatch that wrote the row (None: tracing was off).
    traceparent: str | None = None

    def to_dict(self) -> OutboxEntryBody:
        """One entry of the service's answer (``OutboxEntry.to_dict()``'s shape)."""
        return outbox_entry_body(self, json.loads(self.request.to_json()))


@dataclass(frozen=True, slots=True)
class OutboxPage:
    """``GET /v1/outbox``: ask again with ``after=next_after`` while ``has_more``."""

    entries: tuple[OutboxItem, ...]
    next_after: int
    has_more: bool
    request_id: str | None

    def to_dict(self) -> OutboxPageBody:
        """The service's answer body."""
        return {
            "entries": [entry.to_dict() for entry in self.entries],
            "next_after": self.next_after,
            "has_more": self.has_more,
        }
