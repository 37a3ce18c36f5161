"""Group commit in the SQLite and PostgreSQL ledgers (issue 6).

Operations in flight together share one transaction; each caller still gets
its own outcome, a rule failure fails only its own caller, operations on one id
apply in arrival order on the evolving record, and a caller is answered only
after the commit (an acknowledged operation survives ``kill -9``).

The conformance and stateful suites run with group commit on (it is the
default); the off switch is checked here.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import pytest

from flowdecision.errors import LedgerError
from flowdecision.ledger import AlreadyCompleted, Busy, Claimed, Completed, Ledger, Missing, Pending
from flowdecision.ledger.postgres import PostgresLedger
from flowdecision.ledger.sqlite import SqliteLedger

from .helpers import acknowledged_before_kill, identity, receipt

KINDS = ("sqlite", "postgres")


async def _open(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, **options: Any
) -> Ledger:
    # Tests pass max_batch=N, max_wait_ms=2000: the batch closes as soon as N are queued.
    if kind == "sqlite":
        return await SqliteLedger.open(tmp_path / "ledger.db", **options)
    url = request.getfixturevalue("pg_url")
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute("TRUNCATE flowdecision_claims")
    finally:
        await conn.close()
    return await PostgresLedger.connect(url, **options)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_failing_operation_does_not_fail_its_batch(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ledger = await _open(kind, tmp_path, request, max_batch=4, max_wait_ms=2000)
    try:
        ident = identity("batch")
        results = await asyncio.gather(
            ledger.claim("a", "h", "o", lease_ms=100, now_ms=10, identity=ident),
            ledger.complete("missing", "h", "o", completed_at_ms=11),  # rule failure
            ledger.claim("b", "h", "o", lease_ms=100, now_ms=10, identity=ident),
            ledger.renew("nothing-here", "h", "o", lease_ms=100, now_ms=10),  # no write
            return_exceptions=True,
        )
        assert results[0] == Claimed(1)
        assert isinstance(results[1], LedgerError)
        assert "does not exist" in str(results[1])
        assert results[2] == Claimed(1)
        assert results[3] is False
        assert ledger.commits == 1  # type: ignore[attr-defined]
        # SQLite counts every operation in the committed transaction, PostgreSQL
        # the operations of the rows its write statement wrote.
        expected_ops = 4 if kind == "sqlite" else 2
        assert ledger.committed_ops == expected_ops  # type: ignore[attr-defined]
        assert await ledger.lookup("missing") is None
        assert await ledger.inspect("a", "h") == Pending(110, 1)
        assert await ledger.inspect("b", "h") == Pending(110, 1)
    finally:
        await ledger.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_same_id_operations_apply_in_arrival_order(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ledger = await _open(kind, tmp_path, request, max_batch=5, max_wait_ms=2000)
    try:
        ident = identity("same-id")
        done = receipt(ident)
        results = await asyncio.gather(
            ledger.claim("d", "h", "first", lease_ms=100, now_ms=10, identity=ident),
            ledger.claim("d", "h", "second", lease_ms=100, now_ms=20, identity=ident),
            ledger.complete("d", "h", "second", completed_at_ms=30, identity=ident),
            ledger.complete(
                "d", "h", "first", completed_at_ms=40, identity=ident, receipt=done
            ),  # fails: the first owner's claim is live, so "second" lost; first completes
            ledger.claim("d", "h", "third", lease_ms=100, now_ms=50, identity=ident),
            return_exceptions=True,
        )
        assert results[0] == Claimed(1)
        assert results[1] == Busy(110)
        assert isinstance(results[2], LedgerError)
        assert "owned by another dispatcher" in str(results[2])
        assert results[3] is True  # completed by "first" itself
        assert results[4] == AlreadyCompleted()
        assert ledger.commits == 1  # type: ignore[attr-defined]
        assert await ledger.inspect("d", "h") == Completed(40)
        assert await ledger.completed_receipt("d") == done
    finally:
        await ledger.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_many_concurrent_operations_share_few_commits(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ledger = await _open(kind, tmp_path, request, max_batch=64)
    try:
        outcomes = await asyncio.gather(
            *(ledger.claim(f"id-{n}", "h", "o", lease_ms=1000, now_ms=1) for n in range(200))
        )
        assert outcomes == [Claimed(1)] * 200
        assert ledger.committed_ops == 200  # type: ignore[attr-defined]
        assert ledger.commits < 200  # type: ignore[attr-defined]
        reopened = await _reopen(kind, tmp_path, request)
        try:
            for n in range(0, 200, 37):
                assert await reopened.inspect(f"id-{n}", "h") == Pending(1001, 1)
        finally:
            await reopened.close()
    finally:
        await ledger.close()


async def test_a_sqlite_batch_larger_than_one_read_sees_every_stored_record(
    tmp_path: Path,
) -> None:
    # The batch reads its records in chunks of ids (ledger/sqlite.py): 1,200 operations
    # in one batch, half on stored decisions, cross several chunks.
    ledger = await SqliteLedger.open(tmp_path / "ledger.db", max_batch=1200, max_wait_ms=2000)
    try:
        await asyncio.gather(
            *(ledger.claim(f"id-{n}", "h", "o", lease_ms=1000, now_ms=1) for n in range(600))
        )
        commits = ledger.commits
        outcomes = await asyncio.gather(
            *(ledger.claim(f"id-{n}", "h", "o2", lease_ms=1000, now_ms=2) for n in range(1200))
        )
        assert ledger.commits == commits + 1  # one batch
        assert outcomes[:600] == [Busy(1001)] * 600
        assert outcomes[600:] == [Claimed(1)] * 600
    finally:
        await ledger.close()


async def _reopen(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Ledger:
    if kind == "sqlite":
        return await SqliteLedger.open(tmp_path / "ledger.db")
    return await PostgresLedger.connect(request.getfixturevalue("pg_url"))


@pytest.mark.parametrize("kind", KINDS)
async def test_group_commit_off_commits_every_operation_alone(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ledger = await _open(kind, tmp_path, request, group_commit=False)
    try:
        outcomes = await asyncio.gather(
            *(ledger.claim(f"id-{n}", "h", "o", lease_ms=1000, now_ms=1) for n in range(20)),
            ledger.claim("id-0", "h", "other", lease_ms=1000, now_ms=2),
        )
        assert outcomes[:20] == [Claimed(1)] * 20
        assert outcomes[20] in (Busy(1001), Claimed(1))  # arrival order is not defined
        assert ledger.commits == ledger.committed_ops  # type: ignore[attr-defined]
    finally:
        await ledger.close()


def test_bounds_are_validated(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="max_batch"):
        SqliteLedger(tmp_path / "x.db", max_batch=0)
    with pytest.raises(LedgerError, match="max_wait_ms"):
        SqliteLedger(tmp_path / "x.db", max_wait_ms=-1)
    with pytest.raises(LedgerError, match="max_batch"):
        PostgresLedger("postgresql://nobody@/nothing", max_batch=0)


# -- durability: an acknowledged operation survives kill -9 of the process -------------

_CHILD = textwrap.dedent(
    """
    import asyncio, os, sys
    from flowdecision.ledger.sqlite import SqliteLedger
    from flowdecision.ledger.postgres import PostgresLedger

    async def main(kind, target):
        if kind == "sqlite":
            ledger = await SqliteLedger.open(target)
        else:
            ledger = await PostgresLedger.connect(target)
        out = sys.stdout
        print("ready", flush=True)

        async def worker(w):
            n = 0
            while True:
                decision_id = f"w{w}-{n}"
                await ledger.claim(decision_id, "h", f"o{w}", lease_ms=60_000)
                out.write(decision_id + "\\n")
                out.flush()  # acknowledged: the claim call returned
                n += 1

        await asyncio.gather(*(worker(w) for w in range(16)))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.parametrize("kind", KINDS)
async def test_acknowledged_operations_survive_kill_9(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ledger = await _open(kind, tmp_path, request)
    await ledger.close()
    target = str(tmp_path / "ledger.db") if kind == "sqlite" else request.getfixturevalue("pg_url")
    acked = await asyncio.to_thread(acknowledged_before_kill, _CHILD, kind, target)
    assert len(acked) > 50, acked[:5]
    reopened = await _reopen(kind, tmp_path, request)
    try:
        missing = [d for d in acked if await reopened.lookup(d) is None]
        assert not missing, f"{len(missing)} acknowledged claims lost: {missing[:5]}"
    finally:
        await reopened.close()


async def test_postgres_follow_up_operation_is_not_stranded_by_a_finishing_flusher(
    pg_url: str,
) -> None:
    # Regression: a flusher that had just answered its callers still counted as live
    # until its done-callback ran, so a caller's immediate next operation was queued
    # with nobody left to drain it.
    from flowdecision.ledger.postgres import PostgresLedger

    ledger = await PostgresLedger.connect(pg_url, batch_concurrency=1)
    try:
        for n in range(20):
            decision_id = f"follow-up-{n}"
            assert await ledger.claim(decision_id, "h", "o", lease_ms=60_000) == Claimed(1)
            async with asyncio.timeout(10):
                assert await ledger.renew(decision_id, "h", "o", lease_ms=60_000)
                assert await ledger.complete(decision_id, "h", "o") is True
    finally:
        await ledger.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_an_operation_cancelled_while_queued_is_not_applied(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # A long gathering window: the first claim opens a batch, the second queues
    # behind it and its caller gives up before the batch is written.
    ledger = await _open(kind, tmp_path, request, max_batch=64, max_wait_ms=400)
    try:
        first = asyncio.create_task(ledger.claim("kept", "h", "o", lease_ms=60_000))
        await asyncio.sleep(0.02)
        doomed = asyncio.create_task(ledger.claim("dropped", "h", "o", lease_ms=60_000))
        await asyncio.sleep(0.02)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert await first == Claimed(1)
        kept = await ledger.inspect("kept", "h")
        assert isinstance(kept, Pending) and kept.attempts == 1
        assert await ledger.inspect("dropped", "h") == Missing()
    finally:
        await ledger.close()
