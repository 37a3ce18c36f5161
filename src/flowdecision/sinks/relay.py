"""The outbox relay: drain an outbox into any sink, at least once, in ``seq`` order.

``OutboxRelay(outbox, sink, name="billing")`` reads the outbox's rows after its
named cursor, hands each to ``sink.submit(request, attempt)`` in ``seq`` order
and advances the cursor -- kept in the outbox's own store
(:mod:`.cursor`) -- only after the sink accepted. A relay that dies between
the sink's accept and the cursor's advance delivers those rows again when it
(or another relay of that name) starts: delivery is **at least once**, and
the sink's dedup on ``decision_id`` (every flowdecision sink has one; so do
Temporal, Restate, DBOS and procrastinate through their sinks) makes the
effect exactly once.

* **Order and progress.** Rows go one at a time, in ``seq`` order; the cursor
  advances after each batch, and before the relay starts retrying a failed row
  (so progress is kept through an outage).
* **Retries.** A failed delivery (the sink raised, the engine is down) is
  retried with full-jitter exponential backoff, forever: later rows wait
  behind it (the lag grows and shows on ``/metrics``). A row the sink can
  never accept stalls the relay until an operator moves the cursor past it
  (``flowdecision outbox cursors --set``).
* **One relay per name.** A relay holds a lease on its cursor and renews it
  while it works; a second relay with the same name waits until the lease is
  released or expires. Taking a lease over raises its fencing token, so a
  stalled former holder can no longer move the cursor and stops delivering
  when it notices. Relays with different names drain the same outbox
  independently.
* **Waiting.** Caught up, the relay waits in :meth:`OutboxSink.fetch` with
  ``wait_s``: woken by this process's commits, by ``LISTEN/NOTIFY`` on
  PostgreSQL, or by a poll backing off to ``poll_max_s`` on SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Self

import flowdecision.tracing as tracing

from ..backoff import full_jitter
from ..closing import Closable
from ..errors import FlowDecisionError, InvalidArgumentError, RelayError, SinkConfigError
from ..model import DecisionRequest
from .base import Sink, check_sink
from .cursor import CursorLease, CursorState, LeaseHeld, check_cursor_name
from .loader import WebhookOptions, close_sink, open_sink
from .outbox import OutboxEntry, OutboxSink

__all__ = ["DEFAULT_RELAY_NAME", "OutboxRelay", "RelayError", "RelayStatus"]

log = logging.getLogger("flowdecision.relay")

DEFAULT_RELAY_NAME = "default"


@dataclass(frozen=True, slots=True)
class RelayStatus:
    """What one relay is doing, for ``/metrics``, the status page and the CLI."""

    name: str
    owner: str
    #: starting, waiting_for_lease, delivering, idle, retrying or stopped
    state: str
    #: the seq of the last row the sink accepted (as far as this relay knows)
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
        }


def _default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Stopped(Exception):
    """The relay was asked to stop while it waited."""


class _LeaseLost(Exception):
    """Another relay of this name holds the cursor now."""


class OutboxRelay(Closable):
    """Deliver an outbox's rows to a sink, at least once, under a named cursor.

    ``outbox`` and ``sink`` are objects or URLs (an outbox URL as for
    :class:`OutboxSink`; any sink URL :func:`~.loader.open_sink` takes). What
    the relay opened from a URL it also closes; objects stay the caller's.

    :meth:`run` works until :meth:`stop` (or cancellation); :meth:`drain`
    delivers what is there now and returns; :meth:`status` says where it is.
    """

    def __init__(
        self,
        outbox: OutboxSink | str,
        sink: Sink | str,
        *,
        name: str = DEFAULT_RELAY_NAME,
        batch: int = 200,
        lease_ms: int = 15_000,
        owner: str | None = None,
        retry_base_s: float = 0.05,
        retry_cap_s: float = 10.0,
        idle_wait_s: float = 1.0,
        rng: random.Random | None = None,
        webhook: WebhookOptions | None = None,
    ) -> None:
        self.name = check_cursor_name(name)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 10_000:
            raise InvalidArgumentError(f"batch must be an integer in 1..=10000, got {batch!r}")
        if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or lease_ms < 100:
            raise InvalidArgumentError(f"lease_ms must be an integer >= 100, got {lease_ms!r}")
        for field, value in (("retry_base_s", retry_base_s), ("retry_cap_s", retry_cap_s),
                             ("idle_wait_s", idle_wait_s)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise InvalidArgumentError(f"{field} must be a number > 0, got {value!r}")
        self.batch = batch
        self.lease_ms = lease_ms
        self.owner = owner or _default_owner()
        self.retry_base_s = float(retry_base_s)
        self.retry_cap_s = float(retry_cap_s)
        self.idle_wait_s = float(idle_wait_s)
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
        #: (the seq delivered up to, rows delivered) not yet recorded in the cursor
        self._unsaved = (0, 0)
        self._renewed_at = 0.0
        self._closed = False
        self._status = RelayStatus(
            name=self.name, owner=self.owner, state="starting", position=0, fence=0,
            delivered=0, retries=0, leases_lost=0, head_seq=0, lag_rows=0, lag_seconds=0.0,
        )  # fmt: skip

    # -- life cycle ---------------------------------------------------------------------

    async def open(self) -> Self:
        """Open the outbox and the sink given as URLs (done by :meth:`run` too)."""
        if self._closed:
            raise RelayError(f"relay `{self.name}` is closed")
        if self.outbox is None:
            assert isinstance(self._outbox_arg, str)
            self.outbox = OutboxSink(self._outbox_arg)
            self._owned.append(self.outbox)
            await self.outbox.open()
        if self.sink is None:
            assert isinstance(self._sink_arg, str)
            self.sink = await open_sink(self._sink_arg, webhook=self._webhook)
            self._owned.append(self.sink)
        return self

    async def _open_patiently(self) -> None:
        """:meth:`open`, retried with backoff while the store or the engine is unreachable
        (a bad URL or a missing package fails at once)."""
        retry = 0
        while True:
            try:
                await self.open()
                return
            except (SinkConfigError, RelayError, InvalidArgumentError):
                raise
            except (FlowDecisionError, OSError) as error:
                retry += 1
                self._failed(error, "opening")
                await self._pause(self._delay(retry))

    async def __aenter__(self) -> Self:
        return await self.open()

    def stop(self) -> None:
        """Ask :meth:`run` to finish: it stops between deliveries and releases its lease."""
        self._stop.set()
        if self._wake_stop is not None and not self._wake_stop.done():
            self._wake_stop.set_result(None)

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

    def status(self) -> RelayStatus:
        """The relay's current state and counters (no I/O)."""
        return self._status

    # -- running ------------------------------------------------------------------------

    async def run(self) -> None:
        """Deliver rows as they come until :meth:`stop` is called (or the task is cancelled)."""
        self._wake_stop = asyncio.get_running_loop().create_future()
        if self._stop.is_set():
            return
        await self._work(drain=False)

    async def drain(self) -> int:
        """Deliver every row there is now (retrying failures), then return how many.

        Waits for the lease like :meth:`run` if another relay of this name holds it.
        """
        self._wake_stop = asyncio.get_running_loop().create_future()
        before = self._status.delivered
        await self._work(drain=True)
        return self._status.delivered - before

    async def _work(self, *, drain: bool) -> None:
        """Hold the cursor and deliver (until caught up, with ``drain``), taking the
        lease again whenever another relay of this name took it over."""
        try:
            await self._open_patiently()
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
            self._set(state="stopped")
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
                           "position": verdict.position},
                )  # fmt: skip
                return verdict
            self._held(verdict)
            # The holder may release early (a clean stop): look again at least every second.
            left_s = (verdict.lease_expires_at_ms - verdict.now_ms) / 1000
            await self._pause(min(max(left_s, 0.01), 1.0))

    def _held(self, held: LeaseHeld) -> None:
        if self._status.state != "waiting_for_lease":
            log.info(
                "relay waits: another relay holds its cursor",
                extra={"relay": held.name, "holder": held.owner,
                       "lease_expires_at_ms": held.lease_expires_at_ms},
            )  # fmt: skip
        self._set(state="waiting_for_lease")

    async def _renew_if_due(self, lease: CursorLease, position: int) -> None:
        if time.monotonic() - self._renewed_at >= self.lease_ms / 3000:
            await self._advance(lease, position, 0)

    async def _advance(self, lease: CursorLease, position: int, delivered: int) -> None:
        """Persist ``position`` (and renew); raises :class:`_LeaseLost` when fenced off."""
        outbox = self._ready_outbox()
        retry = 0
        while True:
            started = time.monotonic()
            try:
                ours = await outbox.advance_cursor(
                    lease, position, delivered=delivered, lease_ms=self.lease_ms
                )
            except FlowDecisionError as error:
                retry += 1
                self._failed(error, "advancing the cursor")
                await self._pause(self._delay(retry))
                continue
            if not ours:
                raise _LeaseLost
            self._renewed_at = started
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
        self._set(state="waiting_for_lease", leases_lost=self._status.leases_lost + 1)

    # -- delivering ---------------------------------------------------------------------

    async def _deliver_under(self, lease: CursorLease, *, drain: bool) -> None:
        outbox = self._ready_outbox()
        position = lease.position
        while True:
            self._check_stop()
            await self._renew_if_due(lease, position)
            wait_s = 0.0 if drain else min(self.idle_wait_s, self.lease_ms / 3000)
            try:
                rows = await self._until_stopped(
                    outbox.fetch(after=position, limit=self.batch, wait_s=wait_s)
                )
            except FlowDecisionError as error:
                self._failed(error, "reading the outbox")
                await self._pause(self._delay(1))
                continue
            if not rows:
                await self._refresh_lag()
                if drain:
                    return
                self._set(state="idle")
                continue
            self._set(state="delivering")
            self._unsaved = (position, 0)
            try:
                for row in rows:
                    await self._deliver(row, lease)
                    self._unsaved = (row.seq, self._unsaved[1] + 1)
                await self._save(lease)
            except _LeaseLost:
                raise
            except BaseException:
                # Stopped or cancelled mid-batch: keep the progress made (best effort;
                # rows not recorded are delivered again, which the sink absorbs).
                with contextlib.suppress(Exception):
                    await self._save(lease)
                raise
            position = self._unsaved[0]
            await self._refresh_lag()

    async def _save(self, lease: CursorLease) -> None:
        """Advance the cursor past the rows delivered since the last save."""
        position, count = self._unsaved
        if count:
            await self._advance(lease, position, count)
            self._unsaved = (position, 0)
            self._set(position=position)

    async def _deliver(self, row: OutboxEntry, lease: CursorLease) -> None:
        """Hand ``row`` to the sink until it accepts; keep the lease and progress meanwhile."""
        sink = self.sink
        assert sink is not None
        request = row.request
        retry = 0
        while True:
            # Renewing keeps the recorded position: the cursor moves only when a batch is saved.
            await self._renew_if_due(lease, self._status.position)
            try:
                if tracing.active():
                    await self._traced_submit(sink, row, request, retry)
                else:
                    await sink.submit(request, row.highest_attempt)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                retry += 1
                if retry == 1:
                    # Keep what was delivered before waiting out an outage.
                    await self._save(lease)
                self._failed(error, f"delivering seq {row.seq} (`{row.decision_id}`)")
                self._set(state="retrying", retries=self._status.retries + 1)
                await self._pause(self._delay(retry))
                continue
            status = self._status
            self._set(
                state="delivering",
                delivered=status.delivered + 1,
                last_delivered_at_ms=_now_ms(),
            )
            return

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
        with tracing.span(
            "flowdecision.relay.deliver",
            kind=tracing.PRODUCER,
            parent=tracing.context_of(row.traceparent),
            attributes=attributes,
        ):
            await sink.submit(request, row.highest_attempt)

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
            position=max(self._status.position, state.position),
        )

    def _failed(self, error: BaseException, doing: str) -> None:
        text = f"{doing}: {type(error).__name__}: {error}"
        if self._status.last_error != text:  # one line per distinct failure, not per retry
            log.warning("relay delivery failed; retrying", extra={"relay": self.name,
                                                                  "cause": text})  # fmt: skip
        self._set(last_error=text, last_error_at_ms=_now_ms())

    def _set(self, **changes: Any) -> None:
        self._status = replace(self._status, **changes)
