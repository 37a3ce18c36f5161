"""The ledger API, implemented once over a few storage primitives.

A backend subclasses :class:`Ledger` and supplies only:

* ``_apply(decision_id, op)``: load the record, call ``op(record, clock_ms)``
  and, if the transition changed it, store the new record -- all atomically
  with respect to every other writer of the same store;
* ``_read(decision_id)``: load one record (a consistent snapshot);
* ``_prune(before_ms, progress)``: delete the records :func:`machine.is_prunable`
  selects (in batches where the store is large), reporting progress;
* ``now_ms()``: the backend's clock (the database clock for PostgreSQL).

Argument validation, identity fencing and receipt binding live here, so every
backend enforces exactly the same rules.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from ..errors import LedgerError
from ..identity import ExecutionIdentity, ResultReceipt
from ..limits import IDENTIFIER_FIELDS, check_identifier
from . import machine
from .machine import ClaimRecord, Transition, check_u64
from .states import ClaimOutcome, ClaimState

__all__ = ["Ledger", "LedgerEntry", "Operation", "PruneProgress", "wall_clock_ms"]

T = TypeVar("T")

#: A transition bound to its arguments: ``op(record, clock_ms) -> Transition``.
Operation = Callable[[ClaimRecord | None, int], Transition[T]]

#: Called with the number of records pruned so far, after each batch.
PruneProgress = Callable[[int], None]


def wall_clock_ms() -> int:
    """Unix-epoch milliseconds from this host's clock."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """A redacted view of one record, looked up by decision id alone (no owner)."""

    decision_id: str
    request_hash: str
    state: ClaimState
    attempts: int
    execution_identity: ExecutionIdentity | None
    result_receipt: ResultReceipt | None


def _check_texts(**values: object) -> None:
    # Every store keeps these as UTF-8; a lone surrogate would fail deep inside a
    # backend (and, with group commit, take its batch neighbours down with it).
    for name, value in values.items():
        if not isinstance(value, str):
            raise LedgerError(f"`{name}` must be a string, got {type(value).__name__}")
        if name in IDENTIFIER_FIELDS:
            # Same limit on every backend (PostgreSQL's index would refuse huge ids).
            check_identifier(name, value)
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise LedgerError(f"`{name}` is not valid Unicode text (lone surrogate)") from None


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
    if receipt.identity != identity:
        raise LedgerError("decision result receipt identity conflicts with its claim")


class Ledger(abc.ABC):
    """Durable claim ledger: at most one live owner per decision, fenced completion.

    All times are Unix-epoch milliseconds; a time left as ``None`` means the
    ledger's own clock (:meth:`now_ms`). Failures raise :class:`LedgerError`;
    a ``decision_id`` or ``owner_id`` that breaks the identifier rule
    (:mod:`flowdecision.limits`) raises :class:`InvalidIdentifierError`, a
    :class:`LedgerError` too, before the store is touched.
    Use as an async context manager, or call :meth:`close`.
    """

    # -- storage primitives -------------------------------------------------

    @abc.abstractmethod
    async def _apply(self, decision_id: str, op: Operation[T]) -> T:
        """Atomically load, transform (``op``) and store one record."""

    @abc.abstractmethod
    async def _read(self, decision_id: str) -> ClaimRecord | None:
        """Load one record, or None."""

    @abc.abstractmethod
    async def _prune(self, before_ms: int, progress: PruneProgress | None) -> int:
        """Delete every record :func:`machine.is_prunable` selects; return the count.

        Call ``progress(total_so_far)`` after each committed batch.
        """

    def now_ms(self) -> int:
        """The ledger's clock, in Unix-epoch milliseconds."""
        return wall_clock_ms()

    async def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections and handles. The ledger is unusable afterwards."""

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- the public API -----------------------------------------------------

    async def claim(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
    ) -> ClaimOutcome:
        """Claim the decision for ``owner_id`` for ``lease_ms``.

        Returns ``Claimed(attempt)`` (a new claim, a takeover of an expired or
        released one, or the same owner re-claiming), ``AlreadyCompleted()``,
        ``Busy(lease_expires_at_ms)`` or ``Conflict()`` (different request hash
        or identity). A legacy record without identity takes ``identity``.
        """
        _check_texts(decision_id=decision_id, request_hash=request_hash, owner_id=owner_id)
        check_u64("lease_ms", lease_ms)
        fixed = None if now_ms is None else check_u64("now_ms", now_ms)
        _check_identity(identity)
        return await self._apply(
            decision_id,
            lambda record, clock: machine.claim(
                record,
                request_hash,
                identity,
                owner_id,
                clock if fixed is None else fixed,
                lease_ms,
            ),
        )

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
        _check_texts(decision_id=decision_id, request_hash=request_hash, owner_id=owner_id)
        check_u64("lease_ms", lease_ms)
        fixed = None if now_ms is None else check_u64("now_ms", now_ms)
        _check_identity(identity)
        return await self._apply(
            decision_id,
            lambda record, clock: machine.renew(
                record,
                request_hash,
                identity,
                owner_id,
                clock if fixed is None else fixed,
                lease_ms,
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
    ) -> bool:
        """Record completion; only the current owner with a live lease may complete.

        A ``receipt`` needs an ``identity`` and must be bound to it. Completing
        an already-completed record succeeds for any caller (as in the seed);
        the result tells the two apart: True when the decision is completed by
        ``owner_id`` (by this call or an earlier one), False when another owner
        had already completed it.
        """
        _check_texts(decision_id=decision_id, request_hash=request_hash, owner_id=owner_id)
        fixed = None if completed_at_ms is None else check_u64("completed_at_ms", completed_at_ms)
        _check_identity(identity)
        _check_receipt(identity, receipt)
        return await self._apply(
            decision_id,
            lambda record, clock: machine.complete(
                record,
                decision_id,
                request_hash,
                identity,
                owner_id,
                receipt,
                clock if fixed is None else fixed,
            ),
        )

    async def release(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> None:
        """Give up ``owner_id``'s lease so the next claim can proceed (a new attempt)."""
        _check_texts(decision_id=decision_id, request_hash=request_hash, owner_id=owner_id)
        _check_identity(identity)
        await self._apply(
            decision_id,
            lambda record, _clock: machine.release(record, request_hash, identity, owner_id),
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
        return machine.inspect(record, decision_id, request_hash, identity)

    async def lookup(self, decision_id: str) -> LedgerEntry | None:
        """Read a record by decision id alone (for operators and the service)."""
        _check_texts(decision_id=decision_id)
        record = await self._read(decision_id)
        if record is None:
            return None
        return LedgerEntry(
            decision_id=decision_id,
            request_hash=record.request_hash,
            state=machine.state_of(record),
            attempts=record.attempts,
            execution_identity=record.execution_identity,
            result_receipt=record.result_receipt,
        )

    async def completed_receipt(self, decision_id: str) -> ResultReceipt | None:
        """The result receipt stored with a completed decision, if any."""
        _check_texts(decision_id=decision_id)
        record = await self._read(decision_id)
        return None if record is None else record.result_receipt

    async def prune_completed(
        self, before_ms: int, *, progress: PruneProgress | None = None
    ) -> int:
        """Remove completed records whose completion time is before ``before_ms``.

        Large stores prune in batches (short transactions); ``progress``, if
        given, is called with the running total after each batch.
        """
        return await self._prune(check_u64("before_ms", before_ms), progress)
