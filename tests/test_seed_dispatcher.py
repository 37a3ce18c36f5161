"""Ports of the dispatcher tests in the seed's ``decision.rs`` (names kept)."""

from __future__ import annotations

import asyncio

import pytest

from flowdecision.core.dispatcher import Dispatcher, DispatchOutcome
from flowdecision.core.model import Fail, request_hash
from flowdecision.errors import (
    DecisionBusyError,
    DecisionConflictError,
    DispatchLedgerError,
    LeaseLostError,
    LedgerError,
    SinkError,
    UnauthorizedBranchError,
)
from flowdecision.ledger import Claimed, JsonFileLedger, MemoryLedger, wall_clock_ms
from flowdecision.observability.health import HealthStatus

from .helpers import (
    CancellableSink,
    ControlledSink,
    FailingOnceSink,
    RecordingSink,
    SlowCountingSink,
    request,
)
from .ledgers import ClaimFailingLedger, LeaseLosingLedger, RenewalNotifyingLedger


async def test_submits_once_and_rejects_fork_branches() -> None:
    sink = RecordingSink()
    dispatcher = Dispatcher("production", sink)
    assert (await dispatcher.dispatch(request("production"))).submitted is True
    assert (await dispatcher.dispatch(request("production"))).submitted is False
    assert sink.ids == ["decision-1"]
    with pytest.raises(UnauthorizedBranchError):
        await dispatcher.dispatch(request("fork"))
    health = dispatcher.health()
    assert health.status is HealthStatus.HEALTHY
    assert health.attempted == 3
    assert health.claimed == 1
    assert health.completed == 1
    assert health.duplicates == 1
    assert health.rejected == 1
    assert health.in_flight == 0
    assert health.last_success_at_ms is not None


async def test_completed_receipt_survives_dispatcher_restart() -> None:
    sink = RecordingSink()
    ledger = MemoryLedger()
    first = Dispatcher("production", sink, ledger)
    assert (await first.dispatch(request())).submitted is True
    restarted = Dispatcher("production", sink, ledger)
    assert (await restarted.dispatch(request())).submitted is False
    assert len(sink.calls) == 1
    assert await ledger.completed_receipt("decision-1") is not None


async def test_decision_id_cannot_be_reused_with_different_content() -> None:
    dispatcher = Dispatcher("production", RecordingSink(), MemoryLedger())
    await dispatcher.dispatch(request())
    conflicting = request(decision=Fail(error="different"))
    with pytest.raises(DecisionConflictError):
        await dispatcher.dispatch(conflicting)
    assert dispatcher.health().conflicts == 1


async def test_sink_failure_releases_claim_for_retry() -> None:
    sink = FailingOnceSink()
    dispatcher = Dispatcher("production", sink, MemoryLedger())
    with pytest.raises(SinkError) as failure:
        await dispatcher.dispatch(request())
    assert isinstance(failure.value.__cause__, OSError)
    assert (await dispatcher.dispatch(request())).submitted is True
    assert sink.calls == 2
    health = dispatcher.health()
    assert health.status is HealthStatus.HEALTHY
    assert health.sink_failures == 1
    assert health.failures == 1
    assert health.completed == 1


async def test_competing_file_backed_dispatchers_submit_to_sink_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sink = SlowCountingSink(0.05)
    left = Dispatcher("production", sink, JsonFileLedger(tmp_path))
    right = Dispatcher("production", sink, JsonFileLedger(tmp_path))
    results = await asyncio.gather(
        left.dispatch(request()), right.dispatch(request()), return_exceptions=True
    )
    assert sum(1 for r in results if isinstance(r, DispatchOutcome) and r.submitted) == 1
    assert sum(1 for r in results if isinstance(r, DecisionBusyError)) == 1
    assert sink.calls == 1


async def test_heartbeat_prevents_takeover_while_sink_is_running() -> None:
    sink = ControlledSink()
    ledger = RenewalNotifyingLedger()
    left = Dispatcher("production", sink, ledger, lease_ms=30)
    right = Dispatcher("production", sink, ledger, lease_ms=30)
    left_task = asyncio.create_task(left.dispatch(request()))
    await asyncio.wait_for(ledger.renewed.wait(), timeout=2)
    with pytest.raises(DecisionBusyError):
        await right.dispatch(request())
    sink.finish.set()
    assert (await left_task).submitted is True
    assert sink.calls == 1
    left_health = left.health()
    assert left_health.completed == 1
    assert left_health.lease_renewals > 0
    assert right.health().busy == 1


async def test_dispatcher_health_counts_expired_claim_takeover() -> None:
    ledger = MemoryLedger()
    req = request()
    await ledger.claim(
        req.decision_id,
        request_hash(req),
        "expired-owner",
        lease_ms=1,
        now_ms=wall_clock_ms() - 10,
    )
    dispatcher = Dispatcher("production", RecordingSink(), ledger)
    assert (await dispatcher.dispatch(req)).submitted is True
    health = dispatcher.health()
    assert health.claimed == 1
    assert health.takeovers == 1
    assert health.completed == 1


async def test_dispatcher_health_records_ledger_failure() -> None:
    dispatcher = Dispatcher("production", RecordingSink(), ClaimFailingLedger())
    with pytest.raises(DispatchLedgerError) as failure:
        await dispatcher.dispatch(request())
    assert isinstance(failure.value.__cause__, LedgerError)
    assert str(failure.value) == "Flow decision ledger failed: ledger unavailable"
    health = dispatcher.health()
    assert health.status is HealthStatus.DEGRADED
    assert health.ledger_failures == 1
    assert health.in_flight == 0


async def test_lost_lease_cancels_in_flight_sink_future() -> None:
    sink = CancellableSink(0.05)
    dispatcher = Dispatcher("production", sink, LeaseLosingLedger(), lease_ms=9)
    with pytest.raises(LeaseLostError):
        await dispatcher.dispatch(request())
    await asyncio.sleep(0.06)
    assert sink.started == 1
    assert sink.completed == 0
    health = dispatcher.health()
    assert health.status is HealthStatus.DEGRADED
    assert health.lease_lost == 1
    assert health.in_flight == 0
    assert health.last_failure_at_ms is not None


async def test_cancelled_dispatch_does_not_leak_in_flight_health() -> None:
    sink = ControlledSink()
    dispatcher = Dispatcher("production", sink)
    pending = asyncio.create_task(dispatcher.dispatch(request()))
    await sink.started.wait()
    assert dispatcher.health().in_flight == 1
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    health = dispatcher.health()
    assert health.status is HealthStatus.DEGRADED
    assert health.attempted == 1
    assert health.cancellations == 1
    assert health.in_flight == 0


async def test_claim_is_kept_after_cancellation_until_lease_expires() -> None:
    # As in the seed: a cancelled dispatch does not release; its lease expires.
    sink = ControlledSink()
    ledger = MemoryLedger()
    dispatcher = Dispatcher("production", sink, ledger, lease_ms=60_000)
    pending = asyncio.create_task(dispatcher.dispatch(request()))
    await sink.started.wait()
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    outcome = await ledger.claim("decision-1", request_hash(request()), "other", lease_ms=10)
    assert not isinstance(outcome, Claimed)
