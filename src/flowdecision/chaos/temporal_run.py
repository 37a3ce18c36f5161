"""The workflow that ``flowdecision chaos --sink temporal://…`` delivers to, and its worker.

:class:`ChaosRun` (workflow type :data:`CHAOS_WORKFLOW`) applies every decision
through :class:`~flowdecision.sinks.temporal_workflow.DecisionRunWorkflow` and
records one effect per hook call; the query :data:`EFFECTS_QUERY` returns them
(decision ids, in the order applied). The harness runs the worker in a process
of its own::

    python -m flowdecision.chaos.temporal_run HOST:PORT NAMESPACE TASK_QUEUE
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from flowdecision.core.model import DecisionStep
    from flowdecision.sinks.delivery import DecisionDelivery
    from flowdecision.sinks.temporal_workflow import DecisionRunWorkflow, RunState

__all__ = ["CHAOS_WORKFLOW", "EFFECTS_QUERY", "ChaosRun"]

CHAOS_WORKFLOW = "FlowdecisionChaosRun"
EFFECTS_QUERY = "chaos.effects"


@workflow.defn(name=CHAOS_WORKFLOW)
class ChaosRun(DecisionRunWorkflow):
    """Records each decision it applies; the run stays open (``ends_run = False``)
    whatever it is given (every chaos decision is a ``schedule_step`` now; they
    were ``complete`` decisions before the run invariants)."""

    ends_run = False

    def __init__(self) -> None:
        super().__init__()
        self._effects: list[str] = []

    @workflow.run
    async def run(self, state: RunState | None = None) -> Any:
        return await self.run_decisions(state)

    async def schedule_step(self, step: DecisionStep, delivery: DecisionDelivery) -> None:
        self._effects.append(delivery.decision_id)

    async def schedule_steps(
        self, steps: Sequence[DecisionStep], delivery: DecisionDelivery
    ) -> None:
        self._effects.append(delivery.decision_id)

    async def complete(self, output: Any, delivery: DecisionDelivery) -> None:
        self._effects.append(delivery.decision_id)

    async def fail(self, error: str, delivery: DecisionDelivery) -> None:
        self._effects.append(delivery.decision_id)

    @workflow.query(name=EFFECTS_QUERY)
    def effects(self) -> list[str]:
        return self._effects


async def _serve(address: str, namespace: str, task_queue: str) -> None:
    from temporalio.client import Client

    from flowdecision.sinks.temporal_workflow import decision_worker

    client = await Client.connect(address, namespace=namespace)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with decision_worker(client, task_queue, [ChaosRun]):
        print("chaos worker ready", flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m flowdecision.chaos.temporal_run HOST:PORT NAMESPACE TASK_QUEUE``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        raise SystemExit("usage: python -m flowdecision.chaos.temporal_run HOST:PORT NS QUEUE")
    asyncio.run(_serve(*args))


if __name__ == "__main__":
    main()
