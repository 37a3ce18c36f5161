"""The Python cost of the ledger template and of one dispatch, in process.

One claim -> complete on a ``MemoryLedger`` (the template and the rules, no
store), and one ``Dispatcher.dispatch`` with a no-op sink on a memory ledger;
each the best of ``--repeats`` runs of ``--cycles`` (timeit-style: the least
disturbed run). Prints ``cycle_us dispatch_us``.

To compare two trees, run it on each in turn, interleaved, the order
alternating (docs/BENCHMARKS.md, "The claim key through the rules"):

    for r in 1 2 3 4 5 6 7 8 9; do for tree in A B; do
      PYTHONPATH=$tree/src .venv/bin/python bench/ledger_call_cost.py; done; done
"""

from __future__ import annotations

import argparse
import asyncio
import time

from flowdecision import DecisionRequest, Dispatcher
from flowdecision.core.identity import ExecutionIdentity
from flowdecision.core.model import Complete
from flowdecision.ledger import MemoryLedger


class NoopSink:
    """Accepts every decision at once."""

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        return None


async def cycle_us(cycles: int) -> float:
    """Microseconds per claim -> complete (with an execution identity, as the dispatcher)."""
    ledger = MemoryLedger()
    identity = ExecutionIdentity.derive("a3s.bench.flow-decision", {"tag": "t"})
    start = time.perf_counter()
    for i in range(cycles):
        decision_id = f"d{i}"
        await ledger.claim(decision_id, "h", "o", lease_ms=60_000, identity=identity)
        await ledger.complete(decision_id, "h", "o", identity=identity)
    return (time.perf_counter() - start) / cycles * 1e6


async def dispatch_us(dispatches: int) -> float:
    """Microseconds per dispatch (claim, sink, complete) on a memory ledger."""
    dispatcher = Dispatcher("production", NoopSink(), MemoryLedger(), lease_ms=60_000)
    requests = [
        DecisionRequest(
            decision_id=f"d{i}",
            run_id="r",
            authority_branch_id="production",
            causation_event_id="c",
            decision=Complete(output=None),
        )
        for i in range(dispatches)
    ]
    start = time.perf_counter()
    for request in requests:
        await dispatcher.dispatch(request)
    return (time.perf_counter() - start) / dispatches * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    await cycle_us(500)  # warm up
    await dispatch_us(500)
    cycles = [await cycle_us(args.cycles) for _ in range(args.repeats)]
    dispatches = [await dispatch_us(args.cycles) for _ in range(args.repeats)]
    print(f"{min(cycles):.2f} {min(dispatches):.2f}")


if __name__ == "__main__":
    asyncio.run(main())
