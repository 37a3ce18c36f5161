"""One process of the run-invariants race (tests/test_runs.py).

``python -m tests.run_race LEDGER_URL OUTBOX_URL RUNS NAME START_AT SEED``: for each
of ``RUNS`` runs it dispatches, at once, three ``schedule_step`` decisions shared by
every process and one ``complete`` of its own (``r{i}-done-{NAME}``), in an order
of its own, into the outbox at ``OUTBOX_URL`` (joint with the ledger when both
name the same store). Both processes go through the runs in the same order, from
``START_AT`` (Unix seconds), so their decisions race. Prints one JSON line: how
many dispatches were submitted, duplicates, and refused with ``run_closed``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from flowdecision import Dispatcher, RunClosedError, open_ledger
from flowdecision.model import Complete, DecisionRequest, DecisionStep, ScheduleStep
from flowdecision.sinks.outbox import OutboxSink

STEPS = 3
#: Runs in flight at once in one process.
LANES = 16


def step(run: int, k: int) -> DecisionRequest:
    """Step ``k`` of run ``run``: the same request in every process."""
    decision = ScheduleStep(DecisionStep(f"r{run}-s{k}", "work", {"k": k}))
    return DecisionRequest(f"r{run}-s{k}", f"run-{run}", "production", f"r{run}-e{k}", decision)


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
        decisions = [step(run, k) for k in range(STEPS)] + [done(run, name)]
        rng.shuffle(decisions)
        orders.append(decisions)

    async def one(request: DecisionRequest) -> None:
        try:
            outcome = await dispatcher.dispatch_until_done(request, deadline_s=60)
        except RunClosedError:
            counts["run_closed"] += 1
        else:
            counts[outcome.outcome] += 1

    lanes = asyncio.Semaphore(LANES)

    async def run_one(decisions: list[DecisionRequest]) -> None:
        async with lanes:
            await asyncio.gather(*(one(request) for request in decisions))

    await asyncio.sleep(max(start_at - time.time(), 0))
    try:
        await asyncio.gather(*(run_one(decisions) for decisions in orders))
    finally:
        await outbox.close()
        await ledger.close()
    return counts


if __name__ == "__main__":
    ledger_url, outbox_url, runs, name, start_at, seed = sys.argv[1:7]
    result = asyncio.run(race(ledger_url, outbox_url, int(runs), name, float(start_at), int(seed)))
    print(json.dumps(result))
