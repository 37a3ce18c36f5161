"""The lean ASGI path (service/lean.py) answers every route as Starlette's own stack does.

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
from starlette.applications import Starlette
from starlette.routing import Route

from flowdecision.ledger import MemoryLedger
from flowdecision.service.app import Service, create_app
from flowdecision.service.config import Settings
from flowdecision.service.lean import LeanRouter, lean_stack
from tests.helpers import RecordingSink

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
                        (k, v)
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
