"""The dispatcher: submits each production decision to the sink exactly once.

The sequence follows the newest upstream dispatcher (see ``docs/PROTOCOL.md``):
branch check, id check, identifier limits (:mod:`flowdecision.limits`),
request hash, execution identity and result receipt prepared before the claim,
claim, a heartbeat that renews the lease while the sink runs (cancelling the
sink if the lease is lost), then completion with the receipt. A sink failure
releases the claim so a retry can claim it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from .errors import (
    DecisionBusyError,
    DecisionConflictError,
    DispatchError,
    DispatchLedgerError,
    InvalidIdentifierError,
    InvalidIdentityError,
    LeaseLostError,
    LedgerError,
    SinkError,
    UnauthorizedBranchError,
)
from .health import HealthMetrics, HealthSnapshot
from .identity import DecisionTooLargeError, ExecutionIdentity, ResultReceipt, decision_receipt
from .ledger.base import Ledger
from .ledger.memory import MemoryLedger
from .ledger.states import AlreadyCompleted, Busy, Claimed, Conflict
from .limits import check_identifier, check_identifiers
from .model import DecisionRequest, request_hash
from .sinks.base import Sink, check_sink

__all__ = ["DEFAULT_LEASE_MS", "Dispatcher"]

DEFAULT_LEASE_MS = 30_000
log = logging.getLogger("flowdecision.dispatcher")

_OTHER_IDS = ("decision_id", "run_id", "causation_event_id")

#: Errors caused by the request itself: counted as rejected, never degrading health.
_REJECTED = (
    UnauthorizedBranchError,
    InvalidIdentityError,
    InvalidIdentifierError,
    DecisionTooLargeError,
)


@dataclass(slots=True)
class _IdGate:
    """Serializes dispatches of one decision id within this dispatcher."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class _Heartbeat:
    """Renews the lease every ``period`` while the sink runs, on the loop's timer.

    No task exists until a renewal is due, so a fast sink costs one timer
    handle. When a renewal fails it records why and cancels the dispatching
    task, which really stops the sink coroutine.
    """

    __slots__ = ("_dispatcher", "_handle", "_period", "_renewal", "_task", "args", "error")

    def __init__(
        self,
        dispatcher: Dispatcher,
        task: asyncio.Task[object],
        period_s: float,
        args: tuple[str, str, ExecutionIdentity],
    ) -> None:
        self._dispatcher = dispatcher
        self._task = task
        self._period = period_s
        self.args = args
        self.error: DispatchError | None = None
        self._renewal: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            period_s, self._due
        )

    def _due(self) -> None:
        self._handle = None
        self._renewal = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        decision_id, hash_, identity = self.args
        dispatcher = self._dispatcher
        try:
            renewed = await dispatcher.ledger.renew(
                decision_id,
                hash_,
                dispatcher.owner_id,
                lease_ms=dispatcher.lease_ms,
                identity=identity,
            )
        except Exception as error:
            # Not only LedgerError: a custom ledger or an OS error that escaped must
            # still stop the sink, or it would run on without a lease.
            failure = DispatchLedgerError(str(error) or type(error).__name__)
            failure.__cause__ = error
            self._fail(failure)
            return
        if self._renewal is None:  # stopped while renewing: the sink already finished
            return
        if not renewed:
            self._fail(LeaseLostError(decision_id))
            return
        dispatcher.metrics.lease_renewals += 1
        self._renewal = None
        self._handle = asyncio.get_running_loop().call_later(self._period, self._due)

    def _fail(self, error: DispatchError) -> None:
        if self._renewal is None:
            return
        self._renewal = None
        self.error = error
        self._task.cancel()

    async def stop(self) -> None:
        """Stop renewing; wait for an in-flight renewal so none outlives the dispatch."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        renewal, self._renewal = self._renewal, None
        if renewal is not None and not renewal.done():
            renewal.cancel()
            # The renewal's own outcome no longer matters; completion re-checks the lease.
            await asyncio.gather(renewal, return_exceptions=True)


class Dispatcher:
    """Submits production-branch decisions to ``sink`` under ledger leases.

    ``await dispatch(request)`` returns True when the sink accepted a new
    decision and False for a duplicate of a completed one; everything else
    raises a :class:`DispatchError`. Distinct decisions dispatch concurrently;
    concurrent dispatches of one decision id are serialized, so only one can
    reach the sink.

    ``sink.submit`` must be a coroutine function (:class:`InvalidSinkError`
    otherwise); ``production_branch_id`` and ``owner_id`` must be valid
    identifiers (:class:`InvalidIdentifierError` otherwise).
    """

    def __init__(
        self,
        production_branch_id: str,
        sink: Sink,
        ledger: Ledger | None = None,
        *,
        lease_ms: int = DEFAULT_LEASE_MS,
        owner_id: str | None = None,
    ) -> None:
        if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or lease_ms < 1:
            raise ValueError(f"lease_ms must be a positive integer, got {lease_ms!r}")
        self.production_branch_id = check_identifier("production_branch_id", production_branch_id)
        self.sink = check_sink(sink)
        self.ledger: Ledger = ledger if ledger is not None else MemoryLedger()
        self.lease_ms = lease_ms
        self.owner_id = check_identifier(
            "owner_id", owner_id or f"decision-dispatcher-{uuid.uuid4()}"
        )
        self.metrics = HealthMetrics()
        self._heartbeat_s = max(lease_ms // 3, 1) / 1000
        self._gates: dict[str, _IdGate] = {}

    def health(self) -> HealthSnapshot:
        """The current health snapshot."""
        return self.metrics.snapshot()

    async def dispatch(self, request: DecisionRequest) -> bool:
        """Submit ``request`` exactly once; True if newly accepted, False if a duplicate."""
        metrics = self.metrics
        metrics.attempted += 1
        metrics.in_flight += 1
        started = time.perf_counter_ns()
        try:
            submitted = await self._dispatch(request)
        except DispatchError as error:
            self._record_error(error)
            raise
        except asyncio.CancelledError:
            metrics.cancellations += 1
            metrics.record_failure()
            raise
        except BaseException:
            metrics.record_failure()
            raise
        else:
            metrics.record_success(duplicate=not submitted)
            return submitted
        finally:
            metrics.in_flight -= 1
            metrics.record_elapsed((time.perf_counter_ns() - started) // 1000)

    def _record_error(self, error: DispatchError) -> None:
        metrics = self.metrics
        if isinstance(error, DecisionBusyError):
            metrics.busy += 1
        elif isinstance(error, DecisionConflictError):
            metrics.conflicts += 1
        elif isinstance(error, _REJECTED):
            metrics.rejected += 1
        else:
            if isinstance(error, LeaseLostError):
                metrics.lease_lost += 1
            elif isinstance(error, DispatchLedgerError):
                metrics.ledger_failures += 1
            elif isinstance(error, SinkError):
                metrics.sink_failures += 1
            metrics.record_failure()

    async def _dispatch(self, request: DecisionRequest) -> bool:
        # A branch that breaks the identifier rules is refused as such, not
        # echoed back in a branch error (the production branch never breaks them).
        check_identifier("authority_branch_id", request.authority_branch_id)
        if request.authority_branch_id != self.production_branch_id:
            raise UnauthorizedBranchError(self.production_branch_id, request.authority_branch_id)
        decision_id = request.decision_id
        if not decision_id.strip() or not request.causation_event_id.strip():
            raise InvalidIdentityError()
        # After the seed's checks (so blank ids answer as in the seed), before
        # the claim: no store may see an over-long or control-character id.
        check_identifiers(request, _OTHER_IDS)
        hash_ = request_hash(request)
        identity, receipt = decision_receipt(request)  # DecisionTooLargeError: rejected

        gate = self._gates.get(decision_id)
        if gate is None:
            gate = self._gates[decision_id] = _IdGate()
        gate.users += 1
        try:
            async with gate.lock:
                return await self._claim_and_submit(request, hash_, identity, receipt)
        finally:
            gate.users -= 1
            if gate.users == 0:
                del self._gates[decision_id]

    async def _claim_and_submit(
        self,
        request: DecisionRequest,
        hash_: str,
        identity: ExecutionIdentity,
        receipt: ResultReceipt,
    ) -> bool:
        decision_id = request.decision_id
        ledger = self.ledger
        try:
            outcome = await ledger.claim(
                decision_id, hash_, self.owner_id, lease_ms=self.lease_ms, identity=identity
            )
        except LedgerError as error:
            raise DispatchLedgerError(str(error)) from error
        if isinstance(outcome, AlreadyCompleted):
            return False
        if isinstance(outcome, Busy):
            raise DecisionBusyError(outcome.lease_expires_at_ms)
        if isinstance(outcome, Conflict):
            raise DecisionConflictError(decision_id)
        assert isinstance(outcome, Claimed)
        self.metrics.claimed += 1
        if outcome.attempt > 1:
            self.metrics.takeovers += 1

        await self._submit(request, outcome.attempt, (decision_id, hash_, identity))

        try:
            ours = await ledger.complete(
                decision_id, hash_, self.owner_id, identity=identity, receipt=receipt
            )
        except LedgerError as error:
            raise DispatchLedgerError(str(error)) from error
        if not ours:
            # Another owner took over and completed while this one was stalled (a
            # pause longer than the lease): our delivery was a late duplicate.
            raise LeaseLostError(decision_id)
        return True

    async def _submit(
        self, request: DecisionRequest, attempt: int, args: tuple[str, str, ExecutionIdentity]
    ) -> None:
        task = asyncio.current_task()
        assert task is not None, "dispatch must run inside an asyncio task"
        heartbeat = _Heartbeat(self, task, self._heartbeat_s, args)
        try:
            await self.sink.submit(request, attempt)
        except asyncio.CancelledError:
            if heartbeat.error is None:
                raise  # cancelled from outside: the claim stays until its lease expires
            if task.uncancel() > 0:
                raise  # also cancelled from outside
            raise heartbeat.error from heartbeat.error.__cause__
        except Exception as error:
            await heartbeat.stop()
            if heartbeat.error is not None:
                # The sink turned our cancellation into an ordinary exception.
                if task.uncancel() > 0:
                    raise asyncio.CancelledError from error  # also cancelled from outside
                raise heartbeat.error from heartbeat.error.__cause__
            await self._release_after_failure(args)
            raise SinkError(str(error) or type(error).__name__) from error
        finally:
            await heartbeat.stop()
        if heartbeat.error is not None:
            # The sink swallowed the cancellation: the lease is still gone.
            task.uncancel()
            raise heartbeat.error from heartbeat.error.__cause__

    async def _release_after_failure(self, args: tuple[str, str, ExecutionIdentity]) -> None:
        decision_id, hash_, identity = args
        try:
            await self.ledger.release(decision_id, hash_, self.owner_id, identity=identity)
        except LedgerError as error:
            # Not raised: the lease will expire on its own and the sink error matters more.
            log.warning(
                "failed to release Flow decision claim",
                extra={"decision_id": decision_id, "error": str(error)},
            )
