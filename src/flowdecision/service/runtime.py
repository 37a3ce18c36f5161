"""The running service: ledger, sink, dispatcher, in-flight dispatches, health and shutdown.

:class:`Service` owns what outlives one request. Dispatches run in tasks it
tracks, shielded from the request (a client that hangs up does not cancel a
submission half-way). Shutdown has one deadline, ``shutdown_grace_s`` after it
begins: dispatches still running then are cancelled, and their requests are
answered 503 ``shutting_down``.

Health (:meth:`Service.check_health`) is the state of the service, not of the
last request: the ledger answers a read, the sink answers a probe (where it
can be probed without a side effect), and the share of dispatches that failed
for the service's own reasons over the last minute stays under a threshold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from ..core.dispatcher import ApprovalOutcome, Dispatcher
from ..core.limits import I64_MAX
from ..core.model import DecisionRequest
from ..errors import FlowDecisionError, LedgerUnavailableError
from ..ledger.base import Ledger
from ..ledger.opening import open_ledger
from ..observability.health import ErrorRate, HealthSnapshot
from ..observability.outage import OUTAGE_CODES, Outage
from ..sinks.base import Sink
from ..sinks.cursor import CursorState
from ..sinks.loader import WebhookOptions, close_sink, open_sink
from ..sinks.outbox import OutboxSink
from ..sinks.parking import ParkedRow
from ..sinks.relay import OutboxRelay, RelayStatus
from .config import ConfigError, Settings
from .errors import ErrorContext
from .holds import HoldNotifier, HoldsView, read_holds
from .logs import describe_cause
from .status import RecentDecision

__all__ = [
    "ERROR_RATE_MIN_DISPATCHES",
    "ERROR_RATE_THRESHOLD",
    "PROBE_TIMEOUT_S",
    "Check",
    "HealthVerdict",
    "Service",
]

log = logging.getLogger("flowdecision.service")
T = TypeVar("T")

#: Health degrades when more than this share of the window's dispatches failed...
ERROR_RATE_THRESHOLD = 0.5
#: ...and the window holds at least this many dispatches (one bad request is not a trend).
ERROR_RATE_MIN_DISPATCHES = 10
#: A ledger or sink probe that takes longer than this counts as unreachable.
PROBE_TIMEOUT_S = 2.0
#: Probe results are reused for this long (a load balancer may poll often).
PROBE_TTL_S = 1.0
#: The id the ledger probe reads; it is never written.
PROBE_DECISION_ID = "flowdecision-health-probe"
#: Relay cursors read for ``/metrics`` and the status page are reused for this long.
CURSORS_TTL_S = 1.0
#: Past the grace period, how long cancelled dispatches get to unwind before close.
UNWIND_S = 1.0


@dataclass(frozen=True, slots=True)
class Check:
    """One health check: ``ok``, or the error code that failed it."""

    ok: bool
    code: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"status": "ok" if self.ok else "failed", "code": self.code}


OK = Check(True)
NOT_PROBED = Check(True, "not_probed")


@dataclass(frozen=True, slots=True)
class HealthVerdict:
    """The service's verdict (``/healthz``) with the checks behind it."""

    ledger: Check
    sink: Check
    errors: ErrorRate
    snapshot: HealthSnapshot
    #: the in-service relay (``serve --relay-to``), shown in the body; it does not make
    #: the replica unhealthy (POSTs are still taken): a relay retrying is said, not failed
    relay: RelayStatus | None = None

    @property
    def error_rate_ok(self) -> bool:
        errors = self.errors
        return errors.dispatches < ERROR_RATE_MIN_DISPATCHES or errors.rate <= ERROR_RATE_THRESHOLD

    @property
    def healthy(self) -> bool:
        return self.ledger.ok and self.sink.ok and self.error_rate_ok

    @property
    def reason(self) -> str | None:
        """The code of the first failed check (None when healthy)."""
        if not self.ledger.ok:
            return self.ledger.code
        if not self.sink.ok:
            return self.sink.code
        if not self.error_rate_ok:
            return "error_rate"
        return None

    def to_dict(self) -> dict[str, Any]:
        """The snapshot's counters, with ``status`` the service's verdict and the checks."""
        body = self.snapshot.to_dict()
        body["status"] = "healthy" if self.healthy else "degraded"
        body["reason"] = self.reason
        errors = self.errors
        body["checks"] = {
            "ledger": self.ledger.to_dict(),
            "sink": self.sink.to_dict(),
            "error_rate": {
                "status": "ok" if self.error_rate_ok else "failed",
                "window_s": errors.window_s,
                "dispatches": errors.dispatches,
                "failures": errors.failures,
                "rate": round(errors.rate, 4),
                "threshold": ERROR_RATE_THRESHOLD,
                "min_dispatches": ERROR_RATE_MIN_DISPATCHES,
            },
        }
        relay = self.relay
        if relay is not None:
            body["relay"] = {
                "name": relay.name,
                "state": relay.state,
                "running": relay.state not in ("starting", "opening", "stopped"),
                "last_error": relay.last_error,
                "lag_rows": relay.lag_rows,
                "parked_rows": relay.parked_rows,
            }
        return body


def _sink_probe(sink: Sink) -> Callable[[], Awaitable[object]] | None:
    """How to ask ``sink`` whether it is reachable without delivering anything.

    A sink's own ``async probe()`` if it has one; an outbox is read (past its
    last row); a webhook or a custom sink without ``probe`` is not probed (a
    request would be a side effect): its failures show in the error rate.
    """
    probe = getattr(sink, "probe", None)
    if callable(probe):
        return probe  # type: ignore[no-any-return]
    fetch = getattr(sink, "fetch", None)
    if callable(fetch):
        return lambda: fetch(after=I64_MAX, limit=1)
    return None


async def _check(
    probe: Callable[[], Awaitable[object]], what: str, outage: Outage | None = None
) -> Check:
    """Run ``probe``. With ``outage``, a failure meaning the store is down
    (:data:`~flowdecision.observability.outage.OUTAGE_CODES`) goes to that outage log (one line
    when it starts, summaries, one when it ends) instead of a line per probe."""
    extra: dict[str, object]
    try:
        await asyncio.wait_for(probe(), PROBE_TIMEOUT_S)
    except TimeoutError:
        code, cause = f"{what}_unavailable", f"no answer within {PROBE_TIMEOUT_S} s"
        message, extra = f"{what} probe timed out", {"timeout_s": PROBE_TIMEOUT_S}
    except FlowDecisionError as error:
        code, cause = error.code, describe_cause(error)
        if code in ("ledger_error", "outbox_error", "error"):
            code = f"{what}_unavailable"
        message, extra = f"{what} probe failed", {"code": code, "cause": cause}
    except Exception as error:
        code, cause = f"{what}_unavailable", describe_cause(error)
        message, extra = f"{what} probe failed", {"cause": cause}
    else:
        if outage is not None:
            outage.succeeded(wrote=False)
        # Reads work on a full disk: Service.cached_health says store_full while the
        # writes' outage lasts (from the first write refused to the first that succeeds).
        return OK
    if code == "store_full":
        # Only writes start and end a full-disk outage: a probe's read that found no
        # room (a temporary file) would start one that only the next write could end,
        # and keep /healthz at 503 while writes succeed. Its verdict is the writes'.
        log.warning(message, extra=extra)
        return OK
    if outage is not None and code in OUTAGE_CODES:
        outage.failed(code, cause)
    else:
        log.warning(message, extra=extra)
    return Check(False, code)


class Service:
    """The running parts: ledger, sink, dispatcher, recent decisions and in-flight tasks."""

    def __init__(self, settings: Settings, ledger: Ledger, sink: Sink) -> None:
        self.settings = settings
        self.ledger = ledger
        self.sink = sink
        if settings.keep_tombstones and hasattr(ledger, "keep_tombstones"):
            ledger.keep_tombstones = True  # every prune of this ledger keeps tombstones
        if ledger.runs_supported:  # before the dispatcher, which reads it once
            ledger.run_invariants = settings.run_invariants
        approvals = settings.approval_policy()
        if approvals is not None and not ledger.holds_supported:
            raise ConfigError(
                "approval holds (approve_kinds, approve_steps, approve_runs) need a ledger "
                "that keeps them (sqlite:///, postgresql://, memory:); a JSON file ledger is "
                "shared with Rust hosts, which know no held state"
            )
        self.dispatcher = Dispatcher(
            settings.production_branch,
            sink,
            ledger,
            lease_ms=settings.lease_ms,
            approvals=approvals,
        )
        self.dispatcher.ledger_outage.summary_s = settings.outage_summary_s
        self.recent: deque[RecentDecision] = deque(maxlen=settings.recent_limit)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.started_at_ms = time.time_ns() // 1_000_000
        self.closed = False  # shutdown began: no new dispatch starts
        self.stopped = False  # the sink and the ledger are closed
        self._deadline: asyncio.TimerHandle | None = None
        self._sink_probe = _sink_probe(sink)
        self._probed_at = -PROBE_TTL_S
        self._probing: asyncio.Task[tuple[Check, Check]] | None = None
        self._checks: tuple[Check, Check] = (OK, NOT_PROBED)
        self._failures_at_probe = (0, 0)
        #: Set when shutdown begins: long-polls and event streams end at once.
        self.closing = asyncio.Event()
        #: The relay ``relay_to`` asks for (see :meth:`start_relay`), and its task.
        self.relay: OutboxRelay | None = None
        self._relay_task: asyncio.Task[None] | None = None
        #: Expires holds past their time (``hold_expire_ms``; see :meth:`start_expiry`).
        self._expiry_task: asyncio.Task[None] | None = None
        self._cursors: tuple[float, list[CursorState]] = (-CURSORS_TTL_S, [])
        #: The ledger's held decisions as last counted (:meth:`refresh_holds`).
        self._holds: tuple[float, HoldsView | None] = (-CURSORS_TTL_S, None)
        #: Tells ``hold_notify_url`` of each new hold (None without one).
        self.notifier: HoldNotifier | None = None
        if settings.hold_notify_url is not None:
            self.notifier = HoldNotifier(
                settings.hold_notify_url,
                token=settings.hold_notify_token,
                max_attempts=settings.webhook_max_attempts,
            )

    @classmethod
    async def start(cls, settings: Settings) -> Service:
        """Open the ledger and the sink the settings name."""
        ledger = await open_ledger(settings.ledger)
        try:
            sink = await open_sink(
                settings.sink,
                webhook=WebhookOptions(
                    timeout_s=settings.webhook_timeout_s,
                    max_attempts=settings.webhook_max_attempts,
                    token=settings.webhook_token,
                ),
            )
        except BaseException:
            await ledger.close()
            raise
        return cls(settings, ledger, sink)

    # -- the relay and the outbox's cursors -------------------------------------------

    async def approve(self, decision_id: str, *, actor: str, reason: str) -> ApprovalOutcome:
        """Approve a held decision through the dispatcher (exactly once), tracked like a
        POST's dispatch: the shutdown grace period waits for it."""
        if self.closed:
            raise LedgerUnavailableError("the service is shutting down")
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            return await self.dispatcher.approve(decision_id, actor=actor, reason=reason)
        finally:
            self.tasks.discard(task)

    def announce_hold(self, request: DecisionRequest, hold_expires_at_ms: int | None) -> None:
        """A POST of ``request`` was answered held: tell ``hold_notify_url`` (queued, off
        the request's path; a no-op without one)."""
        if self.notifier is not None and not self.closed:
            self.notifier.start()
            self.notifier.held(request, hold_expires_at_ms)

    def hold_figures(self) -> tuple[int, float] | None:
        """``(held decisions, the oldest one's wait in s)`` as last read (no I/O; None
        before the first read, or on a ledger that keeps no holds)."""
        view = self._holds[1]
        if view is None or view.error is not None:
            return None
        return view.count, view.oldest_age_s(self.ledger.now_ms())  # the clock holds were taken by

    async def refresh_holds(self) -> HoldsView | None:
        """Count the ledger's held decisions (reused for :data:`CURSORS_TTL_S`; None on
        a ledger that keeps no holds)."""
        if not self.ledger.holds_supported or self.stopped:
            return None
        loop = asyncio.get_running_loop()
        if loop.time() - self._holds[0] >= CURSORS_TTL_S:
            self._holds = (loop.time(), await read_holds(self.ledger, shown=0))
        return self._holds[1]

    def start_expiry(self) -> None:
        """Start rejecting expired holds (``hold_expire_ms``), about 4 times per expiry
        time and at least once a second (once; a no-op without an expiry)."""
        policy = self.dispatcher.approvals
        if policy is None or policy.expire_ms is None or self._expiry_task is not None:
            return
        period_s = min(max(policy.expire_ms / 4000, 0.05), 1.0)
        self._expiry_task = asyncio.ensure_future(self._expire_holds(period_s))

    async def _expire_holds(self, period_s: float) -> None:
        while not self.closed:
            try:
                expired = await self.ledger.expire_holds()
            except FlowDecisionError as error:
                log.warning("expiring holds failed", extra={"cause": describe_cause(error)})
            else:
                for entry in expired:
                    log.info("hold expired", extra={"decision_id": entry.decision_id})
            try:
                await asyncio.wait_for(self.closing.wait(), period_s)
            except TimeoutError:
                continue

    def start_relay(self) -> None:
        """Start the relay ``relay_to`` names, draining the outbox sink (once; no-op without)."""
        target = self.settings.relay_to
        if target is None or self.relay is not None or self.closed:
            return
        if not isinstance(self.sink, OutboxSink):
            raise ConfigError("relay_to needs the outbox as the sink")
        self.relay = OutboxRelay(
            self.sink,
            target,
            name=self.settings.relay_name,
            concurrency=self.settings.relay_concurrency,
            webhook=self._webhook_options(),
        )
        self._relay_task = asyncio.ensure_future(self._run_relay(self.relay))

    async def _run_relay(self, relay: OutboxRelay) -> None:
        """Run the relay until shutdown. Its URL was checked when the settings loaded and
        an engine that is down is retried inside it; anything else that stops it is
        logged and it starts again, backing off, so it never stays down silently."""
        retry = 0
        while not self.closed:
            try:
                await relay.run()
                return
            except Exception as error:
                retry += 1
                log.error(
                    "relay stopped; starting it again",
                    extra={"relay": relay.name, "cause": describe_cause(error), "retry": retry},
                )
                await asyncio.sleep(min(0.5 * 2 ** min(retry, 6), 30.0))

    async def parked_rows(self) -> list[ParkedRow] | None:
        """The outbox's parked and held rows (None without an outbox, or while it cannot
        be read: the outbox's own probe reports that)."""
        if not isinstance(self.sink, OutboxSink) or self.stopped:
            return None
        try:
            return await asyncio.wait_for(self.sink.parked(), PROBE_TIMEOUT_S)
        except Exception as error:
            log.debug("reading parked rows failed", extra={"cause": describe_cause(error)})
            return None

    def relay_status(self) -> RelayStatus | None:
        """The in-service relay's status (None without one; no I/O)."""
        return None if self.relay is None else self.relay.status()

    def _webhook_options(self) -> WebhookOptions:
        settings = self.settings
        return WebhookOptions(
            timeout_s=settings.webhook_timeout_s,
            max_attempts=settings.webhook_max_attempts,
            token=settings.webhook_token,
        )

    def cursor_states(self) -> list[CursorState]:
        """The outbox's relay cursors as last read (:meth:`refresh_cursors`; no I/O)."""
        return self._cursors[1]

    async def refresh_cursors(self) -> list[CursorState]:
        """Read the outbox's relay cursors (reused for :data:`CURSORS_TTL_S`); [] without an
        outbox, or the last values while it cannot be read."""
        cursors = getattr(self.sink, "cursors", None)
        if cursors is None or self.stopped:
            return self._cursors[1]
        loop = asyncio.get_running_loop()
        if loop.time() - self._cursors[0] < CURSORS_TTL_S:
            return self._cursors[1]
        try:
            states = await asyncio.wait_for(cursors(), PROBE_TIMEOUT_S)
        except Exception as error:  # the outbox's own probe reports the outage
            log.debug("reading relay cursors failed", extra={"cause": describe_cause(error)})
            return self._cursors[1]
        self._cursors = (loop.time(), list(states))
        return self._cursors[1]

    # -- dispatches ---------------------------------------------------------------

    def error_context(self) -> ErrorContext:
        """What the error table's answers read of the service (the ledger's clock, the
        heartbeat behind a ``busy`` answer's ``Retry-After``)."""
        return ErrorContext(
            now_ms=self.ledger.now_ms(),
            heartbeat_ms=round(self.dispatcher.heartbeat_s * 1000),
        )

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``work`` in a tracked task: it outlives its request, not the grace period."""
        task = asyncio.get_running_loop().create_task(work)  # (ensure_future's checks: a few µs)
        self.tasks.add(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an orphaned failure is in the metrics already

    # -- health -------------------------------------------------------------------

    def cached_health(self) -> HealthVerdict:
        """The verdict from the last probes and the current error rate (no I/O).

        A full disk fails the ledger check (code ``store_full``) from the first
        write it refused until a write succeeds: the probe only reads.
        """
        ledger, sink = self._checks
        outage = self.dispatcher.ledger_outage
        if outage.active and outage.code == "store_full":
            ledger = Check(False, "store_full")
        return HealthVerdict(
            ledger=ledger,
            sink=sink,
            errors=self.dispatcher.metrics.error_rate(),
            snapshot=self.dispatcher.health(),
            relay=self.relay_status(),
        )

    async def check_health(self) -> HealthVerdict:
        """Probe the ledger and the sink.

        Results younger than :data:`PROBE_TTL_S` are reused unless a dispatch
        has seen a ledger or sink failure since.
        """
        loop = asyncio.get_running_loop()
        metrics = self.dispatcher.metrics
        # A ledger or sink failure since the last probe makes its result stale at once.
        failures = (metrics.ledger_failures, metrics.sink_failures)
        stale = failures != self._failures_at_probe
        if (stale or loop.time() - self._probed_at >= PROBE_TTL_S) and not self.stopped:
            self._failures_at_probe = failures
            if self._probing is None:
                self._probing = loop.create_task(self._probe())
            probing = self._probing
            try:
                self._checks = await asyncio.shield(probing)
            finally:
                if self._probing is probing and probing.done():
                    self._probing = None
                    self._probed_at = loop.time()
        return self.cached_health()

    async def _probe(self) -> tuple[Check, Check]:
        ledger_check = _check(
            lambda: self.ledger.lookup(PROBE_DECISION_ID), "ledger", self.dispatcher.ledger_outage
        )
        if self._sink_probe is None:
            return await ledger_check, NOT_PROBED
        ledger, sink = await asyncio.gather(ledger_check, _check(self._sink_probe, "sink"))
        return ledger, sink

    # -- shutdown -----------------------------------------------------------------

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new dispatches; cancel those still running ``grace_s`` from now."""
        if self.closed:
            return
        self.closed = True
        self.closing.set()
        if self.relay is not None:
            self.relay.stop()
        log.info(
            "shutting down",
            extra={"in_flight": len(self.tasks), "grace_s": grace_s},
        )
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(grace_s, self._grace_over)

    def _grace_over(self) -> None:
        self._deadline = None
        late = [task for task in self.tasks if not task.done()]
        if late:
            # Their claims stay until their leases expire; a retry (any replica)
            # then takes over as the next attempt. Their requests get 503.
            log.warning(
                "shutdown grace period over, cancelling in-flight dispatches",
                extra={"cancelled": len(late)},
            )
        for task in late:
            task.cancel()

    async def _stop_relay(self) -> None:
        relay, task = self.relay, self._relay_task
        if relay is None or task is None:
            return
        relay.stop()
        _done, late = await asyncio.wait({task}, timeout=UNWIND_S + 1)
        for pending in late:  # a delivery that ignores the stop: its row is redelivered later
            pending.cancel()
        await relay.close()

    async def stop(self, grace_s: float) -> None:
        """Let in-flight dispatches finish (until the grace deadline), then close everything."""
        if self.stopped:
            return
        self.begin_shutdown(grace_s)
        pending = {task for task in self.tasks if not task.done()}
        if pending:
            # The deadline timer cancels them; wait for that plus a moment to unwind.
            loop = asyncio.get_running_loop()
            deadline = self._deadline
            left = (deadline.when() - loop.time()) if deadline is not None else 0.0
            _done, late = await asyncio.wait(pending, timeout=max(left, 0.0) + UNWIND_S)
            for task in late:  # ignored its cancellation: do not wait for it any longer
                task.cancel()
        if self._probing is not None:
            self._probing.cancel()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            await asyncio.gather(self._expiry_task, return_exceptions=True)
        if self.notifier is not None:
            await self.notifier.close()
        await self._stop_relay()
        self.stopped = True
        try:
            await close_sink(self.sink)
        finally:
            await self.ledger.close()
