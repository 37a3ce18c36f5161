"""The public ledger interface, apart from how any store implements it.

:class:`Ledger` is what the dispatcher, the service, the CLI and operator
tools use. Storage backends do not implement it directly: they extend
:class:`~flowdecision.ledger.base.StoredLedger`, the template that writes the
API once over a few storage primitives. Anything that stores nothing itself --
a wrapper that journals or injects faults, a scripted test double -- implements
:class:`Ledger` (most easily by extending :class:`DelegatingLedger` and
overriding what it changes).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from ..bodies import DecisionStateBody
from ..errors import LedgerError
from ..identity import ExecutionIdentity, ResultReceipt
from ..store.joint import JointWrite, StoreKey
from ..store.lifecycle import Closable
from .machine import ClaimRecord, DecisionOrigin
from .query import AuditPage, AuditQuery, DecisionPage, DecisionQuery
from .states import AuditEntry, ClaimOutcome, ClaimState, Completed, JointOutcome, Pending

__all__ = [
    "ClaimKey",
    "DelegatingLedger",
    "Ledger",
    "LedgerEntry",
    "PruneProgress",
    "decision_state_body",
]

T = TypeVar("T")

#: Called with the number of records pruned so far, after each batch.
PruneProgress = Callable[[int], None]


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


class Ledger(Closable, abc.ABC):
    """Durable claim ledger: at most one live owner per decision, fenced completion.

    All times are Unix-epoch milliseconds; a time left as ``None`` means the
    ledger's own clock (:meth:`now_ms`). Failures raise
    :class:`~flowdecision.errors.LedgerError`; a ``decision_id`` or
    ``owner_id`` that breaks the identifier rule (:mod:`flowdecision.limits`)
    raises :class:`~flowdecision.errors.InvalidIdentifierError`, a
    :class:`LedgerError` too, before the store is touched. Use as an async context manager,
    or call :meth:`close` (a no-op for ledgers that hold nothing). The rules
    behind each call are in ``docs/PROTOCOL.md``.
    """

    @abc.abstractmethod
    async def claim(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
        origin: DecisionOrigin | None = None,
    ) -> ClaimOutcome:
        """Claim the decision for ``owner_id`` for ``lease_ms``.

        Returns ``Claimed(attempt)`` (a new claim, a takeover of an expired or
        released one, or the same owner re-claiming), ``AlreadyCompleted()``,
        ``Busy(lease_expires_at_ms)`` or ``Conflict()`` (different request hash
        or identity). A legacy record without identity takes ``identity``.
        ``origin`` (run and causing event) is kept beside a new record, for
        :meth:`list_decisions`.
        """

    @abc.abstractmethod
    async def renew(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
    ) -> bool:
        """Extend a live lease held by ``owner_id``.

        False after completion, takeover, release, expiry or identity conflict.
        """

    @abc.abstractmethod
    async def complete(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        completed_at_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
        receipt: ResultReceipt | None = None,
        traceparent: str | None = None,
    ) -> bool:
        """Record completion; only the current owner with a live lease may complete.

        A ``receipt`` needs an ``identity`` and must be bound to it. Completing
        an already-completed record succeeds for any caller (as in the seed);
        the result tells the two apart: True when the decision is completed by
        ``owner_id`` (by this call or an earlier one), False when another owner
        had already completed it. ``traceparent`` (the completing dispatch's W3C
        trace context) is side data kept with a new completion where the ledger
        has room for it (SQLite, PostgreSQL, memory; never the JSON file).
        """

    @abc.abstractmethod
    async def release(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> None:
        """Give up ``owner_id``'s lease so the next claim can proceed (a new attempt)."""

    @abc.abstractmethod
    async def inspect(
        self,
        decision_id: str,
        request_hash: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> ClaimState:
        """The claim's redacted state; a hash or identity mismatch raises."""

    @abc.abstractmethod
    async def lookup(self, decision_id: str) -> LedgerEntry | None:
        """Read a record by decision id alone, redacted (no owner): for the service."""

    @abc.abstractmethod
    async def read_record(self, decision_id: str) -> ClaimRecord | None:
        """The whole stored record, owner and lease included, or None.

        For operator tools and verification (the crash harness compares it with
        its journals). Unlike :meth:`lookup` it exposes the owner id, so do not
        serve it to clients.
        """

    @abc.abstractmethod
    async def completed_receipt(self, decision_id: str) -> ResultReceipt | None:
        """The result receipt stored with a completed decision, if any."""

    @abc.abstractmethod
    async def prune_completed(
        self,
        before_ms: int,
        *,
        progress: PruneProgress | None = None,
        keep_tombstones: bool | None = None,
    ) -> int:
        """Remove completed records whose completion time is before ``before_ms``.

        Large stores prune in batches (short transactions); ``progress``, if
        given, is called with the running total after each batch.
        ``keep_tombstones`` (None: the ledger's own setting, off unless
        configured) replaces each pruned record with its tombstone instead of
        deleting it, so a late duplicate is still answered as a duplicate.
        Without it a pruned id can be submitted again (the seed's behaviour).
        """

    @abc.abstractmethod
    async def prune_tombstones(
        self, before_ms: int, *, progress: PruneProgress | None = None
    ) -> int:
        """Delete tombstones of decisions completed before ``before_ms``: the dedup horizon."""

    # -- operator queries and actions ----------------------------------------------

    @abc.abstractmethod
    async def list_decisions(
        self, query: DecisionQuery, *, now_ms: int | None = None
    ) -> DecisionPage:
        """One keyset page of the decisions ``query`` selects (states taken at ``now_ms``)."""

    @abc.abstractmethod
    async def count_decisions(self, query: DecisionQuery, *, now_ms: int | None = None) -> int:
        """How many decisions ``query``'s filters select (cursor and limit ignored)."""

    @abc.abstractmethod
    async def operator_release(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        """Release a pending claim, live or expired, fenced, and audit it in one transaction.

        The owner is cleared and ``attempts`` (the fencing token) bumped, so
        the old owner can never renew or complete. Raises
        :class:`~flowdecision.errors.ActionRefusedError` for a completed
        decision or tombstone, :class:`~flowdecision.errors.UnknownDecisionError`
        for an unknown id. Returns the audit entry written.
        """

    @abc.abstractmethod
    async def forget(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        """Delete a completed decision or a tombstone so its id can be used again, audited.

        ``reason`` must be given. Refuses a pending claim (release it first).
        """

    @abc.abstractmethod
    async def audit(self, query: AuditQuery) -> AuditPage:
        """A page of the append-only audit trail, oldest first."""

    @abc.abstractmethod
    def now_ms(self) -> int:
        """The ledger's clock, in Unix-epoch milliseconds."""

    # -- the joint path (a sink sharing the ledger's store) -------------------------

    def store_key(self) -> StoreKey | None:
        """Where the ledger lives, if other components can write in its transactions.

        None (the default, and for memory and JSON file ledgers): no sink can
        join; the dispatcher uses claim, submit, complete.
        """
        return None

    async def joint_commit(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        identity: ExecutionIdentity,
        receipt: ResultReceipt,
        write: JointWrite,
        traceparent: str | None = None,
        origin: DecisionOrigin | None = None,
    ) -> JointOutcome:
        """Claim, write ``write``'s row and complete, in ONE transaction (a joint commit).

        The claim rules run first, exactly as :meth:`claim`'s; only when they
        answer ``Claimed(attempt)`` is the row written (with that attempt), and
        then the completion rules run on the claimed record, exactly as
        :meth:`complete`'s. All of it commits together or not at all: a
        refused row or a rule failure raises and stores nothing. ``Busy``,
        ``Conflict`` and ``AlreadyCompleted`` are returned (as
        ``JointOutcome.claim``) as :meth:`claim` returns them, with nothing
        written. Concurrent calls share commits (group commit) like every
        other mutation.

        Only ledgers whose :meth:`store_key` is not None support it.
        ``traceparent`` is side data kept with the completion, as for
        :meth:`complete`.
        """
        raise LedgerError(f"{type(self).__name__} cannot write other rows in its transactions")

    async def claim_and_complete(self, *args: Any, **kwargs: Any) -> ClaimOutcome:
        """The old name of :meth:`joint_commit` (same arguments), answering only the
        claim's outcome."""
        return (await self.joint_commit(*args, **kwargs)).claim


class DelegatingLedger(Ledger):
    """A :class:`Ledger` that forwards every call to ``inner``.

    Extend it to observe or alter calls of a real ledger and override only
    what changes: :meth:`intercept` sees each mutation (``claim``, ``renew``,
    ``complete``, ``release``, ``joint_commit``) as it is forwarded, and
    :meth:`around` sees it with its decision id; any method can be overridden
    as well. Closing it closes ``inner``.

    The mutations, :meth:`inspect` and :meth:`prune_completed` forward their
    arguments as given (``inner`` checks them), so their signatures are written
    once, on :class:`Ledger`.
    """

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner

    async def intercept(self, operation: str, call: Awaitable[T]) -> T:
        """Await one forwarded mutation (``operation`` names it); returns its result.

        The default awaits ``call``. An override may act before or after it, or
        raise instead (then it must ``close()`` the coroutine it did not await).
        """
        return await call

    async def around(self, operation: str, decision_id: str, call: Awaitable[T]) -> T:
        """Like :meth:`intercept`, with the call's decision id; the default hands
        the call to :meth:`intercept` (override either one)."""
        return await self.intercept(operation, call)

    async def claim(self, decision_id: str, *args: Any, **kwargs: Any) -> ClaimOutcome:
        return await self.around(
            "claim", decision_id, self.inner.claim(decision_id, *args, **kwargs)
        )

    async def renew(self, decision_id: str, *args: Any, **kwargs: Any) -> bool:
        return await self.around(
            "renew", decision_id, self.inner.renew(decision_id, *args, **kwargs)
        )

    async def complete(self, decision_id: str, *args: Any, **kwargs: Any) -> bool:
        call = self.inner.complete(decision_id, *args, **kwargs)
        return await self.around("complete", decision_id, call)

    async def release(self, decision_id: str, *args: Any, **kwargs: Any) -> None:
        call = self.inner.release(decision_id, *args, **kwargs)
        await self.around("release", decision_id, call)

    async def joint_commit(self, decision_id: str, *args: Any, **kwargs: Any) -> JointOutcome:
        call = self.inner.joint_commit(decision_id, *args, **kwargs)
        return await self.around("joint_commit", decision_id, call)

    async def inspect(self, *args: Any, **kwargs: Any) -> ClaimState:
        return await self.inner.inspect(*args, **kwargs)

    async def lookup(self, decision_id: str) -> LedgerEntry | None:
        return await self.inner.lookup(decision_id)

    async def read_record(self, decision_id: str) -> ClaimRecord | None:
        return await self.inner.read_record(decision_id)

    async def completed_receipt(self, decision_id: str) -> ResultReceipt | None:
        return await self.inner.completed_receipt(decision_id)

    async def prune_completed(self, *args: Any, **kwargs: Any) -> int:
        return await self.inner.prune_completed(*args, **kwargs)

    async def prune_tombstones(
        self, before_ms: int, *, progress: PruneProgress | None = None
    ) -> int:
        return await self.inner.prune_tombstones(before_ms, progress=progress)

    async def list_decisions(
        self, query: DecisionQuery, *, now_ms: int | None = None
    ) -> DecisionPage:
        return await self.inner.list_decisions(query, now_ms=now_ms)

    async def count_decisions(self, query: DecisionQuery, *, now_ms: int | None = None) -> int:
        return await self.inner.count_decisions(query, now_ms=now_ms)

    async def operator_release(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        return await self.intercept(
            "operator_release",
            self.inner.operator_release(decision_id, actor=actor, reason=reason),
        )

    async def forget(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        return await self.intercept(
            "forget", self.inner.forget(decision_id, actor=actor, reason=reason)
        )

    async def audit(self, query: AuditQuery) -> AuditPage:
        return await self.inner.audit(query)

    def now_ms(self) -> int:
        return self.inner.now_ms()

    def store_key(self) -> StoreKey | None:
        return self.inner.store_key()

    async def close(self) -> None:
        await self.inner.close()
