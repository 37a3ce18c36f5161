"""What `Dispatcher.dispatch` returns, how its errors are classified, and
`dispatch_until_done` with two dispatchers on one real SQLite ledger."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from pathlib import Path

import pytest

from flowdecision import (
    DecisionBusyError,
    DecisionConflictError,
    Dispatcher,
    DispatchLedgerCorruptError,
    DispatchLedgerError,
    DispatchOutcome,
    FlowDecisionError,
    JsonFileLedger,
    MemoryLedger,
    SinkError,
    SqliteLedger,
)
from flowdecision.core.dispatcher import ERROR_CLASSES
from flowdecision.core.identity import ResultOutcome, ResultReceipt, decision_receipt
from flowdecision.core.model import request_hash
from flowdecision.errors import classify
from flowdecision.observability.health import ErrorRate, ErrorWindow

from .helpers import ControlledSink, FailingOnceSink, RecordingSink, request


async def test_dispatch_returns_what_it_did_and_stays_truthy_like_the_seed() -> None:
    dispatcher = Dispatcher("production", RecordingSink(), MemoryLedger())
    req = request()
    _identity, receipt = decision_receipt(req)

    first = await dispatcher.dispatch(req)
    assert isinstance(first, DispatchOutcome)
    assert first == DispatchOutcome(True, req.decision_id, 1, receipt)
    assert first and first.outcome == "submitted"
    assert first.to_dict() == {
        "outcome": "submitted",
        "decision_id": req.decision_id,
        "attempt": 1,
        "receipt": receipt.to_dict(),
    }

    again = await dispatcher.dispatch(req)
    assert not again and again.outcome == "duplicate"
    assert again.attempt == 1 and again.receipt == receipt  # the stored ones


def test_the_answer_bytes_are_what_json_dumps_writes_for_to_dict() -> None:
    """The service answers with ``to_json`` (written directly): the bytes Starlette's
    JSONResponse wrote for ``to_dict``, for every shape an outcome takes."""
    _identity, receipt = decision_receipt(request(decision_id='d-\u00e9"\\\n\u2028-\U0001f600'))
    failed = ResultReceipt.new(
        receipt.identity, receipt.evidence_digest, ResultOutcome.FAILED, None, 0
    )
    outcomes = [
        DispatchOutcome(True, 'd-\u00e9"\\\n\u2028-\U0001f600', 1, receipt),
        DispatchOutcome(False, "d-2", 7, receipt),
        DispatchOutcome(False, "d-3", 2, failed),
        DispatchOutcome(False, "d-4", None, None),
        DispatchOutcome(False, "d-5", 3, None, receipt.result_digest),
    ]
    for outcome in outcomes:
        dumped = json.dumps(outcome.to_dict(), ensure_ascii=False, separators=(",", ":"))
        assert outcome.to_json() == dumped.encode("utf-8")


async def test_a_duplicate_reports_the_stored_attempt_after_a_retry(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.db")
    try:
        dispatcher = Dispatcher("production", FailingOnceSink(), ledger)
        req = request()
        with pytest.raises(SinkError):
            await dispatcher.dispatch(req)
        assert (await dispatcher.dispatch(req)).attempt == 2
        other = Dispatcher("production", RecordingSink(), ledger)
        duplicate = await other.dispatch(req)
        assert not duplicate.submitted and duplicate.attempt == 2
        assert duplicate.receipt == decision_receipt(req)[1]
    finally:
        await ledger.close()


async def test_a_corrupt_ledger_is_a_permanent_error_with_its_own_code(tmp_path: Path) -> None:
    (tmp_path / "flow-decisions.json").write_text("garbage{")
    dispatcher = Dispatcher("production", RecordingSink(), JsonFileLedger(tmp_path))
    with pytest.raises(DispatchLedgerCorruptError) as caught:
        await dispatcher.dispatch(request())
    assert isinstance(caught.value, DispatchLedgerError)  # callers catching the base still do
    assert caught.value.code == "ledger_corrupt"
    assert dispatcher.health().ledger_failures == 1
    # Permanent: the retry helper does not wait it out.
    with pytest.raises(DispatchLedgerCorruptError):
        await dispatcher.dispatch_until_done(request(), deadline_s=5)
    assert dispatcher.health().ledger_failures == 2


def test_classify_falls_back_to_the_nearest_base_code() -> None:
    class NewBusy(DecisionBusyError):
        code = "brand_new"

    assert classify(NewBusy(1), ERROR_CLASSES) is ERROR_CLASSES["busy"]
    assert classify(ValueError("x"), ERROR_CLASSES) is None
    assert issubclass(DispatchLedgerCorruptError, FlowDecisionError)


# -- dispatch_until_done: two dispatchers on one real SQLite ledger ------------------


async def test_waits_for_the_other_owner_and_returns_its_answer(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    owner_ledger, waiter_ledger = SqliteLedger(path), SqliteLedger(path)
    try:
        slow = ControlledSink()
        owner = Dispatcher("production", slow, owner_ledger, lease_ms=60_000)
        waiter_sink = RecordingSink()
        waiter = Dispatcher("production", waiter_sink, waiter_ledger, lease_ms=60_000)
        req = request()
        owning = asyncio.create_task(owner.dispatch(req))
        await slow.started.wait()
        with pytest.raises(DecisionBusyError):  # the plain call refuses at once
            await waiter.dispatch(req)

        waiting = asyncio.create_task(waiter.dispatch_until_done(req, deadline_s=30))
        await asyncio.sleep(0.2)  # the waiter polls while the owner's sink runs
        assert not waiting.done()
        slow.finish.set()
        submitted = await owning
        answer = await asyncio.wait_for(waiting, timeout=30)
        assert submitted.submitted and not answer.submitted
        assert answer.attempt == submitted.attempt == 1
        assert answer.receipt == submitted.receipt
        assert waiter_sink.calls == []  # never delivered twice
        assert waiter.health().busy >= 2 and waiter.health().failures == 0
    finally:
        await owner_ledger.close()
        await waiter_ledger.close()


async def test_takes_over_once_a_crashed_owners_lease_expires(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = SqliteLedger(path)
    try:
        req = request()
        identity, _receipt = decision_receipt(req)
        # A dispatcher that claimed and died: its lease runs out in 300 ms.
        await ledger.claim(
            req.decision_id, request_hash(req), "crashed", lease_ms=300, identity=identity
        )
        sink = RecordingSink()
        waiter = Dispatcher("production", sink, SqliteLedger(path))
        try:
            outcome = await asyncio.wait_for(
                waiter.dispatch_until_done(req, deadline_s=30), timeout=30
            )
        finally:
            await waiter.ledger.close()
        assert outcome.submitted and outcome.attempt == 2
        assert sink.calls == [(req.decision_id, 2)]
    finally:
        await ledger.close()


async def test_gives_up_at_the_deadline_with_the_last_error(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.db")
    try:
        req = request()
        await ledger.claim(req.decision_id, request_hash(req), "other", lease_ms=600_000)
        waiter = Dispatcher("production", RecordingSink(), ledger)
        with pytest.raises(DecisionBusyError):
            await asyncio.wait_for(waiter.dispatch_until_done(req, deadline_s=0.3), timeout=30)
        with pytest.raises(ValueError, match="deadline_s"):
            await waiter.dispatch_until_done(req, deadline_s=float("nan"))
        conflicting = request(decision_id="dec-conflict")
        await ledger.claim(conflicting.decision_id, "another-hash", "other", lease_ms=1)
        with pytest.raises(DecisionConflictError):  # not retried
            await waiter.dispatch_until_done(conflicting, deadline_s=30)
    finally:
        await ledger.close()


async def test_rides_out_a_locked_sqlite_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await (await SqliteLedger.open(path)).close()  # created and migrated
    ledger = SqliteLedger(path, busy_timeout_ms=20)
    locked, release = threading.Event(), threading.Event()

    def hold_the_write_lock() -> None:  # another process's long write transaction
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        locked.set()
        release.wait(30)
        conn.execute("ROLLBACK")
        conn.close()

    holder = threading.Thread(target=hold_the_write_lock)
    holder.start()
    try:
        await asyncio.to_thread(locked.wait, 30)
        dispatcher = Dispatcher("production", RecordingSink(), ledger)
        req = request()
        with pytest.raises(DispatchLedgerError) as caught:
            await dispatcher.dispatch(req)
        assert caught.value.code == "ledger_unavailable"  # transient
        waiting = asyncio.create_task(dispatcher.dispatch_until_done(req, deadline_s=30))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        release.set()
        outcome = await asyncio.wait_for(waiting, timeout=30)
        assert outcome.submitted and outcome.attempt == 1
        assert dispatcher.health().ledger_failures >= 2
    finally:
        release.set()
        holder.join()
        await ledger.close()


def test_the_error_window_forgets_what_is_older_than_its_span() -> None:
    now = [1000.0]
    window = ErrorWindow(window_s=60, clock=lambda: now[0])
    window.record(failed=True)
    window.record(failed=False)
    now[0] += 30
    window.record(failed=True)
    assert window.rate() == ErrorRate(window_s=60, dispatches=3, failures=2)
    now[0] += 31  # the first second has left the window
    assert window.rate() == ErrorRate(window_s=60, dispatches=1, failures=1)
    assert window.rate().rate == 1.0
    now[0] += 60
    assert window.rate().dispatches == 0 and window.rate().rate == 0.0
