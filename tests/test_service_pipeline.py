"""The service's one request path (service/pipeline.py): every rule, in its order, on
every route; the router (service/routing.py).

In-process ASGI, one fresh app per case, requests sent in turn; every answer is also
checked over real sockets in the other service tests (test_service*.py).
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from flowdecision.ledger import MemoryLedger
from flowdecision.service.app import Service, create_app
from flowdecision.service.config import Settings
from flowdecision.service.routing import Route, Router
from tests.helpers import RecordingSink
from tests.otel_support import spans_fixture  # noqa: F401 (the `spans` fixture)

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
    "an admin token opens the operator's routes only": (
        {"token": "secret", "admin_token": "admin"},
        [
            _get("/v1/audit", {"Authorization": "Bearer admin"}),
            _post({**_JSON, "Authorization": "Bearer admin"}),
        ],
        [200, 403],
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
    "framing and expectations": (
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
    "request ids": (
        {},
        [
            _post({**_JSON, "X-Request-Id": "bad id!"}),
            ("POST", "/v1/decisions", {"Content-Type": "application/json"}, _DECISION),
        ],
        [201, 200],
    ),
    "tokens": (
        {"token": "secret", "auth_healthz": True},
        [
            _post({**_JSON, "Authorization": "Bearer wrong"}),
            _post({**_JSON, "Authorization": "Basic dTpzZWNyZXQ="}),
            _post({**_JSON, "Authorization": "Basic %%%"}),
        ],
        [401, 201, 401],
    ),
    "invalid and oversized decisions, wait": (
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


async def _answers(settings: Settings, requests: list[Request]) -> list[httpx.Response]:
    app = create_app(settings, service=Service(settings, MemoryLedger(), RecordingSink()))
    transport = httpx.ASGITransport(app=app)
    answers = []
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for method, path, headers, body in requests:
            response = await client.request(method, path, headers=headers, content=body)
            if method != "HEAD" and "content-length" in response.headers:
                assert int(response.headers["content-length"]) == len(response.content)
            answers.append(response)
    return answers


def _settings(overrides: dict[str, Any]) -> Settings:
    overrides = dict(overrides)
    sink = overrides.pop("sink", "python:tests.helpers:RecordingSink")
    return Settings(ledger="memory:", sink=sink, **overrides)


@pytest.mark.parametrize("case", list(CASES))
async def test_every_rule_answers_in_its_order(case: str) -> None:
    overrides, requests, statuses = CASES[case]
    answers = await _answers(_settings(overrides), requests)
    assert [answer.status_code for answer in answers] == statuses
    for (_, _, headers, _), answer in zip(requests, answers, strict=True):
        # Every answer, refusals included, carries the request id: the client's when plain.
        sent = headers.get("X-Request-Id")
        if sent == "req-1":
            assert answer.headers["x-request-id"] == "req-1"
        else:
            assert _GENERATED_ID.match(answer.headers["x-request-id"])
        if answer.status_code >= 400 and answer.request.method != "HEAD":
            error = answer.json()["error"]
            assert error["request_id"] == answer.headers["x-request-id"]
            assert error["code"] and error["message"]


async def test_refusals_carry_what_the_client_needs_to_act() -> None:
    settings = _settings({"token": "secret", "allowed_origins": ("http://console.example",)})
    console = {"Origin": "http://console.example", "Authorization": "Bearer secret"}
    wrong_type = {**_JSON, **console, "Content-Type": "text/plain"}
    put, slash, no_token, preflight, unknown_type = await _answers(
        settings,
        [
            ("PUT", "/v1/decisions", console, b""),
            ("GET", "/healthz/?x=1", {"Authorization": "Bearer secret"}, b""),
            _post({**_JSON, "Origin": "http://console.example"}),
            (
                "OPTIONS",
                "/v1/decisions",
                {"Origin": "http://console.example", "Access-Control-Request-Method": "POST"},
                b"",
            ),
            _post(wrong_type),
        ],
    )
    assert put.status_code == 405 and put.headers["allow"] == "GET, HEAD, POST"
    assert put.json()["error"]["code"] == "method_not_allowed"
    assert slash.status_code == 307 and slash.headers["location"] == "/healthz?x=1"
    # A refusal of an allowed origin's request carries its CORS headers, so the page reads it.
    assert no_token.status_code == 401
    assert no_token.headers["access-control-allow-origin"] == "http://console.example"
    assert no_token.headers.get_list("www-authenticate") == [
        'Bearer realm="flowdecision"',
        'Basic realm="flowdecision"',
    ]
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-methods"] == "GET, POST"
    assert "access-control-expose-headers" not in preflight.headers
    # Refused before its body was read: the connection cannot carry another request.
    assert unknown_type.status_code == 415 and unknown_type.headers["connection"] == "close"
    assert unknown_type.headers["access-control-expose-headers"] == "retry-after, x-request-id"


async def test_an_unknown_path_is_refused_before_auth_leaks_nothing() -> None:
    """Without a token, an unknown path is a 401 like any other: no route list leaks."""
    [unknown, known] = await _answers(
        _settings({"token": "secret"}), [_get("/nope"), _get("/v1/audit")]
    )
    assert (unknown.status_code, known.status_code) == (401, 401)


def test_the_router_finds_plain_paths_patterns_and_slash_redirects() -> None:
    async def endpoint(request: Any) -> Any:  # never called
        raise AssertionError

    async def other(request: Any) -> Any:  # never called
        raise AssertionError

    router = Router(
        [
            Route("/a", endpoint, methods=["GET"]),
            Route("/items/{item_id}", endpoint, methods=["GET"]),
            Route("/files/{rest:path}", endpoint, methods=["GET"]),
            Route("/files/special", endpoint, methods=["GET"]),  # shadowed by the template
            Route("/items/{item_id}", other, methods=["POST"]),  # one endpoint per method
        ]
    )
    found = router.find("/items/x1")
    assert found is not None and found.params == {"item_id": "x1"}
    assert found.routes.endpoints == {"GET": endpoint, "HEAD": endpoint, "POST": other}
    assert found.routes.allow == "GET, HEAD, POST"
    assert router.find("/items/x1/more") is None
    deep = router.find("/files/a/b.txt")
    assert deep is not None and deep.params == {"rest": "a/b.txt"}
    special = router.find("/files/special")
    assert special is not None and special.routes.path == "/files/{rest:path}"
    assert router.redirect("/a/") == "/a" and router.redirect("/b") is None
    assert router.redirect("/items/x1/") == "/items/x1"
    assert router.redirect("/items/x1/more/") is None  # neither it nor its twin has a route
    with pytest.raises(ValueError, match="twice"):
        Route("/{x}/{x}", endpoint, methods=["GET"])
    with pytest.raises(ValueError, match="no method"):
        Route("/x", endpoint, methods=[])
    with pytest.raises(ValueError, match="two routes take GET /a"):
        Router([Route("/a", endpoint, methods=["GET"]), Route("/a", other, methods=["GET"])])


_CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("caller", [None, _CALLER])
async def test_traced_each_request_has_one_server_span_named_for_its_route(
    spans: InMemorySpanExporter, caller: str | None
) -> None:
    headers = dict(_JSON)
    if caller is not None:
        headers["traceparent"] = caller
    await _answers(_settings({}), [_post(headers), _get("/nope", headers)])
    servers = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert [s.name for s in servers] == ["POST /v1/decisions", "GET"]
    posted, unknown = (dict(s.attributes or {}) for s in servers)
    assert posted["http.route"] == "/v1/decisions"
    assert posted["http.response.status_code"] == 201
    assert "http.route" not in unknown and unknown["http.response.status_code"] == 404
    for server in servers:
        parent = server.parent
        got = None if parent is None else f"{parent.trace_id:032x}-{parent.span_id:016x}"
        assert got == (None if caller is None else caller[3:52])
