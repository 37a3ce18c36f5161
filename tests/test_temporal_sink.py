"""TemporalSink against a real Temporal dev server and a real worker process.

The server and the worker (tests/temporal_workflows.py) start once per session
(tests/engine_fixtures.py). Each test uses its own run and decision ids, so
tests never see each other's workflows. "Effects" are the workflow hooks'
calls, read back with a query: exactly once means one effect per decision.
"""

from __future__ import annotations

import asyncio
import gc
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowUpdateFailedError,
)

from flowdecision import DecisionRequest
from flowdecision.core.model import Complete, DecisionStep, Fail, ScheduleSteps
from flowdecision.sinks import Sink
from flowdecision.sinks.delivery import DecisionDelivery
from flowdecision.sinks.loader import SinkConfigError, open_sink, sink_kind
from flowdecision.sinks.temporal import (
    TemporalRunClosedError,
    TemporalSink,
    TemporalSinkError,
    parse_temporal_url,
)
from flowdecision.sinks.temporal_workflow import APPLIED_QUERY
from tests.engine_crash import crash_then_take_over, post_twice_through_serve
from tests.engine_fixtures import TEMPORAL_QUEUE
from tests.engine_servers import TemporalServer, TemporalWorkerProcess, free_port
from tests.service_process import decision

pytestmark = pytest.mark.usefixtures("temporal_worker")


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def step(decision_id: str, run_id: str) -> DecisionRequest:
    """A schedule_step decision (step id ``<decision_id>-s``)."""
    return decision(decision_id, run_id=run_id)


def complete(decision_id: str, run_id: str, output: Any = None) -> DecisionRequest:
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id=f"event-{decision_id}",
        decision=Complete(output=output),
    )


@pytest.fixture
async def client(temporal_server: TemporalServer) -> AsyncIterator[Client]:
    yield await Client.connect(temporal_server.address)


def run_sink(client: Client, workflow: str = "FlowRun", **options: Any) -> TemporalSink:
    return TemporalSink(client, task_queue=TEMPORAL_QUEUE, workflow=workflow, **options)


async def effects(client: Client, run_id: str) -> list[list[Any]]:
    result: list[list[Any]] = await client.get_workflow_handle(run_id).query("effects")
    return result


async def test_each_decision_of_a_run_reaches_the_workflow_once_in_order(client: Client) -> None:
    run_id = _uid("run")
    sink = run_sink(client, wait="completed")
    assert isinstance(sink, Sink)
    sent = [
        step(f"{run_id}-d1", run_id),
        DecisionRequest(
            decision_id=f"{run_id}-d2",
            run_id=run_id,
            authority_branch_id="production",
            causation_event_id="e2",
            decision=ScheduleSteps(
                steps=(
                    DecisionStep(step_id="a", step_name="fetch", input=1),
                    DecisionStep(step_id="b", step_name="fetch", input=2),
                )
            ),
        ),
        step(f"{run_id}-d3", run_id),
    ]
    answers = [await sink.deliver(request, 1) for request in sent]
    assert [(a.target, a.absorbed) for a in answers] == [(run_id, False)] * 3
    # The same decisions again, as a takeover would (attempt 2): Temporal answers
    # the first outcome, the hooks do not run again.
    again = [await sink.deliver(request, 2) for request in sent]
    assert [a.absorbed for a in again] == [True] * 3
    assert await effects(client, run_id) == [
        ["schedule_step", f"{run_id}-d1", 1, f"{run_id}-d1-s"],
        ["schedule_steps", f"{run_id}-d2", 1, ["a", "b"]],
        ["schedule_step", f"{run_id}-d3", 1, f"{run_id}-d3-s"],
    ]
    applied = await client.get_workflow_handle(run_id).query(APPLIED_QUERY)
    assert [ack["decision_id"] for ack in applied] == [r.decision_id for r in sent]


async def test_concurrent_submissions_of_one_decision_apply_it_once(client: Client) -> None:
    run_id = _uid("run")
    sink = run_sink(client)  # wait=accepted, the default
    requests = [step(f"{run_id}-d{n}", run_id) for n in range(5)]
    await asyncio.gather(*(sink.submit(r, attempt) for r in requests for attempt in (1, 2, 3)))
    # Accepted is not finished: wait for each one's outcome (a repeat attaches to it).
    waiting = run_sink(client, wait="completed")
    assert [(await waiting.deliver(r, 4)).absorbed for r in requests] == [True] * 5
    seen = await effects(client, run_id)
    assert sorted(effect[1] for effect in seen) == sorted(r.decision_id for r in requests)


async def test_complete_ends_the_run_and_late_decisions_are_absorbed_or_refused(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    run_id = _uid("run")
    sink = run_sink(client, wait="completed")
    first, last = step(f"{run_id}-d1", run_id), complete(f"{run_id}-end", run_id, {"ok": True})
    await sink.deliver(first, 1)
    await sink.deliver(last, 1)
    handle = client.get_workflow_handle(run_id)
    assert await handle.result() == {"ok": True}
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED
    # A late duplicate after the engine completed: absorbed, nothing runs again.
    assert (await sink.deliver(last, 2)).absorbed is True
    assert (await sink.deliver(first, 3)).absorbed is True
    assert (await run_sink(client).deliver(first, 4)).absorbed is None  # accepted-only: unknown
    # A *new* decision for the closed run starts nothing (no second run under the id).
    with pytest.raises(TemporalRunClosedError, match="already closed"):
        await sink.deliver(step(f"{run_id}-late", run_id), 1)
    gc.collect()  # an unretrieved future's error is logged when it is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert [e[1] for e in await effects(client, run_id)] == [f"{run_id}-d1", f"{run_id}-end"]
    runs = [w async for w in client.list_workflows(f"WorkflowId = '{run_id}'")]
    assert len(runs) == 1


async def test_a_fail_decision_fails_the_run(client: Client) -> None:
    run_id = _uid("run")
    request = DecisionRequest(
        decision_id=f"{run_id}-f",
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id="e",
        decision=Fail(error="the graph gave up"),
    )
    await run_sink(client).submit(request, 1)
    with pytest.raises(WorkflowFailureError) as failed:
        await client.get_workflow_handle(run_id).result()
    assert "the graph gave up" in str(failed.value.cause)
    assert (await run_sink(client, wait="completed").deliver(request, 2)).absorbed is True


async def test_after_continue_as_new_a_resubmission_is_absorbed_by_the_carried_memory(
    client: Client,
) -> None:
    # Temporal deduplicates update ids per workflow *run*; SmallFlowRun continues as
    # new after every 2 decisions, so the third decision lands in a new run.
    run_id = _uid("run")
    sink = run_sink(client, workflow="SmallFlowRun", wait="completed")
    requests = [step(f"{run_id}-d{n}", run_id) for n in range(3)]
    await sink.deliver(requests[0], 1)
    await sink.deliver(requests[1], 1)  # the run continues as new after this one
    # The first thing the new run gets is a resubmission: it may reach the handler
    # in the run's first workflow task, before the run method restored the memory.
    assert (await sink.deliver(requests[0], 2)).absorbed is True
    await sink.deliver(requests[2], 1)
    handle = client.get_workflow_handle(run_id)
    runs = [w async for w in client.list_workflows(f"WorkflowId = '{run_id}'")]
    assert len(runs) == 2  # one continued-as-new run and the current one
    assert (await sink.deliver(requests[1], 3)).absorbed is True
    assert await effects(client, run_id) == [["schedule_step", f"{run_id}-d2", 1, f"{run_id}-d2-s"]]
    applied = await handle.query(APPLIED_QUERY)
    assert [a["decision_id"] for a in applied] == [r.decision_id for r in requests]


async def test_start_mode_one_workflow_per_decision_already_started_is_absorbed(
    client: Client,
) -> None:
    sink = run_sink(client, workflow="HandleDecision", mode="start")
    request = step(_uid("dec"), _uid("run"))
    assert (await sink.deliver(request, 1)).absorbed is False
    assert (await sink.deliver(request, 2)).absorbed is True  # while it may still run
    handle = client.get_workflow_handle(request.decision_id)
    assert await handle.result() == {
        "decision_id": request.decision_id,
        "attempt": 1,
        "kind": "schedule_step",
    }
    assert (await sink.deliver(request, 3)).absorbed is True  # after it completed
    runs = [w async for w in client.list_workflows(f"WorkflowId = '{request.decision_id}'")]
    assert len(runs) == 1


async def test_a_crash_between_the_engines_accept_and_the_ledgers_completion(
    client: Client, temporal_server: TemporalServer, tmp_path: Path
) -> None:
    """A real dispatcher process is SIGKILLed right after Temporal accepted the
    decision; the takeover submits it again (attempt 2) and Temporal absorbs it."""
    run_id = _uid("run")
    url = temporal_server.url(TEMPORAL_QUEUE, "FlowRun", wait="completed")
    request = step(f"{run_id}-crash", run_id)
    await crash_then_take_over(tmp_path / "ledger.db", url, request)
    assert await effects(client, run_id) == [
        ["schedule_step", request.decision_id, 1, f"{request.decision_id}-s"]
    ]


async def test_without_a_worker_the_sink_fails_in_bounded_time(client: Client) -> None:
    sink = TemporalSink(client, task_queue=_uid("nobody-polls"), workflow="FlowRun", timeout_s=2)
    with pytest.raises(TemporalSinkError, match="within 2s"):
        await sink.submit(step(_uid("dec"), _uid("run")), 1)


async def test_a_decision_for_another_run_is_rejected_by_the_validator(client: Client) -> None:
    run_id = _uid("run")
    sink = run_sink(client, wait="completed")
    await sink.submit(step(f"{run_id}-d1", run_id), 1)
    stray = DecisionDelivery.of(step(_uid("dec"), _uid("other-run")), 1)
    handle = client.get_workflow_handle(run_id)
    with pytest.raises(WorkflowUpdateFailedError) as rejected:
        await handle.execute_update("flowdecision.decision", stray)
    assert "is for run" in str(rejected.value.cause)
    assert len(await effects(client, run_id)) == 1


async def test_probe_answers_while_the_server_runs(client: Client) -> None:
    await run_sink(client).probe()


def test_url_parsing_and_bad_urls() -> None:
    parsed = parse_temporal_url(
        "temporal://127.0.0.1:7233/prod?task_queue=q&workflow=FlowRun&mode=start&timeout=5"
    )
    assert (parsed.target_host, parsed.namespace, parsed.task_queue) == (
        "127.0.0.1:7233",
        "prod",
        "q",
    )
    assert (parsed.workflow, parsed.mode, parsed.wait, parsed.timeout_s, parsed.tls) == (
        "FlowRun",
        "start",
        "accepted",
        5.0,
        False,
    )
    assert parse_temporal_url("temporal://h:1?task_queue=q&workflow=W").namespace == "default"
    assert sink_kind("temporal://h:1/ns?task_queue=q&workflow=W") == "temporal"
    for bad, problem in [
        ("temporal://h:1/ns?workflow=W", "needs ?task_queue="),
        ("temporal://h:1/ns?task_queue=q", "needs ?workflow="),
        ("temporal://h/ns?task_queue=q&workflow=W", "needs host:port"),
        ("temporal://h:1/ns?task_queue=q&workflow=W&mode=later", "mode must be run or start"),
        ("temporal://h:1/ns?task_queue=q&workflow=W&wait=never", "wait must be"),
        ("temporal://h:1/ns?task_queue=q&workflow=W&timeout=0", "timeout must be positive"),
        ("temporal://h:1/ns?task_queue=q&workflow=W&color=red", "unknown parameter `color`"),
        ("temporal://h:1/ns?task_queue=q&task_queue=r&workflow=W", "sets `task_queue` twice"),
        ("temporal://h:1/a/b?task_queue=q&workflow=W", "the path is one namespace"),
    ]:
        with pytest.raises(SinkConfigError, match=re.escape(problem)):
            parse_temporal_url(bad)


async def test_a_url_naming_an_unreachable_server_is_a_clear_transient_error() -> None:
    # Transient, not a configuration error: a relay keeps trying until Temporal is up.
    url = f"temporal://127.0.0.1:{free_port()}/default?task_queue=q&workflow=W&timeout=3"
    with pytest.raises(TemporalSinkError, match=r"cannot connect to 127\.0\.0\.1") as raised:
        await open_sink(url)
    assert not isinstance(raised.value, SinkConfigError)


async def test_serve_with_a_temporal_sink_url(
    client: Client, temporal_server: TemporalServer, tmp_path: Path
) -> None:
    run_id = _uid("run")
    sent = step(f"{run_id}-serve", run_id)
    await post_twice_through_serve(
        tmp_path, temporal_server.url(TEMPORAL_QUEUE, "FlowRun", wait="completed"), sent
    )
    assert await effects(client, run_id) == [
        ["schedule_step", sent.decision_id, 1, f"{sent.decision_id}-s"]
    ]


def test_the_worker_fixture_is_the_shared_one(temporal_worker: TemporalWorkerProcess) -> None:
    assert temporal_worker.running and temporal_worker.task_queue == TEMPORAL_QUEUE


async def test_a_restarted_server_keeps_what_it_accepted(tmp_path: Path) -> None:
    """Its own server (the session's stays up): stopped, the sink fails in bounded
    time; started again on the same database, the same client finds the workflow."""
    server = TemporalServer(tmp_path / "temporal")
    await asyncio.to_thread(server.start)
    try:
        own = await Client.connect(server.address)
        # Start mode needs no worker for Temporal to accept the start.
        sink = TemporalSink(own, task_queue="unpolled", workflow="HandleDecision", mode="start",
                            timeout_s=3)  # fmt: skip
        sent = step(_uid("dec"), _uid("run"))
        assert (await sink.deliver(sent, 1)).absorbed is False
        await asyncio.to_thread(server.stop)
        with pytest.raises(TemporalSinkError, match=sent.decision_id):
            await sink.submit(sent, 2)
        await asyncio.to_thread(server.start)
        assert (await sink.deliver(sent, 3)).absorbed is True
    finally:
        await asyncio.to_thread(server.cleanup)
