"""Two replicas, one decision sent to both at once: what does each answer?

    .venv/bin/python bench/replica_race.py [--pairs 100] [--layout pg|sqlite|pg-split|all]

Starts two ``flowdecision serve`` processes on one store and, ``--pairs`` times,
sends one new decision to both at the same moment (two threads released by one
barrier, each with its own keep-alive connection), then counts the pairs of
answers. Layouts:

* ``pg``: the default PostgreSQL layout, ledger and outbox in one database
  (``--ledger postgresql://…``, no ``--sink``: one transaction per decision);
* ``sqlite``: the default SQLite layout, one file for both (``--ledger sqlite:///…``);
* ``pg-split``: a PostgreSQL ledger with the outbox in another database, so the
  claim, the sink's write and the completion are three steps.

PostgreSQL is a throwaway server (tests/postgres_server.py, durable settings).
docs/SERVICE.md ("Deployment", step 4) quotes the result.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.ledger_fixtures import _create_database, _migrate  # noqa: E402
from tests.postgres_server import PostgresServer  # noqa: E402
from tests.service_process import ServiceProcess  # noqa: E402
from tests.test_replica_race import race  # noqa: E402


def run_layout(layout: str, pairs: int, pg: PostgresServer | None, work: Path) -> None:
    if layout == "sqlite":
        args = ["--ledger", f"sqlite:///{work / 'flowdecision.db'}"]
    else:
        assert pg is not None
        ledger = asyncio.run(
            _create_database(pg.url("postgres"), f"race_{layout.replace('-', '_')}")
        )
        asyncio.run(_migrate(ledger))
        args = ["--ledger", ledger]
        if layout == "pg-split":
            outbox = asyncio.run(_create_database(pg.url("postgres"), "race_outbox"))
            asyncio.run(_migrate(outbox))
            args += ["--sink", outbox]
    (work / "a").mkdir()
    (work / "b").mkdir()
    with ServiceProcess(work / "a", *args) as one, ServiceProcess(work / "b", *args) as two:
        counts = race([one.url, two.url], pairs)
    shown = ", ".join(f"{pair}: {n}" for pair, n in counts.most_common())
    print(f"{layout}: {pairs} pairs -> {shown}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--layout", choices=("pg", "sqlite", "pg-split", "all"), default="all")
    options = parser.parse_args()
    layouts = ["pg", "sqlite", "pg-split"] if options.layout == "all" else [options.layout]
    pg = PostgresServer(fast=False).start() if any(x != "sqlite" for x in layouts) else None
    try:
        for layout in layouts:
            with tempfile.TemporaryDirectory(prefix=f"race-{layout}-") as work:
                run_layout(layout, options.pairs, pg, Path(work))
    finally:
        if pg is not None:
            pg.stop()


if __name__ == "__main__":
    main()
