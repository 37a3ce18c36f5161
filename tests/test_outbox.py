"""OutboxSink: insert-if-absent delivery, replays, conflicts and the seq cursor,
on SQLite and on the throwaway PostgreSQL server."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flowdecision import Dispatcher, FlowDecisionError, request_hash
from flowdecision.core.model import Complete
from flowdecision.ledger.sqlite import SqliteLedger
from flowdecision.sinks import (
    OutboxConflictError,
    OutboxError,
    OutboxSchemaError,
    OutboxSink,
    Sink,
)
from flowdecision.sinks.outbox import OUTBOX_SCHEMA_VERSION
from tests.helpers import request


@pytest.fixture(params=["sqlite", "postgres"])
async def outbox_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'outbox.db'}"
        return
    import asyncpg

    url: str = request.getfixturevalue("pg_url")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("DROP TABLE IF EXISTS flow_decision_outbox")
        await conn.execute("DROP TABLE IF EXISTS flow_decision_outbox_schema")
        await conn.execute("DROP TABLE IF EXISTS flow_decision_outbox_cursor")
        await conn.execute("DROP TABLE IF EXISTS flow_decision_outbox_parked")
        await conn.execute("DROP TABLE IF EXISTS flow_decision_outbox_audit")
        await conn.execute("DROP FUNCTION IF EXISTS flow_decision_outbox_notify")
    finally:
        await conn.close()
    # PostgreSQL migrates only when asked
    assert await OutboxSink(url).migrate() == (0, OUTBOX_SCHEMA_VERSION)
    yield url


async def test_first_delivery_inserts_and_replays_only_raise_the_attempt(outbox_url: str) -> None:
    first = request(decision_id="d-1")
    async with OutboxSink(outbox_url) as sink:
        assert isinstance(sink, Sink)
        assert await sink.deliver(first, 1) is True
        assert await sink.deliver(first, 3) is False
        await sink.submit(first, 2)  # a lower, late attempt changes nothing
        entry = await sink.get("d-1")
        assert entry is not None
        assert (entry.first_attempt, entry.highest_attempt) == (1, 3)
        assert entry.request_json == first.to_json()
        assert entry.request_hash == request_hash(first)
        assert entry.request == first
        assert entry.accepted_at_ms > 0
        assert await sink.count() == 1
        assert await sink.get("missing") is None


async def test_different_content_under_a_stored_id_is_refused(outbox_url: str) -> None:
    async with OutboxSink(outbox_url) as sink:
        await sink.submit(request(decision_id="d-1"), 1)
        other = request(decision_id="d-1", decision=Complete(output={"x": 1}))
        with pytest.raises(OutboxConflictError) as caught:
            await sink.submit(other, 2)
        assert isinstance(caught.value, FlowDecisionError)
        assert "d-1" in str(caught.value)
        entry = await sink.get("d-1")
        assert entry is not None
        assert entry.request == request(decision_id="d-1")
        assert entry.highest_attempt == 1


async def test_fetch_pages_in_seq_order_and_survives_reopening(outbox_url: str) -> None:
    async with OutboxSink(outbox_url) as sink:
        for index in range(7):
            await sink.submit(request(decision_id=f"d-{index}"), 1)
        await sink.submit(request(decision_id="d-3"), 2)  # a replay gets no new seq
    async with OutboxSink(outbox_url) as sink:
        seen: list[str] = []
        after = 0
        while page := await sink.fetch(after=after, limit=3):
            assert [e.seq for e in page] == sorted(e.seq for e in page)
            assert all(e.seq > after for e in page)
            seen += [e.decision_id for e in page]
            after = page[-1].seq
        assert seen == [f"d-{index}" for index in range(7)]
        assert await sink.count() == 7
        with pytest.raises(ValueError, match="limit"):
            await sink.fetch(limit=0)
        with pytest.raises(ValueError, match="after"):
            await sink.fetch(after=-1)


async def test_concurrent_deliveries_of_one_id_insert_once(outbox_url: str) -> None:
    sinks = [await OutboxSink(outbox_url).open() for _ in range(4)]
    try:
        decision = request(decision_id="raced")
        results = await asyncio.gather(
            *(sink.deliver(decision, attempt) for attempt, sink in enumerate(sinks, 1))
        )
        assert sorted(results) == [False, False, False, True]
        entry = await sinks[0].get("raced")
        assert entry is not None and entry.highest_attempt == 4
        assert await sinks[0].count() == 1
    finally:
        for sink in sinks:
            await sink.close()


async def test_dispatcher_replay_after_a_crash_has_no_second_effect(
    outbox_url: str, tmp_path: Path
) -> None:
    """The sink accepted, the process "died" before completion: the retry is a replay."""
    async with OutboxSink(outbox_url) as sink, await SqliteLedger.open(tmp_path / "l.db") as ledger:
        decision = request(decision_id="crashy")
        await sink.submit(decision, 1)  # what the dead process delivered under attempt 1
        hash_ = request_hash(decision)
        await ledger.claim("crashy", hash_, "dead-owner", lease_ms=1, now_ms=1)
        dispatcher = Dispatcher("production", sink, ledger, lease_ms=5_000)
        assert (await dispatcher.dispatch(decision)).submitted is True  # takeover, attempt 2
        entry = await sink.get("crashy")
        assert entry is not None and (entry.first_attempt, entry.highest_attempt) == (1, 2)
        assert await sink.count() == 1


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    await (await OutboxSink(f"sqlite:///{path}").open()).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO flow_decision_outbox_schema VALUES (99, 'future', 0)")
    conn.close()
    with pytest.raises(OutboxSchemaError, match=r"schema version 99.*upgrade"):
        await OutboxSink(f"sqlite:///{path}").open()


def test_url_must_be_sqlite_or_postgres() -> None:
    with pytest.raises(OutboxError, match="expected one of sqlite:///path, postgresql"):
        OutboxSink("file:///tmp/x")
    with pytest.raises(OutboxError, match="unsupported"):
        OutboxSink("mysql://x")


async def test_closed_sink_says_so(tmp_path: Path) -> None:
    sink = await OutboxSink(f"sqlite:///{tmp_path / 'o.db'}").open()
    await sink.close()
    with pytest.raises(OutboxError, match="closed"):
        await sink.count()
