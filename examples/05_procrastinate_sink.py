"""A sink into procrastinate: each decision becomes one job, run exactly once.

    pip install 'flowdecision[procrastinate]'
    python examples/05_procrastinate_sink.py postgresql://user@host/db
    # or: FLOWDECISION_EXAMPLE_POSTGRES_URL=postgresql://… python examples/05_procrastinate_sink.py

It applies procrastinate's schema if the database has none, then:

1. dispatches a decision through a Dispatcher with a SQLite ledger (a job is deferred);
2. dispatches it again (a duplicate: the ledger answers, the sink is not called);
3. re-submits it straight to the sink with attempt 2, as the next owner would
   after a crash between the sink and the ledger's completion (absorbed);
4. runs a procrastinate worker until the queue is empty: the job runs once;
5. re-submits it once more after the job ran (plain ``queueing_lock`` would
   run it again here) and runs the worker again: still once.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

import procrastinate

from flowdecision import DecisionRequest, Dispatcher, SqliteLedger
from flowdecision.sinks.procrastinate import ProcrastinateSink

TASK = "examples.handle_decision"
RAN: list[str] = []


def make_app(url: str) -> procrastinate.App:
    """The procrastinate app. In real life it lives in an importable module of your
    worker service (procrastinate warns about an app built in ``__main__``)."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name=TASK)
    async def handle_decision(request_json: str, attempt: int) -> None:
        # The exact wire JSON: parsing it gives back the same request (same hashes).
        request = DecisionRequest.parse(request_json)
        RAN.append(request.decision_id)
        print(f"job ran: {request.decision_id} ({request.decision.to_dict()['type']})")

    return app


async def ensure_schema(app: procrastinate.App) -> None:
    """Apply procrastinate's schema unless the database already has it."""
    connector = app.connector
    assert isinstance(connector, procrastinate.PsycopgConnector)
    async with connector.pool.connection() as conn:
        cursor = await conn.execute("SELECT to_regclass('procrastinate_jobs') IS NULL")
        row = await cursor.fetchone()
    if row is not None and row[0]:
        await app.schema_manager.apply_schema_async()
        print("applied procrastinate's schema")


async def run_worker(app: procrastinate.App) -> None:
    await app.run_worker_async(wait=False, install_signal_handlers=False, listen_notify=False)


async def main(url: str) -> None:
    request = DecisionRequest.parse(
        b'{"decision_id":"example-procrastinate-1","run_id":"run-1",'
        b'"authority_branch_id":"production","causation_event_id":"evt-1",'
        b'"decision":{"type":"complete","output":{"ok":true}}}'
    )
    async with make_app(url).open_async() as app:
        await ensure_schema(app)
        with tempfile.TemporaryDirectory() as folder:
            ledger = SqliteLedger(Path(folder) / "ledger.db")
            try:
                async with ProcrastinateSink(app, TASK) as sink:
                    dispatcher = Dispatcher("production", sink, ledger)
                    print("first dispatch submitted:", bool(await dispatcher.dispatch(request)))
                    print("second dispatch submitted:", bool(await dispatcher.dispatch(request)))
                    print("crash-window re-submission deferred:", await sink.defer(request, 2))
                    await run_worker(app)
                    print("re-submission after the job ran deferred:", await sink.defer(request, 3))
                    await run_worker(app)
            finally:
                await ledger.close()
    print(f"the job ran {RAN.count(request.decision_id)} time(s)")


if __name__ == "__main__":
    target = (
        sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FLOWDECISION_EXAMPLE_POSTGRES_URL")
    )
    if not target:
        sys.exit(
            "usage: 05_procrastinate_sink.py POSTGRESQL_URL (or FLOWDECISION_EXAMPLE_POSTGRES_URL)"
        )
    asyncio.run(main(target))
