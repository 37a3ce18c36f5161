"""The dispatcher: submits each production decision to the sink exactly once.

The sequence follows the newest upstream dispatcher (see ``docs/PROTOCOL.md``):
branch check, id check, identifier limits (:mod:`flowdecision.core.limits`),
request hash, execution identity and result receipt prepared before the claim,
claim, a heartbeat that renews the lease while the sink runs (cancelling the
sink if the lease is lost), then completion with the receipt. A sink failure
releases the claim so a retry can claim it at once.

A :class:`~flowdecision.sinks.JointSink` that shares the ledger's store (an
outbox in the ledger's SQLite file or PostgreSQL database) takes the joint
path instead (:attr:`Dispatcher.joint`): claim, the sink's row and completion
are one ledger transaction (``Ledger.joint_commit``), so there is no lease to
hold while the sink runs and nothing a crash could deliver twice.

``dispatch`` returns a :class:`DispatchOutcome` (submitted or duplicate, the
attempt, the receipt); every failure is a :class:`DispatchError`, whose
``code`` is classified once, in :data:`ERROR_CLASSES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, cast

from ..errors import (
    ActionRefusedError,
    DecisionBusyError,
    DecisionConflictError,
    DecisionRejectedError,
    DispatchError,
    DispatchLedgerError,
    DispatchStoreFullError,
    InvalidArgumentError,
    InvalidIdentityError,
    LeaseLostError,
    LedgerError,
    RunClosedError,
    SinkConflictError,
    SinkContentConflictError,
    SinkError,
    UnauthorizedBranchError,
    UnknownDecisionError,
    classify,
)
from ..ledger.base import Ledger
from ..ledger.machine import ClaimStatus, DecisionOrigin, HoldTerms
from ..ledger.memory import MemoryLedger
from ..ledger.states import (
    Acted,
    AlreadyCompleted,
    AlreadyRejected,
    AuditEntry,
    AwaitingApproval,
    Busy,
    Claimed,
    ClaimKey,
    ClaimOutcome,
    Conflict,
    RunClosed,
)
from ..observability import tracing as _tracing
from ..observability.health import HealthMetrics, HealthSnapshot
from ..observability.outage import Outage
from ..sinks.base import JointSink, Sink, check_sink, is_joint
from .approvals import ApprovalPolicy
from .bodies import ApprovalBody, OutcomeBody
from .defaults import LEASE_MS
from .identity import ExecutionIdentity, ResultReceipt, decision_receipt
from .jsonwire import Fragment, encode_json
from .limits import check_identifier, check_identifiers
from .model import Complete, DecisionRequest, Fail, request_hash

__all__ = [
    "DEFAULT_LEASE_MS",
    "ERROR_CLASSES",
    "ApprovalOutcome",
    "DispatchOutcome",
    "Dispatcher",
    "ErrorClass",
    "decision_origin",
]

#: The default lease (``flowdecision.core.defaults.LEASE_MS``).
DEFAULT_LEASE_MS = LEASE_MS
log = logging.getLogger("flowdecision.core.dispatcher")

_OTHER_IDS = ("decision_id", "run_id", "causation_event_id")


@dataclass(frozen=True, slots=True)
class DispatchOutcome:
    """What one successful :meth:`Dispatcher.dispatch` did.

    ``submitted`` is True when this call delivered the decision to the sink and
    recorded completion, False for a duplicate of an already-completed decision
    (nothing was delivered). ``attempt`` is the claim's fencing token: the
    attempt that submitted, or for a duplicate the attempts stored in the
    ledger. ``receipt`` is the result receipt: the one just recorded, or the
    one stored with the completed decision (None only for legacy records).

    The seed returned a bare bool; an outcome keeps that easy: ``bool(outcome)``
    is ``outcome.submitted``, so ``if await dispatcher.dispatch(request):``
    still reads "if newly submitted".
    """

    submitted: bool
    decision_id: str
    attempt: int | None
    receipt: ResultReceipt | None
    #: Set for a duplicate of a decision pruned to a tombstone (``receipt`` is None).
    receipt_digest: str | None = None
    #: Approval holds: the decision is held for an operator's approval (recorded,
    #: nothing sent; ``submitted`` is False, ``attempt`` and ``receipt`` None).
    held: bool = False
    #: When the hold expires (None: never, or not held).
    hold_expires_at_ms: int | None = None

    def __bool__(self) -> bool:
        return self.submitted

    @property
    def outcome(self) -> Literal["submitted", "duplicate", "held"]:
        """``"submitted"``, ``"duplicate"`` or ``"held"``, as the service reports it."""
        if self.held:
            return "held"
        return "submitted" if self.submitted else "duplicate"

    def to_dict(self) -> OutcomeBody:
        """The service's JSON body: ``outcome``, ``decision_id``, ``attempt``, ``receipt``
        (and ``receipt_digest`` for a tombstone's duplicate; ``state`` and
        ``hold_expires_at_ms`` for a held decision)."""
        body: OutcomeBody = {
            "outcome": self.outcome,
            "decision_id": self.decision_id,
            "attempt": self.attempt,
            "receipt": self.receipt.to_dict() if self.receipt is not None else None,
        }
        if self.receipt_digest is not None:
            body["receipt_digest"] = self.receipt_digest
        if self.held:
            body["state"] = "held"
            body["hold_expires_at_ms"] = self.hold_expires_at_ms
        return body

    def to_json(self) -> bytes:
        """:meth:`to_dict` as compact UTF-8 JSON, the service's answer (once per ``POST``;
        the receipt's text is the one it keeps)."""
        body: dict[str, Any] = {
            "outcome": self.outcome,
            "decision_id": self.decision_id,
            "attempt": self.attempt,
            "receipt": None if self.receipt is None else Fragment(self.receipt.json_text()),
        }
        if self.receipt_digest is not None:
            body["receipt_digest"] = self.receipt_digest
        if self.held:
            body["state"] = "held"
            body["hold_expires_at_ms"] = self.hold_expires_at_ms
        return encode_json(body)


@dataclass(frozen=True, slots=True)
class ApprovalOutcome:
    """What :meth:`Dispatcher.approve` did: the approved decision's dispatch and the
    audit entry written (None when an earlier approval had already delivered it)."""

    dispatch: DispatchOutcome
    audit: AuditEntry | None

    def to_dict(self) -> ApprovalBody:
        """``POST /v1/actions/approve``'s body: the dispatch's shape plus ``audit``."""
        body: Any = dict(self.dispatch.to_dict())
        body["audit"] = None if self.audit is None else self.audit.to_dict()
        return cast(ApprovalBody, body)


@dataclass(frozen=True, slots=True)
class ErrorClass:
    """How the dispatcher accounts for one kind of :class:`DispatchError`.

    ``counter`` is the :class:`HealthMetrics` counter it increments; ``failure``
    says whether it is a failure of the dispatcher's own parts (ledger, sink,
    lease), which degrades health and counts in the error-rate window, rather
    than a refusal of the request itself; ``retryable`` says whether
    :meth:`Dispatcher.dispatch_until_done` tries again.
    """

    counter: str | None
    failure: bool
    retryable: bool = False


#: Every dispatch error code, classified once (looked up with :func:`errors.classify`).
ERROR_CLASSES: dict[str, ErrorClass] = {
    "busy": ErrorClass("busy", failure=False, retryable=True),
    "conflict": ErrorClass("conflicts", failure=False),
    # The run is over: the request is refused, like a forked branch's.
    "run_closed": ErrorClass("rejected", failure=False),
    # An operator rejected the held decision (or its hold expired).
    "decision_rejected": ErrorClass("rejected", failure=False),
    "forbidden_branch": ErrorClass("rejected", failure=False),
    "invalid_request": ErrorClass("rejected", failure=False),
    "invalid_identifier": ErrorClass("rejected", failure=False),
    "decision_too_large": ErrorClass("rejected", failure=False),
    "lease_lost": ErrorClass("lease_lost", failure=True, retryable=True),
    "ledger_unavailable": ErrorClass("ledger_failures", failure=True, retryable=True),
    "ledger_corrupt": ErrorClass("ledger_failures", failure=True),
    "ledger_schema": ErrorClass("ledger_failures", failure=True),
    "store_full": ErrorClass("ledger_failures", failure=True, retryable=True),
    "sink_failed": ErrorClass("sink_failures", failure=True),
    # The sink refuses the content under this id: like a ledger conflict, the
    # caller's content is the problem, not the service.
    "sink_conflict": ErrorClass("conflicts", failure=False),
}


def sink_failure(decision_id: str, error: Exception) -> SinkError:
    """What the sink's ``error`` is reported as: a permanent :class:`SinkConflictError`
    when the sink refuses different content under the id, else a :class:`SinkError`."""
    detail = str(error) or type(error).__name__
    if isinstance(error, SinkContentConflictError):
        return SinkConflictError(decision_id, detail)
    return SinkError(detail)


#: Anything else (a DispatchError subclass without a row): a failure, not retried.
_UNCLASSIFIED = ErrorClass(None, failure=True)

#: Backoff of :meth:`Dispatcher.dispatch_until_done`: first delay, growth, ceiling.
RETRY_BASE_S = 0.05
RETRY_FACTOR = 2.0
RETRY_MAX_S = 1.0


#: Dispatch errors that mean the ledger's store is down (unreachable, or its disk full).
_OUTAGES = frozenset({DispatchLedgerError, DispatchStoreFullError})
#: Refusals that mean the ledger answered (so it is reachable again).
_LEDGER_ANSWERS = frozenset(
    {DecisionBusyError, DecisionConflictError, RunClosedError, DecisionRejectedError}
)
#: The decision types that end a run (``DecisionOrigin.terminal``), by class.
_TERMINAL = {Complete: "complete", Fail: "fail"}


def decision_origin(request: DecisionRequest) -> DecisionOrigin:
    """Where ``request`` comes from, as the ledger keeps it: run, causing event and,
    for a ``complete`` or ``fail``, that it ends its run (the run invariants)."""
    return DecisionOrigin(
        request.run_id, request.causation_event_id, _TERMINAL.get(type(request.decision))
    )


def _store_name(ledger: object) -> str:
    """The ledger's store for log lines (its ``where``, else its file, else its type)."""
    where = getattr(ledger, "where", None) or getattr(ledger, "path", None)
    return str(where) if where else type(ledger).__name__


#: Dispatch errors recorded as span events on ``flowdecision.dispatch`` (by code).
_EVENT_CODES = {
    "busy": "flowdecision.busy",
    "conflict": "flowdecision.conflict",
    "lease_lost": "flowdecision.lease_lost",
}
_NULL_STEP = contextlib.nullcontext()


def _untraced(name: str, **_: Any) -> AbstractContextManager[Any]:
    """A step without tracing: one shared null context, nothing made."""
    return _NULL_STEP


def _ledger_backend(ledger: Ledger) -> str:
    """``sqlite``, ``postgresql``, ``memory``, ``jsonfile`` (or the class name)."""
    while hasattr(ledger, "inner"):  # a DelegatingLedger: name what it wraps
        ledger = ledger.inner
    key = ledger.store_key()
    if key is not None:
        return key.kind
    name = type(ledger).__name__
    return {"MemoryLedger": "memory", "JsonFileLedger": "jsonfile"}.get(name, name)


def _sink_kind(sink: Sink) -> str:
    """``outbox``, ``webhook``, ``procrastinate``, ``dbos`` ... (the class name otherwise)."""
    kind = getattr(sink, "kind", None)
    if isinstance(kind, str) and kind in ("sqlite", "postgresql"):
        return "outbox"  # OutboxSink.kind is its store's kind
    name = type(sink).__name__
    return name.removesuffix("Sink").lower() or name


def _error_class(error: BaseException) -> ErrorClass:
    return classify(error, ERROR_CLASSES) or _UNCLASSIFIED


#: Dispatches of one id waiting their turn (None: one holds it, none waits).
_Waiters = deque["asyncio.Future[None]"] | None


class _Heartbeat:
    """Renews the lease every ``period`` while the sink runs, on the loop's timer.

    No task exists until a renewal is due, so a fast sink costs one timer
    handle. When a renewal fails it records why and cancels the dispatching
    task, which really stops the sink coroutine.
    """

    __slots__ = ("_dispatcher", "_handle", "_period", "_renewal", "_task", "error", "key")

    def __init__(
        self,
        dispatcher: Dispatcher,
        task: asyncio.Task[object],
        period_s: float,
        key: ClaimKey,
    ) -> None:
        self._dispatcher = dispatcher
        self._task = task
        self._period = period_s
        self.key = key
        self.error: DispatchError | None = None
        self._renewal: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            period_s, self._due
        )

    def _due(self) -> None:
        self._handle = None
        self._renewal = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        decision_id, hash_, identity = self.key
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
            self._fail(DispatchLedgerError.wrap(error))
            return
        if self._renewal is None:  # stopped while renewing: the sink already finished
            return
        if not renewed:
            self._fail(LeaseLostError(decision_id))
            return
        dispatcher.metrics.lease_renewals += 1
        if _tracing.active():  # on the sink's span: the renewal runs in its context
            _tracing.event("flowdecision.lease_renewed")
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

    ``await dispatch(request)`` returns a :class:`DispatchOutcome` (truthy when
    the sink accepted a new decision, falsy for a duplicate of a completed
    one); everything else raises a :class:`DispatchError`. Distinct decisions
    dispatch concurrently; concurrent dispatches of one decision id are
    serialized, so only one can reach the sink.

    ``sink.submit`` must be a coroutine function (:class:`InvalidSinkError`
    otherwise); ``production_branch_id`` and ``owner_id`` must be valid
    identifiers (:class:`InvalidIdentifierError` otherwise).

    ``approvals``: an :class:`~flowdecision.core.approvals.ApprovalPolicy`; a new
    decision it names is held (recorded, answered ``held``, nothing sent) until
    :meth:`approve` (docs/PROTOCOL.md, "Approval holds"). The ledger must keep
    holds (SQLite, PostgreSQL, memory; not the JSON file ledger:
    :class:`InvalidArgumentError`).
    """

    def __init__(
        self,
        production_branch_id: str,
        sink: Sink,
        ledger: Ledger | None = None,
        *,
        lease_ms: int = DEFAULT_LEASE_MS,
        owner_id: str | None = None,
        approvals: ApprovalPolicy | None = None,
    ) -> None:
        if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or lease_ms < 1:
            raise InvalidArgumentError(f"lease_ms must be a positive integer, got {lease_ms!r}")
        self.production_branch_id = check_identifier("production_branch_id", production_branch_id)
        self.sink = check_sink(sink)
        self.ledger: Ledger = ledger if ledger is not None else MemoryLedger()
        self.lease_ms = lease_ms
        self.owner_id = check_identifier(
            "owner_id", owner_id or f"decision-dispatcher-{uuid.uuid4()}"
        )
        self.metrics = HealthMetrics()
        #: The ledger's availability as dispatches see it: logs when it goes
        #: down (unreachable, full), a summary while it stays down, and when
        #: it is back, instead of a line per failed dispatch.
        self.ledger_outage = Outage(log, _store_name(self.ledger))
        self._heartbeat_s = max(lease_ms // 3, 1) / 1000
        #: Decision id -> the dispatches waiting for it, while one holds it (see _dispatch).
        self._gates: dict[str, _Waiters] = {}
        #: The joint path: the sink writes inside the ledger's transaction (one store).
        self.joint = is_joint(self.sink, self.ledger)
        #: Whether the ledger keeps the run invariants (then completions name their run).
        self._run_invariants = bool(getattr(self.ledger, "run_invariants", False))
        #: Tracing: the span's ``ledger.backend`` and ``sink.kind`` (set at the first span).
        self._span_labels: tuple[str, str] | None = None
        if approvals is not None and not isinstance(approvals, ApprovalPolicy):
            raise InvalidArgumentError(
                f"approvals must be an ApprovalPolicy, got {type(approvals).__name__}"
            )
        if approvals is not None and approvals.enabled and not self.ledger.holds_supported:
            raise InvalidArgumentError(
                f"approval holds need a ledger that keeps them (SQLite, PostgreSQL, memory); "
                f"{type(self.ledger).__name__} cannot (the JSON file ledger is shared with "
                "Rust hosts, which know no held state)"
            )
        #: The approval policy (None, or one that holds nothing: no holds).
        self.approvals = approvals if approvals is not None and approvals.enabled else None

    @property
    def heartbeat_s(self) -> float:
        """How often a live lease is renewed while the sink runs (a third of the lease)."""
        return self._heartbeat_s

    def health(self) -> HealthSnapshot:
        """The current health snapshot."""
        return self.metrics.snapshot()

    async def dispatch(self, request: DecisionRequest) -> DispatchOutcome:
        """Submit ``request`` exactly once; see :class:`DispatchOutcome` for the result.

        With tracing on (:mod:`flowdecision.observability.tracing`) it is one
        ``flowdecision.dispatch`` span with a child per step; see
        ``docs/OBSERVABILITY.md`` for the tree.
        """
        if _tracing.active():
            return await self._traced(request)
        return await self._counted(request)

    async def _traced(self, request: DecisionRequest) -> DispatchOutcome:
        labels = self._span_labels
        if labels is None:  # fixed for the dispatcher's life: worked out once
            labels = self._span_labels = (_ledger_backend(self.ledger), _sink_kind(self.sink))
        attributes: dict[str, str | int] = {
            "flowdecision.decision_id": request.decision_id,
            "flowdecision.run_id": request.run_id,
            "flowdecision.ledger.backend": labels[0],
            "flowdecision.sink.kind": labels[1],
        }
        with _tracing.SpanScope("flowdecision.dispatch", attributes=attributes) as span:
            try:
                outcome = await self._counted(request)
            except DispatchError as error:
                code = error.code
                span.set_attribute("flowdecision.outcome", code)
                if code in _EVENT_CODES:
                    details: dict[str, str | int] = {
                        "flowdecision.decision_id": request.decision_id
                    }
                    if isinstance(error, DecisionBusyError):
                        details["flowdecision.lease_expires_at_ms"] = error.lease_expires_at_ms
                    span.add_event(_EVENT_CODES[code], details)
                raise
            if outcome.attempt is None:
                span.set_attribute("flowdecision.outcome", outcome.outcome)
            else:  # one call, one lock
                ended: dict[str, str | int] = {"flowdecision.outcome": outcome.outcome}
                ended["flowdecision.attempt"] = outcome.attempt
                span.set_attributes(ended)
            return outcome

    async def _counted(self, request: DecisionRequest) -> DispatchOutcome:
        metrics = self.metrics
        metrics.attempted += 1
        metrics.in_flight += 1
        began = self.ledger_outage.now()
        started = time.perf_counter_ns()
        try:
            outcome = await self._dispatch(request)
        except DispatchError as error:
            self._record_error(error)
            if type(error) in _OUTAGES:
                cause = error.__cause__ or error
                self.ledger_outage.failed(error.code, f"{type(cause).__name__}: {cause}")
            elif self.ledger_outage.active and type(error) in _LEDGER_ANSWERS:
                self.ledger_outage.succeeded(wrote=False, began=began)
            raise
        except asyncio.CancelledError:
            metrics.cancellations += 1
            metrics.record_failure()
            raise
        except BaseException:
            metrics.record_failure()
            raise
        else:
            if outcome.held:  # neither delivered nor a duplicate: it waits for an operator
                metrics.record_refusal()
            else:
                metrics.record_success(duplicate=not outcome.submitted)
            if self.ledger_outage.active:
                self.ledger_outage.succeeded(wrote=outcome.submitted, began=began)
            return outcome
        finally:
            metrics.in_flight -= 1
            metrics.record_elapsed((time.perf_counter_ns() - started) // 1000)

    async def dispatch_until_done(
        self,
        request: DecisionRequest,
        *,
        deadline_s: float = 30.0,
        retry_failures: bool = True,
        max_backoff_s: float = RETRY_MAX_S,
    ) -> DispatchOutcome:
        """Dispatch, trying again until the decision is completed or ``deadline_s`` passes.

        Retried: :class:`DecisionBusyError` (another owner holds the decision:
        its final answer, a duplicate, arrives once it completes, or this
        dispatcher takes over once its lease expires) and, with
        ``retry_failures`` (the default), a lost lease and a transient ledger
        failure (:class:`DispatchLedgerError` itself, not its permanent
        subclasses). Everything else is raised at once: a conflict, a rejected
        request, a sink failure (which may be the decision's own fault) and a
        corrupt or newer-schema ledger.

        Between tries it sleeps with exponential backoff (from
        :data:`RETRY_BASE_S`, doubling, at most ``max_backoff_s``) and jitter
        (each sleep is between half and all of the current delay), never past
        the deadline, and never past the busy owner's lease expiry. When the
        deadline passes, the last error is raised. The deadline bounds the
        waiting, not a try in progress: a slow sink is never cancelled. Every
        try counts in :meth:`health` as a dispatch.
        """
        if not deadline_s >= 0:  # also refuses NaN
            raise InvalidArgumentError(
                f"deadline_s must be a non-negative number, got {deadline_s!r}"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        delay = RETRY_BASE_S
        while True:
            try:
                return await self.dispatch(request)
            except DispatchError as error:
                if not _error_class(error).retryable:
                    raise
                if not retry_failures and not isinstance(error, DecisionBusyError):
                    raise
                left = deadline - loop.time()
                if left <= 0:
                    raise
                sleep = min(delay * random.uniform(0.5, 1.0), left)
                if isinstance(error, DecisionBusyError):
                    # Past the owner's lease this dispatcher can take over: no longer wait.
                    until_expiry = (error.lease_expires_at_ms - self.ledger.now_ms()) / 1000
                    sleep = min(sleep, max(until_expiry, 0.0) + 0.005)
                await asyncio.sleep(sleep)
                delay = min(delay * RETRY_FACTOR, max_backoff_s)

    def _record_error(self, error: DispatchError) -> None:
        metrics = self.metrics
        kind = _error_class(error)
        if kind.counter is not None:
            setattr(metrics, kind.counter, getattr(metrics, kind.counter) + 1)
        if kind.failure:
            metrics.record_failure()
        else:
            metrics.record_refusal()

    async def _dispatch(self, request: DecisionRequest) -> DispatchOutcome:
        # A branch that breaks the identifier rules is refused as such, not
        # echoed back in a branch error (the production branch never breaks them).
        # (The production branch was checked when this dispatcher was built.)
        if request.authority_branch_id != self.production_branch_id:
            check_identifier("authority_branch_id", request.authority_branch_id)
            raise UnauthorizedBranchError(self.production_branch_id, request.authority_branch_id)
        decision_id = request.decision_id
        if not decision_id.strip():
            raise InvalidIdentityError("decision_id")
        if not request.causation_event_id.strip():
            raise InvalidIdentityError("causation_event_id")
        # After the seed's checks (so blank ids answer as in the seed), before
        # the claim: no store may see an over-long or control-character id.
        check_identifiers(request, _OTHER_IDS)
        hash_ = request_hash(request)
        identity, receipt = decision_receipt(request)  # DecisionTooLargeError: rejected

        # One dispatch of an id at a time, in arrival order. An id nobody holds is
        # taken with one dict entry (no lock object: nearly every id is uncontended).
        gates = self._gates
        if decision_id in gates:
            await self._wait_turn(decision_id)
        else:
            gates[decision_id] = None
        try:
            return await self._claim_and_submit(request, hash_, identity, receipt)
        finally:
            self._pass_on(decision_id)

    async def _take_turn(self, decision_id: str) -> None:
        """Wait for ``decision_id``'s gate (see :meth:`_dispatch`); :meth:`_pass_on` frees it."""
        if decision_id in self._gates:
            await self._wait_turn(decision_id)
        else:
            self._gates[decision_id] = None

    async def _wait_turn(self, decision_id: str) -> None:
        """Wait until the dispatch holding ``decision_id`` (and those queued before) is done."""
        waiters = self._gates[decision_id]
        if waiters is None:
            waiters = self._gates[decision_id] = deque()
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._pass_on(decision_id)  # handed the turn as it was cancelled: hand it on
            else:
                waiters.remove(turn)
            raise

    def _pass_on(self, decision_id: str) -> None:
        """Hand ``decision_id`` to the next live waiter, or free it."""
        waiters = self._gates[decision_id]
        while waiters:
            turn = waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        del self._gates[decision_id]

    async def _claim_and_submit(
        self,
        request: DecisionRequest,
        hash_: str,
        identity: ExecutionIdentity,
        receipt: ResultReceipt,
    ) -> DispatchOutcome:
        # Tracing: one check per dispatch; the steps use a shared null context when off.
        traced = _tracing.active()
        # The dispatch span's context is stored with the completion (ledger side data):
        # a later duplicate links to it.
        trace = _tracing.traceparent_of(_tracing.current_span()) if traced else None
        # Approval holds: only a hold goes to the ledger (wrappers that know none see nothing).
        hold = None if self.approvals is None else self.approvals.hold_of(request)
        if self.joint:
            return await self._joint_commit(request, hash_, identity, receipt, trace, hold)
        holding: dict[str, Any] = {} if hold is None else {"hold": hold}
        step = _tracing.SpanScope if traced else _untraced
        decision_id = request.decision_id
        origin = decision_origin(request)
        try:
            with step("flowdecision.claim"):
                outcome = await self.ledger.claim(
                    decision_id,
                    hash_,
                    self.owner_id,
                    lease_ms=self.lease_ms,
                    identity=identity,
                    origin=origin,
                    **holding,
                )
        except LedgerError as error:
            raise DispatchLedgerError.wrap(error) from error
        if not isinstance(outcome, Claimed):
            return await self._not_claimed(decision_id, outcome)
        self._count_claim(outcome, traced)
        return await self._deliver(request, (hash_, identity, receipt), outcome, origin, trace)

    async def _deliver(
        self,
        request: DecisionRequest,
        bound: tuple[str, ExecutionIdentity, ResultReceipt],
        outcome: Claimed,
        origin: DecisionOrigin,
        trace: str | None,
    ) -> DispatchOutcome:
        """Submit a claimed decision to the sink under the lease, then complete it
        (``bound``: its request hash, identity and receipt)."""
        hash_, identity, receipt = bound
        step = _tracing.SpanScope if _tracing.active() else _untraced
        decision_id = request.decision_id
        ledger = self.ledger
        # Only a ledger keeping the run invariants takes the origin at completion
        # (the terminal decision's closes its run); older wrappers never see it.
        closing: dict[str, Any] = {"origin": origin} if self._run_invariants else {}
        with step("flowdecision.sink.submit", attributes={"flowdecision.attempt": outcome.attempt}):
            await self._submit(request, outcome.attempt, ClaimKey(decision_id, hash_, identity))

        try:
            with step("flowdecision.complete"):
                ours = await ledger.complete(
                    decision_id,
                    hash_,
                    self.owner_id,
                    identity=identity,
                    receipt=receipt,
                    traceparent=trace,
                    **closing,
                )
        except LedgerError as error:
            raise DispatchLedgerError.wrap(error) from error
        if not ours:
            # Another owner took over and completed while this one was stalled (a
            # pause longer than the lease): our delivery was a late duplicate.
            raise LeaseLostError(decision_id)
        return DispatchOutcome(True, decision_id, outcome.attempt, receipt)

    async def _joint_commit(
        self,
        request: DecisionRequest,
        hash_: str,
        identity: ExecutionIdentity,
        receipt: ResultReceipt,
        trace: str | None,
        hold: HoldTerms | None = None,
    ) -> DispatchOutcome:
        """The joint path: claim, the sink's row and completion in one commit.

        Traced, the commit is no span of its own: the dispatch span is the one
        span of the joint transaction, whose context the sink's row takes (the
        outbox stores it) and which links to the group-commit batch.
        """
        decision_id = request.decision_id
        sink = cast(JointSink, self.sink)
        try:
            row = await sink.prepare(request)
            done = await self.ledger.joint_commit(
                decision_id,
                hash_,
                self.owner_id,
                lease_ms=self.lease_ms,
                identity=identity,
                receipt=receipt,
                row=row,
                traceparent=trace,
                origin=decision_origin(request),
                **({} if hold is None else {"hold": hold}),
            )
        except LedgerError as error:
            raise DispatchLedgerError.wrap(error) from error
        except Exception as error:  # the sink refused its row (e.g. different content)
            raise sink_failure(request.decision_id, error) from error
        outcome = done.claim
        if not isinstance(outcome, Claimed):
            return await self._not_claimed(decision_id, outcome)
        self._count_claim(outcome, trace is not None)
        if done.inserted:
            sink.committed(row)  # e.g. the outbox wakes the relays waiting for rows
        return DispatchOutcome(True, decision_id, outcome.attempt, receipt)

    async def approve(
        self,
        decision_id: str,
        *,
        actor: str,
        reason: str,
        deadline_s: float | None = None,
    ) -> ApprovalOutcome:
        """An operator approves a held decision: it is dispatched exactly once.

        On the joint path (an outbox in the ledger's store) the approval, the
        claim, the sink's row and the completion are ONE transaction with the
        ``approve`` audit entry. Otherwise the approval claims the decision
        (audited, in one transaction) under the usual lease, the sink runs under
        the heartbeat, and the completion follows; if this process dies on the
        way, approving again takes the decision over once its lease expires
        (waiting up to ``deadline_s`` for it: by default a lease and 5 s) and
        delivers it again under the next attempt (the sink deduplicates on the
        decision id).

        A decision an earlier approval already delivered answers as a duplicate
        (``audit`` None). Raises :class:`UnknownDecisionError` for an unknown id,
        :class:`ActionRefusedError` for one not held (a rejected one included;
        an expired hold is rejected here, audited as ``expire``),
        :class:`RunClosedError` when its run closed meanwhile, and the
        dispatch errors of the sink and the ledger.
        """
        ledger = self.ledger
        record = await ledger.read_record(decision_id)
        if record is None:
            raise UnknownDecisionError(f"decision `{decision_id}` has no record")
        if record.request is None:
            if record.status in (ClaimStatus.COMPLETED, ClaimStatus.TOMBSTONE):
                done = AlreadyCompleted(record.attempts, record.result_receipt)
                return ApprovalOutcome(await self._duplicate(decision_id, done), None)
            raise ActionRefusedError(
                f"decision `{decision_id}` is {record.status.value}: only a held decision "
                "can be approved"
            )
        request = DecisionRequest.parse(record.request.encode("utf-8"))
        hash_ = request_hash(request)
        identity, receipt = decision_receipt(request)
        loop = asyncio.get_running_loop()
        wait_s = self.lease_ms / 1000 + 5 if deadline_s is None else deadline_s
        deadline = loop.time() + wait_s
        delay = RETRY_BASE_S
        while True:
            await self._take_turn(decision_id)
            try:
                acted = await self._approve_once(
                    request, hash_, identity, receipt, actor=actor, reason=reason
                )
            finally:
                self._pass_on(decision_id)
            if not isinstance(acted, Busy):
                return acted
            # An earlier approval's dispatch (a crashed process?) holds the lease.
            left = deadline - loop.time()
            if left <= 0:
                raise DecisionBusyError(acted.lease_expires_at_ms)
            until_expiry = (acted.lease_expires_at_ms - ledger.now_ms()) / 1000
            await asyncio.sleep(min(delay, left, max(until_expiry, 0.0) + 0.005))
            delay = min(delay * RETRY_FACTOR, RETRY_MAX_S)

    async def _approve_once(
        self,
        request: DecisionRequest,
        hash_: str,
        identity: ExecutionIdentity,
        receipt: ResultReceipt,
        *,
        actor: str,
        reason: str,
    ) -> ApprovalOutcome | Busy:
        decision_id = request.decision_id
        row = None
        origin = decision_origin(request)
        try:
            if self.joint:
                row = await cast(JointSink, self.sink).prepare(request)
            acted: Acted = await self.ledger.approve(
                decision_id,
                hash_,
                self.owner_id,
                lease_ms=self.lease_ms,
                actor=actor,
                reason=reason,
                identity=identity,
                origin=origin,
                receipt=receipt,
                row=row,
            )
        except LedgerError:
            raise  # an operator action's errors: refused, unknown, the ledger failing
        except Exception as error:  # the sink refused its row (e.g. different content)
            raise sink_failure(decision_id, error) from error
        outcome = acted.outcome
        if acted.expired:
            raise ActionRefusedError(
                f"decision `{decision_id}`'s hold expired: it is rejected now, not approved"
            )
        if isinstance(outcome, Busy):
            return outcome
        if not isinstance(outcome, Claimed):
            assert outcome is not None
            return ApprovalOutcome(await self._not_claimed(decision_id, outcome), None)
        self._count_claim(outcome, False)
        if row is not None:
            if acted.inserted:
                cast(JointSink, self.sink).committed(row)
            return ApprovalOutcome(
                DispatchOutcome(True, decision_id, outcome.attempt, receipt), acted.entry
            )
        bound = (hash_, identity, receipt)
        dispatched = await self._deliver(request, bound, outcome, origin, None)
        return ApprovalOutcome(dispatched, acted.entry)

    def _count_claim(self, claimed: Claimed, traced: bool) -> None:
        self.metrics.claimed += 1
        if claimed.attempt > 1:
            self.metrics.takeovers += 1
            if traced:
                _tracing.event("flowdecision.takeover", {"flowdecision.attempt": claimed.attempt})

    async def _not_claimed(self, decision_id: str, outcome: ClaimOutcome) -> DispatchOutcome:
        """A duplicate's outcome; raises for a busy or conflicting claim."""
        if isinstance(outcome, AlreadyCompleted | Conflict) and outcome.traceparent is not None:
            # Click from this retry to the submission that counted (tracing is on:
            # only then was a traceparent stored).
            _tracing.add_link(
                _tracing.current_span(), outcome.traceparent, link="completed_original"
            )
        if isinstance(outcome, AlreadyCompleted):
            return await self._duplicate(decision_id, outcome)
        if isinstance(outcome, AwaitingApproval):
            return DispatchOutcome(
                False, decision_id, None, None, held=True, hold_expires_at_ms=outcome.expires_at_ms
            )
        if isinstance(outcome, AlreadyRejected):
            raise DecisionRejectedError(decision_id, outcome.rejected_at_ms)
        if isinstance(outcome, Busy):
            raise DecisionBusyError(outcome.lease_expires_at_ms)
        if isinstance(outcome, RunClosed):
            run = outcome.run
            raise RunClosedError(
                decision_id,
                run.run_id,
                run.status.value,
                run.terminal_decision_id or "",
                run.closed_at_ms,
            )
        assert isinstance(outcome, Conflict), outcome
        raise DecisionConflictError(decision_id)

    async def _duplicate(self, decision_id: str, done: AlreadyCompleted) -> DispatchOutcome:
        if done.attempts is not None:  # every built-in ledger says what it stored
            return DispatchOutcome(
                False, decision_id, done.attempts, done.receipt, done.receipt_digest
            )
        try:  # a ledger that does not: one read
            entry = await self.ledger.lookup(decision_id)
        except LedgerError as error:
            raise DispatchLedgerError.wrap(error) from error
        if entry is None:  # pruned in between
            return DispatchOutcome(False, decision_id, None, None)
        return DispatchOutcome(False, decision_id, entry.attempts, entry.result_receipt)

    async def _submit(self, request: DecisionRequest, attempt: int, key: ClaimKey) -> None:
        task = asyncio.current_task()
        assert task is not None, "dispatch must run inside an asyncio task"
        heartbeat = _Heartbeat(self, task, self._heartbeat_s, key)
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
            await self._release_after_failure(key)
            raise sink_failure(request.decision_id, error) from error
        finally:
            await heartbeat.stop()
        if heartbeat.error is not None:
            # The sink swallowed the cancellation: the lease is still gone.
            task.uncancel()
            raise heartbeat.error from heartbeat.error.__cause__

    async def _release_after_failure(self, key: ClaimKey) -> None:
        decision_id, hash_, identity = key
        try:
            await self.ledger.release(decision_id, hash_, self.owner_id, identity=identity)
        except LedgerError as error:
            # Not raised: the lease will expire on its own and the sink error matters more.
            log.warning(
                "failed to release Flow decision claim",
                extra={"decision_id": decision_id, "error": str(error)},
            )
