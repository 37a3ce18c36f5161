"""The SQLite ledger checkpoints its WAL on a thread of its own (issue 18).

SQLite copies the WAL back into the database file from inside the commit
that takes it past ``wal_autocheckpoint`` pages (1,000 by default), and with
group commit every caller of that batch waits for the copy. The ledger's
:class:`~flowdecision.store.checkpoint.Checkpointer` runs those copies
instead; the writer checkpoints itself only past a backstop (4,000 pages).
These tests watch the database file itself: it grows only when a checkpoint
copies pages into it. Real files, real threads, nothing mocked.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from flowdecision.core.defaults import SQLITE_CHECKPOINT_BACKSTOP_PAGES
from flowdecision.errors import LedgerError
from flowdecision.ledger import Claimed, Pending
from flowdecision.ledger.sqlite import SqliteLedger

#: SQLite's own threshold, for the writer when nothing else checkpoints.
SQLITE_DEFAULT_AUTOCHECKPOINT = 1000


def _wal_frames(path: Path) -> int:
    """Frames in ``path``'s WAL (a 32-byte header, then frames of a 24-byte header
    and one page each)."""
    wal = path.with_name(path.name + "-wal")
    if not wal.exists():
        return 0
    conn = sqlite3.connect(path)
    try:
        page = int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()
    return max(0, (wal.stat().st_size - 32) // (page + 24))


def _checkpoint_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.endswith("-checkpoint")]


async def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for ``condition()`` to hold: the checkpointer is a thread."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        await asyncio.sleep(0.02)


async def _claims(ledger: SqliteLedger, start: int, count: int) -> None:
    """One caller: each claim commits alone, inline (``inline_max_ms``)."""
    for n in range(start, start + count):
        assert await ledger.claim(f"d{n}", "h", "o", lease_ms=100, now_ms=10) == Claimed(1)


async def _claims_until_a_commit_checkpoints(ledger: SqliteLedger, path: Path, start: int) -> int:
    """Lone claims from ``start`` until one's commit copies the WAL into the database
    file, checking the WAL stays near SQLite's own threshold; the claims made."""
    before = path.stat().st_size
    n = start
    while path.stat().st_size == before:
        await _claims(ledger, n, 50)
        n += 50
        assert _wal_frames(path) < 2 * SQLITE_DEFAULT_AUTOCHECKPOINT
    return n


def _stop_checkpointer(ledger: SqliteLedger) -> None:
    """Stop the ledger's checkpointer, as if its thread had died."""
    checkpointer = ledger.checkpointer
    assert checkpointer is not None
    checkpointer.close()
    assert _checkpoint_threads() == []


async def _claims_together(ledger: SqliteLedger, start: int, count: int) -> None:
    """Callers in flight together, ten at a time: group commits on the connection thread."""
    for first in range(start, start + count, 10):
        outcomes = await asyncio.gather(
            *(
                ledger.claim(f"d{n}", "h", "o", lease_ms=100, now_ms=10)
                for n in range(first, min(first + 10, start + count))
            )
        )
        assert set(outcomes) == {Claimed(1)}


async def test_commits_leave_wal_checkpoints_to_a_thread_of_their_own(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path)
    try:
        assert _checkpoint_threads() == ["flowdecision-sqlite-ledger-checkpoint"]
        before = path.stat().st_size
        await _claims_together(ledger, 0, 150)
        assert ledger.inline_commits == 0
        # Fewer pages than SQLite's own threshold: no commit of the writer copied them.
        assert 0 < _wal_frames(path) < SQLITE_DEFAULT_AUTOCHECKPOINT
        await _wait_for(lambda: path.stat().st_size > before, "the database file grew")
        checkpointer = ledger.checkpointer
        assert checkpointer is not None
        assert checkpointer.checkpoints >= 1 and checkpointer.failures == 0
        # A lone caller's commits (inline, on the event loop) wake it too.
        copied = checkpointer.checkpoints
        await _claims(ledger, 150, 20)
        assert ledger.inline_commits == 20
        await _wait_for(
            lambda: checkpointer.checkpoints > copied, "a checkpoint after lone commits"
        )
        # What the checkpoints copied is what was committed.
        assert await ledger.inspect("d169", "h") == Pending(110, 1)
    finally:
        await ledger.close()
    assert _checkpoint_threads() == []
    reopened = await SqliteLedger.open(path)
    try:
        assert await reopened.inspect("d0", "h") == Pending(110, 1)
    finally:
        await reopened.close()


async def test_a_lone_caller_behind_a_stopped_checkpointer_checkpoints_at_sqlites_threshold(
    tmp_path: Path,
) -> None:
    # One caller writing all the time leaves the checkpointer no moment in which the
    # log is fully copied, so the log is never restarted: a lone (inline) commit
    # checkpoints past SQLite's own 1,000 pages, not the batches' 4,000 backstop
    # (docs/BENCHMARKS.md, "The single-caller cycle"). A stopped checkpointer shows it.
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path)
    try:
        _stop_checkpointer(ledger)
        n = await _claims_until_a_commit_checkpoints(ledger, path, 0)
        assert ledger.inline_commits == n
        assert await ledger.inspect(f"d{n - 1}", "h") == Pending(110, 1)
    finally:
        await ledger.close()


async def test_with_an_interval_of_0_the_commits_checkpoint_as_sqlite_does(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path, checkpoint_interval_ms=0)
    try:
        assert ledger.checkpointer is None and _checkpoint_threads() == []
        before = path.stat().st_size
        await _claims(ledger, 0, 150)
        frames = _wal_frames(path)
        assert 0 < frames < SQLITE_DEFAULT_AUTOCHECKPOINT
        await asyncio.sleep(0.5)  # what a checkpointer would have had
        assert path.stat().st_size == before
        # Past SQLite's threshold the commit that crosses it checkpoints.
        await _claims_until_a_commit_checkpoints(ledger, path, 150)
    finally:
        await ledger.close()


async def test_when_the_checkpointer_stops_the_writer_checkpoints_past_the_backstop(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path)
    try:
        _stop_checkpointer(ledger)
        # A few lone commits first: the connection moves to the event loop (SQLite's
        # threshold there) and back to its thread for the batches (the backstop again).
        await _claims(ledger, 0, 5)
        assert ledger.inline_commits == 5
        before = path.stat().st_size
        n = 5
        largest = 0
        while path.stat().st_size == before:
            await _claims_together(ledger, n, 100)
            n += 100
            largest = max(largest, _wal_frames(path))
            assert largest < 2 * SQLITE_CHECKPOINT_BACKSTOP_PAGES, "the WAL grew unbounded"
        # Not at SQLite's 1,000 pages: at the backstop.
        assert largest >= SQLITE_CHECKPOINT_BACKSTOP_PAGES - 100
        assert await ledger.inspect(f"d{n - 1}", "h") == Pending(110, 1)
    finally:
        await ledger.close()


@pytest.mark.parametrize("interval", [-1.0, float("nan"), float("inf")])
def test_a_checkpoint_interval_that_is_no_duration_is_refused(
    tmp_path: Path, interval: float
) -> None:
    with pytest.raises(LedgerError, match="checkpoint_interval_ms must be 0 or more"):
        SqliteLedger(tmp_path / "ledger.db", checkpoint_interval_ms=interval)


async def test_store_connections_keep_statement_journals_in_memory(tmp_path: Path) -> None:
    """A batch's multi-row INSERT keeps a statement journal; on disk, SQLite would
    create and unlink a temporary file for it in every large batch."""
    ledger = await SqliteLedger.open(tmp_path / "ledger.db")
    try:
        # Read on the ledger's own connection (2 = MEMORY).
        assert (
            await ledger._thread.run(lambda conn: conn.execute("PRAGMA temp_store").fetchone()[0])
            == 2
        )
    finally:
        await ledger.close()
