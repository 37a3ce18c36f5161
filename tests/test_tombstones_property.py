"""Tombstones, as a property over random interleavings of submissions and prunes.

With ``keep_tombstones`` a decision reaches the sink at most once, whatever
order submissions (same payload, or a different one under the same id) and
prunes come in. With the seed's default prune, a submission after its
decision was pruned reaches the sink again, exactly as the seed does. Every
example runs on the memory, JSON-file, SQLite and PostgreSQL ledgers (a
database of this module's own, emptied before each example).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowdecision import Dispatcher
from flowdecision.errors import DecisionConflictError
from flowdecision.ledger import JsonFileLedger, Ledger, MemoryLedger, SqliteLedger
from flowdecision.ledger.postgres import PostgresLedger

from .helpers import RecordingSink, step_request
from .ledger_fixtures import _create_database, _migrate, _run_sync

IDS = ["a", "b", "c"]
#: ("submit", id, payload) or ("prune",): a prune of everything completed so far.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from(IDS), st.integers(0, 1)),
        st.tuples(st.just("prune")),
    ),
    min_size=1,
    max_size=25,
)


async def _play(ledger: Ledger, plan: list[tuple[object, ...]], keep: bool) -> list[str]:
    sink = RecordingSink()
    dispatcher = Dispatcher("production", sink, ledger)
    try:
        for step in plan:
            if step[0] == "prune":
                cutoff = ledger.now_ms() + 1
                await ledger.prune_completed(cutoff, keep_tombstones=keep)
                continue
            _, decision_id, payload = step
            assert isinstance(decision_id, str)
            try:
                await dispatcher.dispatch(step_request(decision_id, {"p": payload}))
            except DecisionConflictError:
                pass  # another payload under a known id: refused, never delivered
    finally:
        await ledger.close()
    return sink.ids


@pytest.fixture(scope="module")
def pg_db(pg_server_url: str) -> str:
    """A migrated PostgreSQL database for this module alone."""
    url: str = _run_sync(_create_database(pg_server_url, "flowdecision_tombstone_property"))
    _run_sync(_migrate(url))
    return url


async def _emptied(url: str) -> str:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("TRUNCATE flowdecision_claims")
    finally:
        await conn.close()
    return url


def _ledgers(root: Path, pg_db: str) -> list[Ledger]:
    return [
        MemoryLedger(),
        JsonFileLedger(root / "file"),
        SqliteLedger(root / "ledger.db"),
        PostgresLedger(asyncio.run(_emptied(pg_db))),
    ]


@settings(max_examples=25, deadline=None)
@given(plan=steps)
def test_with_tombstones_a_late_duplicate_never_reaches_the_sink(
    pg_db: str, plan: list[tuple[object, ...]]
) -> None:
    # Each id is delivered once, at its first submission; never again.
    first = list(dict.fromkeys(str(step[1]) for step in plan if step[0] == "submit"))
    with tempfile.TemporaryDirectory() as root:
        for ledger in _ledgers(Path(root), pg_db):
            delivered = asyncio.run(_play(ledger, plan, keep=True))
            assert delivered == first, (type(ledger).__name__, delivered)


@settings(max_examples=25, deadline=None)
@given(plan=steps)
def test_the_default_prune_resubmits_as_the_seed_does(
    pg_db: str, plan: list[tuple[object, ...]]
) -> None:
    # Expected deliveries: a submission is delivered when its id holds no record,
    # and the default prune removes every completed record.
    expected: list[str] = []
    held: set[str] = set()
    for step in plan:
        if step[0] == "prune":
            held.clear()
        elif step[1] not in held:
            expected.append(str(step[1]))
            held.add(str(step[1]))
    with tempfile.TemporaryDirectory() as root:
        for ledger in _ledgers(Path(root), pg_db):
            assert asyncio.run(_play(ledger, plan, keep=False)) == expected
