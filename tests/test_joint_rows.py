"""The joint write as data: ``store/joint.py``'s one insert-if-absent per dialect
(``sqlite_insert_rows``, ``pg_insert_rows``) on a batch of prepared outbox rows,
and what the ledger does with its answers (a refused row leaves its decision
unclaimed; a database error fails the batch).

Runs on SQLite files and on the throwaway PostgreSQL server.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from flowdecision import Dispatcher
from flowdecision.errors import DispatchLedgerError, OutboxConflictError, SinkError
from flowdecision.ledger.opening import open_ledger
from flowdecision.sinks import OutboxSink
from flowdecision.store.joint import JointResult, JointRow, pg_insert_rows, sqlite_insert_rows
from tests.helpers import step_request

BRANCH = "production"


async def _insert(url: str, rows: list[tuple[JointRow, int]]) -> list[JointResult]:
    """The store function of ``url``'s dialect, in a transaction of its own, committed."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            done = sqlite_insert_rows(conn, rows)
            conn.execute("COMMIT")
        finally:
            conn.close()
        return done
    import asyncpg

    pg = await asyncpg.connect(url)
    try:
        async with pg.transaction():
            return await pg_insert_rows(pg, rows)
    finally:
        await pg.close()


async def test_one_batch_says_per_row_inserted_replayed_or_refused(shared_store_url: str) -> None:
    """New rows, a replay (its highest attempt rises) and a conflict (refused, the
    stored row untouched) in one batch: one answer per row, in the batch's order,
    and the new rows' seq in that order."""
    outbox = await OutboxSink(shared_store_url).open()
    try:
        await outbox.deliver(step_request("same"), 1)
        await outbox.deliver(step_request("other", "earlier content"), 1)
        ids = ["new-1", "same", "new-2", "other", "new-3"]
        rows = [(await outbox.prepare(step_request(key)), 3) for key in ids]
        done = await _insert(shared_store_url, rows)
        assert done[:3] + done[4:] == [True, False, True, True]
        refused = done[3]
        assert isinstance(refused, OutboxConflictError) and refused.decision_id == "other"
        entries = await outbox.fetch(after=0, limit=100)
        assert [entry.decision_id for entry in entries] == [
            "same", "other", "new-1", "new-2", "new-3"
        ]  # fmt: skip
        by_id = {entry.decision_id: entry for entry in entries}
        assert (by_id["same"].first_attempt, by_id["same"].highest_attempt) == (1, 3)
        assert (by_id["new-1"].first_attempt, by_id["new-1"].highest_attempt) == (3, 3)
        assert by_id["other"].request == step_request("other", "earlier content")
        assert by_id["other"].highest_attempt == 1
        # A replay with a lower attempt leaves the highest as it is.
        assert await _insert(shared_store_url, [(rows[1][0], 2)]) == [False]
        same = await outbox.get("same")
        assert same is not None and same.highest_attempt == 3
        assert await _insert(shared_store_url, []) == []
    finally:
        await outbox.close()


async def test_a_batch_of_new_rows_is_one_statement_and_reads_nothing_back(
    tmp_path: Path,
) -> None:
    """SQLite: every statement on the ledger's thread is a GIL hand-off, so a batch of
    new rows (the common case) is one multi-row insert and nothing is read back."""
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    outbox = await OutboxSink(url).open()
    try:
        rows = [(await outbox.prepare(step_request(f"fresh-{n}")), 1) for n in range(200)]
        conn = sqlite3.connect(tmp_path / "flowdecision.db", isolation_level=None)
        statements: list[str] = []
        conn.execute("BEGIN IMMEDIATE")
        conn.set_trace_callback(statements.append)
        assert sqlite_insert_rows(conn, rows) == [True] * 200
        conn.set_trace_callback(None)
        conn.execute("COMMIT")
        conn.close()
        # 200 rows of 7 parameters: two statements under SQLite's bound of 999.
        assert len(statements) == 2 and all(s.startswith("INSERT") for s in statements)
        assert await outbox.count() == 200
    finally:
        await outbox.close()


async def _dispatch_all(dispatcher: Dispatcher, ids: list[str]) -> list[Any]:
    return await asyncio.gather(
        *(dispatcher.dispatch(step_request(key)) for key in ids), return_exceptions=True
    )


async def test_a_refused_row_leaves_its_decision_unclaimed_and_the_batch_goes_on(
    shared_store_url: str,
) -> None:
    """Concurrent decisions share transactions; the one whose row the outbox refuses
    answers a sink error and leaves no claim (it can be claimed again at attempt 1),
    the replay and the new ones are completed."""
    ledger = await open_ledger(shared_store_url)
    outbox = await OutboxSink(shared_store_url).open()
    try:
        await outbox.deliver(step_request("old", "earlier content"), 1)
        await outbox.deliver(step_request("replayed"), 1)
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        assert dispatcher.joint
        ids = ["old", "replayed", *(f"n-{n}" for n in range(30))]
        results = await _dispatch_all(dispatcher, ids)
        refused = results[0]
        assert isinstance(refused, SinkError)
        assert isinstance(refused.__cause__, OutboxConflictError)
        assert await ledger.read_record("old") is None
        assert all(not isinstance(r, BaseException) and r.submitted for r in results[1:])
        for key in ids[1:]:
            record = await ledger.read_record(key)
            assert record is not None and record.status.value == "completed"
        # The refused decision was never claimed: an outbox emptied of the old row
        # lets the same decision through at attempt 1.
        await _delete_outbox_row(shared_store_url, "old")
        assert (await dispatcher.dispatch(step_request("old"))).attempt == 1
    finally:
        await outbox.close()
        await ledger.close()


async def _delete_outbox_row(url: str, decision_id: str) -> None:
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            conn.execute("DELETE FROM flow_decision_outbox WHERE decision_id = ?", (decision_id,))
        finally:
            conn.close()
        return
    import asyncpg

    pg = await asyncpg.connect(url)
    try:
        await pg.execute("DELETE FROM flow_decision_outbox WHERE decision_id = $1", decision_id)
    finally:
        await pg.close()


_SQLITE_DOOM = (
    "CREATE TRIGGER flowdecision_test_doom AFTER INSERT ON flow_decision_outbox "
    "WHEN NEW.decision_id = 'doomed' BEGIN SELECT RAISE(ABORT, 'injected: after the row'); END"
)
_PG_DOOM = """
CREATE FUNCTION flowdecision_test_doom() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.decision_id = 'doomed' THEN RAISE EXCEPTION 'injected: after the row'; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER flowdecision_test_doom AFTER INSERT ON flow_decision_outbox
    FOR EACH ROW EXECUTE FUNCTION flowdecision_test_doom();
"""
_PG_UNDOOM = (
    "DROP TRIGGER IF EXISTS flowdecision_test_doom ON flow_decision_outbox; "
    "DROP FUNCTION IF EXISTS flowdecision_test_doom()"
)


async def _doom(url: str, on: bool) -> None:
    """A database error raised right after the row ``doomed`` is inserted (a trigger)."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            conn.execute(_SQLITE_DOOM if on else "DROP TRIGGER IF EXISTS flowdecision_test_doom")
        finally:
            conn.close()
        return
    import asyncpg

    pg = await asyncpg.connect(url)
    try:
        await pg.execute(_PG_UNDOOM)
        if on:
            await pg.execute(_PG_DOOM)
    finally:
        await pg.close()


async def test_a_database_error_after_the_row_fails_the_batch_and_leaves_neither(
    shared_store_url: str,
) -> None:
    ledger = await open_ledger(shared_store_url)
    outbox = await OutboxSink(shared_store_url).open()
    try:
        await _doom(shared_store_url, True)
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        with pytest.raises(DispatchLedgerError, match="injected"):
            await dispatcher.dispatch(step_request("doomed"))
        assert await outbox.get("doomed") is None
        assert await ledger.read_record("doomed") is None  # not even a claim remains
        assert dispatcher.health().to_dict()["ledger_failures"] == 1
        await _doom(shared_store_url, False)
        assert (await dispatcher.dispatch(step_request("doomed"))).attempt == 1
        assert await outbox.count() == 1
    finally:
        await _doom(shared_store_url, False)  # the PostgreSQL database outlives the test
        await outbox.close()
        await ledger.close()


class _WatchedOutbox(OutboxSink):
    """The outbox, recording what the dispatcher tells it committed."""

    told: list[str]

    def committed(self, row: JointRow) -> None:
        self.told.append(row.decision_id)
        super().committed(row)


async def test_the_sink_is_told_once_per_new_row_after_its_commit(shared_store_url: str) -> None:
    """``JointSink.committed``: a new row, not a replay of an identical row already
    there, nor a duplicate (no row written), nor a refused row."""
    ledger = await open_ledger(shared_store_url)
    outbox = _WatchedOutbox(shared_store_url)
    outbox.told = []
    await outbox.open()
    try:
        await outbox.deliver(step_request("replayed"), 1)
        await outbox.deliver(step_request("old", "earlier content"), 1)
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        for key in ("new", "replayed", "new"):
            assert (await dispatcher.dispatch(step_request(key))).attempt == 1
        with pytest.raises(SinkError):
            await dispatcher.dispatch(step_request("old"))
        assert outbox.told == ["new"]
    finally:
        await outbox.close()
        await ledger.close()
