"""Library-level benchmark of the outbox layouts (issue 11): decisions/s with 64
concurrent submitters dispatching new decisions into an OutboxSink.

Layouts, interleaved over rounds (medians reported):

* ``sqlite shared``   ledger and outbox in one SQLite file: the transactional
  path, one group-committed transaction per batch of decisions;
* ``sqlite separate`` ledger.db + outbox.db: claim (group commit), outbox insert
  (its own commit), complete (group commit);
* ``postgres shared`` / ``postgres separate``: one database, the transactional
  path or the claim → submit → complete path (the outbox forced not to join),
  on a durable throwaway server (fsync on) unless ``--postgres-url`` names one.

    .venv/bin/python bench/outbox_bench.py            # 3 rounds x 2000 decisions
    .venv/bin/python bench/outbox_bench.py --backends sqlite --decisions 1000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flowdecision import Dispatcher  # noqa: E402
from flowdecision.core.model import Complete, DecisionRequest  # noqa: E402
from flowdecision.ledger.opening import open_ledger  # noqa: E402
from flowdecision.sinks.base import HasStoreKey  # noqa: E402
from flowdecision.sinks.outbox import OutboxSink  # noqa: E402


class _SeparateOutbox(OutboxSink):
    """An outbox that never joins the ledger's transaction (the old path)."""

    def joint_with(self, ledger: HasStoreKey) -> bool:
        return False


def _request(run: str, index: int) -> DecisionRequest:
    return DecisionRequest(
        decision_id=f"bench-{run}-{index}",
        run_id=f"run-{run}",
        authority_branch_id="production",
        causation_event_id=f"event-{index}",
        decision=Complete(output={"index": index}),
    )


async def _one(ledger_url: str, outbox_url: str, shared: bool, n: int, conc: int) -> float:
    ledger = await open_ledger(ledger_url)
    outbox = await (OutboxSink if shared else _SeparateOutbox)(outbox_url).open()
    try:
        dispatcher = Dispatcher("production", outbox, ledger)
        assert dispatcher.joint is shared
        run = uuid.uuid4().hex[:8]
        requests = [_request(run, i) for i in range(n)]
        queue = iter(requests)

        async def submitter() -> None:
            for item in queue:
                assert (await dispatcher.dispatch(item)).submitted

        started = time.perf_counter()
        await asyncio.gather(*(submitter() for _ in range(conc)))
        elapsed = time.perf_counter() - started
        assert await outbox.count() >= n
        return n / elapsed
    finally:
        await outbox.close()
        await ledger.close()


async def _pg_database(server_url: str) -> str:
    import asyncpg

    from flowdecision.ledger.postgres import PostgresLedger

    name = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    from urllib.parse import urlsplit, urlunsplit

    url = urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
    ledger = PostgresLedger(url)
    try:
        await ledger.migrate()
    finally:
        await ledger.close()
    await OutboxSink(url).migrate()
    return url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--postgres-url", default=os.environ.get("FLOWDECISION_BENCH_POSTGRES_URL"))
    parser.add_argument("--workdir", default=None, help="where SQLite files go (a real disk)")
    args = parser.parse_args()
    backends = args.backends.split(",")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="outbox-bench-"))
    server: Any = None
    pg_url = args.postgres_url
    if "postgres" in backends and not pg_url:
        from tests.postgres_server import PostgresServer

        server = PostgresServer(fast=False).start()  # durable: fsync on
        pg_url = server.url("postgres")
    results: dict[str, list[float]] = {}
    try:
        for round_ in range(args.rounds):
            cells: list[tuple[str, str, str, bool]] = []
            if "sqlite" in backends:
                shared = f"sqlite:///{workdir / f'r{round_}-shared.db'}"
                cells.append(("sqlite shared", shared, shared, True))
                cells.append(
                    (
                        "sqlite separate",
                        f"sqlite:///{workdir / f'r{round_}-ledger.db'}",
                        f"sqlite:///{workdir / f'r{round_}-outbox.db'}",
                        False,
                    )
                )
            if "postgres" in backends:
                assert pg_url is not None
                for name, shared_ in (("postgres shared", True), ("postgres separate", False)):
                    url = asyncio.run(_pg_database(pg_url))
                    cells.append((name, url, url, shared_))
            if round_ % 2:
                cells.reverse()  # interleave: alternate which layout goes first
            for name, ledger_url, outbox_url, shared_ in cells:
                rate = asyncio.run(
                    _one(ledger_url, outbox_url, shared_, args.decisions, args.concurrency)
                )
                results.setdefault(name, []).append(rate)
                load = os.getloadavg()[0]
                print(f"round {round_ + 1} {name:18} {rate:8.0f} decisions/s  (load {load:.1f})")
    finally:
        if server is not None:
            server.stop()
    print(f"\n{args.concurrency} submitters, {args.decisions} new decisions per cell, medians:")
    print("| layout | decisions/s (median) | min–max |")
    print("|---|---:|---:|")
    for name, rates in results.items():
        print(f"| {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f}–{max(rates):,.0f} |")


if __name__ == "__main__":
    main()
