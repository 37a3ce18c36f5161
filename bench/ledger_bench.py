"""Ledger benchmark: claim -> complete cycles per second, per backend.

Not a timed test. For each backend, retained-record count and process count it
bulk-loads the store (executemany / COPY, not the API), then runs N OS
processes that each loop "claim a new decision id, complete it with an
identity and a receipt" for a fixed time, and reports total cycles/s. Beside
each SQL backend it measures the raw limit of the same store: SQLite, a bare
``BEGIN IMMEDIATE`` insert then update of the same row shape at the same
``synchronous`` setting; PostgreSQL, the same two statements from asyncpg.

    .venv/bin/python bench/ledger_bench.py                # full matrix
    .venv/bin/python bench/ledger_bench.py --quick        # smaller, faster
    .venv/bin/python bench/ledger_bench.py --postgres-url postgresql://...
    .venv/bin/python bench/ledger_bench.py --single-only   # the single-caller row alone

First, the **single-caller row**: one process, one caller, claim -> complete on
``SqliteLedger`` (``synchronous=FULL``) against the same two transactions on raw
``sqlite3``, in ``--single-pairs`` interleaved pairs (the order alternating per
pair); it prints every pair and the median ratio, so a per-operation regression
shows even when the machine is noisy.

Without ``--postgres-url`` a throwaway PostgreSQL server (durable settings:
fsync on, synchronous_commit on) is started in a temp dir and stopped after.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from flowdecision.core.identity import (  # noqa: E402
    ExecutionIdentity,
    ResultOutcome,
    ResultReceipt,
    digest_bytes,
)
from flowdecision.core.jsonwire import encode_json_text  # noqa: E402
from flowdecision.ledger.machine import ClaimRecord, ClaimStatus  # noqa: E402

LEASE_MS = 60_000


def _identity(tag: str) -> ExecutionIdentity:
    return ExecutionIdentity.derive("a3s.bench.flow-decision", {"tag": tag})


def _receipt(ident: ExecutionIdentity) -> ResultReceipt:
    return ResultReceipt.new(
        ident,
        digest_bytes("a3s.bench.flow-evidence", b"event"),
        ResultOutcome.SUCCEEDED,
        digest_bytes("a3s.bench.flow-result", b"result"),
        6,
    )


def _completed_row(index: int) -> tuple[str, str, int, str]:
    """A realistic completed record (identity + receipt), as the ledgers store it."""
    ident = _identity("preload")
    record = ClaimRecord(
        request_hash="f" * 64,
        status=ClaimStatus.COMPLETED,
        owner_id="preload-owner",
        lease_expires_at_ms=0,
        attempts=1,
        execution_identity=ident,
        completed_at_ms=1_700_000_000_000 + index,
        result_receipt=_receipt(ident),
    )
    return (
        f"preload-{index:08d}",
        "completed",
        1_700_000_000_000 + index,
        encode_json_text(record.to_dict()),
    )


def _template() -> tuple[str, str]:
    _, _, _, text = _completed_row(0)
    return text, "1700000000000"


# -- preload ---------------------------------------------------------------------


def preload_sqlite(path: Path, count: int) -> None:
    from flowdecision.ledger.sqlite import SqliteLedger

    async def create() -> None:
        await (await SqliteLedger.open(path)).close()

    asyncio.run(create())
    text, stamp = _template()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record) "
        "VALUES (?, 'completed', ?, ?)",
        (
            (
                f"preload-{i:08d}",
                1_700_000_000_000 + i,
                text.replace(stamp, str(1_700_000_000_000 + i)),
            )
            for i in range(count)
        ),
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    # The bulk load ran with synchronous=OFF: flush it now, or the first
    # checkpoint of the measured run pays for writing back the whole file.
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


async def preload_postgres(url: str, count: int) -> None:
    import asyncpg

    from flowdecision.ledger.postgres import PostgresLedger

    ledger = PostgresLedger(url)
    await ledger.migrate()
    await ledger.close()
    text, stamp = _template()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("TRUNCATE flowdecision_claims")
        await conn.copy_records_to_table(
            "flowdecision_claims",
            columns=["decision_id", "status", "completed_at_ms", "record"],
            records=(
                (
                    f"preload-{i:08d}",
                    "completed",
                    1_700_000_000_000 + i,
                    text.replace(stamp, str(1_700_000_000_000 + i)),
                )
                for i in range(count)
            ),
        )
        await conn.execute("VACUUM ANALYZE flowdecision_claims")
    finally:
        await conn.close()


def preload_file(root: Path, count: int) -> None:
    """Completed records in the seed's older shape (no identity, no receipt).

    The JSON file ledger stops at 16 MiB; records with identity and receipt
    (~900 bytes each) would stop it near 17k records, so the file ledger is
    preloaded with ~190-byte records instead (which favours it).
    """
    from flowdecision.ledger.jsonfile import DATA_FILE, encode_ledger

    records = {
        f"preload-{i:08d}": ClaimRecord(
            "f" * 64,
            ClaimStatus.COMPLETED,
            "preload-owner",
            0,
            1,
            None,
            1_700_000_000_000 + i,
            None,
        )
        for i in range(count)
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / DATA_FILE).write_bytes(encode_ledger(records))


# -- workers (one OS process each) ---------------------------------------------------


async def _ledger_loop(
    kind: str, target: str, worker: int, seconds: float, tag: str = "", runs: bool = False
) -> int:
    """Claim -> complete for ``seconds``; ``runs``: each claim names a run and causing event
    (as a service POST does, so the run index is written too)."""
    from flowdecision.ledger import Claimed, Ledger
    from flowdecision.ledger.machine import DecisionOrigin

    ledger: Ledger
    if kind == "sqlite":
        from flowdecision.ledger.sqlite import SqliteLedger

        ledger = await SqliteLedger.open(target)
    elif kind == "postgres":
        from flowdecision.ledger.postgres import PostgresLedger

        ledger = await PostgresLedger.connect(target, max_size=2)
    else:
        from flowdecision.ledger.jsonfile import JsonFileLedger

        ledger = JsonFileLedger(target)
    ident = _identity(f"worker-{worker}")
    receipt = _receipt(ident)
    owner = f"bench-{worker}-{os.getpid()}"
    cycles = 0
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            decision_id = f"w{tag}{worker}-{os.getpid()}-{cycles}"
            origin = None
            if runs:
                origin = DecisionOrigin(f"run-{worker}-{os.getpid()}-{cycles // 10}", decision_id)
            outcome = await ledger.claim(
                decision_id, "h" * 64, owner, lease_ms=LEASE_MS, identity=ident, origin=origin
            )
            assert isinstance(outcome, Claimed), outcome
            await ledger.complete(decision_id, "h" * 64, owner, identity=ident, receipt=receipt)
            cycles += 1
    finally:
        await ledger.close()
    return cycles


def _raw_sqlite_loop(
    target: str, worker: int, seconds: float, synchronous: str, tag: str = ""
) -> int:
    conn = sqlite3.connect(target, isolation_level=None, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    pending, _ = _template()
    completed = pending
    cycles = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        decision_id = f"raw{tag}{worker}-{os.getpid()}-{cycles}"
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record) "
            "VALUES (?, 'pending', NULL, ?)",
            (decision_id, pending),
        )
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "UPDATE flowdecision_claims SET status = 'completed', completed_at_ms = ?, "
            "record = ? WHERE decision_id = ?",
            (1_800_000_000_000, completed, decision_id),
        )
        conn.execute("COMMIT")
        cycles += 1
    conn.close()
    return cycles


async def _raw_postgres_loop(target: str, worker: int, seconds: float, tag: str = "") -> int:
    import asyncpg

    conn = await asyncpg.connect(target)
    pending, _ = _template()
    cycles = 0
    deadline = time.perf_counter() + seconds
    insert = await conn.prepare(
        "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record) "
        "VALUES ($1, 'pending', NULL, $2)"
    )
    update = await conn.prepare(
        "UPDATE flowdecision_claims SET status = 'completed', completed_at_ms = $2, record = $3 "
        "WHERE decision_id = $1"
    )
    try:
        while time.perf_counter() < deadline:
            decision_id = f"raw{tag}{worker}-{os.getpid()}-{cycles}"
            await insert.fetch(decision_id, pending)
            await update.fetch(decision_id, 1_800_000_000_000, pending)
            cycles += 1
    finally:
        await conn.close()
    return cycles


def _worker(
    kind: str,
    target: str,
    worker: int,
    seconds: float,
    sync: str,
    barrier: Any,
    queue: Any,
    runs: bool = False,
) -> None:
    try:
        barrier.wait(120)
        if kind == "raw-sqlite":
            cycles = _raw_sqlite_loop(target, worker, seconds, sync)
        elif kind == "raw-postgres":
            cycles = asyncio.run(_raw_postgres_loop(target, worker, seconds))
        else:
            cycles = asyncio.run(_ledger_loop(kind, target, worker, seconds, runs=runs))
        queue.put(cycles)
    except BaseException as error:
        queue.put(f"{type(error).__name__}: {error}")


def _rounds_worker(
    kinds: list[str],
    target: str,
    worker: int,
    seconds: float,
    rounds: int,
    barrier: Any,
    queue: Any,
) -> None:
    """Run ``rounds`` rounds of one slice per kind, the order alternating each round."""
    try:
        counts: dict[str, list[int]] = {kind: [] for kind in kinds}
        for round_ in range(rounds):
            order = kinds if round_ % 2 == 0 else list(reversed(kinds))
            for kind in order:
                barrier.wait(300)
                tag = f"r{round_}"
                if kind == "raw-sqlite":
                    n = _raw_sqlite_loop(target, worker, seconds, "FULL", tag)
                elif kind == "raw-postgres":
                    n = asyncio.run(_raw_postgres_loop(target, worker, seconds, tag))
                else:
                    n = asyncio.run(_ledger_loop(kind, target, worker, seconds, tag))
                counts[kind].append(n)
        queue.put(counts)
    except BaseException as error:
        queue.put(f"{type(error).__name__}: {error}")
        barrier.abort()


def run_rounds(
    kinds: list[str], target: str, processes: int, seconds: float, rounds: int
) -> dict[str, list[float]]:
    """Cycles/s per kind per round, all kinds interleaved in the same processes."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rounds_worker, args=(kinds, target, i, seconds, rounds, barrier, queue))
        for i in range(processes)
    ]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=rounds * len(kinds) * (seconds + 120)) for _ in procs]
    for proc in procs:
        proc.join()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"{kinds}: {errors}")
    return {
        kind: [sum(r[kind][i] for r in results) / seconds for i in range(rounds)]  # type: ignore[index]
        for kind in kinds
    }


def run_cell(
    kind: str,
    target: str,
    processes: int,
    seconds: float,
    sync: str = "FULL",
    *,
    runs: bool = False,
) -> float:
    """Cycles/s of ``processes`` processes (``runs``: claims name a run, see _ledger_loop)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(kind, target, i, seconds, sync, barrier, queue, runs))
        for i in range(processes)
    ]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=seconds + 300) for _ in procs]
    for proc in procs:
        proc.join()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"{kind}: {errors}")
    return sum(results) / seconds


# -- driver --------------------------------------------------------------------------------


def single_caller(path: Path, pairs: int, seconds: float) -> float:
    """The single-caller row: ``pairs`` interleaved pairs; prints them, returns the median."""
    import statistics

    rounds = run_rounds(["raw-sqlite", "sqlite"], str(path), 1, seconds, pairs)
    ratios = [led / raw for led, raw in zip(rounds["sqlite"], rounds["raw-sqlite"], strict=True)]
    print(f"# single caller: claim -> complete, 1 process, FULL, {pairs} interleaved pairs")
    print("| pair | ledger cycles/s | raw cycles/s | ledger/raw |")
    print("|---:|---:|---:|---:|")
    for index, (led, raw) in enumerate(zip(rounds["sqlite"], rounds["raw-sqlite"], strict=True)):
        print(f"| {index + 1} | {led:,.0f} | {raw:,.0f} | {led / raw:.2f}× |")
    median = statistics.median(ratios)
    print(
        f"| **median** | {statistics.median(rounds['sqlite']):,.0f} "
        f"| {statistics.median(rounds['raw-sqlite']):,.0f} | **{median:.2f}×** |",
        flush=True,
    )
    return median


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 1024 / 1024:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs{mem}, "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement time per cell")
    parser.add_argument("--quick", action="store_true", help="1k/10k/100k only, 2 s cells")
    parser.add_argument("--backends", default="sqlite,postgres,file")
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--processes", default="1,8")
    parser.add_argument("--postgres-url", default=os.environ.get("FLOWDECISION_BENCH_POSTGRES_URL"))
    parser.add_argument("--workdir", default=None, help="where SQLite/JSON stores live (disk!)")
    parser.add_argument("--single-pairs", type=int, default=7, help="single-caller pairs (0: skip)")
    parser.add_argument("--single-only", action="store_true", help="the single-caller row alone")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        sizes = [s for s in sizes if s <= 100_000]
        args.seconds = min(args.seconds, 2.0)
    procs_list = [int(p) for p in args.processes.split(",")]
    backends = args.backends.split(",")
    work = Path(tempfile.mkdtemp(prefix="flowdecision-bench-", dir=args.workdir))
    print(f"# machine: {machine_description()}")
    print(f"# workdir: {work}; {args.seconds:g} s per cell")
    if args.single_pairs > 0 and "sqlite" in backends:
        path = work / "sqlite-single.db"
        preload_sqlite(path, 10_000)
        single_caller(path, args.single_pairs, args.seconds)
        print()
    if args.single_only:
        shutil.rmtree(work, ignore_errors=True)
        return
    print("| backend | retained | procs | ledger cycles/s | raw cycles/s | ledger/raw |")
    print("|---|---:|---:|---:|---:|---:|")
    server = None
    try:
        if "sqlite" in backends:
            for size in sizes:
                path = work / f"sqlite-{size}.db"
                preload_sqlite(path, size)
                for procs in procs_list:
                    raw = run_cell("raw-sqlite", str(path), procs, args.seconds)
                    led = run_cell("sqlite", str(path), procs, args.seconds)
                    print(
                        f"| sqlite (FULL) | {size:,} | {procs} | {led:,.0f} | {raw:,.0f} "
                        f"| {led / raw:.0%} |",
                        flush=True,
                    )
                path.unlink()
                for suffix in ("-wal", "-shm"):
                    Path(str(path) + suffix).unlink(missing_ok=True)
        if "postgres" in backends:
            url = args.postgres_url
            if not url:
                from tests.postgres_server import PostgresServer

                server = PostgresServer(fast=False).start()
                url = server.url("postgres")
            for size in sizes:
                asyncio.run(preload_postgres(url, size))
                for procs in procs_list:
                    raw = run_cell("raw-postgres", url, procs, args.seconds)
                    led = run_cell("postgres", url, procs, args.seconds)
                    print(
                        f"| postgres | {size:,} | {procs} | {led:,.0f} | {raw:,.0f} "
                        f"| {led / raw:.0%} |",
                        flush=True,
                    )
        if "file" in backends:
            for size in (s for s in (1000, 10000) if s <= max(sizes)):
                root = work / f"file-{size}"
                preload_file(root, size)
                for procs in procs_list:
                    led = run_cell("file", str(root), procs, args.seconds)
                    print(f"| json file | {size:,} | {procs} | {led:,.1f} | - | - |", flush=True)
                shutil.rmtree(root)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
