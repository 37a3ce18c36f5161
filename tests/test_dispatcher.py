"""Dispatcher behaviour beyond the seed tests: concurrency, ordering, messages, health."""

from __future__ import annotations

import asyncio
import json

import pytest

from flowdecision import (
    DecisionBusyError,
    DecisionConflictError,
    DecisionTooLargeError,
    Dispatcher,
    DispatchError,
    DispatchLedgerError,
    InvalidIdentityError,
    LeaseLostError,
    MemoryLedger,
    Missing,
    SinkError,
    UnauthorizedBranchError,
)
from flowdecision.core.identity import decision_receipt
from flowdecision.core.model import Complete, DecisionRequest, request_hash

from .helpers import ControlledSink, RecordingSink, request


def test_error_messages_are_the_seeds() -> None:
    assert str(UnauthorizedBranchError("production", "fork")) == (
        "graph branch is not authorized for production Flow decisions: "
        "expected `production`, got `fork`"
    )
    assert str(InvalidIdentityError()) == "decision_id and causation_event_id must be non-empty"
    assert str(DecisionConflictError("d")) == (
        "Flow decision `d` reuses an existing decision id with different content"
    )
    assert str(DecisionBusyError(42)) == "Flow decision is owned by another dispatcher until 42"
    assert str(LeaseLostError("d")) == "Flow decision `d` lost its lease while the sink was running"
    assert str(DispatchLedgerError("x")) == "Flow decision ledger failed: x"
    assert str(SinkError("x")) == "Flow decision sink failed: x"


@pytest.mark.parametrize(
    "fields",
    [{"decision_id": "  "}, {"causation_event_id": ""}, {"causation_event_id": "\t\n"}],
)
async def test_blank_ids_are_rejected_before_any_claim(fields: dict[str, str]) -> None:
    ledger = MemoryLedger()
    dispatcher = Dispatcher("production", RecordingSink(), ledger)
    base = request()
    bad = DecisionRequest(
        decision_id=fields.get("decision_id", base.decision_id),
        run_id=base.run_id,
        authority_branch_id=base.authority_branch_id,
        causation_event_id=fields.get("causation_event_id", base.causation_event_id),
        decision=base.decision,
    )
    with pytest.raises(InvalidIdentityError):
        await dispatcher.dispatch(bad)
    assert len(ledger) == 0
    health = dispatcher.health()
    assert health.rejected == 1 and health.status.value == "healthy"


async def test_a_decision_over_one_mib_fails_before_any_claim() -> None:
    ledger = MemoryLedger()
    sink = RecordingSink()
    dispatcher = Dispatcher("production", sink, ledger)
    huge = request(decision=Complete(output="x" * (1 << 20)))
    with pytest.raises(DecisionTooLargeError, match="exceeds 1048576 bytes") as caught:
        await dispatcher.dispatch(huge)
    assert isinstance(caught.value, DispatchError) and isinstance(caught.value, ValueError)
    assert caught.value.code == "decision_too_large"
    assert (caught.value.size, caught.value.limit) == (len(huge.decision_json()), 1 << 20)
    assert await ledger.inspect(huge.decision_id, request_hash(huge)) == Missing()
    assert sink.calls == []
    # A client error: counted as rejected; health stays healthy.
    health = dispatcher.health()
    assert (health.rejected, health.ledger_failures, health.failures) == (1, 0, 0)
    assert health.status.value == "healthy"


async def test_completion_stores_the_identity_bound_receipt() -> None:
    ledger = MemoryLedger()
    req = request()
    await Dispatcher("production", RecordingSink(), ledger).dispatch(req)
    identity, receipt = decision_receipt(req)
    assert await ledger.completed_receipt(req.decision_id) == receipt
    entry = await ledger.lookup(req.decision_id)
    assert entry is not None and entry.execution_identity == identity


class GateSink:
    """Blocks every submission until ``n`` are in flight at once, then releases all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.in_flight = 0
        self.peak = 0
        self.all_in = asyncio.Event()

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.in_flight >= self.n:
            self.all_in.set()
        await self.all_in.wait()
        self.in_flight -= 1


async def test_distinct_decisions_dispatch_concurrently() -> None:
    sink = GateSink(20)
    dispatcher = Dispatcher("production", sink)
    requests = [request(decision_id=f"d{i}") for i in range(20)]
    # With a global lock this would deadlock: each sink call waits for all 20.
    results = await asyncio.wait_for(
        asyncio.gather(*(dispatcher.dispatch(r) for r in requests)), timeout=10
    )
    assert [outcome.submitted for outcome in results] == [True] * 20
    assert sink.peak == 20
    assert dispatcher.health().completed == 20


async def test_same_decision_in_one_dispatcher_reaches_the_sink_once() -> None:
    sink = ControlledSink()
    dispatcher = Dispatcher("production", sink)
    first = asyncio.create_task(dispatcher.dispatch(request()))
    second = asyncio.create_task(dispatcher.dispatch(request()))
    await sink.started.wait()
    await asyncio.sleep(0.01)
    assert sink.calls == 1  # the second waits behind the first, not Busy
    sink.finish.set()
    assert (await first).submitted is True
    assert (await second).submitted is False  # as if it ran after the first: a duplicate
    health = dispatcher.health()
    assert (health.completed, health.duplicates, health.busy, health.in_flight) == (1, 1, 0, 0)
    assert dispatcher._gates == {}  # per-id gates do not leak


async def test_a_cancelled_waiter_for_one_decision_neither_blocks_nor_skips_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = ControlledSink()
    dispatcher = Dispatcher("production", sink)
    first = asyncio.create_task(dispatcher.dispatch(request()))
    await sink.started.wait()
    waiting = [asyncio.create_task(dispatcher.dispatch(request())) for _ in range(3)]
    await asyncio.sleep(0.01)
    waiting[0].cancel()  # cancelled while it waits its turn
    await asyncio.sleep(0)
    hand_on = dispatcher._pass_on

    def hand_on_then_cancel(decision_id: str) -> None:
        # The turn is handed to waiting[1], which is cancelled before it runs: it
        # must hand the turn on to waiting[2].
        monkeypatch.setattr(dispatcher, "_pass_on", hand_on)
        hand_on(decision_id)
        waiting[1].cancel()

    monkeypatch.setattr(dispatcher, "_pass_on", hand_on_then_cancel)
    sink.finish.set()
    assert (await first).submitted is True
    assert (await asyncio.wait_for(waiting[2], 1)).submitted is False
    for task in waiting[:2]:
        with pytest.raises(asyncio.CancelledError):
            await task
    assert sink.calls == 1
    assert dispatcher._gates == {}
    # The id is free again: a later dispatch does not wait.
    assert (await asyncio.wait_for(dispatcher.dispatch(request()), 1)).submitted is False


async def test_renewal_error_cancels_the_sink_and_reports_a_ledger_failure() -> None:
    class BrokenRenewLedger(MemoryLedger):
        async def renew(self, *args: object, **kwargs: object) -> bool:
            from flowdecision.errors import LedgerError

            raise LedgerError("disk on fire")

    sink = ControlledSink()
    dispatcher = Dispatcher("production", sink, BrokenRenewLedger(), lease_ms=9)
    with pytest.raises(DispatchLedgerError, match="disk on fire"):
        await asyncio.wait_for(dispatcher.dispatch(request()), timeout=5)
    health = dispatcher.health()
    assert health.ledger_failures == 1 and health.in_flight == 0
    assert health.status.value == "degraded"


async def test_outside_cancellation_propagates_and_is_counted() -> None:
    sink = ControlledSink()
    dispatcher = Dispatcher("production", sink, MemoryLedger(), lease_ms=60_000)
    task = asyncio.create_task(dispatcher.dispatch(request()))
    await sink.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dispatcher.health().cancellations == 1


async def test_sink_receives_attempt_as_fencing_token() -> None:
    ledger = MemoryLedger()
    req = request()
    await ledger.claim(req.decision_id, request_hash(req), "crashed", lease_ms=1, now_ms=1)
    sink = RecordingSink()
    await Dispatcher("production", sink, ledger).dispatch(req)
    assert sink.calls == [(req.decision_id, 2)]


def test_health_snapshot_json_uses_the_seed_field_names() -> None:
    snapshot = Dispatcher("production", RecordingSink()).health()
    assert list(snapshot.to_dict()) == [
        "status", "attempted", "claimed", "takeovers", "completed", "duplicates", "busy",
        "conflicts", "rejected", "lease_renewals", "lease_lost", "sink_failures",
        "ledger_failures", "failures", "cancellations", "in_flight",
        "average_dispatch_micros", "max_dispatch_micros", "last_success_at_ms",
        "last_failure_at_ms",
    ]  # fmt: skip
    encoded = json.loads(json.dumps(snapshot.to_dict()))
    assert encoded["status"] == "healthy" and encoded["last_success_at_ms"] is None


def test_lease_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lease_ms must be a positive integer"):
        Dispatcher("production", RecordingSink(), lease_ms=0)


async def test_stalled_owner_whose_decision_was_completed_by_another_reports_lease_lost() -> None:
    # A pause longer than the lease: no heartbeat ran, another dispatcher took over
    # and completed; the stalled owner's late completion must not count as its own.
    ledger = MemoryLedger()
    stalled_sink = ControlledSink()
    stalled = Dispatcher("production", stalled_sink, ledger, lease_ms=60_000)
    first = asyncio.create_task(stalled.dispatch(request()))
    await stalled_sink.started.wait()
    req = request()
    # Expire the stalled owner's lease the way a long pause would: time passes.
    record = await ledger.read_record(req.decision_id)
    assert record is not None
    rescuer_sink = RecordingSink()
    rescuer = Dispatcher("production", rescuer_sink, ledger)
    outcome = await ledger.claim(
        req.decision_id,
        request_hash(req),
        rescuer.owner_id,
        lease_ms=60_000,
        now_ms=record.lease_expires_at_ms,
        identity=decision_receipt(req)[0],
    )
    assert outcome.__class__.__name__ == "Claimed"
    await ledger.complete(req.decision_id, request_hash(req), rescuer.owner_id)
    stalled_sink.finish.set()
    with pytest.raises(LeaseLostError):
        await first
    health = stalled.health()
    assert (health.completed, health.lease_lost, health.in_flight) == (0, 1, 0)
    assert ledger_owner_kept(await ledger.read_record(req.decision_id), rescuer.owner_id)


def ledger_owner_kept(record: object, owner_id: str) -> bool:
    return getattr(record, "owner_id", None) == owner_id


async def test_complete_tells_own_completion_from_another_owners() -> None:
    ledger = MemoryLedger()
    await ledger.claim("a", "h", "o", lease_ms=50, now_ms=100)
    assert await ledger.complete("a", "h", "o", completed_at_ms=110) is True
    assert await ledger.complete("a", "h", "o") is True  # idempotent retry by the owner
    assert await ledger.complete("a", "h", "late") is False  # someone else finished it


async def test_any_renewal_exception_stops_the_sink_and_is_reported() -> None:
    # A renewal failing with something other than LedgerError (a custom ledger, an
    # OSError that escaped) must still end the sink: it no longer holds a lease.
    class OddLedger(MemoryLedger):
        async def renew(self, *args: object, **kwargs: object) -> bool:
            raise RuntimeError("socket closed")

    sink = ControlledSink()
    dispatcher = Dispatcher("production", sink, OddLedger(), lease_ms=9)
    with pytest.raises(DispatchLedgerError, match="socket closed") as failure:
        await asyncio.wait_for(dispatcher.dispatch(request()), timeout=5)
    assert isinstance(failure.value.__cause__, RuntimeError)
    assert not sink.finish.is_set()  # the sink was stopped, never finished
    health = dispatcher.health()
    assert (health.ledger_failures, health.in_flight, health.completed) == (1, 0, 0)
