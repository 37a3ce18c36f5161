"""Operator queries on a 1,000,000-decision ledger, and the write cost of their indexes.

Not a timed test (issue 16; results in docs/BENCHMARKS.md, "Operations queries").
Three phases, so that building the stores stays outside the quiet window and only
the timed parts need an otherwise idle machine::

    .venv/bin/python bench/ops_query_bench.py build   --dir /var/tmp/opsbench   # ~5 min
    /work/bin/quiet .venv/bin/python bench/ops_query_bench.py queries --dir /var/tmp/opsbench
    /work/bin/quiet .venv/bin/python bench/ops_query_bench.py writes  --dir /var/tmp/opsbench
    .venv/bin/python bench/ops_query_bench.py clean   --dir /var/tmp/opsbench

**build** makes a SQLite ledger and a PostgreSQL ledger (a throwaway PostgreSQL
server in ``DIR/pg``, durable settings, as ``tests/postgres_server.py`` runs it)
holding the same decisions, each in the ledger's own schema (opened or migrated
by the ledger itself, so every index of the newest migration exists), loaded
with bulk SQL: the secondary indexes are dropped (their definitions read back
from ``sqlite_master`` / ``pg_indexes``), the rows inserted with one
``executemany`` (SQLite) or ``COPY`` (PostgreSQL), and the indexes re-created
from those definitions; PostgreSQL then runs ``VACUUM ANALYZE`` (as autovacuum
would), SQLite runs nothing (the ledger never runs ``ANALYZE``, so its planner
sees what production sees). Rows are the ledgers' exact format: the record
JSON of a real :class:`ClaimRecord` (identity and receipt on every completed
record, :func:`tombstone_of` for tombstones) with its times patched in.

The mix, over 30 days of first claims ending at ``NOW``: runs of 1..19
decisions (about 100,000 runs); the oldest 40% pruned to tombstones; 3% of
claims left pending with their lease long expired (owners that died),
anywhere in time; the newest 1,000 decisions half pending with a live lease;
the rest completed 50 ms..30 s after their claim.

**queries** times one page of each query shape through the ledger API
(``list_decisions`` / ``count_decisions``, what the service and the CLI call,
rows decoded), at the default page (100) and the hard limit (1,000): by run,
by each state, by claimed age, by completed age, with a cursor deep into the
result, and the counts. Each shape runs ``--samples`` times with fresh
random parameters after a warm-up (and after the store's files were read once,
so the OS cache is warm, as it is for a ledger in use); it prints p50/p99/max
in ms.

**writes** measures the claim -> complete rate (the ledger work of a POST: a
claim with run and causing event, then a completion with identity and receipt;
bench/ledger_bench.py's cycle, ``run_cell(..., runs=True)``, in separate processes)
on copies of the 1M stores with the operator indexes (schema 4) against the
same copies with those indexes dropped and the schema-2 prune index put back
(what the ledger had before issue 16; same code, same columns), at 1 and 8
calling processes, the two variants interleaved round by round (order
alternating), and prints per-round rates, medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import sqlite3
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from flowdecision.core.jsonwire import encode_json_text  # noqa: E402
from flowdecision.ledger.machine import (  # noqa: E402
    ClaimRecord,
    ClaimStatus,
    tombstone_of,
)
from flowdecision.ledger.query import (  # noqa: E402
    DEFAULT_PAGE_LIMIT,
    MAX_PAGE_LIMIT,
    DecisionQuery,
    TimeField,
    encode_cursor,
)
from flowdecision.ledger.states import DecisionState  # noqa: E402
from ledger_bench import _identity, _receipt, machine_description, run_cell  # noqa: E402

NOW = 1_764_000_000_000  # the time every query judges leases at (2025-11-24)
SPAN_MS = 30 * 24 * 3600 * 1000
T0 = NOW - SPAN_MS
LEASE_MS = 60_000
DB = "ops"  # the PostgreSQL database the queries read
#: Placeholders patched into the record templates.
_DONE, _LEASE, _ATTEMPTS = 1_111_111_111_111, 2_222_222_222_222, '"attempts":1,'

S = DecisionState
T = TimeField


# -- the data ---------------------------------------------------------------------------


def _templates() -> dict[str, str]:
    ident = _identity("ops-bench")
    completed = ClaimRecord(
        request_hash="f" * 64,
        status=ClaimStatus.COMPLETED,
        owner_id="dispatcher-7f3a9c",
        lease_expires_at_ms=_LEASE,
        attempts=1,
        execution_identity=ident,
        completed_at_ms=_DONE,
        result_receipt=_receipt(ident),
    )
    pending = ClaimRecord("f" * 64, ClaimStatus.PENDING, "dispatcher-7f3a9c", _LEASE, 1, ident)
    return {
        "completed": encode_json_text(completed.to_dict()),
        "tombstone": encode_json_text(tombstone_of(completed).to_dict()),
        "pending": encode_json_text(pending.to_dict()),
    }


Row = tuple[str, str, int | None, str, int, str, str]


def rows(count: int, seed: int = 16) -> Iterator[Row]:
    """``(decision_id, status, completed_at_ms, record, created_at_ms, run_id, event)``."""
    rng = random.Random(seed)
    texts = _templates()
    run, left = 0, 0
    for i in range(count):
        if left == 0:
            run, left = run + 1, rng.randint(1, 19)
        left -= 1
        created = T0 + i * SPAN_MS // count + rng.randrange(SPAN_MS // count + 1)
        decision_id = hashlib.blake2b(i.to_bytes(8, "big"), digest_size=13).hexdigest()
        attempts = '"attempts":2,' if rng.random() < 0.05 else _ATTEMPTS
        newest = i >= count - 1_000
        if (newest and rng.random() < 0.5) or rng.random() < 0.03:
            lease = NOW + rng.randint(30_000, 3_600_000) if newest else created + LEASE_MS
            text = texts["pending"].replace(str(_LEASE), str(lease))
            status, done = "pending", None
        else:
            done = created + rng.randint(50, 30_000)
            kind = "tombstone" if i < count * 0.4 else "completed"
            text = texts[kind].replace(str(_DONE), str(done))
            text = text.replace(str(_LEASE), str(created + LEASE_MS))
            status = kind
        yield (
            decision_id,
            status,
            done,
            text.replace(_ATTEMPTS, attempts, 1),
            created,
            f"run-{run:07d}",
            f"evt-{i:08d}",
        )


_COLUMNS = ["decision_id", "status", "completed_at_ms", "record", "created_at_ms", "run_id",
            "causation_event_id"]  # fmt: skip


# -- building ---------------------------------------------------------------------------


def build_sqlite(path: Path, count: int) -> None:
    from flowdecision.ledger.sqlite import SqliteLedger

    async def create() -> None:
        await (await SqliteLedger.open(path)).close()

    asyncio.run(create())
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA cache_size = -2000000")
    indexes = conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' "
        "AND tbl_name = 'flowdecision_claims' AND sql IS NOT NULL"
    ).fetchall()
    conn.execute("BEGIN")
    for name, _ in indexes:
        conn.execute(f"DROP INDEX {name}")
    conn.executemany(
        f"INSERT INTO flowdecision_claims ({', '.join(_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?, ?)",
        rows(count),
    )
    for _, sql in indexes:
        conn.execute(sql)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    with open(path, "rb+") as handle:  # loaded with synchronous=OFF: flush it now
        os.fsync(handle.fileno())


def pg_server(base: Path) -> Any:
    """The benchmark's PostgreSQL server in ``base`` (durable settings), not started."""
    from tests.postgres_server import PostgresServer

    server = PostgresServer(fast=False)
    shutil.rmtree(server.base, ignore_errors=True)
    server.base, server.datadir, server.socket_dir = base, base / "data", base
    server.log = base / "server.log"
    return server


async def build_postgres(server: Any, count: int) -> None:
    import asyncpg

    from flowdecision.ledger.postgres import PostgresLedger

    admin = await asyncpg.connect(server.url("postgres"))
    await admin.execute(f"CREATE DATABASE {DB}")
    await admin.close()
    url = server.url(DB)
    ledger = PostgresLedger(url)
    await ledger.migrate()
    await ledger.close()
    conn = await asyncpg.connect(url)
    try:
        indexes = await conn.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'flowdecision_claims' "
            "AND indexname NOT LIKE '%pkey'"
        )
        for index in indexes:
            await conn.execute(f"DROP INDEX {index['indexname']}")
        await conn.copy_records_to_table(
            "flowdecision_claims", columns=_COLUMNS, records=rows(count)
        )
        for index in indexes:
            await conn.execute(index["indexdef"])
        await conn.execute("VACUUM ANALYZE flowdecision_claims")
    finally:
        await conn.close()


def build(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"decisions": args.decisions, "now_ms": NOW}
    if "sqlite" in args.backends:
        path = root / "ledger.db"
        path.unlink(missing_ok=True)
        started = time.perf_counter()
        build_sqlite(path, args.decisions)
        state["sqlite"] = str(path)
        print(f"sqlite: {args.decisions:,} decisions in {time.perf_counter() - started:.0f} s, "
              f"{path.stat().st_size / 2**20:,.0f} MiB", flush=True)  # fmt: skip
    if "postgres" in args.backends:
        base = root / "pg"
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir()
        server = pg_server(base)
        started = time.perf_counter()
        server.start()
        try:
            asyncio.run(build_postgres(server, args.decisions))
        finally:
            server.halt("fast")
        state["postgres"] = str(base)
        print(f"postgres: {args.decisions:,} decisions in {time.perf_counter() - started:.0f} s",
              flush=True)  # fmt: skip
    (root / "state.json").write_text(json.dumps(state))


# -- queries ----------------------------------------------------------------------------


def shapes(rng: random.Random, runs: int) -> dict[str, Callable[[int], DecisionQuery]]:
    """Each query shape: a fresh query of it per call (``limit`` given)."""

    def when(low: float = 0.0, high: float = 1.0) -> int:
        return T0 + int(SPAN_MS * rng.uniform(low, high))

    def day(by: TimeField) -> Callable[[int], DecisionQuery]:
        def make(limit: int) -> DecisionQuery:
            start = when(0, 0.95)
            return DecisionQuery(after_ms=start, before_ms=start + 86_400_000, by=by, limit=limit)

        return make

    return {
        "run_id": lambda n: DecisionQuery(run_id=f"run-{rng.randint(1, runs):07d}", limit=n),
        "state=pending_live": lambda n: DecisionQuery(state=S.PENDING_LIVE, limit=n),
        "state=pending_expired": lambda n: DecisionQuery(state=S.PENDING_EXPIRED, limit=n),
        "state=pending_expired, claimed before 1h ago": lambda n: DecisionQuery(
            state=S.PENDING_EXPIRED, before_ms=NOW - 3_600_000, limit=n
        ),
        "state=completed": lambda n: DecisionQuery(state=S.COMPLETED, limit=n),
        "state=tombstoned": lambda n: DecisionQuery(state=S.TOMBSTONED, limit=n),
        "claimed in a 1-day window": day(T.CLAIMED),
        "claimed after T": lambda n: DecisionQuery(after_ms=when(), limit=n),
        "completed in a 1-day window (by=completed)": day(T.COMPLETED),
        "completed after T (by=completed)": lambda n: DecisionQuery(
            after_ms=when(), by=T.COMPLETED, limit=n
        ),
        "completed, state=completed, after T": lambda n: DecisionQuery(
            state=S.COMPLETED, after_ms=when(0.4), by=T.COMPLETED, limit=n
        ),
        "deep cursor (all, claimed order)": lambda n: DecisionQuery(
            cursor=encode_cursor([when(0.5), ""]), limit=n
        ),
        "deep cursor (state=completed)": lambda n: DecisionQuery(
            state=S.COMPLETED, cursor=encode_cursor([when(0.5), ""]), limit=n
        ),
        "deep cursor (by=completed)": lambda n: DecisionQuery(
            by=T.COMPLETED, cursor=encode_cursor([when(0.5), "", "completed"]), limit=n
        ),
    }


def count_shapes(rng: random.Random, runs: int) -> dict[str, Callable[[], DecisionQuery]]:
    def when(low: float = 0.0, high: float = 0.95) -> int:
        return T0 + int(SPAN_MS * rng.uniform(low, high))

    def window(by: TimeField) -> DecisionQuery:
        start = when()
        return DecisionQuery(after_ms=start, before_ms=start + 86_400_000, by=by)

    return {
        "count run_id": lambda: DecisionQuery(run_id=f"run-{rng.randint(1, runs):07d}"),
        "count state=pending_live": lambda: DecisionQuery(state=S.PENDING_LIVE),
        "count state=pending_expired": lambda: DecisionQuery(state=S.PENDING_EXPIRED),
        "count claimed in a 1-day window": lambda: window(T.CLAIMED),
        "count completed in a 1-day window": lambda: window(T.COMPLETED),
        "count state=completed (~570k)": lambda: DecisionQuery(state=S.COMPLETED),
        "count state=tombstoned (~390k)": lambda: DecisionQuery(state=S.TOMBSTONED),
        "count all (1M)": lambda: DecisionQuery(),
    }


async def _time(call: Callable[[], Awaitable[Any]], samples: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await call()
    taken = []
    for _ in range(samples):
        started = time.perf_counter()
        await call()
        taken.append((time.perf_counter() - started) * 1000)
    return taken


def _summary(name: str, taken: list[float]) -> str:
    taken = sorted(taken)
    p99 = taken[min(len(taken) - 1, int(len(taken) * 0.99))]
    return f"| {name} | {statistics.median(taken):.1f} | {p99:.1f} | {taken[-1]:.1f} |"


async def time_queries(ledger: Any, label: str, samples: int, runs: int) -> None:
    rng = random.Random(7)
    print(f"\n### {label}: one page (ms; {samples} samples per row, after a warm-up)\n")
    print("| query | limit | p50 | p99 | max | rows |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, make in shapes(rng, runs).items():
        for limit in (DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT):
            got: list[int] = []

            async def page(make: Any = make, limit: int = limit, got: list[int] = got) -> None:
                result = await ledger.list_decisions(make(limit), now_ms=NOW)
                got.append(len(result.decisions))

            taken = await _time(page, samples if limit == DEFAULT_PAGE_LIMIT else samples // 2, 5)
            line = _summary(f"{name} | {limit}", taken)
            print(f"{line} {statistics.median(got):.0f} |", flush=True)
    print(f"\n### {label}: counts (ms; {samples // 4} samples per row)\n")
    print("| count | p50 | p99 | max |")
    print("|---|---:|---:|---:|")
    for name, make_count in count_shapes(rng, runs).items():

        async def count(make_count: Any = make_count) -> None:
            await ledger.count_decisions(make_count(), now_ms=NOW)

        print(_summary(name, await _time(count, max(samples // 4, 5), 2)), flush=True)


def _warm(root: Path) -> None:
    """Read a store's files once, so the timings are of a warm cache, not of the disk."""
    for path in [root] if root.is_file() else sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(1 << 20):
                    pass


def queries(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    state = json.loads((root / "state.json").read_text())
    runs = int(state["decisions"]) // 10 - 1  # runs average 10 decisions
    print(f"# operator queries on {state['decisions']:,} decisions")
    print(f"machine: {machine_description()}")

    async def go() -> None:
        if "sqlite" in state and "sqlite" in args.backends:
            from flowdecision.ledger.sqlite import SqliteLedger

            _warm(Path(state["sqlite"]))
            ledger = await SqliteLedger.open(state["sqlite"])
            try:
                await time_queries(ledger, "SQLite", args.samples, runs)
            finally:
                await ledger.close()
        if "postgres" in state and "postgres" in args.backends:
            from flowdecision.ledger.postgres import PostgresLedger

            server = pg_server(Path(state["postgres"]))
            server.resume()
            _warm(Path(state["postgres"]) / "data" / "base")
            try:
                pg = await PostgresLedger.connect(server.url(DB))
                try:
                    await time_queries(pg, "PostgreSQL 15", args.samples, runs)
                finally:
                    await pg.close()
            finally:
                server.halt("fast")

    asyncio.run(go())


# -- writes -----------------------------------------------------------------------------

#: The indexes issue 16 added (migrations 3, 4 and 5), and the prune index before them.
OPS_INDEXES = ["flowdecision_claims_created", "flowdecision_claims_state",
               "flowdecision_claims_run", "flowdecision_claims_completed",
               "flowdecision_claims_lease", "flowdecision_claims_prune"]  # fmt: skip
SCHEMA_2_PRUNE = (
    "CREATE INDEX flowdecision_claims_prune ON flowdecision_claims (completed_at_ms) "
    "WHERE completed_at_ms IS NOT NULL"
)


def _prepare_sqlite(source: Path, root: Path) -> dict[str, str]:
    targets = {}
    for variant in ("indexed", "bare"):
        path = root / f"writes-{variant}.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        src = sqlite3.connect(source)
        dst = sqlite3.connect(path)
        src.backup(dst)
        src.close()
        dst.close()
        if variant == "bare":
            _bare_sqlite(path)
        targets[variant] = str(path)
    return targets


async def _prepare_postgres(server: Any) -> dict[str, str]:
    import asyncpg

    admin = await asyncpg.connect(server.url("postgres"))
    try:
        for variant in ("indexed", "bare"):
            await admin.execute(f"DROP DATABASE IF EXISTS writes_{variant}")
            await admin.execute(f"CREATE DATABASE writes_{variant} TEMPLATE {DB}")
    finally:
        await admin.close()
    await _bare_postgres(server.url("writes_bare"))
    for variant in ("indexed", "bare"):
        conn = await asyncpg.connect(server.url(f"writes_{variant}"))
        await conn.execute("CHECKPOINT")
        await conn.close()
    return {variant: server.url(f"writes_{variant}") for variant in ("indexed", "bare")}


def _interleaved(kind: str, targets: dict[str, str], args: argparse.Namespace) -> None:
    for processes in [int(p) for p in args.processes.split(",")]:
        rates: dict[str, list[float]] = {"indexed": [], "bare": []}
        for round_ in range(args.rounds):
            order = ["indexed", "bare"] if round_ % 2 == 0 else ["bare", "indexed"]
            for variant in order:
                rates[variant].append(
                    run_cell(kind, targets[variant], processes, args.seconds, runs=True)
                )
        ratios = [i / b for i, b in zip(rates["indexed"], rates["bare"], strict=True)]
        print(f"\n#### {kind}, {processes} process(es), {args.rounds} interleaved rounds "
              f"of {args.seconds:g} s\n")  # fmt: skip
        print("| round | with operator indexes (cycles/s) | without (cycles/s) | ratio |")
        print("|---:|---:|---:|---:|")
        for index, (i, b) in enumerate(zip(rates["indexed"], rates["bare"], strict=True)):
            print(f"| {index + 1} | {i:,.0f} | {b:,.0f} | {i / b:.3f} |")
        print(f"| **median** | {statistics.median(rates['indexed']):,.0f} | "
              f"{statistics.median(rates['bare']):,.0f} | **{statistics.median(ratios):.3f}** |",
              flush=True)  # fmt: skip


def writes(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    state = json.loads((root / "state.json").read_text())
    print(f"# claim -> complete with and without the operator indexes, {state['decisions']:,} "
          f"decisions retained\nmachine: {machine_description()}")  # fmt: skip
    if "sqlite" in state and "sqlite" in args.backends:
        if not args.reuse:
            _prepare_sqlite(Path(state["sqlite"]), root)
        targets = {v: str(root / f"writes-{v}.db") for v in ("indexed", "bare")}
        _interleaved("sqlite", targets, args)
    if "postgres" in state and "postgres" in args.backends:
        server = pg_server(Path(state["postgres"]))
        server.resume()
        try:
            if not args.reuse:
                asyncio.run(_prepare_postgres(server))
            targets = {v: server.url(f"writes_{v}") for v in ("indexed", "bare")}
            _interleaved("postgres", targets, args)
        finally:
            server.halt("fast")


def clean(args: argparse.Namespace) -> None:
    shutil.rmtree(args.dir, ignore_errors=True)


# -- posts: the same comparison through `flowdecision serve` ------------------------------


def _bare_sqlite(db: Path) -> None:
    """Drop issue 16's indexes from a fresh default-layout store, put the prune index back."""
    conn = sqlite3.connect(db)
    try:
        for name in OPS_INDEXES:
            conn.execute(f"DROP INDEX IF EXISTS {name}")
        conn.execute(SCHEMA_2_PRUNE)
        conn.commit()
    finally:
        conn.close()


async def _bare_postgres(url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for name in OPS_INDEXES:
            await conn.execute(f"DROP INDEX IF EXISTS {name}")
        await conn.execute(SCHEMA_2_PRUNE)
    finally:
        await conn.close()


def posts(args: argparse.Namespace) -> None:
    """``POST /v1/decisions`` from wrk at ``--clients`` clients against ``flowdecision
    serve`` on its default layouts (SQLite: one file; PostgreSQL: ledger and outbox in
    one database of a throwaway durable server), with the operator indexes and without
    them (same code; each store made by the project itself, then, for "bare", issue
    16's indexes dropped), ``--rounds`` rounds, the order alternating: req/s, ratio."""
    import contextlib
    import tempfile

    from service_bench import Postgres, Server, body_template

    root = Path(tempfile.mkdtemp(prefix="ops-posts-", dir=args.dir))
    template = body_template()
    serve = [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0"]
    try:
        for backend in args.backends.split(","):
            with contextlib.ExitStack() as stack:
                argv: dict[str, list[str]] = {}
                dirs = {variant: root / f"{backend}-{variant}" for variant in ("indexed", "bare")}
                if backend == "postgres":
                    postgres = Postgres(None)
                    stack.callback(postgres.stop)
                for variant, cwd in dirs.items():
                    cwd.mkdir()
                    if backend == "sqlite":
                        argv[variant] = serve
                        Server(serve, cwd).stop()  # creates and migrates the default store
                        if variant == "bare":
                            _bare_sqlite(cwd / ".flowdecision" / "flowdecision.db")
                    else:
                        url = stack.enter_context(postgres.fresh_database())
                        argv[variant] = [*serve, "--ledger", url, "--sink", url]
                        if variant == "bare":
                            asyncio.run(_bare_postgres(url))
                _posts_rounds(backend, argv, dirs, template, args)
    finally:
        template.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


def _posts_rounds(
    backend: str,
    argv: dict[str, list[str]],
    dirs: dict[str, Path],
    template: Path,
    args: argparse.Namespace,
) -> None:
    from service_bench import Server, Target, wrk

    target = Target(f"post {backend}", "flowdecision", "post", "/v1/decisions", 201, backend)
    rates: dict[str, list[float]] = {"indexed": [], "bare": []}
    print(f"\n#### {backend}: POST /v1/decisions, {args.clients} clients, with / without")
    print(f"machine: {machine_description()}")
    print("\n| round | with (req/s) | without (req/s) | ratio | load |\n|---:|---:|---:|---:|---:|")
    for round_ in range(args.rounds):
        order = ["indexed", "bare"] if round_ % 2 == 0 else ["bare", "indexed"]
        for variant in order:
            server = Server(argv[variant], dirs[variant])
            try:
                wrk(target, server.url, args.clients, 1, template)  # warm-up
                data, _ = wrk(target, server.url, args.clients, int(args.seconds), template)
            finally:
                server.stop()
            if data["bad"] or data["requests"] != data["ok"]:
                raise SystemExit(f"{backend} {variant}: {data['bad']} answers other than 201")
            rates[variant].append(data["requests"] / (data["duration_us"] / 1e6))
        ratio = rates["indexed"][-1] / rates["bare"][-1]
        print(
            f"| {round_ + 1} | {rates['indexed'][-1]:,.0f} | {rates['bare'][-1]:,.0f} "
            f"| {ratio:.3f} | {os.getloadavg()[0]:.2f} |",
            flush=True,
        )
    ratios = [a / b for a, b in zip(rates["indexed"], rates["bare"], strict=True)]
    print(
        f"| **median** | {statistics.median(rates['indexed']):,.0f} "
        f"| {statistics.median(rates['bare']):,.0f} | **{statistics.median(ratios):.3f}** | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "phase", choices=["build", "queries", "writes", "prepare-writes", "posts", "clean"]
    )
    parser.add_argument("--dir", required=True, help="where the stores live (disk, ~4 GB)")
    parser.add_argument("--decisions", type=int, default=1_000_000)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--samples", type=int, default=200, help="queries per shape (limit 100)")
    parser.add_argument("--processes", default="1,8", help="calling processes (writes)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (writes, posts)")
    parser.add_argument("--clients", type=int, default=50, help="wrk connections (posts)")
    parser.add_argument("--seconds", type=float, default=4.0, help="per round and variant")
    parser.add_argument(
        "--reuse", action="store_true", help="writes: use the copies prepare-writes made"
    )
    args = parser.parse_args()
    if args.phase == "prepare-writes":
        # Copy the stores for `writes --reuse` outside the quiet window.
        state = json.loads((Path(args.dir) / "state.json").read_text())
        if "sqlite" in state and "sqlite" in args.backends:
            _prepare_sqlite(Path(state["sqlite"]), Path(args.dir))
        if "postgres" in state and "postgres" in args.backends:
            server = pg_server(Path(state["postgres"]))
            server.resume()
            try:
                asyncio.run(_prepare_postgres(server))
            finally:
                server.halt("fast")
        return
    phases = {"build": build, "queries": queries, "writes": writes, "posts": posts, "clean": clean}
    phases[args.phase](args)


if __name__ == "__main__":
    main()
