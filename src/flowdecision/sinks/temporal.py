"""The Temporal sink: each accepted decision reaches a Temporal workflow, deduplicated by Temporal.

Needs the ``temporal`` extra (``pip install 'flowdecision[temporal]'``);
importing :mod:`flowdecision` never imports temporalio.

Two modes (docs/SINKS.md#temporal says what each guarantees, and where the
ledger takes over):

* **run mode** (the default): the flow-graph run is one Temporal workflow whose
  id is the decision's ``run_id``. Each decision is an **Update** whose update
  id is the ``decision_id``, sent with update-with-start (conflict policy
  use-existing, reuse policy reject-duplicate): the first decision of a run
  starts the workflow, later ones join it. Temporal answers a repeated update id
  with the first outcome and does not run the handler again, also after the
  workflow closed. A *new* decision for a run that has closed is refused
  (:class:`TemporalRunClosedError`), never started as a fresh run. Subclass
  :class:`flowdecision.sinks.temporal_workflow.DecisionRunWorkflow` to receive
  the decisions as typed values.
* **start mode**: one workflow per decision, workflow id = ``decision_id``,
  reuse policy reject-duplicate, conflict policy fail. Temporal's "already
  started" answer is an absorbed duplicate. The workflow's one argument is the
  :class:`~flowdecision.sinks.delivery.DecisionDelivery`.

Either way the payload is a :class:`~flowdecision.sinks.delivery.DecisionDelivery`:
the attempt and the request hash travel with the exact wire JSON.

URL form (``flowdecision serve --sink …``)::

    temporal://host:port/namespace?task_queue=Q&workflow=Name[&mode=run|start]
        [&wait=accepted|completed][&timeout=SECONDS][&tls=true]

``namespace`` defaults to ``default``. ``wait`` (run mode): return once the
update is *accepted* (durably in the workflow's history: the default) or once
its handler *completed*. ``timeout`` bounds one submission (default 30 s): an
update is accepted only by a running worker, so with no worker on the task
queue the sink fails after ``timeout`` instead of holding the claim forever.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from ..core.model import DecisionRequest
from ..errors import (
    SinkConfigError,
    TemporalRejectedError,
    TemporalRunClosedError,
    TemporalSinkError,
)
from ..observability.tracing import active
from .delivery import DecisionDelivery, EngineAnswer

if TYPE_CHECKING:
    from temporalio.client import Client

__all__ = [
    "DECISION_UPDATE",
    "TemporalRunClosedError",
    "TemporalSink",
    "TemporalSinkError",
    "TemporalUrl",
    "open_temporal_url",
    "parse_temporal_url",
]

#: The update every decision is sent as in run mode (the workflow base class handles it).
DECISION_UPDATE = "flowdecision.decision"

Mode = Literal["run", "start"]
Wait = Literal["accepted", "completed"]


class TemporalSink:
    """A :class:`~flowdecision.sinks.Sink` delivering decisions to Temporal.

    ``client`` is a connected ``temporalio.client.Client`` (its namespace is the
    one used). ``workflow`` is the workflow *type name* (``@workflow.defn(name=…)``)
    and ``task_queue`` the queue its workers poll. :meth:`close` leaves the
    client alone unless ``owns_client`` (set by the URL loader).
    """

    def __init__(
        self,
        client: Client,
        *,
        task_queue: str,
        workflow: str,
        mode: Mode = "run",
        wait: Wait = "accepted",
        timeout_s: float = 30.0,
        owns_client: bool = False,
    ) -> None:
        if mode not in ("run", "start"):
            raise TemporalSinkError(f"Temporal sink mode must be `run` or `start`, got {mode!r}")
        if wait not in ("accepted", "completed"):
            raise TemporalSinkError(
                f"Temporal sink wait must be `accepted` or `completed`, got {wait!r}"
            )
        if not task_queue or not workflow:
            raise TemporalSinkError("Temporal sink needs a task queue and a workflow type name")
        if not timeout_s > 0:
            raise TemporalSinkError(f"Temporal sink timeout must be positive, got {timeout_s!r}")
        self.client = client
        self.task_queue = task_queue
        self.workflow = workflow
        self.mode: Mode = mode
        self.wait: Wait = wait
        self.timeout_s = timeout_s
        self._owns_client = owns_client

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Deliver ``request``; return once Temporal accepted it (or already had it)."""
        await self.deliver(request, attempt)

    async def deliver(self, request: DecisionRequest, attempt: int) -> EngineAnswer:
        """Like :meth:`submit`, and say what Temporal answered."""
        delivery = DecisionDelivery.of(request, attempt)
        if self.mode == "start":
            return await self._start(delivery)
        return await self._update(delivery)

    async def _start(self, delivery: DecisionDelivery) -> EngineAnswer:
        from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
        from temporalio.exceptions import WorkflowAlreadyStartedError

        try:
            await self.client.start_workflow(
                self.workflow,
                delivery,
                id=delivery.decision_id,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                rpc_timeout=timedelta(seconds=self.timeout_s),
            )
        except WorkflowAlreadyStartedError:
            return EngineAnswer(delivery.decision_id, absorbed=True)
        except Exception as error:
            _raise_if_refused(error, delivery)
            raise TemporalSinkError(
                f"Temporal did not start workflow `{delivery.decision_id}`: {_describe(error)}"
            ) from error
        return EngineAnswer(delivery.decision_id, absorbed=False)

    async def _update(self, delivery: DecisionDelivery) -> EngineAnswer:
        from temporalio.client import WithStartWorkflowOperation
        from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

        start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
            self.workflow,
            id=delivery.run_id,
            task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            # A closed run must not come back as a fresh workflow under the same id.
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        )
        try:
            return await self._send_update(start, delivery)
        finally:
            _consume_start_error(start)

    async def _send_update(self, start: Any, delivery: DecisionDelivery) -> EngineAnswer:
        from temporalio.client import WorkflowUpdateRPCTimeoutOrCancelledError, WorkflowUpdateStage
        from temporalio.exceptions import WorkflowAlreadyStartedError

        stage = (
            WorkflowUpdateStage.COMPLETED
            if self.wait == "completed"
            else WorkflowUpdateStage.ACCEPTED
        )
        try:
            handle = await self.client.start_update_with_start_workflow(
                DECISION_UPDATE,
                delivery,
                start_workflow_operation=start,
                id=delivery.decision_id,
                wait_for_stage=stage,
                result_type=dict,
                rpc_timeout=timedelta(seconds=self.timeout_s),
            )
            if self.wait == "completed":
                ack = await handle.result(rpc_timeout=timedelta(seconds=self.timeout_s))
                return EngineAnswer(delivery.run_id, absorbed=_absorbed(ack, delivery))
        except WorkflowUpdateRPCTimeoutOrCancelledError as error:
            raise TemporalSinkError(
                f"Temporal did not accept decision `{delivery.decision_id}` within "
                f"{self.timeout_s:g}s (is a worker polling task queue `{self.task_queue}`?)"
            ) from error
        except WorkflowAlreadyStartedError as error:
            raise TemporalRunClosedError(
                f"decision `{delivery.decision_id}` is for run `{delivery.run_id}`, whose "
                "Temporal workflow has already closed: not delivered"
            ) from error
        except Exception as error:
            _raise_if_refused(error, delivery)
            raise TemporalSinkError(
                f"Temporal did not take decision `{delivery.decision_id}` "
                f"(workflow `{delivery.run_id}`): {_describe(error)}"
            ) from error
        return EngineAnswer(delivery.run_id, absorbed=None)

    async def probe(self) -> None:
        """Raise unless the Temporal frontend answers its health check (``/healthz``)."""
        try:
            healthy = await self.client.service_client.check_health(
                timeout=timedelta(seconds=min(self.timeout_s, 5.0))
            )
        except Exception as error:
            raise TemporalSinkError(f"Temporal is unreachable: {_describe(error)}") from error
        if not healthy:
            raise TemporalSinkError("Temporal's frontend reports it is not serving")

    async def close(self) -> None:
        """Drop the client if this sink connected it (the URL form); else nothing."""
        # temporalio clients hold no explicit close; dropping the reference is enough.
        self._owns_client = False


def _raise_if_refused(error: Exception, delivery: DecisionDelivery) -> None:
    """Raise :class:`TemporalRejectedError` when Temporal refused the decision for good:
    the run's workflow rejected or failed the update, or the request is invalid."""
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError, RPCStatusCode

    refused = isinstance(error, WorkflowUpdateFailedError) or (
        isinstance(error, RPCError) and error.status == RPCStatusCode.INVALID_ARGUMENT
    )
    if refused:
        raise TemporalRejectedError(
            f"Temporal refused decision `{delivery.decision_id}` "
            f"(workflow `{delivery.run_id}`): {_describe(error)}"
        ) from error


def _consume_start_error(start: Any) -> None:
    """Mark the with-start operation's failure as seen.

    temporalio sets the start operation's own future to the same error it
    raises from the update call; nobody awaits that future, so asyncio would log
    "Future exception was never retrieved" for every refused decision.
    """
    future = getattr(start, "_workflow_handle", None)
    if isinstance(future, asyncio.Future) and future.done() and not future.cancelled():
        future.exception()


def _absorbed(ack: Any, delivery: DecisionDelivery) -> bool | None:
    """From the workflow's ``DecisionAck`` (a dict here): was this a resubmission?"""
    if not isinstance(ack, dict):
        return None
    if ack.get("applied") is False:
        return True
    return ack.get("attempt") != delivery.attempt


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    # WorkflowUpdateFailedError and friends keep the workflow's reason in `.cause`.
    cause = getattr(error, "cause", None) or error.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} ({cause})"
    return text


@dataclass(frozen=True, slots=True)
class TemporalUrl:
    """A parsed ``temporal://host:port/namespace?task_queue=Q&workflow=Name…`` sink URL."""

    target_host: str
    namespace: str
    task_queue: str
    workflow: str
    mode: Mode
    wait: Wait
    timeout_s: float
    tls: bool


_PARAMS = ("task_queue", "workflow", "mode", "wait", "timeout", "tls")


def parse_temporal_url(url: str) -> TemporalUrl:
    """Split a ``temporal://`` sink URL; :class:`SinkConfigError` names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "temporal":
        raise SinkConfigError(f"`{url}` is not a temporal:// sink URL")
    try:
        port = parts.port
    except ValueError as error:
        raise SinkConfigError(f"Temporal sink URL `{url}`: bad port ({error})") from None
    if not parts.hostname or port is None:
        raise SinkConfigError(f"Temporal sink URL `{url}` needs host:port (the frontend address)")
    namespace = unquote(parts.path.strip("/")) or "default"
    if "/" in namespace:
        raise SinkConfigError(f"Temporal sink URL `{url}`: the path is one namespace")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as error:
        raise SinkConfigError(f"Temporal sink URL `{url}` is malformed: {error}") from error
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in _PARAMS:
            raise SinkConfigError(
                f"Temporal sink URL `{url}`: unknown parameter `{name}` "
                f"(known: {', '.join(_PARAMS)})"
            )
        if name in params:
            raise SinkConfigError(f"Temporal sink URL `{url}` sets `{name}` twice")
        params[name] = value
    for needed in ("task_queue", "workflow"):
        if not params.get(needed):
            raise SinkConfigError(f"Temporal sink URL `{url}` needs ?{needed}=…")
    mode = params.get("mode", "run")
    wait = params.get("wait", "accepted")
    if mode not in ("run", "start"):
        raise SinkConfigError(f"Temporal sink URL `{url}`: mode must be run or start")
    if wait not in ("accepted", "completed"):
        raise SinkConfigError(f"Temporal sink URL `{url}`: wait must be accepted or completed")
    try:
        timeout_s = float(params.get("timeout", "30"))
    except ValueError:
        timeout_s = -1.0
    if not 0 < timeout_s < float("inf"):
        raise SinkConfigError(f"Temporal sink URL `{url}`: timeout must be positive seconds")
    tls = params.get("tls", "false").lower()
    if tls not in ("true", "false", "1", "0"):
        raise SinkConfigError(f"Temporal sink URL `{url}`: tls must be true or false")
    return TemporalUrl(
        target_host=f"{parts.hostname}:{port}"
        if ":" not in parts.hostname
        else f"[{parts.hostname}]:{port}",
        namespace=namespace,
        task_queue=params["task_queue"],
        workflow=params["workflow"],
        mode=mode,  # type: ignore[arg-type]
        wait=wait,  # type: ignore[arg-type]
        timeout_s=timeout_s,
        tls=tls in ("true", "1"),
    )


async def open_temporal_url(url: str) -> TemporalSink:
    """Connect to the URL's Temporal frontend; a sink owning that client."""
    from temporalio.client import Client

    parsed = parse_temporal_url(url)
    interceptors: list[Any] = []
    if active():
        # Tracing on: Temporal's own interceptor carries the decision's trace context
        # in the workflow's headers (a worker with the same interceptor continues it).
        from temporalio.contrib.opentelemetry import TracingInterceptor

        interceptors.append(TracingInterceptor())
    try:
        async with asyncio.timeout(parsed.timeout_s):
            client = await Client.connect(
                parsed.target_host,
                namespace=parsed.namespace,
                tls=parsed.tls,
                interceptors=interceptors,
            )
    except Exception as error:  # transient: a relay keeps trying (a bad URL failed above)
        raise TemporalSinkError(
            f"Temporal sink `{url}`: cannot connect to {parsed.target_host}: {_describe(error)}"
        ) from error
    return TemporalSink(
        client,
        task_queue=parsed.task_queue,
        workflow=parsed.workflow,
        mode=parsed.mode,
        wait=parsed.wait,
        timeout_s=parsed.timeout_s,
        owns_client=True,
    )
