"""Fault injection at every boundary the dispatcher crosses.

A wrapping ledger fails (or blocks) on demand before or after the real
operation; sinks hang past the lease, or raise after applying their effect; the
dispatching task is cancelled at each await point. Every case checks what the
dispatcher reports (exception and health), that a later dispatch still gets the
decision delivered with exactly one effect, and that nothing leaks in health.
The ledger's clock is a manual one, so expiry is a step, not a wait.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from typing import TypeVar

import pytest

from flowdecision import (
    DecisionBusyError,
    Dispatcher,
    DispatchLedgerError,
    HealthSnapshot,
    LeaseLostError,
    LedgerUnavailableError,
    SinkError,
)
from flowdecision.core.model import DecisionRequest, request_hash
from flowdecision.ledger import Completed, DelegatingLedger, MemoryLedger, Pending
from flowdecision.sinks import OutboxSink
from tests.helpers import request

T = TypeVar("T")
LONG_LEASE = 60_000
SHORT_LEASE = 60  # heartbeat every 20 ms of real time


class ClockLedger(MemoryLedger):
    """A memory ledger whose clock only moves when a test moves it."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = 1_000_000

    def now_ms(self) -> int:
        return self.clock


class FaultyLedger(DelegatingLedger):
    """Delegates to ``inner``; ``fail[op] = phase`` raises once, ``block[op] = phase``
    hangs once (until cancelled), ``phase`` being ``before`` or ``after`` the real
    operation ("after" means it happened but the caller never heard)."""

    def __init__(self, inner: ClockLedger) -> None:
        super().__init__(inner)
        self.fail: dict[str, str] = {}
        self.block: dict[str, str] = {}
        self.entered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.calls: Counter[str] = Counter()

    async def _hook(self, op: str, phase: str) -> None:
        if self.fail.get(op) == phase:
            del self.fail[op]
            raise LedgerUnavailableError(f"injected {op} failure {phase} the write")
        if self.block.get(op) == phase:
            del self.block[op]
            self.entered[op].set()
            await asyncio.Event().wait()

    async def intercept(self, operation: str, call: Awaitable[T]) -> T:
        self.calls[operation] += 1
        try:
            await self._hook(operation, "before")
        except BaseException:
            if isinstance(call, Coroutine):
                call.close()
            raise
        result = await call
        await self._hook(operation, "after")
        return result


class EffectSink:
    """A deduplicating sink: ``calls`` deliveries, ``effects`` first-time applications.

    ``hang`` blocks the next call until cancelled (``swallow`` then applies the
    effect anyway, like a request that already left the process); ``raise_before``
    / ``raise_after`` fail the next call before or after applying it.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.effects: Counter[str] = Counter()
        self.attempts: list[int] = []
        self.hang = False
        self.swallow = False
        self.raise_before = False
        self.raise_after = False
        self.started = asyncio.Event()

    async def submit(self, req: DecisionRequest, attempt: int) -> None:
        self.calls += 1
        self.attempts.append(attempt)
        self.started.set()
        if self.raise_before:
            self.raise_before = False
            raise ConnectionError("engine unreachable")
        if self.hang:
            self.hang = False
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if not self.swallow:
                    raise
                # The request had already left: it takes effect although we were cancelled.
        self._apply(req)
        if self.raise_after:
            self.raise_after = False
            raise ConnectionResetError("engine applied it, then the connection reset")

    def _apply(self, req: DecisionRequest) -> None:
        self.effects[req.decision_id] = 1  # insert-if-absent: a replay changes nothing


def assert_no_leak(health: HealthSnapshot) -> None:
    assert health.in_flight == 0
    assert health.attempted == (
        health.completed + health.duplicates + health.busy + health.conflicts
        + health.rejected + health.failures
    )  # fmt: skip
    assert health.failures >= (
        health.lease_lost + health.sink_failures + health.ledger_failures + health.cancellations
    )


async def deliver_later(
    ledger: ClockLedger,
    sink: EffectSink,
    req: DecisionRequest,
    dispatcher: Dispatcher | None = None,
) -> bool:
    """A later dispatch (by a new dispatcher unless given): waits out a live lease by
    stepping the clock, and returns what dispatch returned."""
    later = dispatcher or Dispatcher("production", sink, ledger, lease_ms=LONG_LEASE)
    for _ in range(3):
        try:
            result = await later.dispatch(req)
        except DecisionBusyError as busy:
            ledger.clock = busy.lease_expires_at_ms + 1
            continue
        assert_no_leak(later.health())
        assert not later._gates
        return result.submitted
    raise AssertionError("still busy after the lease expired")


def setup(lease_ms: int = LONG_LEASE) -> tuple[ClockLedger, FaultyLedger, EffectSink, Dispatcher]:
    inner = ClockLedger()
    faulty = FaultyLedger(inner)
    sink = EffectSink()
    return inner, faulty, sink, Dispatcher("production", sink, faulty, lease_ms=lease_ms)


# ------------------------------------------------------------- ledger failures


@pytest.mark.parametrize(
    ("op", "phase", "retry_result", "calls"),
    [
        ("claim", "before", True, 1),  # nothing happened; the retry delivers
        ("claim", "after", True, 1),  # we hold a claim we never heard of; re-claim it
        ("complete", "before", True, 2),  # delivered, not completed: the retry replays
        ("complete", "after", False, 1),  # completed but unheard: the retry is a duplicate
    ],
)
async def test_ledger_failure_on_claim_or_complete(
    op: str, phase: str, retry_result: bool, calls: int
) -> None:
    inner, faulty, sink, dispatcher = setup()
    faulty.fail[op] = phase
    req = request()
    with pytest.raises(DispatchLedgerError, match=f"injected {op} failure {phase}") as caught:
        await dispatcher.dispatch(req)
    assert isinstance(caught.value.__cause__, LedgerUnavailableError)
    health = dispatcher.health()
    assert (health.ledger_failures, health.failures, health.completed) == (1, 1, 0)
    assert health.status.value == "degraded"
    assert_no_leak(health)

    # The same dispatcher (same owner) retries at once: it re-claims its own live claim.
    assert await deliver_later(inner, sink, req, dispatcher) is retry_result
    assert sink.calls == calls
    assert sink.effects == {req.decision_id: 1}
    assert isinstance(await inner.inspect(req.decision_id, request_hash(req)), Completed)
    assert dispatcher.health().status.value == "healthy"


async def test_ledger_failure_on_renew_cancels_the_sink() -> None:
    inner, faulty, sink, dispatcher = setup(SHORT_LEASE)
    faulty.fail["renew"] = "before"
    sink.hang = True
    req = request()
    with pytest.raises(DispatchLedgerError, match="injected renew failure"):
        await dispatcher.dispatch(req)
    health = dispatcher.health()
    assert (health.ledger_failures, health.failures, health.lease_lost) == (1, 1, 0)
    assert_no_leak(health)
    assert sink.effects == {}  # the hanging call was cancelled before it applied anything
    # The claim was not released (the ledger was failing); it is still ours and live.
    assert isinstance(await inner.inspect(req.decision_id, request_hash(req)), Pending)
    assert await deliver_later(inner, sink, req, dispatcher) is True
    assert (sink.calls, sink.effects) == (2, {req.decision_id: 1})


async def test_ledger_failure_on_release_keeps_the_sink_error() -> None:
    inner, faulty, sink, dispatcher = setup()
    faulty.fail["release"] = "before"
    sink.raise_before = True
    req = request()
    with pytest.raises(SinkError, match="engine unreachable"):
        await dispatcher.dispatch(req)  # the failed release is logged, not raised
    health = dispatcher.health()
    assert (health.sink_failures, health.ledger_failures, health.failures) == (1, 0, 1)
    assert_no_leak(health)
    assert faulty.calls["release"] == 1
    # Unreleased, the claim blocks others until its lease expires; then one delivery.
    assert await deliver_later(inner, sink, req) is True
    assert (sink.calls, sink.effects) == (2, {req.decision_id: 1})
    assert sink.attempts == [1, 2]


# ------------------------------------------------------------------ sink faults


@pytest.mark.parametrize("swallow", [False, True], ids=["cancellable", "already-sent"])
async def test_sink_that_hangs_past_the_lease(swallow: bool) -> None:
    inner, _, sink, dispatcher = setup(SHORT_LEASE)
    sink.hang, sink.swallow = True, swallow
    req = request()
    task = asyncio.create_task(dispatcher.dispatch(req))
    await sink.started.wait()
    inner.clock += 10 * SHORT_LEASE  # the lease runs out while the sink hangs
    with pytest.raises(LeaseLostError):
        await task
    health = dispatcher.health()
    assert (health.lease_lost, health.failures, health.completed) == (1, 1, 0)
    assert_no_leak(health)
    # An already-sent request took effect anyway; the dedup sink absorbs the replay.
    assert sink.effects == ({req.decision_id: 1} if swallow else {})
    other = Dispatcher("production", sink, inner, lease_ms=LONG_LEASE)
    assert await deliver_later(inner, sink, req, other) is True
    assert other.health().takeovers == 1
    assert (sink.calls, sink.effects, sink.attempts) == (2, {req.decision_id: 1}, [1, 2])


async def test_sink_that_raises_after_applying_into_the_real_outbox(tmp_path: Path) -> None:
    """The "did it happen?" case: the row exists, the dispatcher heard an error."""

    class RaisingAfterOutbox:
        def __init__(self, outbox: OutboxSink) -> None:
            self.outbox = outbox
            self.raise_after = True

        async def submit(self, req: DecisionRequest, attempt: int) -> None:
            await self.outbox.submit(req, attempt)
            if self.raise_after:
                self.raise_after = False
                raise ConnectionResetError("reset after the engine accepted it")

    inner = ClockLedger()
    req = request()
    async with OutboxSink(f"sqlite:///{tmp_path / 'outbox.db'}") as outbox:
        sink = RaisingAfterOutbox(outbox)
        dispatcher = Dispatcher("production", sink, inner, lease_ms=LONG_LEASE)
        with pytest.raises(SinkError, match="reset after the engine accepted it"):
            await dispatcher.dispatch(req)
        health = dispatcher.health()
        assert (health.sink_failures, health.failures) == (1, 1)
        assert_no_leak(health)
        # The claim was released, so a retry goes through at once, as attempt 2.
        assert (await dispatcher.dispatch(req)).submitted is True
        assert await outbox.count() == 1
        entry = await outbox.get(req.decision_id)
        assert entry is not None
        assert (entry.first_attempt, entry.highest_attempt) == (1, 2)
        assert_no_leak(dispatcher.health())


# ------------------------------------------------------------------ cancellation


@pytest.mark.parametrize(
    ("point", "later_result"),
    [
        ("claim-before", True),
        ("claim-after", True),  # claim held until it expires
        ("sink", True),
        ("release-before", True),  # sink failed, release cancelled: claim held until expiry
        ("complete-before", True),  # delivered, not completed: replay absorbed
        ("complete-after", False),  # completed: the later dispatch is a duplicate
    ],
)
async def test_cancellation_at_each_await_point(point: str, later_result: bool) -> None:
    inner, faulty, sink, dispatcher = setup()
    op, _, phase = point.partition("-")
    if point == "sink":
        sink.hang = True
        entered = sink.started
    else:
        faulty.block[op] = phase
        entered = faulty.entered[op]
        if op == "release":
            sink.raise_before = True
    req = request()
    task = asyncio.create_task(dispatcher.dispatch(req))
    await entered.wait()
    assert dispatcher.health().in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    health = dispatcher.health()
    assert (health.cancellations, health.failures, health.attempted) == (1, 1, 1)
    assert health.completed == 0
    assert_no_leak(health)
    assert not dispatcher._gates
    assert await deliver_later(inner, sink, req) is later_result
    assert sink.effects == {req.decision_id: 1}


async def test_cancellation_while_waiting_for_the_same_id() -> None:
    inner, _, sink, dispatcher = setup()
    sink.hang = True
    req = request()
    first = asyncio.create_task(dispatcher.dispatch(req))
    await sink.started.wait()
    second = asyncio.create_task(dispatcher.dispatch(req))
    await asyncio.sleep(0)
    assert dispatcher.health().in_flight == 2
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    # The first still holds the id; the cancelled waiter left no turn queued.
    assert req.decision_id in dispatcher._gates
    assert not dispatcher._gates[req.decision_id]
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    health = dispatcher.health()
    assert (health.cancellations, health.attempted, health.claimed) == (2, 2, 1)
    assert_no_leak(health)
    assert not dispatcher._gates
    assert await deliver_later(inner, sink, req) is True
    assert sink.effects == {req.decision_id: 1}


def test_the_fault_matrix_is_complete() -> None:
    """Every boundary named in docs/RELIABILITY.md has a test here."""
    names = {name for name in globals() if name.startswith("test_")}
    assert {
        "test_ledger_failure_on_claim_or_complete",
        "test_ledger_failure_on_renew_cancels_the_sink",
        "test_ledger_failure_on_release_keeps_the_sink_error",
        "test_sink_that_hangs_past_the_lease",
        "test_sink_that_raises_after_applying_into_the_real_outbox",
        "test_cancellation_at_each_await_point",
        "test_cancellation_while_waiting_for_the_same_id",
    } <= names
