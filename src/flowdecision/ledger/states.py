"""What ledger calls return: claim outcomes and redacted claim states.

The owner id never appears here: it is an internal fencing token, not an
operator-facing diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..identity import ResultReceipt

__all__ = [
    "AlreadyCompleted",
    "Busy",
    "ClaimOutcome",
    "ClaimState",
    "Claimed",
    "Completed",
    "Conflict",
    "JointOutcome",
    "Missing",
    "Pending",
    "Unavailable",
]


@dataclass(frozen=True, slots=True)
class Claimed:
    """The caller now owns the claim; ``attempt`` is its fencing token (1 on first claim)."""

    attempt: int


@dataclass(frozen=True, slots=True)
class AlreadyCompleted:
    """The decision was already completed; it must not be submitted again.

    ``attempts`` and ``receipt`` are what the stored record holds (the receipt
    is None for legacy records); None for both when a ledger does not say.
    ``traceparent`` is the trace context of the dispatch that completed it,
    where the ledger keeps one (for a duplicate's span link). They do not take
    part in equality: every ``AlreadyCompleted`` is equal.
    """

    attempts: int | None = field(default=None, compare=False)
    receipt: ResultReceipt | None = field(default=None, compare=False)
    traceparent: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Busy:
    """Another owner holds a live lease until ``lease_expires_at_ms``."""

    lease_expires_at_ms: int


@dataclass(frozen=True, slots=True)
class Conflict:
    """The decision id is bound to a different request hash or execution identity.

    ``traceparent``: the trace context of the dispatch that completed the
    stored decision, if any (for the conflicting call's span link); it takes no
    part in equality.
    """

    traceparent: str | None = field(default=None, compare=False)


ClaimOutcome = Claimed | AlreadyCompleted | Busy | Conflict


@dataclass(frozen=True, slots=True)
class JointOutcome:
    """What ``Ledger.joint_commit`` did: the claim's outcome and the joint row's fate.

    ``inserted`` is True when the row was new, False when an identical row was
    already there (a replay), None when no row was written (the claim answered
    ``Busy``, ``Conflict`` or ``AlreadyCompleted``).
    """

    claim: ClaimOutcome
    inserted: bool | None = None


class _StateBase:
    __slots__ = ()
    kind: ClassVar[str]

    def is_live_at(self, now_ms: int) -> bool:
        """Whether a pending lease is still live at ``now_ms`` (never for other states)."""
        return False

    def to_dict(self) -> dict[str, Any]:
        """Serialize like serde's externally tagged ``FlowDecisionClaimState``."""
        return {"state": self.kind}


@dataclass(frozen=True, slots=True)
class Missing(_StateBase):
    """No claim record exists for the decision."""

    kind: ClassVar[str] = "missing"


@dataclass(frozen=True, slots=True)
class Pending(_StateBase):
    """A claim is pending; it may already be expired and therefore reclaimable."""

    lease_expires_at_ms: int
    attempts: int
    kind: ClassVar[str] = "pending"

    def is_live_at(self, now_ms: int) -> bool:
        return self.lease_expires_at_ms > now_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.kind,
            "lease_expires_at_ms": self.lease_expires_at_ms,
            "attempts": self.attempts,
        }


@dataclass(frozen=True, slots=True)
class Completed(_StateBase):
    """The claim is completed; ``completed_at_ms`` is None only for legacy records."""

    completed_at_ms: int | None
    kind: ClassVar[str] = "completed"

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.kind, "completed_at_ms": self.completed_at_ms}


@dataclass(frozen=True, slots=True)
class Unavailable(_StateBase):
    """The ledger does not expose inspection (custom host ledgers)."""

    kind: ClassVar[str] = "unavailable"


ClaimState = Missing | Pending | Completed | Unavailable
