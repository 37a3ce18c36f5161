"""RestateSink against a real Restate server and the example service (examples/restate_service.py).

The server and the deployment (served by hypercorn, registered with the
server) start once per session (tests/engine_fixtures.py). Effects are read
back from the engine: the ``DecisionRun`` virtual object's state, and the
lines ``Decisions/handle`` appends to ``restate_effects`` from a journaled step.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from flowdecision import DecisionRequest
from flowdecision.sinks import Sink
from flowdecision.sinks.delivery import DecisionDelivery
from flowdecision.sinks.loader import SinkConfigError, close_sink, open_sink, sink_kind
from flowdecision.sinks.restate import RestateSink, parse_restate_url
from flowdecision.sinks.webhook import WebhookError, WebhookRejectedError
from tests.engine_crash import crash_then_take_over, post_twice_through_serve
from tests.engine_servers import RestateDeployment, RestateServer
from tests.service_process import decision, wait_for

pytestmark = pytest.mark.usefixtures("restate_deployment")


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def step(decision_id: str, run_id: str) -> DecisionRequest:
    """A schedule_step decision (step id ``<decision_id>-s``)."""
    return decision(decision_id, run_id=run_id)


async def applied(server: RestateServer, run_id: str) -> dict[str, Any]:
    """The DecisionRun object's state for ``run_id`` (a shared handler: no queueing)."""
    async with httpx.AsyncClient() as http:
        key = quote(run_id, safe="")
        response = await http.post(f"{server.ingress}/DecisionRun/{key}/applied")
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def effect_lines(path: Path, decision_id: str) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if line.split()[0] == decision_id]


async def test_keyed_by_run_each_decision_applied_once_in_order(
    restate_server: RestateServer,
) -> None:
    run_id = _uid("run/with slash")  # the key is URL-quoted
    sink = RestateSink(restate_server.url("DecisionRun", "apply", keyed_by_run=True))
    assert isinstance(sink, Sink)
    requests = [step(f"{run_id}-d{n}", run_id) for n in range(5)]
    try:
        first = [await sink.deliver(r, 1) for r in requests]
        again = [await sink.deliver(r, 2) for r in requests]  # a takeover's resubmission
    finally:
        await sink.close()
    assert [a.absorbed for a in first] == [False] * 5
    assert [a.absorbed for a in again] == [True] * 5
    assert [a.target for a in again] == [a.target for a in first]  # the same invocations
    await asyncio.to_thread(
        wait_for, lambda: len(asyncio.run(applied(restate_server, run_id))) == 5
    )
    state = await applied(restate_server, run_id)
    assert {d: (s["attempt"], s["order"]) for d, s in state.items()} == {
        r.decision_id: (1, n) for n, r in enumerate(requests)
    }


async def test_service_form_runs_the_handler_once_per_decision(
    restate_server: RestateServer, restate_effects: Path
) -> None:
    sink = await open_sink(restate_server.url("Decisions", "handle"))
    request = step(_uid("dec"), _uid("run"))
    try:
        answers = await asyncio.gather(*(sink.deliver(request, n) for n in (1, 2, 3)))  # type: ignore[attr-defined]
        await asyncio.to_thread(
            wait_for, lambda: effect_lines(restate_effects, request.decision_id)
        )
        # A late duplicate after the handler completed: Restate still knows the key.
        late = await sink.deliver(request, 4)  # type: ignore[attr-defined]
    finally:
        await close_sink(sink)
    assert sorted(a.absorbed for a in answers) == [False, True, True]
    assert late.absorbed is True
    await asyncio.sleep(0.5)  # room for a wrong second run to show up
    assert effect_lines(restate_effects, request.decision_id) == [
        f"{request.decision_id} {[a.absorbed for a in answers].index(False) + 1} schedule_step"
    ]


async def test_the_object_refuses_a_resubmission_restate_no_longer_recognises(
    restate_server: RestateServer,
) -> None:
    """Restate forgets an idempotency key after its retention (24 h by default). A
    call without the key stands in for that: the object's own memory absorbs it."""
    run_id = _uid("run")
    request = step(f"{run_id}-d", run_id)
    sink = RestateSink(restate_server.url("DecisionRun", "apply", keyed_by_run=True))
    try:
        await sink.submit(request, 1)
    finally:
        await sink.close()
    body = DecisionDelivery.of(request, 7).to_dict()
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(f"{restate_server.ingress}/DecisionRun/{run_id}/apply", json=body)
    assert answer.json() == {"decision_id": request.decision_id, "applied": False, "attempt": 1}
    assert (await applied(restate_server, run_id))[request.decision_id]["attempt"] == 1


async def test_a_crash_between_the_engines_accept_and_the_ledgers_completion(
    restate_server: RestateServer, restate_effects: Path, tmp_path: Path
) -> None:
    url = restate_server.url("Decisions", "handle")
    request = step(_uid("dec-crash"), _uid("run"))
    await crash_then_take_over(tmp_path / "ledger.db", url, request)
    await asyncio.to_thread(wait_for, lambda: effect_lines(restate_effects, request.decision_id))
    await asyncio.sleep(0.5)
    assert effect_lines(restate_effects, request.decision_id) == [
        f"{request.decision_id} 1 schedule_step"
    ]


async def test_an_unknown_service_fails_at_once(restate_server: RestateServer) -> None:
    sink = RestateSink(restate_server.url("NoSuchService", "handle"))
    try:
        with pytest.raises(WebhookRejectedError, match=r"Restate rejected .* HTTP 404"):
            await sink.submit(step(_uid("dec"), _uid("run")), 1)
    finally:
        await sink.close()


async def test_probe(restate_server: RestateServer) -> None:
    sink = RestateSink(restate_server.url("Decisions", "handle"))
    try:
        await sink.probe()
    finally:
        await sink.close()


def test_url_parsing_and_bad_urls() -> None:
    target = parse_restate_url("restate+http://127.0.0.1:8080/Decisions/handle")
    assert (target.ingress, target.service, target.handler, target.keyed_by_run) == (
        "http://127.0.0.1:8080",
        "Decisions",
        "handle",
        False,
    )
    assert target.send_url("r") == "http://127.0.0.1:8080/Decisions/handle/send"
    keyed = parse_restate_url("restate+https://ingress/DecisionRun/{run_id}/apply")
    assert keyed.keyed_by_run and keyed.send_url("a/b c") == (
        "https://ingress/DecisionRun/a%2Fb%20c/apply/send"
    )
    assert sink_kind("restate+http://h:1/S/h") == "restate"
    for bad, problem in [
        ("restate+ftp://h/S/h", "must look like restate+http://"),
        ("restate+http://h/S", "the path must be /Service/handler"),
        ("restate+http://h/S/key/h", "the path must be /Service/handler"),
        ("restate+http://h/{run_id}/h", "the path must be /Service/handler"),
        ("restate+http://h/S/h?x=1", "takes no query"),
    ]:
        with pytest.raises(SinkConfigError, match=re.escape(problem)):
            parse_restate_url(bad)


async def test_serve_with_a_restate_sink_url(restate_server: RestateServer, tmp_path: Path) -> None:
    run_id = _uid("run")
    sent = step(f"{run_id}-serve", run_id)
    await post_twice_through_serve(
        tmp_path, restate_server.url("DecisionRun", "apply", keyed_by_run=True), sent
    )
    await asyncio.to_thread(wait_for, lambda: asyncio.run(applied(restate_server, run_id)) != {})
    state = await applied(restate_server, run_id)
    assert json.loads(json.dumps(state))[sent.decision_id]["attempt"] == 1
    assert list(state) == [sent.decision_id]


async def test_a_restarted_server_keeps_its_idempotency_keys(
    restate_deployment: RestateDeployment, tmp_path: Path
) -> None:
    """Its own server (the session's stays up), the session's service registered
    with it: stopped, the sink fails after its retries; started again on the same
    data, a resubmission is still PreviouslyAccepted and applied once."""
    server = RestateServer(tmp_path / "restate")
    await asyncio.to_thread(server.start)
    try:
        await asyncio.to_thread(server.register, restate_deployment.uri)
        run_id = _uid("run")
        sent = step(f"{run_id}-d", run_id)
        sink = RestateSink(server.url("DecisionRun", "apply", keyed_by_run=True),
                           timeout_s=2, max_attempts=2)  # fmt: skip
        try:
            assert (await sink.deliver(sent, 1)).absorbed is False
            await asyncio.to_thread(server.stop)
            with pytest.raises(WebhookError, match="Restate failed after 2 tries"):
                await sink.submit(sent, 2)
            await asyncio.to_thread(server.start)
            assert (await sink.deliver(sent, 3)).absorbed is True
        finally:
            await sink.close()
        await asyncio.to_thread(wait_for, lambda: asyncio.run(applied(server, run_id)) != {})
        assert {d: s["attempt"] for d, s in (await applied(server, run_id)).items()} == {
            sent.decision_id: 1
        }
    finally:
        await asyncio.to_thread(server.cleanup)
