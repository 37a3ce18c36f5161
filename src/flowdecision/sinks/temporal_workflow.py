"""The workflow side of the Temporal sink's run mode: subclass :class:`DecisionRunWorkflow`.

One Temporal workflow per flow-graph run (workflow id = ``run_id``) receives
the run's decisions as Updates (update id = ``decision_id``). Override the
hooks you need; each gets the typed decision and its
:class:`~flowdecision.sinks.delivery.DecisionDelivery` (attempt, hash)::

    from temporalio import workflow
    from flowdecision.sinks.temporal_workflow import DecisionRunWorkflow, RunState

    @workflow.defn(name="FlowRun")
    class FlowRun(DecisionRunWorkflow):
        @workflow.run                       # Temporal wants it on the class itself
        async def run(self, state: RunState | None = None) -> Any:
            return await self.run_decisions(state)

        async def schedule_step(self, step, delivery):
            await workflow.execute_activity(step.step_name, step.input, ...)

Run it with :func:`decision_worker` (or pass
:data:`SANDBOX_PASSTHROUGH` to your own worker's sandbox).

What the base class adds to Temporal's own guarantees:

* **one decision at a time, in acceptance order**: the hooks of one run never
  interleave, even while a hook awaits an activity;
* **a memory of applied decisions that survives continue-as-new**: Temporal
  deduplicates update ids within one workflow *run* only; the base class
  carries the ids it applied (the last :attr:`DecisionRunWorkflow.remembered`)
  into the next run, and answers a repeated id there without calling a hook;
* **the end of the run**: a ``complete`` decision returns its output from the
  workflow, a ``fail`` decision fails it (``ApplicationError`` of type
  ``FlowRunFailed``), once every accepted decision's hook has finished. A new
  decision after that is rejected by the update validator, before it enters
  the history; set :attr:`DecisionRunWorkflow.ends_run` False to keep the run
  open instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from ..core.model import Complete, DecisionStep, Fail, ScheduleStep, ScheduleSteps
from .delivery import DecisionDelivery
from .temporal import DECISION_UPDATE

if TYPE_CHECKING:
    from temporalio.client import Client
    from temporalio.worker import Worker

__all__ = [
    "APPLIED_QUERY",
    "SANDBOX_PASSTHROUGH",
    "DecisionAck",
    "DecisionRunWorkflow",
    "RunState",
    "decision_worker",
]

#: The query answering the decisions a run applied, oldest first (``list[DecisionAck]``).
APPLIED_QUERY = "flowdecision.applied"
#: Modules the workflow sandbox should pass through (pure data code, imported once).
SANDBOX_PASSTHROUGH = ("flowdecision",)


@dataclass(frozen=True, slots=True)
class DecisionAck:
    """A run's answer to one decision: the attempt that first delivered it.

    ``applied`` is False when the decision had already been applied (a
    resubmission that reached the workflow after a continue-as-new); Temporal
    answers a repeated update id within one run with the first ack itself.
    """

    decision_id: str
    attempt: int
    request_hash: str
    applied: bool = True


@dataclass(slots=True)
class RunState:
    """What a run carries into its next run on continue-as-new."""

    acks: list[DecisionAck] = field(default_factory=list)


class DecisionRunWorkflow:
    """Base class of a run-mode workflow; see the module docstring."""

    #: How many applied decision ids a run carries across continue-as-new.
    remembered: int = 10_000
    #: Continue as new after this many decisions in one run (None: when Temporal suggests it).
    continue_as_new_after: int | None = None
    #: A ``complete`` or ``fail`` decision ends the run.
    ends_run: bool = True

    def __init__(self) -> None:
        self._acks: dict[str, DecisionAck] = {}
        self._lock = asyncio.Lock()
        self._in_this_run = 0
        self._end: Complete | Fail | None = None
        self._closing = False
        # Set once run_decisions restored the carried memory; an update delivered in
        # the run's first workflow task would otherwise run before it.
        self._restored = False

    # ---- hooks: override what you need

    async def schedule_step(self, step: DecisionStep, delivery: DecisionDelivery) -> None:
        """A ``schedule_step`` decision."""

    async def schedule_steps(
        self, steps: Sequence[DecisionStep], delivery: DecisionDelivery
    ) -> None:
        """A ``schedule_steps`` decision (calls :meth:`schedule_step` for each by default)."""
        for step in steps:
            await self.schedule_step(step, delivery)

    async def complete(self, output: Any, delivery: DecisionDelivery) -> None:
        """A ``complete`` decision (the run then ends with ``output`` if :attr:`ends_run`)."""

    async def fail(self, error: str, delivery: DecisionDelivery) -> None:
        """A ``fail`` decision (the run then fails with ``error`` if :attr:`ends_run`)."""

    # ---- the run

    async def run_decisions(self, state: RunState | None = None) -> Any:
        """Receive decisions until the run ends; call it from your ``@workflow.run``."""
        for ack in (state.acks if state else [])[-self.remembered :]:
            self._acks[ack.decision_id] = ack
        self._restored = True
        await workflow.wait_condition(lambda: self._end is not None or self._should_continue())
        # No new decision is accepted from here on (the validator checks _closing).
        self._closing = True
        await workflow.wait_condition(workflow.all_handlers_finished)
        end = self._end
        if isinstance(end, Complete):
            return end.to_dict()["output"]
        if isinstance(end, Fail):
            raise ApplicationError(end.error, type="FlowRunFailed", non_retryable=True)
        workflow.continue_as_new(RunState(acks=list(self._acks.values())[-self.remembered :]))

    def _should_continue(self) -> bool:
        if self.continue_as_new_after is not None:
            return self._in_this_run >= self.continue_as_new_after
        return workflow.info().is_continue_as_new_suggested()

    @workflow.update(name=DECISION_UPDATE)
    async def receive_decision(self, delivery: DecisionDelivery) -> DecisionAck:
        """The update the sink sends; answers the first attempt that delivered it."""
        await workflow.wait_condition(lambda: self._restored)
        known = self._acks.get(delivery.decision_id)
        if known is not None:
            return DecisionAck(known.decision_id, known.attempt, known.request_hash, False)
        request = delivery.request()
        ack = DecisionAck(delivery.decision_id, delivery.attempt, delivery.request_hash)
        self._acks[delivery.decision_id] = ack
        self._in_this_run += 1
        async with self._lock:
            decision = request.decision
            if isinstance(decision, ScheduleStep):
                await self.schedule_step(decision.step, delivery)
            elif isinstance(decision, ScheduleSteps):
                await self.schedule_steps(decision.steps, delivery)
            elif isinstance(decision, Complete):
                await self.complete(decision.to_dict()["output"], delivery)
            else:
                await self.fail(decision.error, delivery)
            if self.ends_run and isinstance(decision, (Complete, Fail)) and self._end is None:
                self._end = decision
        return ack

    @receive_decision.validator
    def check_decision(self, delivery: DecisionDelivery) -> None:
        """Reject (before it enters the history) a decision this run cannot take."""
        run_id = workflow.info().workflow_id
        if delivery.run_id != run_id:
            raise ApplicationError(
                f"decision `{delivery.decision_id}` is for run `{delivery.run_id}`, not `{run_id}`",
                type="WrongRun",
            )
        known = self._acks.get(delivery.decision_id)
        if known is not None:
            if known.request_hash != delivery.request_hash:
                raise ApplicationError(
                    f"decision `{delivery.decision_id}` was applied with another request",
                    type="DecisionConflict",
                )
            return  # a resubmission: answered from memory
        if self._end is not None or self._closing:
            raise ApplicationError(
                f"run `{run_id}` has ended; decision `{delivery.decision_id}` refused",
                type="RunEnded",
            )

    @workflow.query(name=APPLIED_QUERY)
    def applied(self) -> list[DecisionAck]:
        """The decisions this run applied or carried over, oldest first."""
        return list(self._acks.values())


def decision_worker(
    client: Client,
    task_queue: str,
    workflows: Sequence[type],
    *,
    activities: Sequence[Any] = (),
    graceful_shutdown_s: float = 5.0,
) -> Worker:
    """A ``temporalio.worker.Worker`` for decision workflows, with flowdecision
    passed through the workflow sandbox (run it with ``async with`` or ``run()``)."""
    from temporalio.worker import Worker
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    runner = SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(*SANDBOX_PASSTHROUGH)
    )
    return Worker(
        client,
        task_queue=task_queue,
        workflows=list(workflows),
        activities=list(activities),
        workflow_runner=runner,
        graceful_shutdown_timeout=timedelta(seconds=graceful_shutdown_s),
    )
