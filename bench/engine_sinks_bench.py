"""Engine sinks benchmark: late duplicates and throughput of procrastinate and DBOS.

Not a timed test. Against a throwaway PostgreSQL server with durable settings
(or ``--postgres-url``), for N decisions:

* **plain procrastinate**: defer each with ``queueing_lock=decision_id``, run a
  worker until the queue is empty, defer every one again (a late duplicate, as
  after a crash between the engine accepting and the ledger completing), run
  the worker again, and count how many jobs ran twice;
* **ProcrastinateSink**: the same through the sink (attempt 1, then attempt 2),
  timing the first deferrals and the re-submissions;
* **Dispatcher + SqliteLedger + ProcrastinateSink**: N dispatches, 16 at a time;
* **DBOSSink** on a SQLite and on a PostgreSQL system database: N starts, then
  N re-starts, and how many workflows ran twice.

    .venv/bin/python bench/engine_sinks_bench.py [--decisions 300] [--postgres-url URL]

Prints a Markdown table and writes it to ``bench/results/engine-sinks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import procrastinate  # noqa: E402
from dbos import DBOS  # noqa: E402

from flowdecision import DecisionRequest, Dispatcher, SqliteLedger  # noqa: E402
from flowdecision.core.model import Complete  # noqa: E402
from flowdecision.sinks.procrastinate import ProcrastinateSink  # noqa: E402

TASK = "bench.record_decision"
PROCRASTINATE_RUNS: Counter[str] = Counter()
DBOS_RUNS: Counter[str] = Counter()
#: row -> metric -> one value per round (rates), and row -> [ran twice, total] over rounds.
RATES: dict[str, dict[str, list[float]]] = {}
TWICE: dict[str, list[int]] = {}


def record(row: str, counter: Counter[str], batch: list[DecisionRequest], **rates: float) -> None:
    for metric, value in rates.items():
        RATES.setdefault(row, {}).setdefault(metric, []).append(value)
    seen = TWICE.setdefault(row, [0, 0])
    seen[0] += sum(1 for r in batch if counter[r.decision_id] > 1)
    seen[1] += len(batch)


@DBOS.workflow(name="bench_record_decision")
async def dbos_record(request_json: str, attempt: int) -> None:
    DBOS_RUNS[DecisionRequest.parse(request_json).decision_id] += 1


def requests(tag: str, count: int) -> list[DecisionRequest]:
    return [
        DecisionRequest(
            decision_id=f"{tag}-{index}",
            run_id=f"run-{index % 10}",
            authority_branch_id="production",
            causation_event_id=f"event-{index}",
            decision=Complete(output={"index": index}),
        )
        for index in range(count)
    ]


def make_app(url: str) -> procrastinate.App:
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=16)
    )

    @app.task(name=TASK)
    async def record_decision(request_json: str, attempt: int) -> None:
        PROCRASTINATE_RUNS[DecisionRequest.parse(request_json).decision_id] += 1

    return app


async def drain(app: procrastinate.App) -> None:
    await app.run_worker_async(
        wait=False, install_signal_handlers=False, listen_notify=False, concurrency=4
    )


async def timed(calls: list[Callable[[], Awaitable[Any]]], parallel: int = 16) -> float:
    """Run the calls ``parallel`` at a time; calls per second."""
    gate = asyncio.Semaphore(parallel)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await call()

    started = time.perf_counter()
    await asyncio.gather(*(one(call) for call in calls))
    return len(calls) / (time.perf_counter() - started)


async def bench_procrastinate(url: str, tag: str, count: int) -> None:
    async with make_app(url).open_async() as app:
        await app.schema_manager.apply_schema_async()

        def plain_defer(r: DecisionRequest, attempt: int) -> Awaitable[int]:
            return app.configure_task(TASK, queueing_lock=r.decision_id).defer_async(
                request_json=r.to_json().decode(), attempt=attempt
            )

        await drain(app)  # the worker's first start is not part of any figure
        plain = requests(f"plain-{tag}", count)
        first = await timed([lambda r=r: plain_defer(r, 1) for r in plain])
        await drain(app)
        again = await timed([lambda r=r: plain_defer(r, 2) for r in plain])
        await drain(app)
        record(
            "plain procrastinate, `queueing_lock` only",
            PROCRASTINATE_RUNS,
            plain,
            **{"deferrals/s": first, "late duplicates deferred/s": again},
        )

        sink_batch = requests(f"sink-{tag}", count)
        async with ProcrastinateSink(app, TASK) as sink:
            first = await timed([lambda r=r: sink.defer(r, 1) for r in sink_batch])
            await drain(app)
            again = await timed([lambda r=r: sink.defer(r, 2) for r in sink_batch])
            await drain(app)
            record(
                "ProcrastinateSink",
                PROCRASTINATE_RUNS,
                sink_batch,
                **{"deferrals/s": first, "re-submissions absorbed/s": again},
            )

            dispatched = requests(f"dispatch-{tag}", count)
            with tempfile.TemporaryDirectory() as folder:
                ledger = SqliteLedger(Path(folder) / "ledger.db")
                try:
                    dispatcher = Dispatcher("production", sink, ledger)
                    rate = await timed([lambda r=r: dispatcher.dispatch(r) for r in dispatched])
                    dup = await timed([lambda r=r: dispatcher.dispatch(r) for r in dispatched])
                finally:
                    await ledger.close()
            await drain(app)
            record(
                "Dispatcher + SqliteLedger + ProcrastinateSink",
                PROCRASTINATE_RUNS,
                dispatched,
                **{"decisions/s": rate, "duplicates answered by the ledger/s": dup},
            )


async def bench_dbos(system_db: str, label: str, tag: str, count: int) -> None:
    from flowdecision.sinks.dbos import DBOSSink

    DBOS(config={"name": "fd-bench", "system_database_url": system_db, "log_level": "WARNING"})
    DBOS.launch()
    try:
        sink = DBOSSink(dbos_record)
        batch = requests(f"dbos-{tag}", count)
        first = await timed([lambda r=r: sink.submit(r, 1) for r in batch])
        for request in batch:
            handle = await DBOS.retrieve_workflow_async(request.decision_id)
            await handle.get_result()
        again = await timed([lambda r=r: sink.submit(r, 2) for r in batch])
    finally:
        DBOS.destroy()
    record(
        f"DBOSSink, {label} system database",
        DBOS_RUNS,
        batch,
        **{"starts/s": first, "re-starts absorbed/s": again},
    )


async def create_database(server_url: str, name: str) -> str:
    import psycopg

    async with await psycopg.AsyncConnection.connect(server_url, autocommit=True) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await conn.execute(f'CREATE DATABASE "{name}"')
    base, _, query = server_url.partition("?")
    base = base.rsplit("/", 1)[0] + f"/{name}"
    return f"{base}?{query}" if query else base


def cell(values: list[float]) -> str:
    ordered = sorted(values)
    middle = statistics.median(ordered)
    if len(ordered) == 1:
        return f"{middle:,.0f}"
    return f"{middle:,.0f} ({ordered[0]:,.0f}–{ordered[-1]:,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres-url", help="a server's maintenance database URL")
    args = parser.parse_args()
    server = None
    if args.postgres_url:
        server_url = args.postgres_url
    else:
        from tests.postgres_server import PostgresServer

        server = PostgresServer(fast=False).start()
        server_url = server.url("postgres")
    try:
        for round_ in range(args.rounds):
            db = asyncio.run(create_database(server_url, f"fd_bench_procrastinate_{round_}"))
            asyncio.run(bench_procrastinate(db, f"r{round_}", args.decisions))
            with tempfile.TemporaryDirectory() as folder:
                sqlite_db = f"sqlite:///{Path(folder) / 'dbos.sqlite'}"
                asyncio.run(bench_dbos(sqlite_db, "SQLite", f"s{round_}", args.decisions))
            db = asyncio.run(create_database(server_url, f"fd_bench_dbos_{round_}"))
            asyncio.run(bench_dbos(db, "PostgreSQL", f"p{round_}", args.decisions))
            print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    rows = []
    for row, metrics in RATES.items():
        rates = "; ".join(f"{cell(values)} {metric}" for metric, values in metrics.items())
        twice, total = TWICE[row]
        shown = f"**{twice} of {total} ran twice**" if twice else f"{twice} of {total} ran twice"
        rows.append(f"| {row} | {rates} | {shown} |")
    table = "\n".join(
        [
            f"{args.decisions} decisions per round, 16 in flight, {args.rounds} rounds "
            f"(median, min–max); Python {platform.python_version()}",
            "",
            "| path | throughput | late duplicates (all rounds) |",
            "|---|---|---|",
            *rows,
        ]
    )
    print(table)
    out = ROOT / "bench" / "results" / "engine-sinks.md"
    out.write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
