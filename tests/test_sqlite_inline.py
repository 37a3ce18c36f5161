"""A lone SQLite ledger mutation commits on its caller's event loop (issue 18).

When one mutation is asked for in an event-loop iteration and the connection
thread is idle, the SQLite ledger runs its transaction on the loop's thread
(no thread hand-off); two or more go to the connection thread as one batch.
These tests check what that must not change: answers only after the commit
(kill -9), group commit for concurrent callers, a cancelled caller's mutation
not applied, and never the event loop waiting for another writer's lock.
"""

from __future__ import annotations

import asyncio
import sqlite3
import textwrap
from pathlib import Path

import pytest

from flowdecision.errors import LedgerError
from flowdecision.ledger import Busy, Claimed, Completed, Missing, Pending
from flowdecision.ledger.machine import DecisionOrigin
from flowdecision.ledger.sqlite import SqliteLedger

from .helpers import Ticker, acknowledged_before_kill, identity, receipt

#: No pause for slow commits in these tests (a loaded CI disk can take 5 ms to fsync).
PATIENT = {"inline_max_ms": 60_000.0}


async def test_a_lone_caller_commits_inline_and_its_records_are_stored(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path, **PATIENT)
    try:
        ident = identity("inline")
        for n in range(5):
            assert await ledger.claim(f"d{n}", "h", "o", lease_ms=100, now_ms=10) == Claimed(1)
            assert await ledger.complete(
                f"d{n}", "h", "o", completed_at_ms=20, identity=ident, receipt=receipt(ident)
            )
        assert ledger.inline_commits == 10
        assert ledger.commits == 10
    finally:
        await ledger.close()
    # Another process's view: a plain connection reads the committed rows.
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT decision_id, status FROM flowdecision_claims ORDER BY decision_id"
        ).fetchall()
    finally:
        conn.close()
    assert rows == [(f"d{n}", "completed") for n in range(5)]
    reopened = await SqliteLedger.open(path)
    try:
        assert await reopened.inspect("d3", "h") == Completed(20)
        assert await reopened.completed_receipt("d3") == receipt(ident)
    finally:
        await reopened.close()


async def test_a_rule_failure_inline_fails_its_caller_and_stores_nothing(tmp_path: Path) -> None:
    ledger = await SqliteLedger.open(tmp_path / "ledger.db", **PATIENT)
    try:
        assert await ledger.claim("d", "h", "first", lease_ms=100, now_ms=10) == Claimed(1)
        assert await ledger.claim("d", "h", "second", lease_ms=100, now_ms=20) == Busy(110)
        try:
            await ledger.complete("d", "h", "second", completed_at_ms=30)
        except Exception as error:  # the claim belongs to "first"
            assert "owned by another dispatcher" in str(error)
        else:
            raise AssertionError("completing another owner's claim succeeded")
        assert await ledger.inspect("d", "h") == Pending(110, 1)
        assert ledger.inline_commits == 3  # the failed one committed an empty transaction
    finally:
        await ledger.close()


async def test_concurrent_callers_still_share_commits(tmp_path: Path) -> None:
    ledger = await SqliteLedger.open(tmp_path / "ledger.db")
    try:
        outcomes = await asyncio.gather(
            *(ledger.claim(f"id-{n}", "h", "o", lease_ms=1000, now_ms=1) for n in range(40))
        )
        assert outcomes == [Claimed(1)] * 40
        assert ledger.inline_commits == 0
        assert ledger.committed_ops == 40
        assert ledger.commits < 10
    finally:
        await ledger.close()


async def test_inline_is_off_when_told_or_when_batches_wait_for_company(tmp_path: Path) -> None:
    for options in ({"inline_max_ms": 0}, {"max_wait_ms": 5}):
        ledger = await SqliteLedger.open(tmp_path / "ledger.db", **options)  # type: ignore[arg-type]
        try:
            for n in range(3):
                claimed = await ledger.claim(f"{options}-{n}", "h", "o", lease_ms=1000, now_ms=1)
                assert claimed == Claimed(1)
            assert ledger.inline_commits == 0, options
            assert ledger.commits == 3
        finally:
            await ledger.close()


async def test_slow_inline_commits_send_lone_mutations_to_the_thread_for_a_while(
    tmp_path: Path,
) -> None:
    # Every commit is "slow" against a budget of a nanosecond: after three in a row
    # lone mutations take the connection thread (for a second).
    ledger = await SqliteLedger.open(tmp_path / "ledger.db", inline_max_ms=1e-6)
    try:
        for n in range(8):
            assert await ledger.claim(f"d{n}", "h", "o", lease_ms=1000, now_ms=1) == Claimed(1)
        assert ledger.inline_commits == 3
        assert ledger.commits == 8
    finally:
        await ledger.close()


@pytest.mark.parametrize("companion", [False, True], ids=["alone", "with-a-companion"])
async def test_a_caller_cancelled_before_its_commit_started_is_not_applied(
    tmp_path: Path, companion: bool
) -> None:
    # The first caller of a loop iteration flushes what was asked for when it
    # resumes; cancelled before that, it still hands a companion's claim on.
    ledger = await SqliteLedger.open(tmp_path / "ledger.db")
    try:
        doomed = asyncio.create_task(ledger.claim("dropped", "h", "o", lease_ms=60_000))
        kept = None
        if companion:
            kept = asyncio.create_task(ledger.claim("kept", "h", "o", lease_ms=60_000, now_ms=1))
        await asyncio.sleep(0)  # the claims are asked for; they run after this task
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        assert doomed.cancelled()
        assert await ledger.inspect("dropped", "h") == Missing()
        if kept is None:
            assert ledger.commits == 0
        else:
            assert await kept == Claimed(1)
            assert await ledger.inspect("kept", "h") == Pending(60_001, 1)
            assert ledger.committed_ops == 1
    finally:
        await ledger.close()


async def test_the_event_loop_never_waits_for_another_writers_lock(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path, **PATIENT)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        assert await ledger.claim("before", "h", "o", lease_ms=1000, now_ms=1) == Claimed(1)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
        beat = Ticker(0.001)
        claim = asyncio.create_task(ledger.claim("during", "h", "o", lease_ms=1000, now_ms=1))
        await asyncio.sleep(0.3)
        assert not claim.done()  # waiting for the lock, on the connection thread
        assert beat.ticks > 50  # while the event loop kept running
        other.execute("COMMIT")
        async with asyncio.timeout(10):
            assert await claim == Claimed(1)
        beat.stop()
        assert ledger.inline_commits == 1  # "before" only
        # The connection thread's commit restored the busy timeout: inline again.
        assert await ledger.claim("after", "h", "o", lease_ms=1000, now_ms=1) == Claimed(1)
        assert ledger.inline_commits == 2
    finally:
        other.close()
        await ledger.close()


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from flowdecision.ledger.sqlite import SqliteLedger

    async def main(target):
        # No pause for slow commits (a loaded CI disk): every acknowledged claim inline.
        ledger = await SqliteLedger.open(target, inline_max_ms=60_000.0)
        out = sys.stdout
        print("ready", flush=True)
        n = 0
        while True:
            decision_id = f"d{n}"
            await ledger.claim(decision_id, "h", "o", lease_ms=60_000)
            out.write(f"{decision_id} {ledger.inline_commits}\\n")
            out.flush()  # acknowledged: the claim call returned
            n += 1

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_inline_acknowledged_claims_survive_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await (await SqliteLedger.open(path)).close()
    acked = await asyncio.to_thread(acknowledged_before_kill, _CHILD, str(path))
    assert len(acked) > 50, acked[:5]
    last_id, inline = acked[-1].split()
    assert int(inline) == int(last_id[1:]) + 1  # every acknowledged claim committed inline
    reopened = await SqliteLedger.open(path)
    try:
        missing = [line for line in acked if await reopened.lookup(line.split()[0]) is None]
        assert not missing, f"{len(missing)} acknowledged claims lost: {missing[:5]}"
    finally:
        await reopened.close()


async def test_a_database_error_in_a_lone_mutation_is_the_ledgers_error(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path, **PATIENT)
    try:
        origin = DecisionOrigin("run-1", "event-1")
        assert await ledger.claim("d0", "h", "o", lease_ms=100, origin=origin) == Claimed(1)
        # The runs table goes away under the ledger (another process, a bad restore):
        # the run's read fails inside the transaction, which rolls back.
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("DROP TABLE flowdecision_runs")
        other.close()
        with pytest.raises(LedgerError, match="no such table") as raised:
            await ledger.claim("d1", "h", "o", lease_ms=100, origin=origin)
        assert not isinstance(raised.value, sqlite3.Error)
        assert await ledger.inspect("d1", "h") == Missing()
    finally:
        await ledger.close()
