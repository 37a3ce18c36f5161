"""What ledger calls take and return: the claim key, claim outcomes, redacted
claim states and entries.

The owner id never appears here: it is an internal fencing token, not an
operator-facing diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any, ClassVar, NamedTuple

from ..core.bodies import DecisionStateBody, RunStateBody
from ..core.identity import ExecutionIdentity, ResultReceipt
from ..core.limits import I64_MAX
from ..store.chain import chained

__all__ = [
    "Acted",
    "AlreadyCompleted",
    "AlreadyRejected",
    "AuditEntry",
    "AwaitingApproval",
    "Busy",
    "ClaimKey",
    "ClaimOutcome",
    "ClaimState",
    "Claimed",
    "Completed",
    "Conflict",
    "DecisionState",
    "Held",
    "JointOutcome",
    "LedgerEntry",
    "Missing",
    "Pending",
    "Rejected",
    "RunClosed",
    "RunState",
    "RunStatus",
    "Tombstoned",
    "Unavailable",
    "decision_state_body",
    "new_claim_key",
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
    ``receipt_digest`` is set instead of ``receipt`` when the decision was
    pruned to a tombstone, which keeps only the receipt's digest.
    """

    attempts: int | None = field(default=None, compare=False)
    receipt: ResultReceipt | None = field(default=None, compare=False)
    traceparent: str | None = field(default=None, compare=False)
    receipt_digest: str | None = field(default=None, compare=False)


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


class RunStatus(StrEnum):
    """Where a run stands under the run invariants (docs/PROTOCOL.md, "Runs")."""

    #: No terminal decision claimed: the run takes any new decision.
    OPEN = "open"
    #: A terminal decision (``complete``/``fail``) is claimed, not yet completed:
    #: another terminal decision is refused, other new decisions are taken.
    CLOSING = "closing"
    #: Its terminal decision completed: the run takes no new decision.
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RunState:
    """One run's record under the run invariants: its terminal decision and its close.

    Stored beside the claim records (never in them: they stay the seed's), in
    the same transaction as the claim and the completion that change it. A run
    without a stored record is ``open`` (:meth:`opened`). ``terminal_kind`` is
    the terminal decision's type (``complete`` or ``fail``): what closed the run.
    """

    run_id: str
    terminal_decision_id: str | None = None
    terminal_kind: str | None = None
    #: When the terminal decision was first claimed (the run went ``closing``).
    terminal_claimed_at_ms: int | None = None
    closed_at_ms: int | None = None

    @classmethod
    def opened(cls, run_id: str) -> RunState:
        """An open run (no terminal decision): what a run without a record is."""
        return cls(run_id)

    @property
    def status(self) -> RunStatus:
        """``open``, ``closing`` or ``closed``."""
        if self.closed_at_ms is not None:
            return RunStatus.CLOSED
        if self.terminal_decision_id is not None:
            return RunStatus.CLOSING
        return RunStatus.OPEN

    @property
    def closed_by(self) -> str | None:
        """The decision that closed the run, once closed."""
        return self.terminal_decision_id if self.closed_at_ms is not None else None

    def to_dict(self) -> RunStateBody:
        """The one JSON shape of a run's state (``GET /v1/runs/{id}``'s ``run``,
        ``flowdecision list --run --json``, the clients' ``DecisionPage.run``)."""
        return {
            "run_id": self.run_id,
            "state": self.status.value,
            "terminal_decision_id": self.terminal_decision_id,
            "terminal_kind": self.terminal_kind,  # type: ignore[typeddict-item]
            "closed_by": self.closed_by,
            "closed_at_ms": self.closed_at_ms,
        }

    @classmethod
    def from_dict(cls, obj: Any) -> RunState:
        """Read back :meth:`to_dict`'s shape (the client)."""
        return cls(
            run_id=str(obj["run_id"]),
            terminal_decision_id=obj.get("terminal_decision_id"),
            terminal_kind=obj.get("terminal_kind"),
            closed_at_ms=obj.get("closed_at_ms"),
        )


@dataclass(frozen=True, slots=True)
class RunClosed:
    """The claim was refused: its run is closed, or (for a terminal decision)
    another terminal decision of the run is claimed or completed. ``run`` says
    which decision and when; nothing was stored for the refused decision."""

    run: RunState


@dataclass(frozen=True, slots=True)
class AwaitingApproval:
    """The decision is held for an operator's approval (approval holds): recorded,
    nothing sent to the sink. ``expires_at_ms``: when the hold expires (becomes
    rejected), None for never."""

    expires_at_ms: int | None = None


@dataclass(frozen=True, slots=True)
class AlreadyRejected:
    """An operator rejected the held decision (or its hold expired) at
    ``rejected_at_ms``: it is never sent to the sink."""

    rejected_at_ms: int | None = None


ClaimOutcome = (
    Claimed | AlreadyCompleted | Busy | Conflict | RunClosed | AwaitingApproval | AlreadyRejected
)


@dataclass(frozen=True, slots=True)
class JointOutcome:
    """What ``Ledger.joint_commit`` did: the claim's outcome and the joint row's fate.

    ``inserted`` is True when the row was new, False when an identical row was
    already there (a replay), None when no row was written (the claim answered
    ``Busy``, ``Conflict`` or ``AlreadyCompleted``).
    """

    claim: ClaimOutcome
    inserted: bool | None = None


class DecisionState(StrEnum):
    """What operators query by: a stored decision's state at a given time.

    A released claim (owner gone, lease 0) is ``pending_expired``: the next
    caller takes it at once. ``tombstoned``: pruned with ``keep_tombstones``;
    only its id, request hash, attempts, completion time and receipt digest
    remain, which still answer a late duplicate.
    """

    PENDING_LIVE = "pending_live"
    PENDING_EXPIRED = "pending_expired"
    COMPLETED = "completed"
    TOMBSTONED = "tombstoned"
    #: Waiting for an operator's approval (approval holds): nothing sent yet.
    HELD = "held"
    #: Rejected by an operator, or its hold expired: never sent (terminal).
    REJECTED = "rejected"


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
class Tombstoned(Completed):
    """A completed claim pruned with ``keep_tombstones``: only its request hash,
    attempts, completion time and receipt digest remain (so it is still
    :class:`Completed`, and a late duplicate is answered). The operator's
    view of a lookup names it, as ``list`` does (``tombstoned``)."""

    kind: ClassVar[str] = "tombstoned"


@dataclass(frozen=True, slots=True)
class Held(_StateBase):
    """Held for an operator's approval; ``expires_at_ms`` None: the hold never expires."""

    expires_at_ms: int | None
    kind: ClassVar[str] = "held"

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.kind, "hold_expires_at_ms": self.expires_at_ms}


@dataclass(frozen=True, slots=True)
class Rejected(_StateBase):
    """Rejected by an operator (or its hold expired) at ``rejected_at_ms``: terminal."""

    rejected_at_ms: int | None
    kind: ClassVar[str] = "rejected"

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.kind, "rejected_at_ms": self.rejected_at_ms}


@dataclass(frozen=True, slots=True)
class Unavailable(_StateBase):
    """The ledger does not expose inspection (custom host ledgers)."""

    kind: ClassVar[str] = "unavailable"


ClaimState = Missing | Pending | Completed | Tombstoned | Held | Rejected | Unavailable


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One operator action, as the append-only audit table keeps it.

    ``seq`` orders the trail (assigned by the store when the entry is written,
    in the same transaction as the action); ``at_ms`` is the ledger's clock;
    ``action`` is ``release``, ``forget``, ``approve``, ``reject`` or ``expire``;
    ``state_before`` is the
    :class:`DecisionState` the action found and ``attempts`` the record's
    attempts after it (a release bumps them: the fencing token).
    ``prev_hash`` and ``row_hash`` chain the trail (:mod:`flowdecision.store.chain`):
    the previous entry's ``row_hash`` and this one's (None on entries written
    before the chain existed).
    """

    seq: int
    at_ms: int
    action: str
    decision_id: str
    actor: str
    reason: str
    state_before: str
    attempts: int
    prev_hash: str | None = None
    row_hash: str | None = None

    def content(self) -> tuple[int, str, str, str, str, str, int]:
        """What the chain hashes of the entry (and the SQL ledgers store): every
        field but ``seq`` and the hashes, the time clamped to i64 as stored."""
        return (
            min(self.at_ms, I64_MAX),
            self.action,
            self.decision_id,
            self.actor,
            self.reason,
            self.state_before,
            self.attempts,
        )

    def chained(self, last_row_hash: str | None) -> AuditEntry:
        """This entry appended after the entry whose ``row_hash`` is ``last_row_hash``
        (None: the trail is empty or holds only entries from before the chain)."""
        return chained(self, last_row_hash)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (``GET /v1/audit``, ``flowdecision audit --json``)."""
        return {
            "seq": self.seq,
            "at_ms": self.at_ms,
            "action": self.action,
            "decision_id": self.decision_id,
            "actor": self.actor,
            "reason": self.reason,
            "state_before": self.state_before,
            "attempts": self.attempts,
            "prev_hash": self.prev_hash,
            "row_hash": self.row_hash,
        }

    @classmethod
    def from_dict(cls, obj: Any) -> AuditEntry:
        """Read back :meth:`to_dict`'s shape (the JSON ledger's audit file, the client)."""
        return cls(
            seq=int(obj["seq"]),
            at_ms=int(obj["at_ms"]),
            action=str(obj["action"]),
            decision_id=str(obj["decision_id"]),
            actor=str(obj["actor"]),
            reason=str(obj["reason"]),
            state_before=str(obj["state_before"]),
            attempts=int(obj["attempts"]),
            prev_hash=obj.get("prev_hash"),
            row_hash=obj.get("row_hash"),
        )


@dataclass(frozen=True, slots=True)
class Acted:
    """What an operator's action on a held decision did (``Ledger.approve``,
    ``reject``, ``expire_hold``), in one transaction.

    ``outcome``: an approval's claim outcome (``Claimed``: this caller now owns
    the decision; ``AlreadyCompleted``: approved and delivered before; ``Busy``:
    an earlier approval's dispatch still holds it; ``RunClosed``), None for a
    rejection. ``entry``: the audit entry appended (None when nothing changed).
    ``expired``: the hold had expired; the decision was rejected instead (the
    entry's action is ``expire``). ``inserted``: on the joint path, whether the
    sink's row was new (as :attr:`JointOutcome.inserted`).
    """

    outcome: ClaimOutcome | None
    entry: AuditEntry | None
    expired: bool = False
    inserted: bool | None = None


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """A redacted view of one record, looked up by decision id alone (no owner)."""

    decision_id: str
    request_hash: str
    state: ClaimState
    attempts: int
    execution_identity: ExecutionIdentity | None
    result_receipt: ResultReceipt | None

    def to_dict(self) -> DecisionStateBody:
        """The one JSON shape of a looked-up decision: ``GET /v1/decisions/{id}``'s
        body, ``flowdecision inspect --json``'s output and the client's
        ``DecisionState.to_dict()`` (the receipt is ``receipt``)."""
        state = self.state
        body = decision_state_body(
            self.decision_id,
            state.kind,
            self.attempts,
            self.request_hash,
            self.execution_identity,
            self.result_receipt,
        )
        if isinstance(state, Pending):
            body["lease_expires_at_ms"] = state.lease_expires_at_ms
        if isinstance(state, Completed):
            body["completed_at_ms"] = state.completed_at_ms
        if isinstance(state, Held):
            body["hold_expires_at_ms"] = state.expires_at_ms
        if isinstance(state, Rejected):
            body["rejected_at_ms"] = state.rejected_at_ms
        return body


def decision_state_body(
    decision_id: str,
    state: str,
    attempts: int,
    request_hash: str,
    identity: ExecutionIdentity | None,
    receipt: ResultReceipt | None,
) -> DecisionStateBody:
    """A looked-up decision's JSON members that every state has (the caller adds
    ``lease_expires_at_ms`` or ``completed_at_ms``): :meth:`LedgerEntry.to_dict`'s
    and the client's ``DecisionState.to_dict()``'s one shape."""
    return {
        "decision_id": decision_id,
        "state": state,
        "attempts": attempts,
        "request_hash": request_hash,
        "execution_identity": identity.to_dict() if identity else None,
        "receipt": receipt.to_dict() if receipt else None,
    }


class ClaimKey(NamedTuple):
    """What a claim is bound to: the decision, its request hash and (optionally)
    the execution identity. The dispatcher carries one per dispatch into its
    heartbeat and its release, instead of three loose values (a tuple: free to
    build and to unpack on the hot path)."""

    decision_id: str
    request_hash: str
    identity: ExecutionIdentity | None = None


#: ``new_claim_key((decision_id, request_hash, identity))``: a :class:`ClaimKey`
#: without NamedTuple's Python-level ``__new__`` (half its cost): the ledger
#: template builds one per call.
new_claim_key = partial(tuple.__new__, ClaimKey)
