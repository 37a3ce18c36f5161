"""Two hosts, one PostgreSQL ledger: every decision is submitted once, whichever host wins.

    python examples/04_postgres_two_hosts.py postgresql://user@host/db
    # or set FLOWDECISION_EXAMPLE_POSTGRES_URL

Migrates the ledger and the outbox (a new, empty database is enough), then
starts two dispatcher processes ("host-a", "host-b"; on real machines they
would be on different hosts) on the same
``PostgresLedger``. Both get the same 40 decisions of one run, in different
orders and 8 at a time, so they race for each one. The sink is the PostgreSQL
outbox on the same database, which a workflow engine would pull from.
Afterwards the outbox holds each decision once, delivered at attempt 1, and the
two hosts' ``submitted`` counts add up to 40: the losers got ``duplicate``
(or ``busy`` first, and retried).
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import uuid

from flowdecision import DecisionBusyError, DecisionRequest, Dispatcher, PostgresLedger
from flowdecision.sinks import OutboxSink

COUNT = 40
CONCURRENCY = 8


def decision_ids(run: str) -> list[str]:
    return [f"{run}-dec-{n:02d}" for n in range(COUNT)]


def request_for(run: str, decision_id: str) -> DecisionRequest:
    return DecisionRequest.parse(
        {
            "decision_id": decision_id,
            "run_id": run,
            "authority_branch_id": "production",
            "causation_event_id": f"evt-{decision_id}",
            "decision": {
                "type": "schedule_step",
                "step": {"step_id": f"{decision_id}-step", "step_name": "charge", "input": {}},
            },
        }
    )


async def host(name: str, url: str, run: str) -> None:
    """One host: its own ledger pool, outbox connection and dispatcher (its own owner id)."""
    ledger = PostgresLedger(url)
    outbox = OutboxSink(url)
    dispatcher = Dispatcher("production", outbox, ledger, lease_ms=5000)
    ids = decision_ids(run)
    random.Random(name).shuffle(ids)  # each host walks the run in its own order
    counts = {"submitted": 0, "duplicate": 0, "busy": 0}
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(decision_id: str) -> None:
        async with slots:
            while True:
                try:
                    submitted = await dispatcher.dispatch(request_for(run, decision_id))
                except DecisionBusyError:
                    counts["busy"] += 1  # the other host is submitting it right now
                    await asyncio.sleep(0.02)
                    continue
                counts["submitted" if submitted else "duplicate"] += 1
                return

    try:
        await asyncio.gather(*(one(decision_id) for decision_id in ids))
    finally:
        await outbox.close()
        await ledger.close()
    submitted, duplicate, busy = counts["submitted"], counts["duplicate"], counts["busy"]
    print(f"{name}: submitted {submitted}, duplicate {duplicate}, busy retries {busy}", flush=True)


async def prepare(url: str) -> None:
    """Create both schemas (what ``flowdecision migrate --ledger URL --outbox URL`` does).

    PostgreSQL stores migrate only when asked; once per database, safe to run concurrently.
    """
    ledger = PostgresLedger(url)
    try:
        await ledger.migrate()
    finally:
        await ledger.close()
    outbox = OutboxSink(url)  # not `async with`: opening checks the schema we create here
    try:
        await outbox.migrate()
    finally:
        await outbox.close()


async def check(url: str, run: str) -> bool:
    async with OutboxSink(url) as outbox:
        rows = [await outbox.get(decision_id) for decision_id in decision_ids(run)]
    present = [row for row in rows if row is not None]
    once = all(row.first_attempt == row.highest_attempt == 1 for row in present)
    print(f"outbox: {len(present)} of {COUNT} decisions, each delivered once: {once}")
    return len(present) == COUNT and once


def main(url: str) -> int:
    asyncio.run(prepare(url))
    run = f"run-{uuid.uuid4().hex[:8]}"
    hosts = [
        subprocess.Popen(
            [sys.executable, __file__, "host", name, url, run], stdout=subprocess.PIPE, text=True
        )
        for name in ("host-a", "host-b")
    ]
    reports = [process.communicate(timeout=300)[0] for process in hosts]
    if any(process.returncode != 0 for process in hosts):
        return 1
    print("".join(reports), end="")
    submitted = sum(int(report.split("submitted ")[1].split(",")[0]) for report in reports)
    print(f"submitted in all: {submitted} (one per decision)")
    return 0 if asyncio.run(check(url, run)) and submitted == COUNT else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["host"]:
        asyncio.run(host(sys.argv[2], sys.argv[3], sys.argv[4]))
    else:
        target = (
            sys.argv[1]
            if len(sys.argv) > 1
            else os.environ.get("FLOWDECISION_EXAMPLE_POSTGRES_URL")
        )
        if not target:
            sys.exit(
                "usage: 04_postgres_two_hosts.py URL, or set FLOWDECISION_EXAMPLE_POSTGRES_URL"
            )
        sys.exit(main(target))
