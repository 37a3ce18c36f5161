"""OutboxRelay: seq order, a durable named cursor, retries, the lease, and waking
without a busy poll -- on SQLite and on the throwaway PostgreSQL server."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flowdecision import DecisionRequest, Dispatcher
from flowdecision.errors import InvalidArgumentError
from flowdecision.ledger.sqlite import SqliteLedger
from flowdecision.sinks import OutboxSink
from flowdecision.sinks.cursor import CursorLease, LeaseHeld
from flowdecision.sinks.outbox import OUTBOX_SCHEMA_VERSION, OutboxCursorLeasedError
from flowdecision.sinks.relay import OutboxRelay
from tests.helpers import RecordingSink, request


@pytest.fixture(params=["sqlite", "postgres"])
async def outbox_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'outbox.db'}"
        return
    from tests.ledger_fixtures import _create_database

    global _databases
    _databases += 1
    server: str = request.getfixturevalue("pg_server_url")
    url = await _create_database(server, f"flowdecision_relay_{_databases}")
    await OutboxSink(url).migrate()  # PostgreSQL migrates only when asked
    yield url


_databases = 0


async def _fill(outbox: OutboxSink, count: int, start: int = 0) -> list[str]:
    ids = [f"d-{index:04d}" for index in range(start, start + count)]
    for decision_id in ids:
        await outbox.submit(request(decision_id=decision_id), 1)
    return ids


class CountingSink:
    """Records deliveries; tracks how many run at once; fails while ``down``."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delivered: list[tuple[str, int]] = []
        self.effects: set[str] = set()  # the engine's dedup on decision_id
        self.in_flight = 0
        self.most_in_flight = 0
        self.delay_s = delay_s
        self.down = False
        self.refused = 0

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.down:
                self.refused += 1
                raise ConnectionError("engine unavailable")
            self.delivered.append((request.decision_id, attempt))
            self.effects.add(request.decision_id)
        finally:
            self.in_flight -= 1


async def test_a_relay_delivers_every_row_in_seq_order_and_resumes_after_its_cursor(
    outbox_url: str,
) -> None:
    async with OutboxSink(outbox_url) as outbox:
        ids = await _fill(outbox, 25)
        sink = RecordingSink()
        relay = OutboxRelay(outbox, sink, name="billing", batch=7)
        assert await relay.drain() == 25
        assert sink.ids == ids
        assert relay.status().position == (await outbox.fetch(after=0, limit=100))[-1].seq
        (state,) = await outbox.cursors()
        assert (state.name, state.lag_rows, state.delivered, state.leased) == (
            "billing", 0, 25, False,
        )  # fmt: skip
        # A new relay of that name (a restart) starts after the durable cursor.
        more = await _fill(outbox, 5, start=25)
        later = RecordingSink()
        assert await OutboxRelay(outbox, later, name="billing").drain() == 5
        assert later.ids == more


async def test_relays_with_different_names_each_get_every_row(outbox_url: str) -> None:
    async with OutboxSink(outbox_url) as outbox:
        ids = await _fill(outbox, 12)
        sinks = {name: RecordingSink() for name in ("billing", "audit", "search")}
        relays = [OutboxRelay(outbox, sink, name=name) for name, sink in sinks.items()]
        assert await asyncio.gather(*(relay.drain() for relay in relays)) == [12, 12, 12]
        assert all(sink.ids == ids for sink in sinks.values())
        assert [state.name for state in await outbox.cursors()] == ["audit", "billing", "search"]


async def test_two_relays_with_one_name_never_deliver_in_parallel(outbox_url: str) -> None:
    async with OutboxSink(outbox_url) as outbox:
        ids = await _fill(outbox, 40)
        sink = CountingSink(delay_s=0.002)
        first = OutboxRelay(outbox, sink, name="one", lease_ms=1_000, idle_wait_s=0.05)
        second = OutboxRelay(outbox, sink, name="one", lease_ms=1_000, idle_wait_s=0.05)
        tasks = [asyncio.create_task(relay.run()) for relay in (first, second)]
        await _until(lambda: len(sink.effects) == 40)
        states = {first.status().state, second.status().state}
        assert "waiting_for_lease" in states, states
        # The holder stops cleanly and releases: the other one takes over at once.
        holder, waiter = (first, second) if first.status().fence else (second, first)
        holder.stop()
        await tasks[[first, second].index(holder)]
        more = await _fill(outbox, 10, start=40)
        await _until(lambda: len(sink.effects) == 50)
        assert waiter.status().delivered == 10
        waiter.stop()
        await asyncio.gather(*tasks)
        assert sink.most_in_flight == 1
        assert [decision_id for decision_id, _ in sink.delivered] == ids + more


async def test_a_stale_lease_holder_is_fenced_off(outbox_url: str) -> None:
    async with OutboxSink(outbox_url) as outbox:
        await _fill(outbox, 3)
        first = await outbox.acquire_cursor("one", "relay-a", 150)
        assert isinstance(first, CursorLease)
        held = await outbox.acquire_cursor("one", "relay-b", 150)
        assert isinstance(held, LeaseHeld) and held.owner == "relay-a"
        await asyncio.sleep(0.3)  # relay-a stalls past its lease
        second = await outbox.acquire_cursor("one", "relay-b", 10_000)
        assert isinstance(second, CursorLease) and second.fence == first.fence + 1
        assert await outbox.advance_cursor(first, 3, lease_ms=10_000) is False
        assert await outbox.advance_cursor(second, 2, lease_ms=10_000) is True
        assert await outbox.advance_cursor(second, 1, lease_ms=10_000) is True  # never back
        (state,) = await outbox.cursors("one")
        assert (state.position, state.owner, state.fence) == (2, "relay-b", second.fence)
        with pytest.raises(OutboxCursorLeasedError):
            await outbox.set_cursor("one", 0)
        assert await outbox.release_cursor(second) is True
        await outbox.set_cursor("one", 0)  # an operator's replay, once nobody holds it
        (state,) = await outbox.cursors("one")
        assert (state.position, state.owner, state.lag_rows) == (0, None, 3)
        assert await outbox.advance_cursor(second, 3, lease_ms=10_000) is False


async def test_a_relay_keeps_its_place_through_an_engine_outage(outbox_url: str) -> None:
    async with OutboxSink(outbox_url) as outbox:
        ids = await _fill(outbox, 10)
        sink = CountingSink()
        relay = OutboxRelay(outbox, sink, name="r", retry_base_s=0.01, retry_cap_s=0.05,
                            idle_wait_s=0.05)  # fmt: skip
        task = asyncio.create_task(relay.run())
        await _until(lambda: len(sink.effects) == 10)
        sink.down = True
        more = await _fill(outbox, 10, start=10)
        await _until(lambda: sink.refused >= 5)
        assert relay.status().state == "retrying"
        assert "engine unavailable" in (relay.status().last_error or "")
        (state,) = await outbox.cursors("r")
        assert state.lag_rows == 10 and state.lag_seconds >= 0
        sink.down = False
        await _until(lambda: len(sink.effects) == 20)
        relay.stop()
        await task
        assert [decision_id for decision_id, _ in sink.delivered] == ids + more
        assert relay.status().retries >= 5


async def test_waiting_for_rows_wakes_on_a_commit_without_polling_it(outbox_url: str) -> None:
    async with OutboxSink(outbox_url, poll_max_s=30) as outbox:
        started = time.monotonic()
        assert await outbox.fetch(after=0, limit=10, wait_s=0.2) == []
        assert time.monotonic() - started >= 0.2
        waiter = asyncio.create_task(outbox.fetch(after=0, limit=10, wait_s=60))
        await asyncio.sleep(0.3)  # the waiter is asleep (SQLite's poll has backed off)
        assert not waiter.done()
        if outbox.kind == "postgresql":  # another writer's commit: LISTEN/NOTIFY
            writer = OutboxSink(outbox_url)
            await writer.submit(request(decision_id="late"), 1)
            await writer.close()
        else:  # this process's commit: the in-process wake-up
            await outbox.submit(request(decision_id="late"), 1)
        rows = await asyncio.wait_for(waiter, 4)  # long before the 60 s wait or a poll
        assert [row.decision_id for row in rows] == ["late"]


async def test_the_dispatchers_transactional_commit_wakes_a_waiting_relay(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    sink = RecordingSink()
    async with (
        OutboxSink(url, poll_max_s=30) as outbox,
        SqliteLedger(tmp_path / "shared.db") as led,
    ):
        dispatcher = Dispatcher("production", outbox, led)
        assert dispatcher.joint
        relay = OutboxRelay(outbox, sink, idle_wait_s=30)
        task = asyncio.create_task(relay.run())
        await _until(lambda: relay.status().state == "idle")
        await asyncio.sleep(0.3)  # the poll has backed off far beyond the wait below
        await dispatcher.dispatch(request(decision_id="via-ledger"))
        await asyncio.wait_for(_until(lambda: sink.ids == ["via-ledger"]), 4)
        relay.stop()
        await task


async def test_a_version_1_sqlite_outbox_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    from flowdecision.sinks.outbox import load_outbox_migrations

    (_, name, script) = load_outbox_migrations("sqlite")[0]
    conn.executescript(script)
    conn.execute(
        "CREATE TABLE flow_decision_outbox_schema (version INTEGER PRIMARY KEY, "
        "name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)"
    )
    conn.execute("INSERT INTO flow_decision_outbox_schema VALUES (1, ?, 0)", (name,))
    text = request(decision_id="kept").to_json().decode()
    conn.execute(
        "INSERT INTO flow_decision_outbox (decision_id, request_json, request_hash, "
        "first_attempt, highest_attempt, accepted_at_ms) VALUES ('kept', ?, 'h', 1, 1, 5)",
        (text,),
    )
    conn.commit()
    conn.close()
    sink = RecordingSink()
    assert await OutboxRelay(f"sqlite:///{path}", sink).drain() == 1
    assert sink.ids == ["kept"]
    conn = sqlite3.connect(path)
    versions = [row[0] for row in conn.execute("SELECT version FROM flow_decision_outbox_schema")]
    assert versions == list(range(1, OUTBOX_SCHEMA_VERSION + 1)) and OUTBOX_SCHEMA_VERSION >= 2
    conn.close()


def test_bad_relay_settings_are_refused_with_their_name() -> None:
    for kwargs, word in (({"name": ""}, "name"), ({"batch": 0}, "batch"),
                         ({"lease_ms": 5}, "lease_ms"), ({"retry_cap_s": 0}, "retry_cap_s"),
                         ({"name": "a\x00b"}, "control")):  # fmt: skip
        with pytest.raises(InvalidArgumentError, match=word):
            OutboxRelay("sqlite:///x.db", RecordingSink(), **kwargs)  # type: ignore[arg-type]


async def _until(predicate: object, limit_s: float = 20) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
