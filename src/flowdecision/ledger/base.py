"""The ledger: its public API, documented and written once over a few storage primitives.

:class:`Ledger` is what the dispatcher, the service, the CLI and operator
tools use. A storage backend subclasses it and supplies only:

* ``_apply(decision_id, op)``: load the record, call ``op(record, clock_ms)``
  and, if the transition changed it, store the new record -- all atomically
  with respect to every other writer of the same store;
* ``_read(decision_id)``: load one record (a consistent snapshot);
* ``_prune(before_ms, progress, mode)``: delete the records :func:`machine.is_prunable`
  selects, or turn them into tombstones, or delete old tombstones
  (:class:`PruneMode`; in batches where the store is large), reporting progress;
* ``_act(decision_id, op)``: an operator action: load, transform (or delete),
  and append the audit entry it returns, in one transaction;
* ``_list``, ``_count``, ``_audit``: the operator queries (scans or indexes);
* ``now_ms()``: the backend's clock (the database clock for PostgreSQL);
* with run invariants (:attr:`Ledger.run_invariants`), ``_apply`` also takes a
  :class:`RunBound` operation: it loads the run's record too, in the same
  transaction, and stores the transition's ``run``; ``_read_run`` reads one.

A transition that creates a record carries its :class:`~.machine.Creation`
(first-claim time, run, causing event): backends keep it beside the record.

Argument validation, identity fencing and receipt binding live here, so every
backend enforces exactly the same rules. Anything that stores nothing itself
(a wrapper that journals or injects faults, a scripted test double) extends
:class:`~flowdecision.ledger.delegating.DelegatingLedger` instead, which
forwards every public call.
"""

from __future__ import annotations

import abc
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from ..connections.closing import Closable
from ..core.identity import ExecutionIdentity, ResultReceipt
from ..core.limits import IDENTIFIER_FIELDS, check_identifier, plain_identifiers
from ..errors import ActionRefusedError, LedgerError
from ..store.chain import ChainReport, verify_rows
from ..store.joint import JointRow, StoreKey
from . import machine
from .machine import (
    TERMINAL_KINDS,
    ClaimRecord,
    ClaimStatus,
    DecisionOrigin,
    HoldTerms,
    Transition,
    check_u64,
)
from .query import (
    MAX_PAGE_LIMIT,
    AuditPage,
    AuditQuery,
    DecisionPage,
    DecisionQuery,
    StoredDecision,
    scan_audit,
    scan_count,
    scan_page,
)
from .states import (
    Acted,
    AuditEntry,
    Claimed,
    ClaimKey,
    ClaimOutcome,
    ClaimState,
    DecisionState,
    JointOutcome,
    LedgerEntry,
    RunState,
    new_claim_key,
)

__all__ = [
    "EXPIRY_ACTOR",
    "HoldOperation",
    "JointOperation",
    "Ledger",
    "LedgerEntry",
    "Operation",
    "PruneMode",
    "PruneProgress",
    "RunBound",
    "RunOperation",
    "ScanningLedger",
    "wall_clock_ms",
]

T = TypeVar("T")

#: Called with the number of records pruned so far, after each batch.
PruneProgress = Callable[[int], None]
#: A transition bound to its arguments: ``op(record, clock_ms) -> Transition``.
Operation = Callable[[ClaimRecord | None, int], Transition[T]]
#: A transition under its run's invariants: ``op(record, run, clock_ms) -> Transition``.
RunOperation = Callable[[ClaimRecord | None, RunState | None, int], Transition[T]]


@dataclass(frozen=True, slots=True)
class RunBound(Generic[T]):
    """An operation under its run's invariants, for a backend's ``_apply``.

    The backend loads the record of run ``run_id`` (None when it has none)
    together with the decision's record, in the same transaction, calls
    ``op(record, run, clock)``, and stores the transition's record and, when
    set, its ``run`` -- atomically with every other writer of the store, so
    the check and the close hold across processes and hosts.
    """

    run_id: str
    op: RunOperation[T]
    #: Whether it may change the run's record (a terminal decision's claim or
    #: completion); other operations of the run only read it.
    closes: bool = False


#: :func:`machine.claim` or :func:`_renew_rule`:
#: ``rule(record, key, owner_id, now_ms, lease_ms, origin)``.
_LeaseRule = Callable[
    [ClaimRecord | None, ClaimKey, str, int, int, DecisionOrigin | None], Transition[T]
]


@dataclass(frozen=True, slots=True)
class JointOperation:
    """``joint_commit`` bound to its arguments, for a backend's ``_apply_joint``.

    A backend runs, in one transaction and on one clock value: ``claim`` on the
    record; if its result is ``Claimed(attempt)``, ``complete`` on the claimed
    record (both pure), then the joint ``row`` with that attempt
    (``store.joint``'s insert for its dialect); and stores the completed
    record only if all three succeeded. Otherwise it stores what ``claim``
    alone left (a refused claim changes nothing, except a legacy completed
    record binding its identity).

    ``claim`` and ``complete`` take ``(record, run, clock)``. With ``run_id``
    (run invariants on) the backend loads that run's record in the same
    transaction and passes it (``complete`` gets the run as ``claim`` left it:
    its transition's ``run``, if set), and stores the last ``run`` set; without,
    ``run`` is None.
    """

    claim: RunOperation[ClaimOutcome]
    complete: RunOperation[bool]
    row: JointRow
    run_id: str | None = None
    #: As :attr:`RunBound.closes`.
    closes: bool = False


@dataclass(frozen=True, slots=True)
class HoldOperation:
    """An operator's action on a held decision, for a backend's ``_act_on_hold``.

    In ONE transaction, on one clock value: ``rule(record, run, clock)`` (with
    ``run_id``, the run's record is loaded and locked as for :class:`RunBound`;
    else ``run`` is None); when its :class:`~.states.Acted` outcome is
    ``Claimed`` and ``row`` is set (the joint path), the joint row with that
    attempt, then ``complete`` on the claimed record; the resulting record and
    run stored; the rule's audit entry (if any) appended to the chained audit
    trail. A refused row or a rule failure stores nothing.
    """

    rule: RunOperation[Acted]
    run_id: str | None = None
    row: JointRow | None = None
    complete: RunOperation[bool] | None = None

    def apply(self, record: ClaimRecord | None, run: RunState | None, clock: int) -> HoldApplied:
        """The pure part, the same on every backend: the rule and, on the joint path,
        the completion rules on the claimed record; the backend then writes the row
        (with :attr:`HoldApplied.row_attempt`), the record, the run and the entry."""
        transition = self.rule(record, run, clock)
        acted, stored, closed = transition.result, transition.record, transition.run
        outcome = acted.outcome
        attempt = None
        if self.row is not None and isinstance(outcome, Claimed):
            assert self.complete is not None
            completed = self.complete(stored, closed or run, clock)
            stored, closed = completed.record, completed.run or closed
            attempt = outcome.attempt
        return HoldApplied(acted, stored if transition.changed else None, closed, attempt)


@dataclass(frozen=True, slots=True)
class HoldApplied:
    """What :meth:`HoldOperation.apply` decided: the result, the record to store (None:
    none changed), the run to store (None: unchanged) and, on the joint path, the
    attempt to write the joint row with (None: no row)."""

    acted: Acted
    record: ClaimRecord | None
    run: RunState | None
    row_attempt: int | None


#: Who an automatic expiry of a hold is audited as.
EXPIRY_ACTOR = "flowdecision"


class PruneMode(Enum):
    """What a prune does with the records it selects."""

    #: The seed's prune: delete completed records completed before the cutoff.
    DELETE = "delete"
    #: ``--keep-tombstones``: replace those records with their tombstones.
    TOMBSTONE = "tombstone"
    #: ``--tombstones-before``: delete tombstones of decisions completed before the cutoff.
    TOMBSTONES = "tombstones"

    def selects(self, record: ClaimRecord, before_ms: int) -> bool:
        """Whether this prune acts on ``record`` (the rule the SQL mirrors)."""
        if self is PruneMode.TOMBSTONES:
            return machine.is_tombstone_prunable(record, before_ms)
        return machine.is_prunable(record, before_ms)


#: Longest actor and reason of an operator action (characters).
ACTOR_MAX = 200
REASON_MAX = 2000


def _renew_rule(
    record: ClaimRecord | None,
    key: ClaimKey,
    owner_id: str,
    now_ms: int,
    lease_ms: int,
    origin: DecisionOrigin | None,
) -> Transition[bool]:
    """:func:`machine.renew` as a lease rule (a renewal creates nothing: no origin)."""
    return machine.renew(record, key, owner_id, now_ms, lease_ms)


def wall_clock_ms() -> int:
    """Unix-epoch milliseconds from this host's clock."""
    return time.time_ns() // 1_000_000


def _check_texts(**values: object) -> None:
    # Every store keeps these as UTF-8; a lone surrogate would fail deep inside a
    # backend (and, with group commit, take its batch neighbours down with it).
    for name, value in values.items():
        _check_text(name, value)


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise LedgerError(f"`{name}` must be a string, got {type(value).__name__}")
    if name in IDENTIFIER_FIELDS:
        # Same limit on every backend (PostgreSQL's index would refuse huge ids).
        check_identifier(name, value)
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LedgerError(f"`{name}` is not valid Unicode text (lone surrogate)") from None


def _check_owned(decision_id: object, request_hash: object, owner_id: object) -> None:
    """:func:`_check_texts` for the three texts of every mutation, without building
    a dict of them (it runs once per ledger call)."""
    if plain_identifiers(decision_id, request_hash, owner_id):
        return  # (a plain id is also a valid hash text)
    _check_text("decision_id", decision_id)
    _check_text("request_hash", request_hash)
    _check_text("owner_id", owner_id)


def _check_identity(identity: ExecutionIdentity | None) -> None:
    if identity is None:
        return
    try:
        identity.validate()
    except ValueError as error:
        raise LedgerError(str(error)) from error


def _check_receipt(identity: ExecutionIdentity | None, receipt: ResultReceipt | None) -> None:
    if receipt is None:
        return
    if identity is None:
        raise LedgerError("decision result receipt requires an execution identity")
    # A ResultReceipt is validated when constructed and is immutable: no re-check here.
    if receipt.identity is not identity and receipt.identity != identity:
        raise LedgerError("decision result receipt identity conflicts with its claim")


#: A W3C ``traceparent`` is 55 characters; anything else is not kept (side data only).
_TRACEPARENT_LEN = 55


def _check_traceparent(value: str | None) -> str | None:
    # Side data for observability: a malformed value is dropped, never an error.
    if value is None or not isinstance(value, str) or len(value) != _TRACEPARENT_LEN:
        return None
    return value if value.isascii() and value.isprintable() else None


class Ledger(Closable, abc.ABC):
    """Durable claim ledger: at most one live owner per decision, fenced completion.

    All times are Unix-epoch milliseconds; a time left as ``None`` means the
    ledger's own clock (:meth:`now_ms`). Failures raise
    :class:`~flowdecision.errors.LedgerError`; a ``decision_id`` or
    ``owner_id`` that breaks the identifier rule (:mod:`flowdecision.core.limits`)
    raises :class:`~flowdecision.errors.InvalidIdentifierError`, a
    :class:`LedgerError` too, before the store is touched. Use as an async context manager,
    or call :meth:`close` (a no-op for ledgers that hold nothing). The rules
    behind each call are in ``docs/PROTOCOL.md``.

    Each public call validates its arguments and runs the pure transitions of
    :mod:`.machine` through the storage primitives (the module docstring lists
    them), which a backend implements (and :meth:`now_ms` when the store has
    its own clock).
    """

    #: What :meth:`prune_completed` does when not told: keep tombstones or not.
    keep_tombstones: bool = False
    #: Whether claims and completions that name their run (``origin``) keep the
    #: run invariants (docs/PROTOCOL.md, "Runs"): off here and on the memory and
    #: JSON file ledgers (the seed's behaviour), on by default on SQLite and
    #: PostgreSQL.
    run_invariants: bool = False

    @property
    def runs_supported(self) -> bool:
        """Whether this kind of ledger can keep the run invariants at all (the JSON
        file ledger, shared with Rust hosts, cannot)."""
        return False

    @property
    def holds_supported(self) -> bool:
        """Whether this kind of ledger can hold decisions for approval: the ledgers
        that keep runs (their records are this project's own; the JSON file ledger's
        are the seed's, shared live with Rust hosts, which know no held state)."""
        return self.runs_supported

    # -- storage primitives -------------------------------------------------

    @abc.abstractmethod
    async def _apply(self, decision_id: str, op: Operation[T] | RunBound[T]) -> T:
        """Atomically load, transform (``op``) and store one record (and, for a
        :class:`RunBound` operation, its run's record)."""

    async def _read_run(self, run_id: str) -> RunState | None:
        """The stored record of run ``run_id``, or None (ledgers without run invariants)."""
        return None

    @abc.abstractmethod
    async def _read(self, decision_id: str) -> ClaimRecord | None:
        """Load one record, or None."""

    @abc.abstractmethod
    async def _prune(self, before_ms: int, progress: PruneProgress | None, mode: PruneMode) -> int:
        """Act on every record ``mode.selects``; return the count.

        DELETE and TOMBSTONES delete; TOMBSTONE replaces each record with
        :func:`machine.tombstone_of` (its creation and origin stay).
        Call ``progress(total_so_far)`` after each committed batch.
        """

    @abc.abstractmethod
    async def _act(self, decision_id: str, op: Operation[AuditEntry]) -> AuditEntry:
        """Atomically: load, ``op`` (its record stored, or deleted when None), append its entry.

        The store assigns the entry's ``seq``; the returned entry carries it.
        """

    @abc.abstractmethod
    async def _list(self, query: DecisionQuery, now_ms: int) -> DecisionPage:
        """One page for ``query`` (:func:`~.query.scan_page` is the reference answer)."""

    @abc.abstractmethod
    async def _count(self, query: DecisionQuery, now_ms: int) -> int:
        """How many decisions ``query`` selects."""

    @abc.abstractmethod
    async def _audit(self, query: AuditQuery) -> AuditPage:
        """A page of the audit trail."""

    async def _due_holds(self, now_ms: int) -> list[str]:
        """The held decisions whose hold expired by ``now_ms`` (the SQL ledgers ask
        their store; this reads every held decision's row)."""
        due: list[str] = []
        query: DecisionQuery | None = DecisionQuery(state=DecisionState.HELD, limit=MAX_PAGE_LIMIT)
        while query is not None:
            page = await self.list_decisions(query, now_ms=now_ms)
            due += [
                row.decision_id
                for row in page.decisions
                if row.hold_expires_at_ms is not None and row.hold_expires_at_ms <= now_ms
            ]
            query = None if page.next_cursor is None else query.next_page(page.next_cursor)
        return due

    async def _act_on_hold(self, decision_id: str, op: HoldOperation) -> Acted:
        """Atomically apply an operator's action on a held decision (:class:`HoldOperation`);
        the returned :class:`Acted` carries the appended entry (its ``seq``) and, on the
        joint path, ``inserted``."""
        raise LedgerError(f"{type(self).__name__} cannot hold decisions for approval")

    async def _apply_joint(self, decision_id: str, joint: JointOperation) -> JointOutcome:
        """Atomically claim, write the joint row and complete (see :class:`JointOperation`).

        Only backends with a :meth:`store_key` implement it.
        """
        raise LedgerError(f"{type(self).__name__} cannot write other rows in its transactions")

    def now_ms(self) -> int:
        """The ledger's clock, in Unix-epoch milliseconds."""
        return wall_clock_ms()

    # -- the public API -----------------------------------------------------

    def store_key(self) -> StoreKey | None:
        """Where the ledger lives, if other components can write in its transactions.

        None (the default, and for memory and JSON file ledgers): no sink can
        join; the dispatcher uses claim, submit, complete.
        """
        return None

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
        hold: HoldTerms | None = None,
    ) -> ClaimOutcome:
        """Claim the decision for ``owner_id`` for ``lease_ms``.

        Returns ``Claimed(attempt)`` (a new claim, a takeover of an expired or
        released one, or the same owner re-claiming), ``AlreadyCompleted()``,
        ``Busy(lease_expires_at_ms)`` or ``Conflict()`` (different request hash
        or identity). A legacy record without identity takes ``identity``.
        ``origin`` (run and causing event) is kept beside a new record, for
        :meth:`list_decisions`. ``hold`` (approval holds: the policy holds this
        decision): a new decision is recorded held instead, answered
        ``AwaitingApproval``; a held or rejected one answers so whatever
        ``hold`` is (docs/PROTOCOL.md, "Approval holds").
        """
        if origin is not None:
            _check_origin(origin)
        self._check_hold(hold)
        key = new_claim_key((decision_id, request_hash, identity))
        run_id = self._run_of(origin)
        if run_id is None:
            if hold is None:
                return await self._leased(machine.claim, key, owner_id, lease_ms, now_ms, origin)
            fixed_at = _lease_args(key, owner_id, lease_ms, now_ms)
            return await self._apply(
                decision_id,
                lambda record, clock: machine.claim(
                    record,
                    key,
                    owner_id,
                    clock if fixed_at is None else fixed_at,
                    lease_ms,
                    origin,
                    hold,
                ),
            )
        assert origin is not None
        fixed = _lease_args(key, owner_id, lease_ms, now_ms)
        bound = origin

        def rule(record: ClaimRecord | None, run: RunState | None, clock: int) -> Transition[Any]:
            at = clock if fixed is None else fixed
            return machine.run_claim(record, run, key, owner_id, at, lease_ms, bound, hold)

        closes = origin.terminal is not None
        result: ClaimOutcome = await self._apply(decision_id, RunBound(run_id, rule, closes))
        return result

    def _check_hold(self, hold: HoldTerms | None) -> None:
        """Refuse a malformed ``hold``, or any hold on a ledger that cannot keep one."""
        if hold is None:
            return
        if not isinstance(hold, HoldTerms):
            raise LedgerError(f"`hold` must be a HoldTerms, got {type(hold).__name__}")
        if not self.holds_supported:
            raise LedgerError(
                f"{type(self).__name__} cannot hold decisions for approval (the JSON file "
                "ledger is shared with Rust hosts, which know no held state): use a SQLite, "
                "PostgreSQL or memory ledger"
            )
        _check_texts(request=hold.request)
        if hold.expire_ms is not None:
            check_u64("hold.expire_ms", hold.expire_ms)

    def _run_of(self, origin: DecisionOrigin | None) -> str | None:
        """The run whose invariants a call keeps: its origin's, when this ledger keeps them."""
        if not self.run_invariants or origin is None:
            return None
        return origin.run_id

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
        key = new_claim_key((decision_id, request_hash, identity))
        return await self._leased(_renew_rule, key, owner_id, lease_ms, now_ms, None)

    def _leased(
        self,
        rule: _LeaseRule[T],
        key: ClaimKey,
        owner_id: str,
        lease_ms: int,
        now_ms: int | None,
        origin: DecisionOrigin | None,
    ) -> Awaitable[T]:
        """Validate the arguments :meth:`claim` and :meth:`renew` share; ``rule`` applied
        (the backend's awaitable itself: no coroutine of its own around it)."""
        fixed = _lease_args(key, owner_id, lease_ms, now_ms)
        return self._apply(
            key.decision_id,
            lambda record, clock: rule(
                record, key, owner_id, clock if fixed is None else fixed, lease_ms, origin
            ),
        )

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
        origin: DecisionOrigin | None = None,
    ) -> bool:
        """Record completion; only the current owner with a live lease may complete.

        A ``receipt`` needs an ``identity`` and must be bound to it. Completing
        an already-completed record succeeds for any caller (as in the seed);
        the result tells the two apart: True when the decision is completed by
        ``owner_id`` (by this call or an earlier one), False when another owner
        had already completed it. ``traceparent`` (the completing dispatch's W3C
        trace context) is side data kept with a new completion where the ledger
        has room for it (SQLite, PostgreSQL, memory; never the JSON file).
        ``origin`` names the decision's run: with :attr:`run_invariants`, the
        completion of the run's terminal decision closes the run in the same
        transaction (the dispatcher always gives it).
        """
        _check_owned(decision_id, request_hash, owner_id)
        fixed = None if completed_at_ms is None else check_u64("completed_at_ms", completed_at_ms)
        _check_identity(identity)
        _check_receipt(identity, receipt)
        key = new_claim_key((decision_id, request_hash, identity))
        trace = _check_traceparent(traceparent)
        if origin is not None:
            _check_origin(origin)
        run_id = self._run_of(origin)
        if run_id is not None:

            def rule(record: ClaimRecord | None, run: RunState | None, clock: int) -> Any:
                at = clock if fixed is None else fixed
                return machine.run_complete(record, run, key, owner_id, receipt, at, trace)

            assert origin is not None
            closes = origin.terminal is not None
            done: bool = await self._apply(decision_id, RunBound(run_id, rule, closes))
            return done
        return await self._apply(
            decision_id,
            lambda record, clock: machine.complete(
                record, key, owner_id, receipt, clock if fixed is None else fixed, trace
            ),
        )

    async def joint_commit(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        identity: ExecutionIdentity,
        receipt: ResultReceipt,
        row: JointRow,
        traceparent: str | None = None,
        origin: DecisionOrigin | None = None,
        hold: HoldTerms | None = None,
    ) -> JointOutcome:
        """Claim, write ``row`` and complete, in ONE transaction (a joint commit).

        The claim rules run first, exactly as :meth:`claim`'s; only when they
        answer ``Claimed(attempt)`` do the completion rules run on the claimed
        record, exactly as :meth:`complete`'s, and is the row written (with
        that attempt; ``JointOutcome.inserted`` says whether it was new or a
        replay). All of it commits together or not at all: a refused row (the
        table's conflict error) or a rule failure raises and stores nothing; a
        database error fails every decision of the transaction. ``Busy``,
        ``Conflict`` and ``AlreadyCompleted`` are returned (as
        ``JointOutcome.claim``) as :meth:`claim` returns them, with nothing
        written. Concurrent calls share commits (group commit) like every
        other mutation.

        Only ledgers whose :meth:`store_key` is not None support it.
        ``traceparent`` is side data kept with the completion, as for
        :meth:`complete`. ``hold``: as :meth:`claim`'s (a held decision writes
        no row).
        """
        _check_owned(decision_id, request_hash, owner_id)
        if origin is not None:
            _check_origin(origin)
        check_u64("lease_ms", lease_ms)
        _check_identity(identity)
        _check_receipt(identity, receipt)
        self._check_hold(hold)
        self._check_joint_row(decision_id, row)

        key = new_claim_key((decision_id, request_hash, identity))
        trace = _check_traceparent(traceparent)
        run_id = self._run_of(origin)
        complete = _completion_rule(key, owner_id, receipt, trace, run_id is not None)
        if run_id is not None:
            assert origin is not None
            bound = origin

            def run_claim(
                record: ClaimRecord | None, run: RunState | None, clock: int
            ) -> Transition[ClaimOutcome]:
                return machine.run_claim(record, run, key, owner_id, clock, lease_ms, bound, hold)

            joint = JointOperation(run_claim, complete, row, run_id, bound.terminal is not None)
            return await self._apply_joint(decision_id, joint)

        def claim(
            record: ClaimRecord | None, _run: RunState | None, clock: int
        ) -> Transition[ClaimOutcome]:
            return machine.claim(record, key, owner_id, clock, lease_ms, origin, hold)

        return await self._apply_joint(decision_id, JointOperation(claim, complete, row))

    def _check_joint_row(self, decision_id: str, row: JointRow) -> None:
        """Refuse a joint row for another store or another decision."""
        store = self.store_key()
        if store is None or (row.store is not store and row.store != store):
            where = "no shared store" if store is None else f"{store.kind} store {store.where}"
            raise LedgerError(
                f"a joint row for {row.store.kind} store {row.store.where} cannot join "
                f"this ledger's transaction ({where})"
            )
        if row.decision_id != decision_id:
            raise LedgerError(
                f"joint row for decision `{row.decision_id}` offered with `{decision_id}`"
            )

    # -- approval holds (docs/PROTOCOL.md, "Approval holds") -----------------------

    async def approve(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        actor: str,
        reason: str,
        identity: ExecutionIdentity | None = None,
        origin: DecisionOrigin | None = None,
        receipt: ResultReceipt | None = None,
        row: JointRow | None = None,
        traceparent: str | None = None,
    ) -> Acted:
        """An operator approves a held decision: ONE transaction claims it for
        ``owner_id`` (attempt 1, under the claim and, with ``origin``, the run
        rules) and appends an ``approve`` entry to the audit trail.

        With ``row`` (a joint sink's row: the joint path) the same transaction
        also writes the row and completes the decision with ``receipt``, so the
        approval, the claim and the row commit together or not at all. Without,
        the caller now owns a claim to submit and complete (``Dispatcher.approve``
        does both). See :func:`machine.approve` for the other answers
        (``AlreadyCompleted``, ``Busy``, ``RunClosed``; an expired hold is
        rejected instead, audited ``expire``) and refusals.
        """
        entry = _action_entry("approve", decision_id, actor, reason)
        _check_owned(decision_id, request_hash, owner_id)
        check_u64("lease_ms", lease_ms)
        _check_identity(identity)
        if origin is not None:
            _check_origin(origin)
        key = new_claim_key((decision_id, request_hash, identity))
        run_id = self._run_of(origin)
        runs = run_id is not None

        def rule(record: ClaimRecord | None, run: RunState | None, clock: int) -> Transition[Acted]:
            at = _at(entry, clock)
            return machine.approve(record, run, key, owner_id, clock, lease_ms, origin, at, runs)

        complete = None
        if row is not None:
            if identity is None or receipt is None:
                raise LedgerError("a joint approval needs the decision's identity and receipt")
            _check_receipt(identity, receipt)
            self._check_joint_row(decision_id, row)
            trace = _check_traceparent(traceparent)
            complete = _completion_rule(key, owner_id, receipt, trace, runs)
        return await self._act_on_hold(decision_id, HoldOperation(rule, run_id, row, complete))

    async def reject(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        """An operator rejects a held decision, audited: it is answered ``rejected`` from
        then on and never sent. If the policy that held it said so, its run closes
        (run invariants on). Refuses anything but a held decision."""
        return await self._end_hold("reject", decision_id, actor, reason)

    async def expire_hold(
        self, decision_id: str, *, actor: str = EXPIRY_ACTOR, reason: str = "the hold expired"
    ) -> AuditEntry:
        """Reject a held decision whose hold has expired, audited as ``expire``; refuses
        one whose hold has not (or that is no longer held)."""
        return await self._end_hold("expire", decision_id, actor, reason)

    async def _end_hold(self, action: str, decision_id: str, actor: str, reason: str) -> AuditEntry:
        entry = _action_entry("reject", decision_id, actor, reason)
        record = await self._read(decision_id)
        run_id = self._run_of(_origin_of_hold(record))
        expiring = action == "expire"

        def rule(record: ClaimRecord | None, run: RunState | None, clock: int) -> Transition[Acted]:
            return machine.reject(record, run, run_id, _at(entry, clock), clock, expiring)

        acted = await self._act_on_hold(decision_id, HoldOperation(rule, run_id))
        assert acted.entry is not None
        return acted.entry

    async def expire_holds(self, *, now_ms: int | None = None) -> list[AuditEntry]:
        """Reject every held decision whose hold has expired by ``now_ms`` (the
        ledger's clock by default), each audited as ``expire``; returns the entries.

        Safe to run from several processes at once: a hold another one expired
        (or an operator acted on) meanwhile is skipped.
        """
        now = await self._query_clock() if now_ms is None else check_u64("now_ms", now_ms)
        done: list[AuditEntry] = []
        for decision_id in await self._due_holds(now):
            try:
                done.append(await self.expire_hold(decision_id))
            except ActionRefusedError:
                continue  # approved, rejected or expired by someone else meanwhile
        return done

    async def release(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> None:
        """Give up ``owner_id``'s lease so the next claim can proceed (a new attempt)."""
        _check_owned(decision_id, request_hash, owner_id)
        _check_identity(identity)
        key = new_claim_key((decision_id, request_hash, identity))
        await self._apply(
            decision_id, lambda record, _clock: machine.release(record, key, owner_id)
        )

    async def inspect(
        self,
        decision_id: str,
        request_hash: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> ClaimState:
        """The claim's redacted state; a hash or identity mismatch raises."""
        _check_texts(decision_id=decision_id, request_hash=request_hash)
        _check_identity(identity)
        record = await self._read(decision_id)
        return machine.inspect(record, new_claim_key((decision_id, request_hash, identity)))

    async def lookup(self, decision_id: str) -> LedgerEntry | None:
        """Read a record by decision id alone, redacted (no owner): for the service."""
        _check_texts(decision_id=decision_id)
        record = await self._read(decision_id)
        if record is None:
            return None
        return LedgerEntry(
            decision_id=decision_id,
            request_hash=record.request_hash,
            state=machine.lookup_state(record),
            attempts=record.attempts,
            execution_identity=record.execution_identity,
            result_receipt=record.result_receipt,
        )

    async def read_record(self, decision_id: str) -> ClaimRecord | None:
        """The whole stored record, owner and lease included, or None.

        For operator tools and verification (the crash harness compares it with
        its journals). Unlike :meth:`lookup` it exposes the owner id, so do not
        serve it to clients.
        """
        _check_texts(decision_id=decision_id)
        return await self._read(decision_id)

    async def completed_receipt(self, decision_id: str) -> ResultReceipt | None:
        """The result receipt stored with a completed decision, if any."""
        _check_texts(decision_id=decision_id)
        record = await self._read(decision_id)
        return None if record is None else record.result_receipt

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
        keep = self.keep_tombstones if keep_tombstones is None else bool(keep_tombstones)
        mode = PruneMode.TOMBSTONE if keep else PruneMode.DELETE
        return await self._prune(check_u64("before_ms", before_ms), progress, mode)

    async def prune_tombstones(
        self, before_ms: int, *, progress: PruneProgress | None = None
    ) -> int:
        """Delete tombstones of decisions completed before ``before_ms``: the dedup horizon."""
        return await self._prune(check_u64("before_ms", before_ms), progress, PruneMode.TOMBSTONES)

    async def _query_clock(self) -> int:
        """The time operator queries judge leases by (PostgreSQL: the database's)."""
        return self.now_ms()

    async def list_decisions(
        self, query: DecisionQuery, *, now_ms: int | None = None
    ) -> DecisionPage:
        """One keyset page of the decisions ``query`` selects (states taken at ``now_ms``)."""
        now = await self._query_clock() if now_ms is None else check_u64("now_ms", now_ms)
        return await self._list(query, now)

    async def count_decisions(self, query: DecisionQuery, *, now_ms: int | None = None) -> int:
        """How many decisions ``query``'s filters select (cursor and limit ignored)."""
        now = await self._query_clock() if now_ms is None else check_u64("now_ms", now_ms)
        return await self._count(query.counting(), now)

    async def run_state(self, run_id: str) -> RunState:
        """The state of run ``run_id`` under the run invariants (docs/PROTOCOL.md, "Runs").

        A run without a record of its own (no terminal decision claimed yet, or
        none of its decisions known) is ``open``: it takes new decisions. On a
        ledger without :attr:`run_invariants` every run is ``open``.
        """
        _check_texts(run_id=run_id)
        found = await self._read_run(run_id)
        return RunState.opened(run_id) if found is None else found

    async def operator_release(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        """Release a pending claim, live or expired, fenced, and audit it in one transaction.

        The owner is cleared and ``attempts`` (the fencing token) bumped, so
        the old owner can never renew or complete. Raises
        :class:`~flowdecision.errors.ActionRefusedError` for a completed
        decision or tombstone, :class:`~flowdecision.errors.UnknownDecisionError`
        for an unknown id. Returns the audit entry written.
        """
        entry = _action_entry("release", decision_id, actor, reason)
        return await self._act(
            decision_id,
            lambda record, clock: machine.operator_release(record, _at(entry, clock), clock),
        )

    async def forget(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        """Delete a completed decision or a tombstone so its id can be used again, audited.

        ``reason`` must be given. Refuses a pending claim (release it first).
        """
        entry = _action_entry("forget", decision_id, actor, reason)
        return await self._act(
            decision_id,
            lambda record, clock: machine.forget(record, _at(entry, clock), clock),
        )

    async def audit(self, query: AuditQuery) -> AuditPage:
        """A page of the append-only audit trail, oldest first."""
        return await self._audit(query)

    async def verify_audit(self) -> ChainReport:
        """Read the whole audit trail and recompute its hash chain: the report names
        the first entry that does not match (docs/OPERATIONS.md, "Verifying the
        audit trail")."""
        entries: list[AuditEntry] = []
        query = AuditQuery(limit=MAX_PAGE_LIMIT)
        while True:
            page = await self.audit(query)
            entries.extend(page.entries)
            if page.next_cursor is None:
                break
            query = AuditQuery(limit=MAX_PAGE_LIMIT, cursor=page.next_cursor)
        return verify_rows(entries)


class ScanningLedger(Ledger):
    """A :class:`Ledger` with no index: the operator queries scan every record.

    Subclasses supply the records and the audit trail as snapshots
    (:meth:`_scanned`, :meth:`_trail`); :func:`~.query.scan_page` and its
    siblings answer from them (the memory and JSON file ledgers).
    """

    @abc.abstractmethod
    async def _scanned(self) -> list[StoredDecision]:
        """Every record (tombstones included) with its creation, as of now."""

    @abc.abstractmethod
    async def _trail(self) -> list[AuditEntry]:
        """The whole audit trail, oldest first."""

    async def _list(self, query: DecisionQuery, now_ms: int) -> DecisionPage:
        return scan_page(await self._scanned(), query, now_ms)

    async def _count(self, query: DecisionQuery, now_ms: int) -> int:
        return scan_count(await self._scanned(), query, now_ms)

    async def _audit(self, query: AuditQuery) -> AuditPage:
        return scan_audit(await self._trail(), query)


def _completion_rule(
    key: ClaimKey,
    owner_id: str,
    receipt: ResultReceipt | None,
    trace: str | None,
    runs: bool,
) -> RunOperation[bool]:
    """The completion rules of a joint commit or approval: :func:`machine.run_complete`
    under the run invariants (``runs``), else :func:`machine.complete`."""
    if runs:

        def run_complete(
            record: ClaimRecord | None, run: RunState | None, clock: int
        ) -> Transition[bool]:
            return machine.run_complete(record, run, key, owner_id, receipt, clock, trace)

        return run_complete

    def complete(record: ClaimRecord | None, _run: RunState | None, clock: int) -> Transition[bool]:
        return machine.complete(record, key, owner_id, receipt, clock, trace)

    return complete


def _origin_of_hold(record: ClaimRecord | None) -> DecisionOrigin | None:
    """The run of a held decision, read from its stored request (None for anything else)."""
    if record is None or record.status is not ClaimStatus.HELD or record.request is None:
        return None
    try:
        run_id = json.loads(record.request).get("run_id")
    except (ValueError, AttributeError):
        return None
    return DecisionOrigin(run_id) if isinstance(run_id, str) else None


def _lease_args(key: ClaimKey, owner_id: str, lease_ms: int, now_ms: int | None) -> int | None:
    """Validate what :meth:`Ledger.claim` and :meth:`Ledger.renew` share; the fixed
    clock (``now_ms``), or None for the ledger's own."""
    decision_id, request_hash, identity = key
    _check_owned(decision_id, request_hash, owner_id)
    check_u64("lease_ms", lease_ms)
    fixed = None if now_ms is None else check_u64("now_ms", now_ms)
    _check_identity(identity)
    return fixed


def _check_origin(origin: DecisionOrigin) -> None:
    if not isinstance(origin, DecisionOrigin):
        raise LedgerError(f"`origin` must be a DecisionOrigin, got {type(origin).__name__}")
    if origin.terminal is not None and origin.terminal not in TERMINAL_KINDS:
        raise LedgerError(
            f"`origin.terminal` must be `complete`, `fail` or None, got {origin.terminal!r}"
        )
    run_id, cause = origin.run_id, origin.causation_event_id
    if plain_identifiers("" if run_id is None else run_id, "" if cause is None else cause):
        return
    for name in ("run_id", "causation_event_id"):
        value = getattr(origin, name)
        if value is not None:
            _check_texts(**{name: value})


def _action_entry(action: str, decision_id: str, actor: str, reason: str) -> AuditEntry:
    """The audit entry an action starts from (validated); the rule fills in the rest."""
    _check_texts(decision_id=decision_id, actor=actor, reason=reason)
    for name, value, longest in (("actor", actor, ACTOR_MAX), ("reason", reason, REASON_MAX)):
        if not value.strip():
            raise LedgerError(f"an operator action needs a non-empty `{name}`")
        if len(value) > longest:
            raise LedgerError(f"`{name}` is longer than {longest} characters")
    return AuditEntry(0, 0, action, decision_id, actor, reason, "", 0)


def _at(entry: AuditEntry, clock: int) -> AuditEntry:
    return AuditEntry(
        entry.seq, clock, entry.action, entry.decision_id, entry.actor, entry.reason, "", 0
    )
