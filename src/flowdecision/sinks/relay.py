"""The outbox relay: drain an outbox into any sink, at least once, ordered per run.

``OutboxRelay(outbox, sink, name="billing")`` reads the outbox's rows after its
named cursor -- kept in the outbox's own store (:mod:`.cursor`) -- and hands
each to ``sink.submit(request, attempt)``. A relay that dies delivers the rows
after its saved cursor again when it (or another relay of that name) starts:
delivery is **at least once**, and the sink's dedup on ``decision_id`` (every
flowdecision sink has one; so do Temporal, Restate, DBOS and procrastinate
through their sinks) makes the effect exactly once.

* **Ordered per run, concurrent across runs.** One reader reads rows in
  ``seq`` order into per-run *lanes*; up to ``concurrency`` lanes deliver at
  once, each one row at a time, so a run's decisions reach the sink in ``seq``
  order (Temporal's updates to one workflow, Restate's virtual object) while
  different runs overlap. ``concurrency=1`` is a single line in ``seq`` order.
* **A durable low-water mark.** The cursor is the highest ``seq`` below which
  every row is done (accepted by the sink, or parked); it is saved every
  ``save_interval_s`` while it moves, and each save renews the lease. The
  reader never runs more than ``window`` rows past the mark, so a relay killed
  at any point redelivers **at most ``window`` rows** (default
  ``max(batch, 32 × concurrency)``: 1,024; a run's rows come in a row, so the window
  must span many runs to keep every lane busy).
* **Permanent vs transient failures.** A row the sink refuses for good (it
  raised a :class:`~flowdecision.errors.SinkRefusedError`: a webhook 4xx, a
  closed Temporal run, an unknown Restate handler, a content conflict) is
  **parked** (:mod:`.parking`): recorded with its error, attempts and time; the
  run's later rows are held behind it, in order, and every other run goes on.
  An operator retries or skips it (``flowdecision outbox retry|skip``). Any
  other failure is transient: that lane backs off (full jitter, up to
  ``retry_cap_s``) and tries again, forever. When failures come from more than
  one run with no success between them the sink looks down: one delivery at a
  time probes it, backing off, until one passes; the relay logs one warning
  when that starts and one when it ends, not one per try.
* **One relay per name.** A relay holds a lease on its cursor and renews it
  while it works; a second relay with the same name waits until the lease is
  released or expires. Taking a lease over raises its fencing token, so a
  stalled former holder can no longer move the cursor or touch parked rows,
  and stops delivering when it notices. Relays with different names drain the
  same outbox independently.
* **Waiting.** Caught up, the reader waits in :meth:`OutboxSink.fetch` with
  ``wait_s``: woken by this process's commits, by ``LISTEN/NOTIFY`` on
  PostgreSQL, or by a poll backing off to ``poll_max_s`` on SQLite.
* **Opening.** An engine that is down when the relay starts is retried with
  backoff (the status says ``opening``); a malformed URL or a missing package
  fails at once (:class:`~flowdecision.errors.SinkConfigError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import random
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Self

import flowdecision.observability.tracing as tracing

from ..connections.backoff import full_jitter
from ..connections.closing import Closable
from ..core.model import DecisionRequest
from ..errors import (
    FlowDecisionError,
    InvalidArgumentError,
    RelayError,
    SinkConfigError,
    sink_refused,
)
from .base import Sink, check_sink
from .cursor import CursorLease, CursorState, LeaseHeld, check_cursor_name
from .loader import WebhookOptions, close_sink, open_sink
from .outbox import OutboxEntry, OutboxSink

__all__ = ["DEFAULT_RELAY_NAME", "OutboxRelay", "RelayError", "RelayStatus"]

log = logging.getLogger("flowdecision.relay")

DEFAULT_RELAY_NAME = "default"
#: Lanes delivering at once, unless told otherwise.
DEFAULT_CONCURRENCY = 32
#: Failures from this many runs in a row, with no success between: the sink looks down.
OUTAGE_STREAK = 2
#: A repeated failure is logged again at most this often (with the count meanwhile).
LOG_EVERY_S = 30.0
#: How often a running relay looks for parked rows an operator released.
PARKED_POLL_S = 1.0
#: Stopping, deliveries in flight get this long to finish before they are cancelled.
STOP_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class RelayStatus:
    """What one relay is doing, for ``/metrics``, the status page, ``/healthz`` and the CLI."""

    name: str
    owner: str
    #: starting, opening, waiting_for_lease, delivering, idle, retrying, backing_off or stopped
    state: str
    #: the saved low-water mark: every row up to it is delivered or parked
    position: int
    #: the fencing token of the lease held (0: none yet)
    fence: int
    #: rows this relay delivered (since it started)
    delivered: int
    #: failed deliveries that were retried
    retries: int
    #: times this relay found its lease taken over
    leases_lost: int
    #: the outbox's newest seq when last read
    head_seq: int
    lag_rows: int
    lag_seconds: float
    last_error: str | None = None
    last_error_at_ms: int | None = None
    last_delivered_at_ms: int | None = None
    #: lanes that may deliver at once
    concurrency: int = 1
    #: rows read and not yet done
    in_flight: int = 0
    #: rows this relay parked (since it started)
    parked: int = 0
    #: rows parked and held in the outbox for this relay's name, when last read
    parked_rows: int = 0
    held_rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "owner": self.owner,
            "state": self.state,
            "position": self.position,
            "fence": self.fence,
            "delivered": self.delivered,
            "retries": self.retries,
            "leases_lost": self.leases_lost,
            "head_seq": self.head_seq,
            "lag_rows": self.lag_rows,
            "lag_seconds": round(self.lag_seconds, 3),
            "last_error": self.last_error,
            "last_error_at_ms": self.last_error_at_ms,
            "last_delivered_at_ms": self.last_delivered_at_ms,
            "concurrency": self.concurrency,
            "in_flight": self.in_flight,
            "parked": self.parked,
            "parked_rows": self.parked_rows,
            "held_rows": self.held_rows,
        }


def _default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Stopped(Exception):
    """The relay was asked to stop while it waited."""


class _LeaseLost(Exception):
    """Another relay of this name holds the cursor now."""


#: A lane item: deliver the run's parked-table rows (an operator released one).
_RESUME = object()


class _Tenure:
    """One lease's worth of delivering: the lanes, the low-water mark, the held runs."""

    def __init__(self, lease: CursorLease) -> None:
        self.lease = lease
        #: the highest seq read
        self.read = lease.position
        #: the mark last saved in the cursor
        self.saved = lease.position
        #: rows delivered since the last save (the cursor's ``delivered`` counter)
        self.unsaved = 0
        #: seqs read and not yet done, in seq order (rows are read in seq order);
        #: ``finished`` holds done ones not yet popped
        self.pending: deque[int] = deque()
        self.finished: set[int] = set()
        self.lanes: dict[str, deque[Any]] = {}
        #: lanes waiting for a worker, oldest head row first (a heap of (seq, run id)):
        #: at ``concurrency=1`` that is ``seq`` order; above it, the longest-waiting run
        #: goes next. A plain heap and a list of idle workers, not an asyncio.PriorityQueue:
        #: a lane passes through it once per row, and the queue's bookkeeping showed.
        self.ready: list[tuple[int, str]] = []
        self.idle: deque[asyncio.Future[None]] = deque()
        #: runs with rows parked or held: their rows go through the parked table
        self.blocked: set[str] = set()
        self.resuming: set[str] = set()
        #: lane items not yet done (rows and resumes)
        self.outstanding = 0
        #: lanes in the middle of an item (a delivery in flight)
        self.active = 0
        self.progress = asyncio.Event()
        self.fatal: BaseException | None = None
        #: the requests of rows read and not yet done, parsed once (by seq)
        self.requests: dict[int, DecisionRequest] = {}

    def mark(self) -> int:
        """The low-water mark: every row up to it is done."""
        pending, finished = self.pending, self.finished
        while pending and pending[0] in finished:
            finished.discard(pending.popleft())
        return pending[0] - 1 if pending else self.read

    def put(self, run_id: str, item: Any) -> None:
        lane = self.lanes.get(run_id)
        if lane is None:
            self.lanes[run_id] = lane = deque([item])
            self.wait_turn(run_id, lane)
        else:
            lane.append(item)
        self.outstanding += 1
        if item is not _RESUME:
            self.pending.append(item.seq)
            self.read = max(self.read, item.seq)

    def wait_turn(self, run_id: str, lane: deque[Any]) -> None:
        """Queue the lane for a worker, ranked by its first item's seq (a resume first)."""
        head = lane[0]
        heapq.heappush(self.ready, (0 if head is _RESUME else head.seq, run_id))
        idle = self.idle
        while idle:
            worker = idle.popleft()
            if not worker.done():  # a worker cancelled while idle is skipped
                worker.set_result(None)
                return

    def keeps_turn(self, run_id: str, lane: deque[Any]) -> bool:
        """Whether the lane that just did an item goes again at once: its first item is
        older than every waiting lane's, so :meth:`next_lane` would hand it back anyway."""
        head = lane[0]
        ready = self.ready
        return not ready or (0 if head is _RESUME else head.seq, run_id) < ready[0]

    async def next_lane(self) -> str:
        """The run whose lane goes next (the oldest first item); waits while none is ready."""
        ready = self.ready
        while not ready:
            worker = asyncio.get_running_loop().create_future()
            self.idle.append(worker)
            await worker
        return heapq.heappop(ready)[1]

    def done(self, item: Any) -> None:
        self.outstanding -= 1
        if item is not _RESUME:
            self.finished.add(item.seq)
            self.requests.pop(item.seq, None)
        self.progress.set()

    def resume(self, run_id: str) -> None:
        if run_id not in self.resuming:
            self.resuming.add(run_id)
            self.put(run_id, _RESUME)


class OutboxRelay(Closable):
    """Deliver an outbox's rows to a sink, at least once, ordered per run, under a named cursor.

    ``outbox`` and ``sink`` are objects or URLs (an outbox URL as for
    :class:`OutboxSink`; any sink URL :func:`~.loader.open_sink` takes). What
    the relay opened from a URL it also closes; objects stay the caller's.

    :meth:`run` works until :meth:`stop` (or cancellation); :meth:`drain`
    delivers what is deliverable now and returns; :meth:`status` says where it is.
    """

    def __init__(
        self,
        outbox: OutboxSink | str,
        sink: Sink | str,
        *,
        name: str = DEFAULT_RELAY_NAME,
        batch: int = 200,
        concurrency: int = DEFAULT_CONCURRENCY,
        window: int | None = None,
        lease_ms: int = 15_000,
        owner: str | None = None,
        retry_base_s: float = 0.05,
        retry_cap_s: float = 10.0,
        idle_wait_s: float = 1.0,
        save_interval_s: float = 0.1,
        rng: random.Random | None = None,
        webhook: WebhookOptions | None = None,
    ) -> None:
        self.name = check_cursor_name(name)
        for field, value, low, high in (
            ("batch", batch, 1, 10_000),
            ("concurrency", concurrency, 1, 1_000),
            ("window", batch if window is None else window, 1, 100_000),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidArgumentError(
                    f"{field} must be an integer in {low}..={high}, got {value!r}"
                )
        if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or lease_ms < 100:
            raise InvalidArgumentError(f"lease_ms must be an integer >= 100, got {lease_ms!r}")
        for field, number in (("retry_base_s", retry_base_s), ("retry_cap_s", retry_cap_s),
                              ("idle_wait_s", idle_wait_s),
                              ("save_interval_s", save_interval_s)):  # fmt: skip
            if isinstance(number, bool) or not isinstance(number, int | float) or not number > 0:
                raise InvalidArgumentError(f"{field} must be a number > 0, got {number!r}")
        self.batch = batch
        self.concurrency = concurrency
        #: rows the reader may run ahead of the saved mark: the redelivery bound
        self.window = max(batch, 32 * concurrency) if window is None else window
        self.lease_ms = lease_ms
        self.owner = owner or _default_owner()
        self.retry_base_s = float(retry_base_s)
        self.retry_cap_s = float(retry_cap_s)
        self.idle_wait_s = float(idle_wait_s)
        self.save_interval_s = float(save_interval_s)
        self._rng = rng or random.Random()
        self._webhook = webhook
        self._outbox_arg = outbox
        self._sink_arg = sink
        self.outbox: OutboxSink | None = outbox if isinstance(outbox, OutboxSink) else None
        self.sink: Sink | None = None if isinstance(sink, str) else check_sink(sink)
        self._owned: list[object] = []
        self._stop = asyncio.Event()
        self._wake_stop: asyncio.Future[None] | None = None
        self._lease: CursorLease | None = None
        self._tenure: _Tenure | None = None
        self._renewed_at = 0.0
        self._saved_at = 0.0
        self._closed = False
        #: transient failures in a row with no success between (the sink-wide backoff)
        self._streak = 0
        self._streak_runs: set[str] = set()
        self._probes = 0
        self._not_before = 0.0
        self._probe = asyncio.Lock()
        #: (what failed last, when it was logged, failures since)
        self._logged: tuple[str, float, int] = ("", 0.0, 0)
        #: the fields of :meth:`status`, kept mutable: a delivery updates two of them, and
        #: building a frozen status each time cost more than the relay's own bookkeeping
        self._now: dict[str, Any] = dict(
            name=self.name, owner=self.owner, state="starting", position=0, fence=0,
            delivered=0, retries=0, leases_lost=0, head_seq=0, lag_rows=0, lag_seconds=0.0,
            last_error=None, last_error_at_ms=None, last_delivered_at_ms=None,
            concurrency=concurrency, in_flight=0, parked=0, parked_rows=0, held_rows=0,
        )  # fmt: skip

    # -- life cycle ---------------------------------------------------------------------

    async def open(self) -> Self:
        """Open the outbox and the sink given as URLs (done by :meth:`run` too)."""
        if self._closed:
            raise RelayError(f"relay `{self.name}` is closed")
        if self.outbox is None:
            assert isinstance(self._outbox_arg, str)
            outbox = OutboxSink(self._outbox_arg)
            await outbox.open()
            self.outbox = outbox
            self._owned.append(outbox)
        if self.sink is None:
            assert isinstance(self._sink_arg, str)
            self.sink = await open_sink(self._sink_arg, webhook=self._webhook)
            self._owned.append(self.sink)
        return self

    async def open_patiently(self) -> Self:
        """:meth:`open`, retried with backoff while the store or the engine is unreachable.

        A malformed URL or a missing package fails at once
        (:class:`~flowdecision.errors.SinkConfigError`); :meth:`stop` ends the wait.
        """
        self._wake_stop = self._wake_stop or asyncio.get_running_loop().create_future()
        retry = 0
        while True:
            try:
                return await self.open()
            except (SinkConfigError, RelayError, InvalidArgumentError):
                raise
            except (FlowDecisionError, OSError) as error:
                retry += 1
                self._set(state="opening")
                self._failed(error, "opening the sink")
                await self._pause(self._delay(retry))

    async def __aenter__(self) -> Self:
        return await self.open()

    def stop(self) -> None:
        """Ask :meth:`run` to finish: no delivery starts, those in flight get
        :data:`STOP_GRACE_S` to finish (then they are cancelled, and their rows delivered
        again later), the mark is saved and the lease released."""
        self._stop.set()
        if self._wake_stop is not None and not self._wake_stop.done():
            self._wake_stop.set_result(None)
        if self._tenure is not None:  # the reader may be waiting for progress
            self._tenure.progress.set()

    async def close(self) -> None:
        """Stop, release the lease, and close what the relay opened itself."""
        self.stop()
        await self._release()
        if self._closed:
            return
        self._closed = True
        owned, self._owned = self._owned, []
        for thing in reversed(owned):
            try:
                await close_sink(thing)
            except Exception as error:  # closing must go on for the rest
                log.warning("closing failed", extra={"relay": self.name, "cause": str(error)})

    async def refresh(self) -> RelayStatus:
        """Read the cursor's lag and the parked and held rows again; the status."""
        if self.outbox is not None:
            await self._refresh_lag()
        return self.status()

    def status(self) -> RelayStatus:
        """The relay's current state and counters (no I/O)."""
        tenure = self._tenure
        self._now["in_flight"] = 0 if tenure is None else tenure.outstanding
        return RelayStatus(**self._now)

    # -- running ------------------------------------------------------------------------

    async def run(self) -> None:
        """Deliver rows as they come until :meth:`stop` is called (or the task is cancelled)."""
        self._wake_stop = asyncio.get_running_loop().create_future()
        if self._stop.is_set():
            return
        await self._work(drain=False)

    async def drain(self) -> int:
        """Deliver every row that is deliverable now (retrying transient failures, parking
        refused rows), then return how many were delivered.

        Waits for the lease like :meth:`run` if another relay of this name holds it.
        Rows parked, or held behind a parked row, are not waited for: :meth:`status`
        (``parked_rows``, ``held_rows``) says how many are left.
        """
        self._wake_stop = asyncio.get_running_loop().create_future()
        before: int = self._now["delivered"]
        await self._work(drain=True)
        delivered: int = self._now["delivered"]
        return delivered - before

    async def _work(self, *, drain: bool) -> None:
        """Hold the cursor and deliver (until nothing is deliverable, with ``drain``),
        taking the lease again whenever another relay of this name took it over."""
        try:
            await self.open_patiently()
            while not self._stop.is_set():
                try:
                    lease = await self._acquire()
                    await self._deliver_under(lease, drain=drain)
                    if drain:
                        return
                except _LeaseLost:
                    self._lost()
        except _Stopped:
            pass
        finally:
            self._set(state="stopped", in_flight=0)
            await self._release()

    # -- the lease ----------------------------------------------------------------------

    async def _acquire(self) -> CursorLease:
        outbox = self._ready_outbox()
        retry = 0
        while True:
            self._check_stop()
            try:
                verdict = await outbox.acquire_cursor(self.name, self.owner, self.lease_ms)
            except FlowDecisionError as error:  # the outbox's store is down: keep trying
                retry += 1
                self._failed(error, "acquiring the cursor")
                await self._pause(self._delay(retry))
                continue
            if isinstance(verdict, CursorLease):
                self._lease = verdict
                self._renewed_at = time.monotonic()
                self._set(state="delivering", position=verdict.position, fence=verdict.fence)
                log.info(
                    "relay holds its cursor",
                    extra={"relay": self.name, "owner": self.owner, "fence": verdict.fence,
                           "position": verdict.position, "concurrency": self.concurrency},
                )  # fmt: skip
                return verdict
            self._held(verdict)
            # The holder may release early (a clean stop): look again at least every second.
            left_s = (verdict.lease_expires_at_ms - verdict.now_ms) / 1000
            await self._pause(min(max(left_s, 0.01), 1.0))

    def _held(self, held: LeaseHeld) -> None:
        if self._now["state"] != "waiting_for_lease":
            log.info(
                "relay waits: another relay holds its cursor",
                extra={"relay": held.name, "holder": held.owner,
                       "lease_expires_at_ms": held.lease_expires_at_ms},
            )  # fmt: skip
        self._set(state="waiting_for_lease")

    async def _save(self, tenure: _Tenure, *, force: bool = False) -> None:
        """Persist the low-water mark (and renew the lease) when it moved and a save is
        due, or the lease needs renewing; raises :class:`_LeaseLost` when fenced off."""
        now = time.monotonic()
        mark = tenure.mark()
        moved = mark > tenure.saved or tenure.unsaved > 0
        renew = now - self._renewed_at >= self.lease_ms / 3000
        if not renew and not (moved and (force or now - self._saved_at >= self.save_interval_s)):
            return
        delivered = tenure.unsaved
        outbox = self._ready_outbox()
        retry = 0
        while True:
            started = time.monotonic()
            try:
                ours = await outbox.advance_cursor(
                    tenure.lease, mark, delivered=delivered, lease_ms=self.lease_ms
                )
            except FlowDecisionError as error:
                retry += 1
                self._failed(error, "advancing the cursor")
                await self._pause(self._delay(retry))
                continue
            if not ours:
                raise _LeaseLost
            self._renewed_at = self._saved_at = started
            tenure.saved = max(tenure.saved, mark)
            tenure.unsaved -= delivered
            self._set(position=tenure.saved)
            return

    async def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None or self.outbox is None:
            return
        try:
            await self.outbox.release_cursor(lease)
        except FlowDecisionError as error:  # it expires on its own
            log.warning("relay could not release its lease", extra={"cause": str(error)})

    def _lost(self) -> None:
        self._lease = None
        log.warning(
            "relay lost its cursor's lease to another relay of the same name; waiting",
            extra={"relay": self.name, "owner": self.owner},
        )
        self._set(state="waiting_for_lease", leases_lost=self._now["leases_lost"] + 1)

    # -- reading: one reader fills the lanes --------------------------------------------

    async def _deliver_under(self, lease: CursorLease, *, drain: bool) -> None:
        outbox = self._ready_outbox()
        tenure = _Tenure(lease)
        self._tenure = tenure
        workers = [
            asyncio.ensure_future(self._lane_worker(tenure)) for _ in range(self.concurrency)
        ]
        looked_at_parked = -PARKED_POLL_S
        try:
            while True:
                self._check_stop()
                # Cleared before looking: progress made from here on wakes the waits below.
                tenure.progress.clear()
                if tenure.fatal is not None:
                    raise tenure.fatal
                # Caught up, the mark is saved before the reader waits for rows: the
                # lag must read 0 at once, not after the wait.
                await self._save(tenure, force=tenure.outstanding == 0)
                if time.monotonic() - looked_at_parked >= PARKED_POLL_S:
                    looked_at_parked = time.monotonic()
                    await self._look_at_parked(tenure)
                ahead = tenure.read - tenure.mark()
                if ahead >= self.window:  # the redelivery bound: wait for the mark to move
                    await self._wait_progress(tenure)
                    continue
                busy = tenure.outstanding > 0
                wait_s = 0.0 if drain or busy else min(self.idle_wait_s, self.lease_ms / 3000)
                try:
                    rows = await self._until_stopped(
                        outbox.fetch(
                            after=tenure.read,
                            limit=min(self.batch, self.window - ahead),
                            wait_s=wait_s,
                        )
                    )
                except FlowDecisionError as error:
                    self._failed(error, "reading the outbox")
                    await self._pause(self._delay(1))
                    continue
                for row in rows:
                    self._enqueue(tenure, row)
                if rows:
                    self._set(state=self._working_state())
                    continue
                if busy:
                    await self._wait_progress(tenure)
                    continue
                await self._save(tenure, force=True)
                await self._refresh_lag()
                if drain:
                    await self._look_at_parked(tenure)
                    if tenure.outstanding == 0:
                        return
                    continue
                self._set(state="idle")
        finally:
            self._tenure = None
            if self._stop.is_set() and tenure.fatal is None:
                await self._let_in_flight_finish(tenure)
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            # Keep the progress made (best effort; rows not recorded are delivered again).
            if tenure.fatal is None:
                with contextlib.suppress(Exception):
                    await self._save(tenure, force=True)

    async def _let_in_flight_finish(self, tenure: _Tenure) -> None:
        """Stopping: give the deliveries in flight up to :data:`STOP_GRACE_S` to finish, so
        that a clean stop leaves nothing to deliver again (a retrying lane stops at once)."""
        deadline = time.monotonic() + STOP_GRACE_S
        while True:
            tenure.progress.clear()  # before looking, so a lane finishing now is not missed
            left = deadline - time.monotonic()
            if not tenure.active or left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tenure.progress.wait(), left)

    def _enqueue(self, tenure: _Tenure, row: OutboxEntry) -> None:
        try:
            request = tenure.requests[row.seq] = row.request
            run_id = request.run_id
        except FlowDecisionError:
            run_id = ""  # unreadable: its own lane; the sink's refusal parks it
        tenure.put(run_id, row)

    async def _wait_progress(self, tenure: _Tenure) -> None:
        """Wait for a lane to finish an item (the reader cleared the event before it
        looked, so none is missed), for the lease's renewal to come due, or for
        :meth:`stop` (which sets the event too).

        A timer that sets the event, not ``wait_for``: the reader waits here about once
        per row done while its window is full, and ``wait_for`` costs a task each time."""
        timer = asyncio.get_running_loop().call_later(
            min(1.0, self.lease_ms / 3000), tenure.progress.set
        )
        try:
            await tenure.progress.wait()
        finally:
            timer.cancel()

    async def _look_at_parked(self, tenure: _Tenure) -> None:
        """Queue a resume for runs an operator released (their first row is held now) and
        for runs whose parked rows are gone (skipped)."""
        try:
            blocked, ready = await self._ready_outbox().ready_runs(self.name)
        except FlowDecisionError as error:
            self._failed(error, "reading parked rows")
            return
        if not tenure.blocked and not blocked:
            return
        stale = {run for run in tenure.blocked - blocked if run not in tenure.lanes}
        tenure.blocked |= blocked
        for run_id in [*ready, *sorted(stale)]:
            tenure.resume(run_id)

    def _working_state(self) -> str:
        if self._streak >= OUTAGE_STREAK:
            return "backing_off"
        return "delivering"

    # -- delivering: a lane delivers one run's rows, one at a time ----------------------

    async def _lane_worker(self, tenure: _Tenure) -> None:
        try:
            run_id = await tenure.next_lane()
            while True:
                lane = tenure.lanes[run_id]
                self._check_stop()  # stopping: no new delivery starts
                tenure.active += 1
                try:
                    done = await self._lane_step(tenure, run_id, lane)
                finally:
                    tenure.active -= 1
                    tenure.progress.set()
                for finished in done:
                    tenure.done(finished)
                # One item a turn: the lane queues again behind older rows of other runs
                # (or goes on at once when it is the oldest: the queue would return it).
                if not lane:
                    del tenure.lanes[run_id]
                elif tenure.keeps_turn(run_id, lane):
                    continue
                else:
                    tenure.wait_turn(run_id, lane)
                run_id = await tenure.next_lane()
        except (asyncio.CancelledError, _Stopped):
            return
        except BaseException as error:  # lease lost, or a bug: the reader re-raises it
            tenure.fatal = error
            tenure.progress.set()

    async def _lane_step(self, tenure: _Tenure, run_id: str, lane: deque[Any]) -> list[Any]:
        """Do the lane's next item; the items done (popped)."""
        item = lane[0]
        if item is _RESUME:
            await self._resume(tenure, run_id)
            tenure.resuming.discard(run_id)
            return [lane.popleft()]
        if run_id in tenure.blocked:
            held = []
            while lane and lane[0] is not _RESUME:
                held.append(lane.popleft())
            await self._park(tenure, run_id, held, "held", None, 0)
            return held
        await self._deliver_row(tenure, run_id, item)
        return [lane.popleft()]

    async def _deliver_row(self, tenure: _Tenure, run_id: str, row: OutboxEntry) -> None:
        refusal = await self._attempt(run_id, row)
        if refusal is None:
            self._delivered(tenure)
            return
        tenure.blocked.add(run_id)
        await self._park(tenure, run_id, [row], "parked", refusal, 1)

    async def _resume(self, tenure: _Tenure, run_id: str) -> None:
        """Deliver run ``run_id``'s rows from the parked table, in seq order, until one is
        parked (the run stays held) or none is left (the run goes on as usual)."""
        outbox = self._ready_outbox()
        while True:
            rows = await self._patiently(lambda: outbox.run_rows(self.name, run_id))
            if not rows:
                tenure.blocked.discard(run_id)
                return
            tenure.blocked.add(run_id)
            for state, attempts, row in rows:
                if state == "parked":
                    return
                refusal = await self._attempt(run_id, row)
                if refusal is not None:
                    await self._park(tenure, run_id, [row], "parked", refusal, attempts + 1)
                    return
                if not await self._patiently(lambda seq=row.seq: outbox.unpark(tenure.lease, seq)):
                    raise _LeaseLost
                self._delivered(tenure)

    async def _park(
        self,
        tenure: _Tenure,
        run_id: str,
        rows: list[OutboxEntry],
        state: str,
        refusal: BaseException | None,
        attempts: int,
    ) -> None:
        error = None if refusal is None else f"{type(refusal).__name__}: {refusal}"
        outbox = self._ready_outbox()
        ours = await self._patiently(
            lambda: outbox.park(
                tenure.lease, rows, run_id, state=state, error=error, attempts=attempts
            )
        )
        if not ours:
            raise _LeaseLost
        if state == "parked":
            row = rows[0]
            log.warning(
                "relay parked a row its sink refused; the run's later rows wait behind it",
                extra={"relay": self.name, "seq": row.seq, "decision_id": row.decision_id,
                       "run_id": run_id, "cause": error},
            )  # fmt: skip
            self._set(parked=self._now["parked"] + 1)

    async def _patiently(self, work: Any) -> Any:
        """``await work()``, retried with backoff while the outbox's store fails."""
        retry = 0
        while True:
            try:
                return await work()
            except FlowDecisionError as error:
                retry += 1
                self._failed(error, "writing parked rows")
                await self._pause(self._delay(retry))

    def _delivered(self, tenure: _Tenure) -> None:
        tenure.unsaved += 1
        now = self._now
        now["state"] = self._working_state()
        now["delivered"] += 1
        now["last_delivered_at_ms"] = _now_ms()

    async def _attempt(self, run_id: str, row: OutboxEntry) -> BaseException | None:
        """Hand ``row`` to the sink until it accepts (None) or refuses it for good (the
        refusal); transient failures back off, this lane's and, in an outage, the sink's."""
        sink = self.sink
        assert sink is not None
        retry = 0
        while True:
            try:
                await self._submission(sink, row, retry)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if sink_refused(error):
                    self._recovered()  # the sink answered: it is up
                    return error
                retry += 1
                self._transient(error, run_id, row)
                await self._pause(self._delay(retry))
                continue
            self._recovered()
            return None

    def _submission(self, sink: Sink, row: OutboxEntry, retry: int) -> Awaitable[None]:
        """The submission to await: while the sink looks down, a turn at probing it.

        Not a coroutine itself, and the sink's own coroutine when the sink is up: every
        resumption of a delivery in flight passes through each frame of the chain."""
        if self._streak >= OUTAGE_STREAK:
            return self._probe_submit(sink, row, retry)
        return self._submit(sink, row, retry)

    async def _probe_submit(self, sink: Sink, row: OutboxEntry, retry: int) -> None:
        """Take turns probing a sink that looks down: one delivery at a time, after the
        sink-wide backoff."""
        while self._streak >= OUTAGE_STREAK:
            async with self._probe:
                if self._streak < OUTAGE_STREAK:
                    break
                await self._pause(max(self._not_before - time.monotonic(), 0.0))
                await self._submit(sink, row, retry)
                return
        await self._submit(sink, row, retry)

    def _submit(self, sink: Sink, row: OutboxEntry, retry: int) -> Awaitable[None]:
        tenure = self._tenure
        request = tenure.requests.get(row.seq) if tenure is not None else None
        if request is None:  # a row from the parked table, or one that did not parse
            request = row.request
        if not tracing.active():
            return sink.submit(request, row.highest_attempt)
        return self._traced_submit(sink, row, request, retry)

    async def _traced_submit(
        self, sink: Sink, row: OutboxEntry, request: DecisionRequest, retry: int
    ) -> None:
        """One delivery as a ``flowdecision.relay.deliver`` span continuing the row's trace
        (the trace of the dispatch that wrote it); the sink passes this span on."""
        attributes: dict[str, str | int] = {
            "flowdecision.decision_id": row.decision_id,
            "flowdecision.run_id": request.run_id,
            "flowdecision.attempt": row.highest_attempt,
            "flowdecision.outbox.seq": row.seq,
            "flowdecision.relay.name": self.name,
            "flowdecision.relay.retry": retry,
        }
        with tracing.SpanScope(
            "flowdecision.relay.deliver",
            kind=tracing.PRODUCER,
            parent=tracing.context_of(row.traceparent),
            attributes=attributes,
        ):
            await sink.submit(request, row.highest_attempt)

    def _transient(self, error: BaseException, run_id: str, row: OutboxEntry) -> None:
        self._streak_runs.add(run_id)
        self._streak += 1
        outage = self._streak >= OUTAGE_STREAK and len(self._streak_runs) > 1
        if not outage:
            self._streak = min(self._streak, OUTAGE_STREAK - 1)
        elif self._now["state"] != "backing_off":
            log.warning(
                "relay's sink looks down: one delivery at a time probes it, backing off",
                extra={"relay": self.name, "cause": f"{type(error).__name__}: {error}"},
            )
        if outage:  # the probes back off exponentially, whatever the burst before them
            self._probes += 1
            self._not_before = time.monotonic() + self._delay(self._probes)
        self._failed(error, f"delivering seq {row.seq} (`{row.decision_id}`)")
        self._set(state="backing_off" if outage else "retrying", retries=self._now["retries"] + 1)

    def _recovered(self) -> None:
        if not self._streak:  # nothing failed since the last success (every delivery)
            return
        if self._streak >= OUTAGE_STREAK:
            log.warning(
                "relay's sink answers again",
                extra={"relay": self.name, "failures": self._streak},
            )
        self._streak = 0
        self._streak_runs.clear()
        self._probes = 0
        self._not_before = 0.0

    # -- helpers ------------------------------------------------------------------------

    def _ready_outbox(self) -> OutboxSink:
        if self.outbox is None:
            raise RelayError(f"relay `{self.name}` is not open")
        return self.outbox

    def _delay(self, retry: int) -> float:
        return full_jitter(retry, base_s=self.retry_base_s, cap_s=self.retry_cap_s, rng=self._rng)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Stopped

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if :meth:`stop` is called meanwhile."""
        self._check_stop()
        waker = self._wake_stop
        if waker is None:
            await asyncio.sleep(seconds)
        else:
            try:
                await asyncio.wait_for(asyncio.shield(waker), seconds)
            except TimeoutError:
                pass
        self._check_stop()

    async def _until_stopped(self, work: Any) -> Any:
        """Await ``work`` unless :meth:`stop` comes first (then raise :class:`_Stopped`)."""
        waker = self._wake_stop
        if waker is None:
            return await work
        task = asyncio.ensure_future(work)
        await asyncio.wait({task, waker}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # cancelled on purpose: its outcome does not matter
                pass
            raise _Stopped
        return task.result()

    async def _refresh_lag(self) -> None:
        try:
            states = await self._ready_outbox().cursors(self.name)
        except FlowDecisionError:
            return  # the lag stays as last read; the next read failure shows in the errors
        if states:
            self._lag_from(states[0])

    def _lag_from(self, state: CursorState) -> None:
        self._set(
            head_seq=state.head_seq,
            lag_rows=state.lag_rows,
            lag_seconds=state.lag_seconds,
            position=max(self._now["position"], state.position),
            parked_rows=state.parked_rows,
            held_rows=state.held_rows,
        )

    def _failed(self, error: BaseException, doing: str) -> None:
        """Record a failure; log it when its kind changes, else at most every
        :data:`LOG_EVERY_S` with the count meanwhile (not once per try)."""
        kind = f"{doing.split(' seq ')[0]}: {type(error).__name__}"
        text = f"{doing}: {type(error).__name__}: {error}"
        last, logged_at, since = self._logged
        now = time.monotonic()
        if kind != last or now - logged_at >= LOG_EVERY_S:
            log.warning(
                "relay delivery failed; retrying",
                extra={"relay": self.name, "cause": text, "failures_since_last_line": since},
            )
            self._logged = (kind, now, 0)
        else:
            self._logged = (last, logged_at, since + 1)
        self._set(last_error=text, last_error_at_ms=_now_ms())

    def _set(self, **changes: Any) -> None:
        self._now.update(changes)
