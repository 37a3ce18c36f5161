"""Clock skew at the dispatcher level.

The dispatcher passes no time to the ledger (``now_ms=None``), so each backend
uses its own clock: PostgreSQL the server's ``clock_timestamp()``, the file and
SQLite ledgers this host's clock. A dispatcher host whose clock runs ten minutes
ahead is simulated by shifting ``time.time_ns`` in this process, which is what
``wall_clock_ms`` (and so every host-clock ledger) reads.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from flowdecision import DecisionBusyError, Dispatcher
from flowdecision.errors import LeaseLostError
from flowdecision.ledger import wall_clock_ms
from flowdecision.ledger.postgres import PostgresLedger
from flowdecision.ledger.sqlite import SqliteLedger
from tests.helpers import ControlledSink, RecordingSink, request

SKEW_NS = 10 * 60 * 1_000_000_000  # ten minutes ahead
LEASE_MS = 60_000


def _run_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    real = time.time_ns
    before = wall_clock_ms()
    monkeypatch.setattr(time, "time_ns", lambda: real() + SKEW_NS)
    assert wall_clock_ms() - before >= 600_000  # the skew really is in effect


async def test_postgres_dispatcher_running_ahead_cannot_take_over_a_live_lease(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = request(decision_id=f"skew-{uuid.uuid4()}")
    async with (
        await PostgresLedger.connect(pg_url) as honest_ledger,
        await PostgresLedger.connect(pg_url) as skewed_ledger,
    ):
        sink = ControlledSink()
        honest = Dispatcher("production", sink, honest_ledger, lease_ms=LEASE_MS)
        owner = asyncio.create_task(honest.dispatch(req))
        await sink.started.wait()

        _run_ahead(monkeypatch)
        other_sink = RecordingSink()
        skewed = Dispatcher("production", other_sink, skewed_ledger, lease_ms=LEASE_MS)
        with pytest.raises(DecisionBusyError) as busy:
            await skewed.dispatch(req)
        # By its own clock the lease ended minutes ago; the database clock says it is live.
        assert busy.value.lease_expires_at_ms < wall_clock_ms() - LEASE_MS
        assert other_sink.calls == []
        assert skewed.health().busy == 1 and skewed.health().takeovers == 0

        sink.finish.set()
        assert (await owner).submitted is True  # the honest owner completes under its own lease
        assert sink.calls == 1
        assert (await skewed.dispatch(req)).submitted is False


async def test_sqlite_trusts_the_host_clock_so_it_needs_one_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contrast that motivates the single-host assumption (docs/RELIABILITY.md)."""
    req = request()
    async with (
        await SqliteLedger.open(tmp_path / "l.db") as honest_ledger,
        await SqliteLedger.open(tmp_path / "l.db") as skewed_ledger,
    ):
        sink = ControlledSink()
        honest = Dispatcher("production", sink, honest_ledger, lease_ms=LEASE_MS)
        owner = asyncio.create_task(honest.dispatch(req))
        await sink.started.wait()
        _run_ahead(monkeypatch)
        other_sink = RecordingSink()
        skewed = Dispatcher("production", other_sink, skewed_ledger, lease_ms=LEASE_MS)
        assert (await skewed.dispatch(req)).submitted is True  # took over a lease that was live
        assert other_sink.calls == [(req.decision_id, 2)]
        record = await honest_ledger.read_record(req.decision_id)
        assert record is not None and record.owner_id == skewed.owner_id
        monkeypatch.undo()
        sink.finish.set()
        # The first owner's completion lands on an already-completed record: the ledger's
        # "complete is idempotent for any caller" rule records nothing and answers that
        # another owner completed it, so the dispatcher reports the lost lease. There were
        # still two deliveries: only a deduplicating sink is safe.
        with pytest.raises(LeaseLostError):
            await owner
        after = await honest_ledger.read_record(req.decision_id)
        assert after == record
        assert sink.calls == 1 and len(other_sink.calls) == 1
