"""Workflows the Temporal sink tests deliver to, and a worker for them.

``python -m tests.temporal_workflows ADDRESS QUEUE`` runs the worker until SIGTERM.

* ``FlowRun`` (run mode): a :class:`DecisionRunWorkflow` that records every hook
  call (its *effects*) and answers them on the ``effects`` query.
* ``SmallFlowRun``: the same, continuing as new after every 2 decisions.
* ``PlainFlowRun``: the base class's no-op hooks (for the benchmark).
* ``HandleDecision`` (start mode): one workflow per decision; returns what it got.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from flowdecision.core.model import DecisionStep
    from flowdecision.sinks.delivery import DecisionDelivery
    from flowdecision.sinks.temporal_workflow import DecisionRunWorkflow, RunState


class _Recording(DecisionRunWorkflow):
    def __init__(self) -> None:
        super().__init__()
        self._effects: list[list[Any]] = []

    async def schedule_step(self, step: DecisionStep, delivery: DecisionDelivery) -> None:
        # An await inside the hook: the base class must still apply decisions one at a time.
        await workflow.sleep(0.01)
        self._effects.append(
            ["schedule_step", delivery.decision_id, delivery.attempt, step.step_id]
        )

    async def schedule_steps(
        self, steps: Sequence[DecisionStep], delivery: DecisionDelivery
    ) -> None:
        ids = [step.step_id for step in steps]
        self._effects.append(["schedule_steps", delivery.decision_id, delivery.attempt, ids])

    async def complete(self, output: Any, delivery: DecisionDelivery) -> None:
        self._effects.append(["complete", delivery.decision_id, delivery.attempt, output])

    async def fail(self, error: str, delivery: DecisionDelivery) -> None:
        self._effects.append(["fail", delivery.decision_id, delivery.attempt, error])

    @workflow.query(name="effects")
    def effects(self) -> list[list[Any]]:
        return self._effects


@workflow.defn(name="FlowRun")
class FlowRun(_Recording):
    @workflow.run
    async def run(self, state: RunState | None = None) -> Any:
        return await self.run_decisions(state)


@workflow.defn(name="SmallFlowRun")
class SmallFlowRun(_Recording):
    continue_as_new_after = 2

    @workflow.run
    async def run(self, state: RunState | None = None) -> Any:
        return await self.run_decisions(state)


@workflow.defn(name="PlainFlowRun")
class PlainFlowRun(DecisionRunWorkflow):
    """The base class's no-op hooks only (bench/engine_relay_bench.py)."""

    @workflow.run
    async def run(self, state: RunState | None = None) -> Any:
        return await self.run_decisions(state)


@workflow.defn(name="HandleDecision")
class HandleDecision:
    @workflow.run
    async def run(self, delivery: DecisionDelivery) -> dict[str, Any]:
        request = delivery.request()
        return {
            "decision_id": request.decision_id,
            "attempt": delivery.attempt,
            "kind": delivery.kind,
        }


WORKFLOWS = [FlowRun, SmallFlowRun, PlainFlowRun, HandleDecision]


async def _serve(address: str, task_queue: str) -> None:
    import signal

    from temporalio.client import Client

    from flowdecision.sinks.temporal_workflow import decision_worker

    client = await Client.connect(address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with decision_worker(client, task_queue, WORKFLOWS, graceful_shutdown_s=1):
        ready = os.environ.get("FLOWDECISION_TEST_WORKER_READY")
        if ready:
            Path(ready).write_text("ready")
        print(f"worker on {task_queue} at {address}", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2]))
    # temporalio's native runtime can abort while the interpreter finalizes; the
    # worker has shut down cleanly by now, so leave without finalizing.
    os._exit(0)
