"""The trace context reaches every engine in the engine's own way (in-memory exporter):
the receiving side sees the trace of the dispatch that submitted the decision.

* webhook: a ``traceparent`` header on the POST (a real HTTP receiver);
* procrastinate: a ``traceparent`` job argument, read by a real worker's task;
* DBOS: the workflow is started inside DBOS's ``PropagateOtelContext``: DBOS's
  own workflow span is a child of the dispatch's ``flowdecision.sink.submit``;
* Temporal: Temporal's ``TracingInterceptor`` writes the context into the call's
  Temporal headers; a worker with the same interceptor (a real Temporal server,
  a worker in this process) runs the workflow in the decision's trace and links
  each update handler to its decision's;
* Restate: the ingress call's ``traceparent`` header, read by the handler;
* the outbox: the row's ``traceparent`` (covered in tests/test_tracing.py), from
  which :func:`flowdecision.observability.tracing.context_of` continues the trace.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import procrastinate
import pytest
from dbos import DBOS
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowdecision import DecisionRequest, Dispatcher
from flowdecision.core.model import DecisionStep, ScheduleSteps
from flowdecision.ledger import MemoryLedger, SqliteLedger
from flowdecision.observability import tracing
from flowdecision.sinks import OutboxSink
from flowdecision.sinks.dbos import DBOSSink
from flowdecision.sinks.loader import close_sink, open_sink
from flowdecision.sinks.procrastinate import ProcrastinateSink
from flowdecision.sinks.relay import OutboxRelay
from flowdecision.sinks.temporal import DECISION_UPDATE, open_temporal_url
from flowdecision.sinks.webhook import WebhookSink
from tests.dbos_workflows import record_decision
from tests.engine_servers import RestateServer, TemporalServer
from tests.helpers import request
from tests.otel_support import (  # noqa: F401 (the `spans` fixture)
    hex_ids,
    linked_to,
    named,
    spans_fixture,
    traceparent,
)
from tests.service_process import wait_for
from tests.webhook_receiver import WebhookReceiver

TASK = "flowdecision_test.traced_decision"
#: (decision id, traceparent) of every job execution.
TRACED_RUNS: list[tuple[str, str | None]] = []


async def test_the_webhook_receiver_gets_the_sink_spans_traceparent(
    spans: InMemorySpanExporter,
) -> None:
    with WebhookReceiver() as receiver:
        async with WebhookSink(receiver.url) as sink:
            dispatcher = Dispatcher("production", sink, MemoryLedger())
            assert (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted
        [(_, headers, _)] = receiver.requests
    [submit] = named(spans.get_finished_spans(), "flowdecision.sink.submit")
    assert headers["traceparent"] == traceparent(submit)
    [dispatch] = named(spans.get_finished_spans(), "flowdecision.dispatch")
    assert dict(dispatch.attributes or {})["flowdecision.sink.kind"] == "webhook"


async def test_without_tracing_the_webhook_gets_no_traceparent() -> None:
    with WebhookReceiver() as receiver:
        async with WebhookSink(receiver.url) as sink:
            await Dispatcher("production", sink, MemoryLedger()).dispatch(request())
        [(_, headers, _)] = receiver.requests
    assert "traceparent" not in {name.lower() for name in headers}


def _traced_app(url: str) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name=TASK, queue="decisions")
    async def traced_decision(request_json: str, attempt: int, traceparent: str) -> None:
        # What an engine task does with it: continue the decision's trace.
        parent = tracing.context_of(traceparent)
        with trace.get_tracer("worker").start_as_current_span("handle decision", context=parent):
            TRACED_RUNS.append((DecisionRequest.parse(request_json).decision_id, traceparent))

    return app


@pytest.fixture
async def procrastinate_app(pg_empty_url: str) -> AsyncIterator[procrastinate.App]:
    TRACED_RUNS.clear()
    async with _traced_app(pg_empty_url).open_async() as app:
        await app.schema_manager.apply_schema_async()
        yield app


async def test_a_procrastinate_task_continues_the_trace_from_its_job_argument(
    procrastinate_app: procrastinate.App, spans: InMemorySpanExporter
) -> None:
    async with ProcrastinateSink(procrastinate_app, TASK) as sink:
        assert sink._passes_traceparent()  # the registered task takes `traceparent`
        dispatcher = Dispatcher("production", sink, MemoryLedger())
        assert (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted
    await procrastinate_app.run_worker_async(
        wait=False, install_signal_handlers=False, listen_notify=False, concurrency=1
    )
    [submit] = named(spans.get_finished_spans(), "flowdecision.sink.submit")
    assert TRACED_RUNS == [("dec-1", traceparent(submit))]
    [handled] = named(spans.get_finished_spans(), "handle decision")
    assert hex_ids(handled)[0] == hex_ids(submit)[0]  # the same trace
    assert handled.parent is not None and handled.parent.span_id == submit.context.span_id


async def test_a_task_without_the_parameter_gets_no_traceparent_argument(
    procrastinate_app: procrastinate.App, spans: InMemorySpanExporter
) -> None:
    plain = ProcrastinateSink(procrastinate_app, "not.registered.here")
    assert not plain._passes_traceparent()  # unknown signature: nothing extra is sent
    forced = ProcrastinateSink(procrastinate_app, "not.registered.here", pass_traceparent=True)
    assert forced._passes_traceparent()


@pytest.fixture
def dbos_launched(tmp_path: Path) -> Iterator[None]:
    # enable_otlp: DBOS records its workflow spans (with the provider already registered).
    DBOS(
        config={
            "name": "flowdecision-tracing",
            "system_database_url": f"sqlite:///{tmp_path}/d",
            "enable_otlp": True,
        }
    )
    DBOS.launch()
    try:
        yield
    finally:
        DBOS.destroy()


async def test_a_dbos_workflow_span_is_a_child_of_the_sink_span(
    spans: InMemorySpanExporter, dbos_launched: None
) -> None:
    dispatcher = Dispatcher("production", DBOSSink(record_decision), MemoryLedger())
    assert (await dispatcher.dispatch(request(decision_id="dec-dbos"))).submitted
    handle = await DBOS.retrieve_workflow_async("dec-dbos")
    assert await asyncio.wait_for(handle.get_result(), timeout=60) == "dec-dbos"
    [submit] = named(spans.get_finished_spans(), "flowdecision.sink.submit")

    def workflow_spans() -> list[object]:
        return [
            s
            for s in spans.get_finished_spans()
            if s.name == "record_decision" and hex_ids(s)[0] == hex_ids(submit)[0]
        ]

    for _ in range(100):  # DBOS ends its span just after the result is recorded
        if workflow_spans():
            break
        await asyncio.sleep(0.05)
    [workflow] = workflow_spans()
    assert workflow.parent is not None  # type: ignore[attr-defined]
    assert workflow.parent.span_id == submit.context.span_id  # type: ignore[attr-defined]


@pytest.fixture
async def dispatched(tmp_path: Path, spans: InMemorySpanExporter) -> AsyncIterator[OutboxSink]:
    """The default layout with decision ``dec-1`` dispatched (tracing on): its outbox."""
    path = tmp_path / "flowdecision.db"
    ledger = await SqliteLedger.open(path)
    outbox = await OutboxSink(f"sqlite:///{path}").open()
    try:
        await Dispatcher("production", outbox, ledger).dispatch(request(decision_id="dec-1"))
        yield outbox
    finally:
        await outbox.close()
        await ledger.close()


async def test_an_outbox_consumer_continues_the_trace_from_the_row(
    dispatched: OutboxSink, spans: InMemorySpanExporter
) -> None:
    [entry] = await dispatched.fetch(after=0)
    parent = tracing.context_of(entry.traceparent)
    with trace.get_tracer("consumer").start_as_current_span("consume", context=parent):
        pass
    [dispatch] = named(spans.get_finished_spans(), "flowdecision.dispatch")
    [consumed] = named(spans.get_finished_spans(), "consume")
    assert hex_ids(consumed)[0] == hex_ids(dispatch)[0]
    assert consumed.parent is not None and consumed.parent.span_id == dispatch.context.span_id


async def test_the_relay_continues_the_trace_from_the_row_into_the_engine(
    dispatched: OutboxSink, spans: InMemorySpanExporter
) -> None:
    with WebhookReceiver() as receiver:
        async with OutboxRelay(dispatched, WebhookSink(receiver.url), name="traced") as relay:
            assert await relay.drain() == 1
        [(_, headers, _)] = receiver.requests
    finished = spans.get_finished_spans()
    [dispatch] = named(finished, "flowdecision.dispatch")
    [deliver] = named(finished, "flowdecision.relay.deliver")
    # The relay's span continues the dispatch's trace from the row's traceparent ...
    assert deliver.parent is not None and deliver.parent.span_id == dispatch.context.span_id
    assert hex_ids(deliver)[0] == hex_ids(dispatch)[0]
    attributes = dict(deliver.attributes or {})
    assert attributes["flowdecision.outbox.seq"] == 1
    assert attributes["flowdecision.relay.name"] == "traced"
    # ... and the engine receives the relay's span, in the same trace.
    assert headers["traceparent"] == traceparent(deliver)


@pytest.fixture
async def traced_temporal_worker(
    temporal_server: TemporalServer, spans: InMemorySpanExporter
) -> AsyncIterator[str]:
    """A worker in this process, on a task queue of its own, whose client has Temporal's
    ``TracingInterceptor`` (so has the worker): what the docs tell a user to run. Its
    spans go to the test's in-memory exporter. Yields the task queue."""
    from temporalio.client import Client
    from temporalio.contrib.opentelemetry import TracingInterceptor

    from flowdecision.sinks.temporal_workflow import decision_worker
    from tests.temporal_workflows import WORKFLOWS

    queue = f"traced-{uuid.uuid4().hex[:10]}"
    client = await Client.connect(temporal_server.address, interceptors=[TracingInterceptor()])
    async with decision_worker(client, queue, WORKFLOWS, graceful_shutdown_s=1):
        yield queue


async def test_a_temporal_worker_continues_each_decisions_trace(
    temporal_server: TemporalServer, traced_temporal_worker: str, spans: InMemorySpanExporter
) -> None:
    url = (
        f"temporal://{temporal_server.address}/default?task_queue={traced_temporal_worker}"
        "&workflow=FlowRun&timeout=30&wait=completed"
    )
    sink = await open_temporal_url(url)
    run_id = f"run-{uuid.uuid4().hex[:10]}"
    steps = ScheduleSteps(steps=[DecisionStep(step_id="a", step_name="fetch", input=1)])
    first = request(decision_id=f"dec-1-{run_id}", run_id=run_id, decision=steps)
    second = request(decision_id=f"dec-2-{run_id}", run_id=run_id)  # completes the run
    try:
        dispatcher = Dispatcher("production", sink, MemoryLedger())
        assert (await dispatcher.dispatch(first)).submitted  # starts the run's workflow
        assert (await dispatcher.dispatch(second)).submitted  # an update of the running one
    finally:
        await sink.close()
    finished = spans.get_finished_spans()
    submit_1, submit_2 = named(finished, "flowdecision.sink.submit")

    def client_span(submit: Any) -> Any:
        # Temporal's TracingInterceptor recorded the client call as a child of the sink
        # span and wrote its context into the call's Temporal headers.
        [call] = [
            s
            for s in finished
            if s.parent is not None and s.parent.span_id == submit.context.span_id
        ]
        assert call.name == "StartUpdateWithStartWorkflow:FlowRun"
        assert hex_ids(call)[0] == hex_ids(submit)[0]
        return call

    call_1, call_2 = client_span(submit_1), client_span(submit_2)
    # The worker side, from the headers: the workflow run is a child of the first
    # decision's call, in its trace ...
    [run] = named(finished, "RunWorkflow:FlowRun")
    assert hex_ids(run)[0] == hex_ids(submit_1)[0]
    assert run.parent is not None and run.parent.span_id == call_1.context.span_id
    # ... and each decision's update handler links to that decision's call: the
    # worker sees the trace id of every decision it applies.
    handled = named(finished, f"HandleUpdate:{DECISION_UPDATE}")
    assert len(handled) == 2
    linked = [link for span in handled for link in linked_to(span)]
    assert sorted(linked) == sorted([hex_ids(call_1), hex_ids(call_2)])
    assert all(hex_ids(span)[0] == hex_ids(run)[0] for span in handled)


@pytest.mark.usefixtures("restate_deployment")
async def test_a_restate_handler_receives_the_sink_spans_traceparent(
    restate_server: RestateServer, restate_effects: Path, spans: InMemorySpanExporter
) -> None:
    sink = await open_sink(restate_server.url("Decisions", "handle"))
    decision = request(decision_id=f"dec-{uuid.uuid4().hex[:10]}")
    try:
        assert (await Dispatcher("production", sink, MemoryLedger()).dispatch(decision)).submitted
    finally:
        await close_sink(sink)

    def lines() -> list[str]:
        if not restate_effects.exists():
            return []
        return [
            line
            for line in restate_effects.read_text().splitlines()
            if line.split()[0] == decision.decision_id
        ]

    await asyncio.to_thread(wait_for, lines)
    [submit] = named(spans.get_finished_spans(), "flowdecision.sink.submit")
    # The handler (examples/restate_service.py) read the header Restate passed on.
    [line] = lines()
    assert line.endswith(f" traceparent={traceparent(submit)}")
