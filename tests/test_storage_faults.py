"""Storage faults under the SQLite ledger (and the file-ledger cases that
tests/test_jsonfile_ledger.py does not already cover: a read-only directory).

Every case: the error is clear and names the file; the data is left byte-identical
(or, after a crash, intact as ``PRAGMA integrity_check`` sees it); and the ledger
works again once the fault is removed. Faults are real: damaged files on disk,
a child process running as ``nobody`` against a directory it cannot write
(chmod alone does not stop root), ``RLIMIT_FSIZE`` in a child, and a child
SIGKILLed in the middle of a write transaction.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pwd
import resource
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from flowdecision import LedgerCorruptError, LedgerSchemaError, LedgerUnavailableError
from flowdecision.ledger import Claimed, JsonFileLedger, Pending
from flowdecision.ledger.jsonfile import DATA_FILE, LOCK_FILE, SIDE_FILE
from flowdecision.ledger.sqlite import SqliteLedger

HASH = "h" * 64
CTX = multiprocessing.get_context("fork")


async def _seed_async(path: Path, count: int) -> None:
    async with await SqliteLedger.open(path) as ledger:
        for index in range(count):
            await ledger.claim(f"d-{index:04d}", HASH, "o", lease_ms=5, now_ms=1)


def _seed(path: Path, count: int = 200) -> None:
    """Create a ledger with ``count`` claims (from a helper thread, so async tests can call it)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _seed_async(path, count)).result()


def _integrity(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


def _count(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT count(*) FROM flowdecision_claims").fetchone()[0])
    finally:
        conn.close()


async def _works(path: Path, decision_id: str = "after-the-fault") -> None:
    async with await SqliteLedger.open(path) as ledger:
        assert isinstance(await ledger.claim(decision_id, HASH, "o", lease_ms=5), Claimed)
        assert isinstance(await ledger.inspect("d-0000", HASH), Pending)


@pytest.mark.parametrize("damage", ["truncated-half", "truncated-to-header", "garbage"])
async def test_damaged_sqlite_file_is_reported_and_left_byte_identical(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "ledger.db"
    _seed(path)
    original = path.read_bytes()
    if damage == "truncated-half":
        content = original[: len(original) // 2]
    elif damage == "truncated-to-header":
        content = original[:50]
    else:
        content = bytes((index * 131 + 7) % 256 for index in range(len(original)))
    path.write_bytes(content)
    fragment = "file is not a database" if damage == "garbage" else "malformed"
    for operation in ("claim", "inspect", "prune"):
        ledger = SqliteLedger(path)
        try:
            with pytest.raises(LedgerCorruptError) as failure:
                if operation == "claim":
                    await ledger.claim("new", HASH, "o", lease_ms=5)
                elif operation == "inspect":
                    await ledger.inspect("d-0150", HASH)
                else:
                    await ledger.prune_completed(10)
        finally:
            await ledger.close()
        assert str(path) in str(failure.value) and fragment in str(failure.value)
        assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.db"]
    path.write_bytes(original)  # the operator restores the file
    await _works(path)
    assert _integrity(path) == "ok" and _count(path) == 201


async def test_a_corrupt_record_names_the_decision_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    _seed(path, 3)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "UPDATE flowdecision_claims SET record = '{\"status\":' WHERE decision_id = 'd-0001'"
    )
    conn.close()
    async with await SqliteLedger.open(path) as ledger:
        with pytest.raises(LedgerCorruptError) as failure:
            await ledger.claim("d-0001", HASH, "o", lease_ms=5)
        assert "d-0001" in str(failure.value) and str(path) in str(failure.value)
        # The damage is contained to that record; the others still work.
        assert isinstance(await ledger.claim("d-0002", HASH, "o", lease_ms=5), Claimed)
    assert _integrity(path) == "ok"


async def test_newer_schema_is_refused_untouched_and_works_once_downgraded(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    _seed(path, 5)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    content = path.read_bytes()
    with pytest.raises(LedgerSchemaError) as failure:
        await SqliteLedger.open(path)
    assert str(path) in str(failure.value) and "schema version 99" in str(failure.value)
    assert path.read_bytes() == content
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    await _works(path)


# ----------------------------------------------------------- read-only directory


def _as_unprivileged(work: Any, queue: Any, drop: bool) -> None:
    """In a forked child: drop to `nobody` when root (chmod does not stop root).

    The child reads nothing from the checkout: the package was imported and its
    migrations read (they are cached per process) before the fork, so this
    works when the checkout sits where `nobody` cannot read (root's home, a
    0700 ``mktemp -d``); see test_migrations_are_read_once_per_process.
    """
    try:
        if drop and os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
        queue.put(("ok", work()))
    except Exception as error:  # reported to the parent, which asserts on it
        queue.put((type(error).__name__, str(error)))


def _in_child(work: Any, *, drop: bool = True) -> tuple[str, Any]:
    queue = CTX.Queue()
    child = CTX.Process(target=_as_unprivileged, args=(work, queue, drop))
    child.start()
    child.join(60)
    return queue.get(timeout=10)  # type: ignore[no-any-return]


@pytest.fixture
def shared_dir() -> Any:
    """A directory `nobody` can reach (pytest's tmp_path is private to root)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="flowdecision-ro-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        for folder in (root, *[p for p in root.rglob("*") if p.is_dir()]):
            os.chmod(folder, 0o755)
        shutil.rmtree(root, ignore_errors=True)


def _make_readonly_dir(root: Path) -> Path:
    directory = root / "ro"
    directory.mkdir()
    return directory


def _hand_to_nobody(*paths: Path) -> None:
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        for path in paths:
            os.chown(path, nobody.pw_uid, nobody.pw_gid)


def _probe_write(directory: Path) -> str:
    try:
        (directory / "probe").write_bytes(b"x")
    except PermissionError:
        return "refused"
    return "written"


def test_sqlite_ledger_in_a_read_only_directory(shared_dir: Path) -> None:
    directory = _make_readonly_dir(shared_dir)
    path = directory / "ledger.db"
    _seed(path, 5)
    _hand_to_nobody(path)  # the file itself is writable; only the directory is not
    os.chmod(path, 0o666)
    os.chmod(directory, 0o555)
    content = path.read_bytes()
    # The child really cannot write there (not root, or dropped to nobody).
    assert _in_child(lambda: _probe_write(directory)) == ("ok", "refused")

    def claim() -> str:
        return repr(asyncio.run(_claim_once(path)))

    kind, message = _in_child(claim)
    assert kind == "LedgerUnavailableError", message
    assert str(path) in message and "readonly database" in message
    assert path.read_bytes() == content
    assert sorted(p.name for p in directory.iterdir()) == ["ledger.db"]
    os.chmod(directory, 0o777)  # the fault is removed
    assert _in_child(claim) == ("ok", "Claimed(attempt=1)")
    assert _integrity(path) == "ok" and _count(path) == 6


_WITHOUT_SQL_FILES = """
import asyncio, shutil, sys
from pathlib import Path

import flowdecision
from flowdecision.ledger import SqliteLedger
from flowdecision.core.model import Complete, DecisionRequest
from flowdecision.sinks import OutboxSink

# The installed files vanish or become unreadable after import (an upgrade in
# place, dropped privileges): stores still open and migrate with the SQL of the
# code that is running.
shutil.rmtree(Path(flowdecision.__file__).parent / "ledger" / "sql")
shutil.rmtree(Path(flowdecision.__file__).parent / "sinks" / "sql")

async def main() -> None:
    work = Path(sys.argv[1])
    async with await SqliteLedger.open(work / "ledger.db") as ledger:
        print(await ledger.claim("d", "h" * 64, "o", lease_ms=5))
    async with OutboxSink(f"sqlite:///{work / 'outbox.db'}") as outbox:
        decision = DecisionRequest(
            decision_id="d",
            run_id="r",
            authority_branch_id="production",
            causation_event_id="e",
            decision=Complete(output={}),
        )
        print(await outbox.deliver(decision, 1))

asyncio.run(main())
"""


def test_migrations_are_read_once_per_process(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    import flowdecision

    copy = tmp_path / "site"
    shutil.copytree(Path(flowdecision.__file__).parent, copy / "flowdecision")
    import orjson

    # -S: only the copy, the standard library and orjson (the one runtime dependency
    # this path imports), not the editable install of the checkout.
    where_orjson = Path(orjson.__file__).parent.parent
    result = subprocess.run(
        [sys.executable, "-S", "-c", _WITHOUT_SQL_FILES, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(where_orjson)])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Claimed(attempt=1)", "True"]


async def _claim_once(path: Path) -> object:
    ledger = SqliteLedger(path)
    try:
        return await ledger.claim("new", HASH, "o", lease_ms=5)
    finally:
        await ledger.close()


def test_file_ledger_in_a_read_only_directory(shared_dir: Path) -> None:
    directory = _make_readonly_dir(shared_dir)
    asyncio.run(JsonFileLedger(directory).claim("a", HASH, "o", lease_ms=5, now_ms=1))
    data, lock, side = directory / DATA_FILE, directory / LOCK_FILE, directory / SIDE_FILE
    _hand_to_nobody(data, lock, side)
    for path in (data, lock, side):
        os.chmod(path, 0o666)
    os.chmod(directory, 0o555)
    content, side_content = data.read_bytes(), side.read_bytes()
    assert _in_child(lambda: _probe_write(directory)) == ("ok", "refused")

    def claim() -> str:
        outcome = asyncio.run(JsonFileLedger(directory).claim("b", HASH, "o", lease_ms=5, now_ms=1))
        return repr(outcome)

    kind, message = _in_child(claim)
    assert kind == "LedgerUnavailableError", message
    # The ledger file is written first (the new claim's run beside it only after): refused.
    assert f"write decision ledger `{data}`" in message and "Permission denied" in message
    assert (data.read_bytes(), side.read_bytes()) == (content, side_content)
    assert sorted(p.name for p in directory.iterdir()) == sorted([DATA_FILE, LOCK_FILE, SIDE_FILE])
    os.chmod(directory, 0o777)
    assert _in_child(claim) == ("ok", "Claimed(attempt=1)")


# -------------------------------------------------------------------- full disk


def _fill(path: Path, limit: int) -> tuple[list[str], str]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    committed: list[str] = []

    async def go() -> str:
        async with await SqliteLedger.open(path) as ledger:
            for index in range(100_000):
                key = f"fill-{index:06d}-" + "x" * 200
                try:
                    await ledger.claim(key, HASH * 8, "o", lease_ms=5, now_ms=1)
                except LedgerUnavailableError as error:
                    return str(error)
                committed.append(key)
        return "never filled up"

    return committed, asyncio.run(go())


def test_sqlite_full_disk_keeps_every_commit_and_recovers(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    _seed(path, 20)
    limit = path.stat().st_size + 64 * 1024
    kind, result = _in_child(lambda: _fill(path, limit), drop=False)
    assert kind == "ok", result
    committed, message = result
    assert committed, "the limit left no room at all"
    assert str(path) in message and "full" in message
    assert _integrity(path) == "ok"
    conn = sqlite3.connect(path)
    stored = {row[0] for row in conn.execute("SELECT decision_id FROM flowdecision_claims")}
    conn.close()
    assert set(committed) <= stored and len(stored) == 20 + len(committed)
    asyncio.run(_works(path))  # no limit in this process: the fault is gone


# ------------------------------------------------------- crash mid-transaction


def _crash_mid_write(path: Path, ready: Any) -> None:
    async def commit_some() -> None:
        async with await SqliteLedger.open(path) as ledger:
            for index in range(30):
                await ledger.claim(f"committed-{index}", HASH, "o", lease_ms=5, now_ms=1)

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint = 0")  # keep the commits in the WAL
    asyncio.run(commit_some())
    conn.execute("BEGIN IMMEDIATE")
    for index in range(3000):  # enough to spill uncommitted pages into the WAL
        conn.execute(
            "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record) "
            "VALUES (?, 'pending', NULL, ?)",
            (f"uncommitted-{index}", "{" + "y" * 500 + "}"),
        )
    ready.put("in the middle of a transaction")
    signal.pause()


def test_sqlite_recovers_after_a_process_dies_mid_transaction(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    _seed(path, 5)
    ready = CTX.Queue()
    child = CTX.Process(target=_crash_mid_write, args=(path, ready))
    child.start()
    assert ready.get(timeout=60) == "in the middle of a transaction"
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join(10)
    assert child.exitcode == -signal.SIGKILL
    wal = path.with_name("ledger.db-wal")
    assert wal.exists() and wal.stat().st_size > 0  # left behind by the crash

    async def check() -> None:
        async with await SqliteLedger.open(path) as ledger:
            for index in range(30):
                assert isinstance(await ledger.inspect(f"committed-{index}", HASH), Pending)
            assert await ledger.lookup("uncommitted-0") is None
            assert isinstance(await ledger.claim("after-crash", HASH, "o", lease_ms=5), Claimed)

    asyncio.run(check())
    assert _integrity(path) == "ok"
    assert _count(path) == 5 + 30 + 1
