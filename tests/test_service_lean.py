"""The lean ASGI path (service/lean.py, and the front of service/front.py) answers every
route as Starlette's own stack does.

In-process ASGI: the same requests go to two fresh apps built by ``create_app``,
one through the stack the service runs (``app.middleware_stack``, the lean
path), one through Starlette's ``build_middleware_stack()``. Statuses, headers
(but ``date``) and bodies must be equal, request by request; every answer is
also checked over real sockets in the other service tests.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.routing import Route

from flowdecision import tracing
from flowdecision.ledger import MemoryLedger
from flowdecision.service.app import Service, create_app
from flowdecision.service.config import Settings
from flowdecision.service.front import DecisionsFront
from flowdecision.service.lean import LeanRouter, lean_stack
from tests.helpers import RecordingSink
from tests.otel_support import spans_fixture, traceparent  # noqa: F401 (the `spans` fixture)

_DECISION = (
    b'{"decision_id":"d-1","run_id":"r","authority_branch_id":"production",'
    b'"causation_event_id":"e","decision":{"type":"fail","error":"x"}}'
)
_JSON = {"Content-Type": "application/json", "X-Request-Id": "req-1"}

Request = tuple[str, str, dict[str, str], bytes]


def _post(headers: dict[str, str], body: bytes = _DECISION) -> Request:
    return ("POST", "/v1/decisions", headers, body)


def _get(path: str, headers: dict[str, str] | None = None) -> Request:
    return ("GET", path, {"X-Request-Id": "req-1", **(headers or {})}, b"")


#: case -> (settings overrides, requests sent to one app in turn, expected statuses)
CASES: dict[str, tuple[dict[str, Any], list[Request], list[int]]] = {
    "submitted then duplicate, then read": (
        {},
        [_post(_JSON), _post(_JSON), _get("/v1/decisions/d-1"), _get("/v1/decisions/nope")],
        [201, 200, 200, 404],
    ),
    "ids with dots and slashes": (
        {},
        [_get("/v1/decisions/a/b"), _get("/v1/decisions/%2E%2E"), _get("/v1/decisions/")],
        [404, 404, 404],
    ),
    "prefer wait": ({}, [_post({**_JSON, "Prefer": "wait=2"})], [201]),
    "wrong content type": ({}, [_post({**_JSON, "Content-Type": "text/plain"})], [415]),
    "foreign host": ({}, [_post({**_JSON, "Host": "evil.example"})], [421]),
    "foreign origin": ({}, [_post({**_JSON, "Origin": "http://evil.example"})], [403]),
    "allowed origin and its preflight": (
        {"allowed_origins": ("http://console.example",)},
        [
            _post({**_JSON, "Origin": "http://console.example"}),
            (
                "OPTIONS",
                "/v1/decisions",
                {"Origin": "http://console.example", "Access-Control-Request-Method": "POST"},
                b"",
            ),
        ],
        [201, 204],
    ),
    "invalid body": ({}, [_post(_JSON, b'{"decision_id":')], [422]),
    "too large": ({"max_body_bytes": 64}, [_post(_JSON)], [413]),
    "no token": ({"token": "secret"}, [_post(_JSON), _get("/metrics")], [401, 401]),
    "token": (
        {"token": "secret"},
        [_post({**_JSON, "Authorization": "Bearer secret"}), _get("/healthz")],
        [201, 200],
    ),
    "reads": (
        {},
        [_get("/healthz"), _get("/metrics"), _get("/"), _get("/openapi.json")],
        [200, 200, 200, 200],
    ),
    "outbox": (
        {"sink": "memory:"},
        [_get("/v1/outbox?limit=5"), _get("/v1/outbox?limit=0"), _get("/v1/outbox?after=x")],
        [404, 404, 404],
    ),
    # Requests the front (service/front.py) sends down the stack, and ones it answers.
    "front: headers it leaves to the stack": (
        {},
        [
            _post({**_JSON, "Expect": "100-continue"}),
            _post({**_JSON, "Content-Encoding": "identity"}),
            _post({**_JSON, "Content-Encoding": "gzip"}),
            _post({**_JSON, "Expect": "nothing"}),
            _post({**_JSON, "Content-Type": "application/json; charset=utf-8"}),
            _post({**_JSON, "Content-Type": "Application/JSON"}),
        ],
        [201, 200, 415, 417, 200, 200],
    ),
    "front: request ids": (
        {},
        [
            _post({**_JSON, "X-Request-Id": "bad id!"}),
            ("POST", "/v1/decisions", {"Content-Type": "application/json"}, _DECISION),
        ],
        [201, 200],
    ),
    "front: tokens": (
        {"token": "secret", "auth_healthz": True},
        [
            _post({**_JSON, "Authorization": "Bearer wrong"}),
            _post({**_JSON, "Authorization": "Basic dTpzZWNyZXQ="}),
            _post({**_JSON, "Authorization": "Basic %%%"}),
        ],
        [401, 201, 401],
    ),
    "front: invalid and oversized decisions, wait": (
        {"max_body_bytes": 4096},
        [
            _post(_JSON, b"{}"),
            _post(_JSON, b""),
            _post({**_JSON, "Prefer": "wait=1, other", "prefer": "wait=3"}),
            _post(_JSON, b'{"decision_id":"' + b"x" * 5000 + b'"}'),
        ],
        [422, 422, 201, 413],
    ),
    "methods and paths no route has": (
        {},
        [
            ("PUT", "/healthz", {}, b""),
            ("DELETE", "/v1/decisions", {}, b""),
            ("HEAD", "/healthz", {}, b""),
            _get("/nope"),
            _get("/healthz/"),
            ("PATCH", "/v1/decisions", {}, b""),
        ],
        [405, 405, 200, 404, 307, 405],
    ),
}


#: A request id the service made up (16 hex digits of the process, a counter).
_GENERATED_ID = re.compile(r"^[0-9a-f]{24}$")


def _without_times(response: httpx.Response) -> bytes:
    """The body, with the times and durations that differ between two runs masked."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return re.sub(rb'(_at_ms|_micros|_ms|_s)":[0-9.]+', rb'\1":0', response.content)
    return re.sub(rb"[0-9]+", b"0", response.content)  # metrics, the status page


async def _answers(
    settings: Settings, requests: list[Request], lean: bool
) -> tuple[list[tuple[int, list[tuple[str, str]], bytes]], Starlette]:
    app = create_app(settings, service=Service(settings, MemoryLedger(), RecordingSink()))
    if not lean:
        app.middleware_stack = app.build_middleware_stack()  # Starlette's own layers
    transport = httpx.ASGITransport(app=app)
    answers = []
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for method, path, headers, body in requests:
            headers = {"X-Request-Id": "req-1", **headers}  # not a new id per run
            response = await client.request(method, path, headers=headers, content=body)
            if method != "HEAD" and "content-length" in response.headers:
                assert int(response.headers["content-length"]) == len(response.content)
            answers.append(
                (
                    response.status_code,
                    sorted(
                        (k, _GENERATED_ID.sub("<new id>", v))
                        for k, v in response.headers.items()
                        if k not in ("date", "content-length")
                    ),
                    _without_times(response),
                )
            )
    return answers, app


@pytest.mark.parametrize("case", list(CASES))
async def test_the_lean_path_answers_as_starlettes_stack(case: str) -> None:
    overrides, requests, statuses = CASES[case]
    overrides = dict(overrides)
    sink = overrides.pop("sink", "python:tests.helpers:RecordingSink")
    settings = Settings(ledger="memory:", sink=sink, **overrides)
    lean, _app = await _answers(settings, requests, lean=True)
    full, _ = await _answers(settings, requests, lean=False)
    assert lean == full
    assert [status for status, _, _ in lean] == statuses


def test_every_route_of_the_service_takes_the_lean_path() -> None:
    settings = Settings(ledger="memory:", sink="memory:")
    app = create_app(settings)
    stack: Any = app.middleware_stack
    while not isinstance(stack, LeanRouter):
        stack = stack.app  # down through the user middleware
    routes = [route for route in app.routes if isinstance(route, Route)]
    assert len(routes) == len(app.routes)
    taken = {route.path for route in [*stack.exact.values(), *stack.patterned]}
    assert taken == {route.path for route in routes}
    assert stack._ordered
    assert "/v1/decisions" in stack.exact
    assert {route.path for route in stack.patterned} == {
        "/v1/decisions/{decision_id:path}",
        "/v1/runs/{run_id:path}",
    }


async def test_a_route_the_lean_path_cannot_call_sends_everything_through_starlette() -> None:
    class AsgiEndpoint:
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def endpoint(request: Any) -> Any:
        raise AssertionError("shadowed by the ASGI route before it")

    app = Starlette(routes=[Route("/x", AsgiEndpoint()), Route("/x", endpoint)])
    app.middleware_stack = lean_stack(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/x")).status_code == 204


async def test_the_front_answers_plain_submissions_and_sends_the_rest_down_the_stack() -> None:
    settings = Settings(ledger="memory:", sink="memory:")
    app = create_app(settings, service=Service(settings, MemoryLedger(), RecordingSink()))
    front = app.middleware_stack
    assert isinstance(front, DecisionsFront) and front.enabled
    stack = front.app
    down: list[str] = []

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        down.append(f"{scope['method']} {scope['path']}")
        await stack(scope, receive, send)

    front.app = recording
    transport = httpx.ASGITransport(app=app)
    statuses = []
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for headers, body in [
            (_JSON, _DECISION),  # taken
            ({**_JSON, "Prefer": "wait=1"}, _DECISION),  # taken
            ({**_JSON, "Origin": "http://evil.example"}, _DECISION),
            ({**_JSON, "Host": "evil.example"}, _DECISION),
            ({"X-Request-Id": "req-2"}, _DECISION),  # no content type
            (_JSON, b"not json"),  # taken: the handler's 422
        ]:
            response = await client.post("/v1/decisions", headers=headers, content=body)
            statuses.append(response.status_code)
        statuses.append((await client.get("/healthz")).status_code)
    assert statuses == [201, 200, 403, 421, 415, 422, 200]
    assert down == ["POST /v1/decisions"] * 3 + ["GET /healthz"]


_CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("caller", [None, _CALLER])
async def test_traced_the_front_opens_the_server_span_the_stack_would(
    spans: InMemorySpanExporter, caller: str | None
) -> None:
    """The front names its server span for the route as it starts it and extracts a
    parent only when a header carries one: the finished span is the stack's."""
    headers = {**_JSON, "X-Request-Id": "req-1"}
    if caller is not None:
        headers["traceparent"] = caller
    finished = {}
    for lean in (True, False):
        await _answers(Settings(ledger="memory:", sink="memory:"), [_post(headers)], lean=lean)
        [server] = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
        spans.clear()
        parent = server.parent
        finished[lean] = (
            server.name,
            dict(server.attributes or {}),
            None if parent is None else f"{parent.trace_id:032x}-{parent.span_id:016x}",
        )
        # The span's traceparent, formatted once and kept by the lean span, is W3C's.
        assert tracing.traceparent_of(server) == traceparent(server)
    assert finished[True] == finished[False]
    name, attributes, parent_ids = finished[True]
    assert name == "POST /v1/decisions" and attributes["http.route"] == "/v1/decisions"
    assert attributes["http.response.status_code"] == 201
    assert parent_ids == (None if caller is None else caller[3:52])
