"""The seed-format JSON file ledger: format, validation, durability, processes."""

from __future__ import annotations

import asyncio
import fcntl
import json
import multiprocessing
import os
import resource
import stat
from pathlib import Path

import pytest

from flowdecision.errors import LedgerCorruptError, LedgerSchemaError, LedgerUnavailableError
from flowdecision.ledger import AlreadyCompleted, Busy, Claimed, JsonFileLedger, Pending
from flowdecision.ledger.jsonfile import (
    DATA_FILE,
    LOCK_FILE,
    MAX_DECISION_LEDGER_BYTES,
    SIDE_FILE,
)

from .helpers import Ticker, identity, receipt


def _data(root: Path) -> Path:
    return root / DATA_FILE


async def test_writes_exactly_the_seed_format(tmp_path: Path) -> None:
    ledger = JsonFileLedger(tmp_path)
    ident = identity("format")
    await ledger.claim("b", "hash-b", "owner", lease_ms=50, now_ms=100)
    await ledger.claim("a", "hash-a", "owner", lease_ms=50, now_ms=100, identity=ident)
    await ledger.complete(
        "a", "hash-a", "owner", completed_at_ms=120, identity=ident, receipt=receipt(ident)
    )
    expected = (
        '{"schema_version":1,"records":{'
        '"a":{"request_hash":"hash-a","execution_identity":'
        + ident.to_json().decode()
        + ',"status":"completed","owner_id":"owner","lease_expires_at_ms":0,"attempts":1,'
        '"completed_at_ms":120,"result_receipt":' + receipt(ident).to_json().decode() + "},"
        '"b":{"request_hash":"hash-b","status":"pending","owner_id":"owner",'
        '"lease_expires_at_ms":150,"attempts":1}}}'
    )
    assert _data(tmp_path).read_bytes() == expected.encode()
    assert stat.S_IMODE(_data(tmp_path).stat().st_mode) == 0o600


async def test_reads_a_rust_v0_file_and_drops_unknown_fields_on_rewrite(tmp_path: Path) -> None:
    legacy = {
        "schema_version": 0,
        "extra": True,
        "records": {
            "done": {
                "request_hash": "h",
                "status": "completed",
                "owner_id": "rust-host",
                "lease_expires_at_ms": 0,
                "attempts": 1,
                "future_field": [1, 2],
            }
        },
    }
    _data(tmp_path).write_text(json.dumps(legacy))
    ledger = JsonFileLedger(tmp_path)
    assert isinstance(await ledger.claim("done", "h", "py", lease_ms=5, now_ms=1), AlreadyCompleted)
    await ledger.claim("new", "h2", "py", lease_ms=5, now_ms=1)
    rewritten = json.loads(_data(tmp_path).read_bytes())
    assert rewritten["schema_version"] == 1
    assert "extra" not in rewritten
    assert "future_field" not in rewritten["records"]["done"]
    # A legacy completed record has no completion time, so pruning keeps it.
    assert await ledger.prune_completed(10**12) == 0


@pytest.mark.parametrize(
    ("content", "error_type", "fragment"),
    [
        (b'{"schema_version":1,"records":{"a":', LedgerCorruptError, "decode decision ledger"),
        (b"\x00\xffgarbage\x13", LedgerCorruptError, "decode decision ledger"),
        (b'{"schema_version":1}', LedgerCorruptError, "`records`"),
        (b'{"records":{}}', LedgerCorruptError, "`schema_version`"),
        (b'{"schema_version":2,"records":{}}', LedgerSchemaError, "newer than supported schema 1"),
        (
            b'{"schema_version":1,"records":{"a":{"request_hash":"h","status":"paused",'
            b'"owner_id":"o","lease_expires_at_ms":0,"attempts":1}}}',
            LedgerCorruptError,
            "unknown status `paused`",
        ),
        (
            b'{"schema_version":1,"records":{"a":{"request_hash":"h","status":"pending",'
            b'"owner_id":"o","lease_expires_at_ms":-1,"attempts":1}}}',
            LedgerCorruptError,
            "out of range",
        ),
        (
            b'{"schema_version":1,"records":{"a":{"request_hash":"h","status":"pending",'
            b'"owner_id":"o","lease_expires_at_ms":0,"attempts":1,"execution_identity":'
            b'{"schema":"a3s.code.execution-identity.v1","domain":"BAD","digest":"x"}}}}',
            LedgerCorruptError,
            "validate identity for decision `a`",
        ),
    ],
    ids=[
        "truncated",
        "garbage",
        "no-records",
        "no-version",
        "newer-schema",
        "unknown-status",
        "negative",
        "bad-identity",
    ],
)
async def test_invalid_file_is_reported_and_left_byte_identical(
    tmp_path: Path, content: bytes, error_type: type[Exception], fragment: str
) -> None:
    _data(tmp_path).write_bytes(content)
    ledger = JsonFileLedger(tmp_path)
    for operation in (
        ledger.claim("a", "h", "o", lease_ms=5),
        ledger.inspect("a", "h"),
        ledger.prune_completed(1),
    ):
        with pytest.raises(error_type) as failure:
            await operation
        assert fragment in str(failure.value)
        assert str(_data(tmp_path)) in str(failure.value)
    assert _data(tmp_path).read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([DATA_FILE, LOCK_FILE])


async def test_oversized_file_is_refused_before_reading(tmp_path: Path) -> None:
    with open(_data(tmp_path), "wb") as handle:
        handle.truncate(MAX_DECISION_LEDGER_BYTES + 1)  # sparse: size is what counts
    with pytest.raises(LedgerCorruptError, match="exceeds 16777216 bytes"):
        await JsonFileLedger(tmp_path).claim("a", "h", "o", lease_ms=5)
    assert _data(tmp_path).stat().st_size == MAX_DECISION_LEDGER_BYTES + 1


async def test_write_that_would_exceed_the_bound_is_refused(tmp_path: Path) -> None:
    ledger = JsonFileLedger(tmp_path)
    await ledger.claim("a", "h", "o", lease_ms=5, now_ms=1)
    before = _data(tmp_path).read_bytes()
    with pytest.raises(LedgerCorruptError, match="exceeds 16777216 bytes"):
        await ledger.claim("b", "h" * MAX_DECISION_LEDGER_BYTES, "o", lease_ms=5, now_ms=1)
    assert _data(tmp_path).read_bytes() == before


async def test_stale_temp_files_from_a_crash_are_swept(tmp_path: Path) -> None:
    ledger = JsonFileLedger(tmp_path)
    await ledger.claim("a", "h", "o", lease_ms=5, now_ms=1)
    stale = tmp_path / "flow-decisions.tmp-3b6f0c5e-crashed"
    stale.write_bytes(b'{"schema_version":1,"rec')
    reopened = JsonFileLedger(tmp_path)
    assert isinstance(await reopened.claim("b", "h", "o", lease_ms=5, now_ms=1), Claimed)
    assert not stale.exists()
    assert set((await reopened.records()).keys()) == {"a", "b"}


def _write_with_file_size_limit(root: str, limit: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        asyncio.run(JsonFileLedger(root).claim("big", "h" * 4096, "o", lease_ms=5, now_ms=1))
        queue.put("ok")
    except LedgerUnavailableError as error:
        queue.put(str(error))


def test_full_disk_leaves_the_original_and_no_temp_file(tmp_path: Path) -> None:
    asyncio.run(JsonFileLedger(tmp_path).claim("a", "h", "o", lease_ms=5, now_ms=1))
    before = _data(tmp_path).read_bytes()
    queue: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()  # type: ignore[type-arg]
    child = multiprocessing.get_context("fork").Process(
        target=_write_with_file_size_limit, args=(str(tmp_path), 1024, queue)
    )
    child.start()
    child.join(30)
    message = queue.get(timeout=5)
    assert "write decision ledger" in message and str(_data(tmp_path)) in message
    assert _data(tmp_path).read_bytes() == before
    # No temporary file is left; the operator side file beside the ledger was there before.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([DATA_FILE, LOCK_FILE, SIDE_FILE])
    # Once the fault is gone the ledger works again.
    assert isinstance(
        asyncio.run(JsonFileLedger(tmp_path).claim("big", "h", "o", lease_ms=5, now_ms=1)),
        Claimed,
    )


async def test_waiting_for_the_file_lock_does_not_block_the_event_loop(tmp_path: Path) -> None:
    ledger = JsonFileLedger(tmp_path)
    await ledger.claim("warm", "h", "o", lease_ms=5, now_ms=1)
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another "process" holds the ledger
    ticking = Ticker(0.005)
    claim = asyncio.create_task(ledger.claim("a", "h", "o", lease_ms=5, now_ms=1))
    await asyncio.sleep(0.2)
    assert not claim.done()
    assert ticking.ticks >= 10  # the loop kept running while the claim waited
    os.close(fd)  # releases the flock
    assert isinstance(await asyncio.wait_for(claim, 5), Claimed)
    ticking.stop()


def _contend(root: str, owner: str, ids: list[str], start: object, queue: object) -> None:
    start.wait()  # type: ignore[attr-defined]

    async def go() -> list[tuple[str, str]]:
        ledger = JsonFileLedger(root)
        results = []
        for decision_id in ids:
            outcome = await ledger.claim(decision_id, "hash", owner, lease_ms=600_000)
            results.append((decision_id, type(outcome).__name__))
        return results

    queue.put((owner, asyncio.run(go())))  # type: ignore[attr-defined]


def test_several_processes_get_exactly_one_claim_per_live_lease(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ids = [f"d{i}" for i in range(12)]
    start = ctx.Event()
    queue = ctx.Queue()
    workers = [
        ctx.Process(target=_contend, args=(str(tmp_path), f"owner-{n}", ids, start, queue))
        for n in range(4)
    ]
    for worker in workers:
        worker.start()
    start.set()
    results = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(30)
        assert worker.exitcode == 0
    claimed: dict[str, list[str]] = {}
    for owner, outcomes in results:
        for decision_id, kind in outcomes:
            assert kind in ("Claimed", "Busy")
            if kind == "Claimed":
                claimed.setdefault(decision_id, []).append(owner)
    assert sorted(claimed) == sorted(ids)
    assert all(len(owners) == 1 for owners in claimed.values())
    records = asyncio.run(JsonFileLedger(tmp_path).records())
    assert sorted(records) == sorted(ids)
    for decision_id, record in records.items():
        assert record.owner_id == claimed[decision_id][0]
        assert record.attempts == 1


async def test_busy_reports_the_lease_and_inspect_hides_the_owner(tmp_path: Path) -> None:
    ledger = JsonFileLedger(tmp_path)
    await ledger.claim("a", "h", "owner", lease_ms=50, now_ms=100)
    assert await ledger.claim("a", "h", "other", lease_ms=50, now_ms=120) == Busy(150)
    state = await ledger.inspect("a", "h")
    assert state == Pending(lease_expires_at_ms=150, attempts=1)
    assert "owner" not in repr(state)
