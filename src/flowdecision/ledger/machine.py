"""The claim state machine, written once, as pure functions over one record.

Every backend (memory, JSON file, SQLite, PostgreSQL) loads a record, calls one
of these functions, and stores the record it returns, atomically. Nothing here
does I/O or reads a clock: time arrives as an argument, which is what lets the
PostgreSQL backend feed in the database's clock and the conformance tests feed
in time that stands still or runs backwards.

This is a literal port of the record functions of ``decision_ledger.rs``
(``claim_record``, ``renew_record``, ``complete_record``, ``release_record``,
``inspect_record``, ``prune_records``), with the same error messages. What a
claim is bound to -- decision id, request hash, execution identity -- arrives
as one :class:`~.states.ClaimKey`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Generic, TypeVar

from ..core.identity import ExecutionIdentity, ResultReceipt, digest_bytes
from ..core.jsonwire import Fragment, encode_json
from ..core.limits import U32_MAX, U64_MAX
from ..errors import ActionRefusedError, LedgerCorruptError, LedgerError, UnknownDecisionError
from .states import (
    Acted,
    AlreadyCompleted,
    AlreadyRejected,
    AuditEntry,
    AwaitingApproval,
    Busy,
    Claimed,
    ClaimKey,
    ClaimOutcome,
    ClaimState,
    Completed,
    Conflict,
    DecisionState,
    Held,
    Missing,
    Pending,
    Rejected,
    RunClosed,
    RunState,
    Tombstoned,
)

__all__ = [
    "RECEIPT_DIGEST_DOMAIN",
    "REJECTED_KIND",
    "TERMINAL_KINDS",
    "U32_MAX",
    "U64_MAX",
    "ClaimRecord",
    "ClaimStatus",
    "Creation",
    "DecisionOrigin",
    "HoldTerms",
    "Transition",
    "approve",
    "check_u32",
    "check_u64",
    "claim",
    "complete",
    "decision_state",
    "forget",
    "inspect",
    "is_prunable",
    "is_tombstone_prunable",
    "lookup_state",
    "operator_release",
    "receipt_digest",
    "reject",
    "release",
    "renew",
    "run_claim",
    "run_complete",
    "tombstone_of",
]

#: The decision types that end a run (:attr:`DecisionOrigin.terminal`).
TERMINAL_KINDS = frozenset({"complete", "fail"})

#: A run's ``terminal_kind`` when a rejection closed it (``HoldTerms.reject_closes_run``).
REJECTED_KIND = "rejected"

#: Domain of a tombstone's receipt digest (:func:`receipt_digest`).
RECEIPT_DIGEST_DOMAIN = "a3s.code.flow-decision.receipt-digest.v1"

T = TypeVar("T")


class ClaimStatus(StrEnum):
    """Stored status of a claim record (serialized in snake_case like the seed)."""

    PENDING = "pending"
    COMPLETED = "completed"
    #: Not in the seed: a pruned completed record kept for dedup (never written
    #: to the seed's JSON file; the JSON ledger keeps tombstones beside it).
    TOMBSTONE = "tombstone"
    #: Not in the seed (approval holds; never in the JSON file ledger): recorded with
    #: its request, waiting for an operator's approval; nothing reached the sink.
    HELD = "held"
    #: Not in the seed: rejected by an operator, or its hold expired. Terminal.
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """One decision's claim, exactly the seed's ``ClaimRecord``.

    ``execution_identity`` is None only for legacy records written by the older
    ledger; ``completed_at_ms`` is None for pending and legacy completed records.

    ``traceparent`` is side data, not part of the seed's record: the W3C trace
    context of the dispatch that completed the decision (see
    :mod:`flowdecision.observability.tracing`). The SQL ledgers keep it in a column of its
    own; it is never serialized (:meth:`to_dict`), so the JSON file ledger
    never holds it, and it takes no part in equality.

    A tombstone (``status`` TOMBSTONE, see :func:`tombstone_of`) keeps only the
    request hash, attempts, completion time and ``receipt_digest``.

    Approval holds (not in the seed): a ``HELD`` record keeps the decision's
    ``request`` (its wire JSON text, what an approval dispatches; kept through
    the approval's claim until completion drops it), ``hold_expires_at_ms`` and
    ``reject_closes_run``; a ``REJECTED`` record keeps its rejection time in
    ``completed_at_ms``.
    """

    request_hash: str
    status: ClaimStatus
    owner_id: str
    lease_expires_at_ms: int
    attempts: int
    execution_identity: ExecutionIdentity | None = None
    completed_at_ms: int | None = None
    result_receipt: ResultReceipt | None = None
    traceparent: str | None = field(default=None, compare=False)
    receipt_digest: str | None = None
    request: str | None = None
    hold_expires_at_ms: int | None = None
    reject_closes_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The seed's serde form: declaration order, absent options omitted."""
        out: dict[str, Any] = {"request_hash": self.request_hash}
        if self.execution_identity is not None:
            out["execution_identity"] = self.execution_identity.to_dict()
        out["status"] = self.status.value
        out["owner_id"] = self.owner_id
        out["lease_expires_at_ms"] = self.lease_expires_at_ms
        out["attempts"] = self.attempts
        if self.completed_at_ms is not None:
            out["completed_at_ms"] = self.completed_at_ms
        if self.result_receipt is not None:
            out["result_receipt"] = self.result_receipt.to_dict()
        if self.receipt_digest is not None:
            out["receipt_digest"] = self.receipt_digest
        self._hold_fields(out)
        return out

    def _hold_fields(self, out: dict[str, Any]) -> None:
        """The approval-hold fields, present only when set (a seed record has none)."""
        if self.request is not None:
            out["request"] = self.request
        if self.hold_expires_at_ms is not None:
            out["hold_expires_at_ms"] = self.hold_expires_at_ms
        if self.reject_closes_run:
            out["reject_closes_run"] = True

    def json_text(self) -> str:
        """:meth:`to_dict` as compact JSON text (every stored claim and completion
        writes one), the identity's and receipt's kept texts placed as they are."""
        out: dict[str, Any] = {"request_hash": self.request_hash}
        identity = self.execution_identity
        if identity is not None:
            out["execution_identity"] = Fragment(identity.json_text())
        # ``_value_``, the enum's own name for it: ``.value`` is two Python calls.
        out["status"] = self.status._value_
        out["owner_id"] = self.owner_id
        out["lease_expires_at_ms"] = self.lease_expires_at_ms
        out["attempts"] = self.attempts
        if self.completed_at_ms is not None:
            out["completed_at_ms"] = self.completed_at_ms
        if self.result_receipt is not None:
            out["result_receipt"] = Fragment(self.result_receipt.json_text())
        if self.receipt_digest is not None:
            out["receipt_digest"] = self.receipt_digest
        self._hold_fields(out)
        return encode_json(out).decode()

    @classmethod
    def from_dict(cls, decision_id: str, obj: Any, *, summary: bool = False) -> ClaimRecord:
        """Decode and validate a stored record as the seed's ``read_records`` does.

        Unknown fields are ignored. Raises :class:`LedgerCorruptError` naming the
        decision and the problem. ``summary``: leave out (neither decode nor
        check) the execution identity and the result receipt, which cost most
        of the decoding; for listings that show neither (operator queries).
        """
        if not isinstance(obj, dict):
            raise LedgerCorruptError(f"decision `{decision_id}` record is not an object")

        def field(name: str, kind: type, optional: bool = False) -> Any:
            if name not in obj or (optional and obj[name] is None):
                if optional:
                    return None
                raise LedgerCorruptError(f"decision `{decision_id}` record: missing field `{name}`")
            value = obj[name]
            if kind is int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise LedgerCorruptError(
                        f"decision `{decision_id}` record: field `{name}` must be an integer"
                    )
            elif not isinstance(value, kind):
                raise LedgerCorruptError(
                    f"decision `{decision_id}` record: field `{name}` has the wrong type"
                )
            return value

        status_text = field("status", str)
        try:
            status = ClaimStatus(status_text)
        except ValueError:
            raise LedgerCorruptError(
                f"decision `{decision_id}` record: unknown status `{status_text}`, "
                "expected `pending`, `completed`, `tombstone`, `held` or `rejected`"
            ) from None
        lease = field("lease_expires_at_ms", int)
        attempts = field("attempts", int)
        completed_at = field("completed_at_ms", int, optional=True)
        _range(decision_id, "lease_expires_at_ms", lease, U64_MAX)
        _range(decision_id, "attempts", attempts, U32_MAX)
        if completed_at is not None:
            _range(decision_id, "completed_at_ms", completed_at, U64_MAX)
        identity: ExecutionIdentity | None = None
        raw_identity = None if summary else obj.get("execution_identity")
        if raw_identity is not None:
            try:
                identity = ExecutionIdentity.from_dict(raw_identity)
                identity.validate()
            except ValueError as error:
                raise LedgerCorruptError(
                    f"validate identity for decision `{decision_id}`: {error}"
                ) from error
        receipt: ResultReceipt | None = None
        raw_receipt = None if summary else obj.get("result_receipt")
        if raw_receipt is not None:
            try:
                receipt = ResultReceipt.from_dict(raw_receipt)
            except ValueError as error:
                raise LedgerCorruptError(
                    f"validate result receipt for decision `{decision_id}`: {error}"
                ) from error
            if status is not ClaimStatus.COMPLETED:
                raise LedgerCorruptError(
                    f"decision `{decision_id}` has a result receipt before completion"
                )
            if identity is None:
                raise LedgerCorruptError(
                    f"decision `{decision_id}` result receipt has no execution identity binding"
                )
            if receipt.identity != identity:
                raise LedgerCorruptError(
                    f"decision `{decision_id}` result receipt identity conflicts with its claim"
                )
        digest = field("receipt_digest", str, optional=True)
        if digest is not None and status is not ClaimStatus.TOMBSTONE:
            raise LedgerCorruptError(
                f"decision `{decision_id}` record: only a tombstone has a `receipt_digest`"
            )
        request = field("request", str, optional=True)
        if request is not None and status not in (ClaimStatus.HELD, ClaimStatus.PENDING):
            raise LedgerCorruptError(
                f"decision `{decision_id}` record: only a held or pending decision keeps "
                "its `request`"
            )
        if status is ClaimStatus.HELD and request is None:
            raise LedgerCorruptError(f"decision `{decision_id}` record: held without its `request`")
        expires = field("hold_expires_at_ms", int, optional=True)
        if expires is not None:
            _range(decision_id, "hold_expires_at_ms", expires, U64_MAX)
        closes = field("reject_closes_run", bool, optional=True)
        return cls(
            request_hash=field("request_hash", str),
            status=status,
            owner_id=field("owner_id", str),
            lease_expires_at_ms=lease,
            attempts=attempts,
            execution_identity=identity,
            completed_at_ms=completed_at,
            result_receipt=receipt,
            receipt_digest=digest,
            request=request,
            hold_expires_at_ms=expires,
            reject_closes_run=bool(closes),
        )


def _range(decision_id: str, name: str, value: int, maximum: int) -> None:
    if not 0 <= value <= maximum:
        raise LedgerCorruptError(
            f"decision `{decision_id}` record: field `{name}` is out of range 0..={maximum}"
        )


@dataclass(frozen=True, slots=True)
class DecisionOrigin:
    """Where a decision comes from: its run and the event that caused it.

    Given to the first claim and kept beside the record (never in it: the
    record stays the seed's), so operators can list a run's decisions.
    """

    run_id: str | None = None
    causation_event_id: str | None = None
    #: The decision's type when it ends its run (``complete`` or ``fail``), else
    #: None: what the run invariants (:func:`run_claim`) go by. Not stored.
    terminal: str | None = None


@dataclass(frozen=True, slots=True)
class HoldTerms:
    """A new decision the approval policy holds (``flowdecision.core.approvals``):
    what its ``HELD`` record keeps until an operator acts.

    ``request``: the decision's wire JSON text (what an approval dispatches);
    ``expire_ms``: how long the hold lasts (None: until an operator acts);
    ``reject_closes_run``: whether rejecting it closes its run.
    """

    request: str
    expire_ms: int | None = None
    reject_closes_run: bool = False


@dataclass(frozen=True, slots=True)
class Creation:
    """A record came into being: when it was first claimed, and its origin."""

    at_ms: int
    origin: DecisionOrigin | None = None


@dataclass(frozen=True, slots=True)
class Transition(Generic[T]):
    """What a transition decided: the record to store and the caller's result.

    ``changed`` is False when the stored record must stay as it is, so backends
    skip the write (a busy claim or a refused renewal costs no commit).
    ``changed`` with ``record`` None deletes the record (only :func:`forget`).
    ``created`` is set when the transition made a new record: backends store
    its creation time and origin beside the record. ``run`` (only from the run
    rules, :func:`run_claim` and :func:`run_complete`) is the run's record to
    store, in the same transaction, when the transition changed it.
    """

    record: ClaimRecord | None
    result: T
    changed: bool
    created: Creation | None = None
    run: RunState | None = None


def check_u64(name: str, value: object) -> int:
    """Validate an unsigned 64-bit argument (times, leases) with a clear error."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise LedgerError(f"`{name}` must be an integer in 0..={U64_MAX}, got {value!r}")
    return value


def check_u32(name: str, value: object) -> int:
    """Validate an unsigned 32-bit argument with a clear error."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U32_MAX:
        raise LedgerError(f"`{name}` must be an integer in 0..={U32_MAX}, got {value!r}")
    return value


def _lease_expiry(now_ms: int, lease_ms: int) -> int:
    # Rust: now_ms.saturating_add(lease_ms.max(1))
    return min(now_ms + max(lease_ms, 1), U64_MAX)


def _identity_conflicts(record: ClaimRecord, identity: ExecutionIdentity | None) -> bool:
    return (
        record.execution_identity is not None
        and identity is not None
        and record.execution_identity != identity
    )


def claim(
    record: ClaimRecord | None,
    key: ClaimKey,
    owner_id: str,
    now_ms: int,
    lease_ms: int,
    origin: DecisionOrigin | None = None,
    hold: HoldTerms | None = None,
) -> Transition[ClaimOutcome]:
    """``claim_record``: take a missing, released or expired claim; report the rest.

    A tombstone answers like the completed record it was: the same request
    hash is ``AlreadyCompleted`` (with the receipt's digest), another one is a
    ``Conflict``; it binds no identity (it keeps none).

    Approval holds: with ``hold``, a new decision is recorded ``HELD`` (not
    claimed) and answered ``AwaitingApproval``. A held record answers
    ``AwaitingApproval`` to every claim, a rejected one ``AlreadyRejected``
    (with or without ``hold``: only an approval, :func:`approve`, takes a held
    decision); a different request hash is a ``Conflict`` as always.
    """
    request_hash, identity = key.request_hash, key.identity
    if record is None and hold is not None:
        expires = None if hold.expire_ms is None else min(now_ms + hold.expire_ms, U64_MAX)
        held = ClaimRecord(
            request_hash=request_hash,
            status=ClaimStatus.HELD,
            owner_id="",
            lease_expires_at_ms=0,
            attempts=0,
            execution_identity=identity,
            request=hold.request,
            hold_expires_at_ms=expires,
            reject_closes_run=hold.reject_closes_run,
        )
        return Transition(held, AwaitingApproval(expires), True, Creation(now_ms, origin))
    lease_expires_at_ms = _lease_expiry(now_ms, lease_ms)
    if record is None:
        created = ClaimRecord(
            request_hash=request_hash,
            status=ClaimStatus.PENDING,
            owner_id=owner_id,
            lease_expires_at_ms=lease_expires_at_ms,
            attempts=1,
            execution_identity=identity,
        )
        return Transition(created, Claimed(1), True, Creation(now_ms, origin))
    if record.status is ClaimStatus.TOMBSTONE:
        if record.request_hash != request_hash:
            return Transition(record, Conflict(), False)
        done = AlreadyCompleted(attempts=record.attempts, receipt_digest=record.receipt_digest)
        return Transition(record, done, False)
    if record.request_hash != request_hash or _identity_conflicts(record, identity):
        return Transition(record, Conflict(record.traceparent), False)
    if record.status is ClaimStatus.HELD:
        return Transition(record, AwaitingApproval(record.hold_expires_at_ms), False)
    if record.status is ClaimStatus.REJECTED:
        return Transition(record, AlreadyRejected(record.completed_at_ms), False)
    if record.status is ClaimStatus.COMPLETED:
        done = AlreadyCompleted(record.attempts, record.result_receipt, record.traceparent)
        if record.execution_identity is None and identity is not None:
            return Transition(replace(record, execution_identity=identity), done, True)
        return Transition(record, done, False)
    if record.lease_expires_at_ms > now_ms and record.owner_id != owner_id:
        return Transition(record, Busy(record.lease_expires_at_ms), False)
    attempts = min(record.attempts + 1, U32_MAX)
    taken = replace(
        record,
        execution_identity=record.execution_identity or identity,
        owner_id=owner_id,
        lease_expires_at_ms=lease_expires_at_ms,
        attempts=attempts,
    )
    return Transition(taken, Claimed(attempts), True)


def renew(
    record: ClaimRecord | None, key: ClaimKey, owner_id: str, now_ms: int, lease_ms: int
) -> Transition[bool]:
    """``renew_record``: extend a live lease held by ``owner_id``; never binds an identity."""
    if (
        record is None
        or record.request_hash != key.request_hash
        or record.status is not ClaimStatus.PENDING
        or record.owner_id != owner_id
        or record.lease_expires_at_ms <= now_ms
        or _identity_conflicts(record, key.identity)
    ):
        return Transition(record, False, False)
    renewed = replace(record, lease_expires_at_ms=_lease_expiry(now_ms, lease_ms))
    return Transition(renewed, True, True)


def complete(
    record: ClaimRecord | None,
    key: ClaimKey,
    owner_id: str,
    receipt: ResultReceipt | None,
    completed_at_ms: int,
    traceparent: str | None = None,
) -> Transition[bool]:
    """``complete_record``: finish a live claim held by ``owner_id``.

    Completing an already-completed record succeeds for any caller: it attaches
    the supplied identity or receipt if none is stored, and a different receipt
    conflicts. Raises :class:`LedgerError` with the seed's messages.

    The result (an addition to the seed, which returns nothing) says whether
    the record is completed *by this owner*: False means another owner
    completed it first, so this caller's lease was lost along the way.
    ``traceparent`` (side data, see :class:`ClaimRecord`) is kept with a new
    completion only: the submission that counted.
    """
    decision_id, request_hash, identity = key
    if record is None:
        raise LedgerError(f"decision claim `{decision_id}` does not exist")
    if record.request_hash != request_hash:
        raise LedgerError(f"decision `{decision_id}` request hash conflicts with its claim")
    if record.status is ClaimStatus.TOMBSTONE:
        # Pruned: nothing to attach any more, but a different receipt still conflicts.
        if receipt is not None and receipt_digest(receipt) != record.receipt_digest:
            raise LedgerError(
                f"decision `{decision_id}` result receipt conflicts with its completion"
            )
        return Transition(record, False, False)
    if _identity_conflicts(record, identity):
        raise LedgerError(f"decision `{decision_id}` execution identity conflicts with its claim")
    if record.status in _NEVER_CLAIMED:
        raise LedgerError(
            f"decision `{decision_id}` is {record.status.value}: it was never claimed"
        )
    if record.status is ClaimStatus.COMPLETED:
        updated = record
        if receipt is not None:
            if record.result_receipt is not None:
                if record.result_receipt != receipt:
                    raise LedgerError(
                        f"decision `{decision_id}` result receipt conflicts with its completion"
                    )
            else:
                updated = replace(updated, result_receipt=receipt)
        if updated.execution_identity is None and identity is not None:
            updated = replace(updated, execution_identity=identity)
        return Transition(updated, record.owner_id == owner_id, updated is not record)
    if record.owner_id != owner_id:
        raise LedgerError(f"decision `{decision_id}` is owned by another dispatcher")
    if record.lease_expires_at_ms == 0 or record.lease_expires_at_ms <= completed_at_ms:
        raise LedgerError(f"decision `{decision_id}` claim lease expired before completion")
    # The constructor, not dataclasses.replace: this is on every dispatch's path.
    done = ClaimRecord(
        request_hash=record.request_hash,
        status=ClaimStatus.COMPLETED,
        owner_id=record.owner_id,
        lease_expires_at_ms=0,
        attempts=record.attempts,
        execution_identity=record.execution_identity or identity,
        completed_at_ms=completed_at_ms,
        result_receipt=receipt,
        traceparent=traceparent,
    )
    return Transition(done, True, True)


def release(record: ClaimRecord | None, key: ClaimKey, owner_id: str) -> Transition[None]:
    """``release_record``: the owner gives up its lease so a retry can claim at once.

    Anything else (wrong hash, completed, other owner, identity conflict) is a
    silent no-op, as in the seed; release never binds an identity.
    """
    if (
        record is None
        or record.request_hash != key.request_hash
        or record.status is not ClaimStatus.PENDING
        or _identity_conflicts(record, key.identity)
        or record.owner_id != owner_id
    ):
        return Transition(record, None, False)
    return Transition(replace(record, owner_id="", lease_expires_at_ms=0), None, True)


def inspect(record: ClaimRecord | None, key: ClaimKey) -> ClaimState:
    """``inspect_record``: the redacted state; a hash or identity mismatch is an error."""
    if record is None:
        return Missing()
    if record.request_hash != key.request_hash:
        raise LedgerError(f"decision `{key.decision_id}` request hash conflicts with its claim")
    if _identity_conflicts(record, key.identity):
        raise LedgerError(
            f"decision `{key.decision_id}` execution identity conflicts with its claim"
        )
    return state_of(record)


def state_of(record: ClaimRecord | None) -> ClaimState:
    """The redacted state of a record, without any hash or identity check."""
    if record is None:
        return Missing()
    if record.status is ClaimStatus.PENDING:
        return Pending(record.lease_expires_at_ms, record.attempts)
    if record.status is ClaimStatus.HELD:
        return Held(record.hold_expires_at_ms)
    if record.status is ClaimStatus.REJECTED:
        return Rejected(record.completed_at_ms)
    return Completed(record.completed_at_ms)  # a tombstone too: it was completed


def lookup_state(record: ClaimRecord) -> ClaimState:
    """The state a lookup by id shows (``GET /v1/decisions/{id}``, ``inspect``): as
    :func:`state_of`, with a tombstone named as one, as operator queries name it."""
    if record.status is ClaimStatus.TOMBSTONE:
        return Tombstoned(record.completed_at_ms)
    return state_of(record)


def decision_state(record: ClaimRecord, now_ms: int) -> DecisionState:
    """The state operators query by, at ``now_ms`` (a released claim is expired)."""
    if record.status is ClaimStatus.COMPLETED:
        return DecisionState.COMPLETED
    if record.status is ClaimStatus.TOMBSTONE:
        return DecisionState.TOMBSTONED
    if record.status is ClaimStatus.HELD:
        return DecisionState.HELD
    if record.status is ClaimStatus.REJECTED:
        return DecisionState.REJECTED
    if record.lease_expires_at_ms > now_ms:
        return DecisionState.PENDING_LIVE
    return DecisionState.PENDING_EXPIRED


def receipt_digest(receipt: ResultReceipt) -> str:
    """The digest a tombstone keeps of a receipt: over its exact JSON bytes."""
    return digest_bytes(RECEIPT_DIGEST_DOMAIN, receipt.to_json())


def tombstone_of(record: ClaimRecord) -> ClaimRecord:
    """What ``prune --keep-tombstones`` keeps of a completed record.

    The request hash (so a different payload still conflicts), attempts, the
    completion time (so tombstones can be pruned by age) and the receipt's
    digest (so a late duplicate is answered with it); owner, lease, identity
    and receipt are dropped.
    """
    return ClaimRecord(
        request_hash=record.request_hash,
        status=ClaimStatus.TOMBSTONE,
        owner_id="",
        lease_expires_at_ms=0,
        attempts=record.attempts,
        completed_at_ms=record.completed_at_ms,
        receipt_digest=(
            None if record.result_receipt is None else receipt_digest(record.result_receipt)
        ),
    )


def is_tombstone_prunable(record: ClaimRecord, before_ms: int) -> bool:
    """``prune --tombstones-before``: tombstones of decisions completed before the cutoff."""
    return (
        record.status is ClaimStatus.TOMBSTONE
        and record.completed_at_ms is not None
        and record.completed_at_ms < before_ms
    )


def _missing(decision_id: str) -> UnknownDecisionError:
    return UnknownDecisionError(f"decision `{decision_id}` has no record")


def operator_release(
    record: ClaimRecord | None, entry: AuditEntry, now_ms: int
) -> Transition[AuditEntry]:
    """An operator releases a pending claim, live or expired, so the next caller takes it now.

    Fenced: the owner is cleared, the lease ended and ``attempts`` (the
    fencing token) bumped, so the old owner's renew and complete are refused
    and any work it still does carries an attempt older than the next one.
    Raises :class:`ActionRefusedError` for anything but a pending claim.
    """
    if record is None:
        raise _missing(entry.decision_id)
    state = decision_state(record, now_ms)
    if record.status is not ClaimStatus.PENDING:
        raise ActionRefusedError(
            f"decision `{entry.decision_id}` is {state.value}: only a pending claim can be released"
        )
    attempts = min(record.attempts + 1, U32_MAX)
    released = replace(record, owner_id="", lease_expires_at_ms=0, attempts=attempts)
    return Transition(released, replace(entry, state_before=state.value, attempts=attempts), True)


def forget(record: ClaimRecord | None, entry: AuditEntry, now_ms: int) -> Transition[AuditEntry]:
    """An operator deletes a completed or rejected decision or a tombstone, so its id
    can be used again.

    Raises :class:`ActionRefusedError` for a pending claim (release it first) or
    a held decision (reject it first).
    """
    if record is None:
        raise _missing(entry.decision_id)
    state = decision_state(record, now_ms)
    if record.status in (ClaimStatus.PENDING, ClaimStatus.HELD):
        raise ActionRefusedError(
            f"decision `{entry.decision_id}` is {state.value}: only a completed or rejected "
            "decision or a tombstone can be forgotten (release a pending claim, or reject a "
            "held decision, first)"
        )
    return Transition(
        None, replace(entry, state_before=state.value, attempts=record.attempts), True
    )


#: States no claim ever took: a completion of them is refused.
_NEVER_CLAIMED = (ClaimStatus.HELD, ClaimStatus.REJECTED)


def is_prunable(record: ClaimRecord, before_ms: int) -> bool:
    """``prune_records``: completed before the cutoff; legacy records without a time stay."""
    return (
        record.status is ClaimStatus.COMPLETED
        and record.completed_at_ms is not None
        and record.completed_at_ms < before_ms
    )


# -- the run invariants --------------------------------------------------------------


def run_claim(
    record: ClaimRecord | None,
    run: RunState | None,
    key: ClaimKey,
    owner_id: str,
    now_ms: int,
    lease_ms: int,
    origin: DecisionOrigin,
    hold: HoldTerms | None = None,
) -> Transition[ClaimOutcome]:
    """:func:`claim` under its run's invariants; ``run`` is the run's stored record.

    The claim rules answer first, so a duplicate stays a duplicate (and a busy
    or conflicting claim answers as ever). A claim they would grant -- a new
    decision, a takeover, a re-claim -- is refused with :class:`RunClosed`,
    storing nothing, when the run is closed (no attempt starts after the
    close), or when the decision is terminal and the run already has another
    terminal decision (at most one per run). A granted terminal claim reserves
    the run's terminal slot: the run goes ``closing``, and the completion of
    that decision (:func:`run_complete`) closes it.

    A new hold (``hold``) is refused the same way, before it is recorded; it
    reserves nothing: its approval's claim does.
    """
    claimed = claim(record, key, owner_id, now_ms, lease_ms, origin, hold)
    decision_id = key.decision_id
    if type(claimed.result) is AwaitingApproval and claimed.created is not None:
        if run is not None and (
            run.closed_at_ms is not None
            or (origin.terminal is not None and run.terminal_decision_id != decision_id)
        ):
            return Transition(record, RunClosed(run), False)
        return claimed
    if type(claimed.result) is not Claimed:
        return claimed
    if run is not None and (
        run.closed_at_ms is not None
        or (origin.terminal is not None and run.terminal_decision_id != decision_id)
    ):
        return Transition(record, RunClosed(run), False)
    if origin.terminal is None or (run is not None and run.terminal_decision_id == decision_id):
        return claimed  # not terminal, or the reserved terminal claimed again
    assert origin.run_id is not None
    reserved = RunState(origin.run_id, decision_id, origin.terminal, now_ms)
    return Transition(claimed.record, claimed.result, True, claimed.created, reserved)


def run_complete(
    record: ClaimRecord | None,
    run: RunState | None,
    key: ClaimKey,
    owner_id: str,
    receipt: ResultReceipt | None,
    completed_at_ms: int,
    traceparent: str | None = None,
) -> Transition[bool]:
    """:func:`complete` under its run's invariants: completing the run's terminal
    decision closes the run, at the completion's time, in the same transaction.

    Any other completion is :func:`complete`'s alone: a decision claimed before
    the close still completes after it (its owner's submission was already
    under way; the ledger records what happened) -- it just cannot be claimed
    again.
    """
    done = complete(record, key, owner_id, receipt, completed_at_ms, traceparent)
    if (
        run is None
        or run.closed_at_ms is not None
        or run.terminal_decision_id != key.decision_id
        or not done.changed
        or record is None
        or record.status is not ClaimStatus.PENDING
    ):
        return done
    closed = replace(run, closed_at_ms=completed_at_ms)
    return Transition(done.record, done.result, True, done.created, closed)


# -- approval holds ------------------------------------------------------------------


def approve(
    record: ClaimRecord | None,
    run: RunState | None,
    key: ClaimKey,
    owner_id: str,
    now_ms: int,
    lease_ms: int,
    origin: DecisionOrigin | None,
    entry: AuditEntry,
    runs: bool = False,
) -> Transition[Acted]:
    """An operator approves a held decision: it is claimed for ``owner_id`` under the
    claim rules (and, with ``runs``, the run rules: :func:`run_claim`), as a released
    claim would be (attempt 1), and the approval is audited (``entry``).

    Answers without storing anything: ``AlreadyCompleted`` (an earlier approval
    delivered it: no second audit entry), ``Busy`` (an earlier approval's
    dispatch holds a live lease; after it expires, an approval takes over, as a
    claim does) and ``RunClosed``. A hold past its expiry is rejected instead,
    audited as ``expire`` (:attr:`Acted.expired`). Raises
    :class:`ActionRefusedError` for a rejected decision or one never held,
    :class:`UnknownDecisionError` for an unknown id.
    """
    if record is None:
        raise _missing(entry.decision_id)
    if record.request_hash != key.request_hash or _identity_conflicts(record, key.identity):
        # (Forgotten and held again with other content since the approver read it.)
        raise ActionRefusedError(
            f"decision `{key.decision_id}` changed while it was being approved: approve it again"
        )
    state = decision_state(record, now_ms)
    if record.status in (ClaimStatus.COMPLETED, ClaimStatus.TOMBSTONE):
        done = AlreadyCompleted(
            record.attempts, record.result_receipt, record.traceparent, record.receipt_digest
        )
        return Transition(record, Acted(done, None), False)
    if record.status is ClaimStatus.REJECTED or record.request is None:
        raise ActionRefusedError(
            f"decision `{entry.decision_id}` is {state.value}: only a held decision can be approved"
        )
    if _expired(record, now_ms):
        return reject(record, run, origin.run_id if runs and origin else None, entry, now_ms, True)
    base = record
    if record.status is ClaimStatus.HELD:
        # Approved: from here on it is a released claim, taken under the claim rules.
        base = replace(
            record, status=ClaimStatus.PENDING, hold_expires_at_ms=None, reject_closes_run=False
        )
    if runs:
        assert origin is not None
        claimed = run_claim(base, run, key, owner_id, now_ms, lease_ms, origin)
    else:
        claimed = claim(base, key, owner_id, now_ms, lease_ms, origin)
    outcome = claimed.result
    if not isinstance(outcome, Claimed):
        return Transition(record, Acted(outcome, None), False)
    audited = replace(entry, state_before=state.value, attempts=outcome.attempt)
    return Transition(claimed.record, Acted(outcome, audited), True, None, claimed.run)


def _expired(record: ClaimRecord, now_ms: int) -> bool:
    return (
        record.status is ClaimStatus.HELD
        and record.hold_expires_at_ms is not None
        and record.hold_expires_at_ms <= now_ms
    )


def reject(
    record: ClaimRecord | None,
    run: RunState | None,
    run_id: str | None,
    entry: AuditEntry,
    now_ms: int,
    expiring: bool = False,
) -> Transition[Acted]:
    """An operator rejects a held decision (``expiring``: its hold expired): it is
    ``REJECTED`` from now on, audited (``entry``; an expiry's action is ``expire``).

    When its hold says so (``reject_closes_run``) and ``run_id`` is given (the
    ledger keeps the run invariants), the run closes with it (``terminal_kind``
    ``rejected``), unless another terminal decision already holds the run.
    Raises :class:`ActionRefusedError` for anything but a held decision (and,
    ``expiring``, one whose hold has not expired).
    """
    if record is None:
        raise _missing(entry.decision_id)
    state = decision_state(record, now_ms)
    if record.status is not ClaimStatus.HELD:
        raise ActionRefusedError(
            f"decision `{entry.decision_id}` is {state.value}: only a held decision can be rejected"
        )
    if expiring and not _expired(record, now_ms):
        raise ActionRefusedError(f"decision `{entry.decision_id}`'s hold has not expired")
    rejected = ClaimRecord(
        request_hash=record.request_hash,
        status=ClaimStatus.REJECTED,
        owner_id="",
        lease_expires_at_ms=0,
        attempts=record.attempts,
        execution_identity=record.execution_identity,
        completed_at_ms=now_ms,
    )
    closed = None
    if record.reject_closes_run and run_id is not None and run is None:
        closed = RunState(run_id, entry.decision_id, REJECTED_KIND, now_ms, now_ms)
    action = "expire" if expiring else entry.action
    audited = replace(entry, action=action, state_before=state.value, attempts=record.attempts)
    return Transition(rejected, Acted(None, audited, expiring), True, None, closed)
