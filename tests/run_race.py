"""One process of the run-invariants race (tests/test_runs.py).

``python -m tests.run_race LEDGER_URL OUTBOX_URL RUNS NAME START_AT SEED``: for each
of ``RUNS`` runs it dispatches three ``schedule_step`` decisions and one ``complete``
of its own (``r{i}-s{k}-{NAME}``, ``r{i}-done-{NAME}``) into the outbox at
``OUTBOX_URL`` (joint with the ledger when both name the same store), runs and
decisions in an order of its own. Every run is in flight at once in both
processes, from ``START_AT`` (Unix seconds), so each process's steps and complete
race the other's under the run invariants alone. (Ids shared by both processes
would race too, but on PostgreSQL a batch that loses an insert to the other
process is retried whole, which serializes the two processes and would hide a
missing run lock: with the lock removed, this race fails.) Prints one JSON line:
how many dispatches were submitted, duplicates, and refused with ``run_closed``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from flowdecision import Dispatcher, RunClosedError, open_ledger
from flowdecision.core.model import Complete, DecisionRequest, DecisionStep, ScheduleStep
from flowdecision.sinks.outbox import OutboxSink

STEPS = 3


def step(run: int, k: int, name: str) -> DecisionRequest:
    """This process's step ``k`` of run ``run``."""
    decision_id = f"r{run}-s{k}-{name}"
    decision = ScheduleStep(DecisionStep(decision_id, "work", {"k": k}))
    return DecisionRequest(decision_id, f"run-{run}", "production", f"{decision_id}-e", decision)


def done(run: int, name: str) -> DecisionRequest:
    """This process's ``complete`` of run ``run`` (its own id: one of them wins)."""
    decision = Complete(output={"by": name})
    return DecisionRequest(
        f"r{run}-done-{name}", f"run-{run}", "production", f"r{run}-end-{name}", decision
    )


async def race(
    ledger_url: str, outbox_url: str, runs: int, name: str, start_at: float, seed: int
) -> dict[str, int]:
    ledger = await open_ledger(ledger_url)
    outbox = await OutboxSink(outbox_url).open()
    dispatcher = Dispatcher("production", outbox, ledger, owner_id=f"racer-{name}")
    counts = {"submitted": 0, "duplicate": 0, "run_closed": 0}
    rng = random.Random(seed)
    orders = []
    for run in range(runs):
        decisions = [step(run, k, name) for k in range(STEPS)] + [done(run, name)]
        rng.shuffle(decisions)
        orders.append(decisions)
    # Runs in an order of this process's own too: however far one process runs ahead
    # of the other, some of their runs meet in transactions that overlap.
    rng.shuffle(orders)

    async def one(request: DecisionRequest) -> None:
        try:
            outcome = await dispatcher.dispatch_until_done(request, deadline_s=60)
        except RunClosedError:
            counts["run_closed"] += 1
        else:
            counts[outcome.outcome] += 1

    await asyncio.sleep(max(start_at - time.time(), 0))
    try:
        await asyncio.gather(*(one(request) for decisions in orders for request in decisions))
    finally:
        await outbox.close()
        await ledger.close()
    return counts


if __name__ == "__main__":
    ledger_url, outbox_url, runs, name, start_at, seed = sys.argv[1:7]
    result = asyncio.run(race(ledger_url, outbox_url, int(runs), name, float(start_at), int(seed)))
    print(json.dumps(result))
