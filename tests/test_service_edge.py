"""The edge seam (service/edge/): the uvicorn contract it relies on, ``--edge=plain``,
the request-head cap (431) and malformed HTTP answered as JSON, on real sockets."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from flowdecision.service.config import ConfigError, Settings
from flowdecision.service.edge import HEAD_MAX_BYTES, HEAD_MAX_FIELDS, contract
from flowdecision.service.server import check_edge
from tests.service_process import ROOT, ServiceProcess, decision
from tests.test_service_transport import (
    STACKS,
    _connect,
    _read_until_closed,
    _stack_args,
    _status_and_error,
)

# -- the contract with uvicorn ---------------------------------------------------------------


def test_the_installed_uvicorn_keeps_every_internal_the_edge_relies_on() -> None:
    contract.contract_problems.cache_clear()
    assert contract.contract_problems() == ()


def test_the_tested_versions_are_the_pinned_ones_and_installed() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    service = pyproject["project"]["optional-dependencies"]["service"]
    for package, (low, high) in contract.TESTED.items():
        pins = [line for line in service if re.match(rf"{package}\b", line)]
        assert len(pins) == 1, (package, service)
        shown = ".".join(map(str, low)), ".".join(map(str, high))
        assert pins[0].split(";")[0].strip() == f"{package}>={shown[0]},<{shown[1]}", pins[0]
    installed = contract.installed_versions()
    assert set(installed) == set(contract.TESTED)  # uvloop and httptools are installed in CI
    assert all(within for _version, within in installed.values()), installed


def test_a_moved_internal_is_named_and_the_guarded_edge_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if uvicorn renamed its keep-alive helper, which the edge calls.
    monkeypatch.delattr(H11Protocol, "_unset_keepalive_if_required")
    contract.contract_problems.cache_clear()
    try:
        problems = contract.contract_problems()
        assert problems == (
            "uvicorn.protocols.http.h11_impl.H11Protocol._unset_keepalive_if_required() is gone",
        )
        with pytest.raises(ConfigError, match=r"_unset_keepalive_if_required.*edge = plain"):
            check_edge(Settings().validate())
        check_edge(Settings(edge="plain").validate())  # stock uvicorn needs no contract
    finally:
        monkeypatch.undo()
        contract.contract_problems.cache_clear()


def test_the_contract_reads_assignments_in_uvicorns_source() -> None:
    import ast

    tree = ast.parse("class C:\n def f(self):\n  self.cycle = 1\n  self.n: int = 2\n  x = 3\n")
    assert contract._self_assignments(tree) == {"cycle", "n"}


# -- --edge=plain ------------------------------------------------------------------------------


def _big_header_request(size: int) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: %s\r\n\r\n" % (b"a" * size)


def test_plain_edge_serves_with_stock_uvicorn(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--edge", "plain") as service:
        with httpx.Client(base_url=service.url, headers=service.headers) as client:
            assert client.post("/v1/decisions", content=decision().to_json()).status_code == 201
            health = client.get("/healthz")
            assert health.status_code == 200 and health.headers["x-request-id"]
        # No head cap of its own: that is the proxy's job (docs/SERVICE.md).
        with _connect(service.url) as conn:
            conn.sendall(_big_header_request(HEAD_MAX_BYTES * 2))
            assert _read_until_closed(conn).startswith(b"HTTP/1.1 200 ")
    assert "connection limits" not in service.log_text()


def test_an_unknown_edge_is_refused() -> None:
    with pytest.raises(ConfigError, match="edge must be one of guarded, plain"):
        Settings(edge="nginx").validate()


# -- the request-head cap --------------------------------------------------------------------


@pytest.fixture(params=STACKS, ids=[f"{h}-{lp}" for h, lp in STACKS])
def edge_service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path, *_stack_args(*request.param)) as service:
        yield service


def test_a_request_head_past_the_cap_is_a_431(edge_service: ServiceProcess) -> None:
    with _connect(edge_service.url) as conn:
        conn.sendall(_big_header_request(HEAD_MAX_BYTES))
        answer = _read_until_closed(conn)
    assert _status_and_error(answer) == (431, "request_head_too_large")
    fields = b"".join(b"X-F%d: v\r\n" % n for n in range(HEAD_MAX_FIELDS))
    with _connect(edge_service.url) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + fields + b"\r\n")
        assert _status_and_error(_read_until_closed(conn)) == (431, "request_head_too_large")
    # A 32 MB header: refused after the first 64 KiB, without reading the rest into memory.
    with _connect(edge_service.url) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        try:
            for _ in range(32 * 16):
                conn.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the service closed after lingering; the answer was sent before
        else:
            answer = _read_until_closed(conn)
            assert _status_and_error(answer) == (431, "request_head_too_large")
    assert "head_too_large" in _wait_for_log(edge_service, "head_too_large")


def _wait_for_log(service: ServiceProcess, needle: str) -> str:
    from tests.service_process import wait_for

    wait_for(lambda: needle in service.log_text(), timeout=30)
    return service.log_text()


def test_a_head_at_the_cap_passes_even_when_its_end_is_split_across_reads(
    edge_service: ServiceProcess,
) -> None:
    # Host, Content-Type, Content-Length and these: exactly the cap.
    fields = b"".join(b"X-F%d: v\r\n" % n for n in range(HEAD_MAX_FIELDS - 3))
    body = decision().to_json() + b" " * 200_000  # a body larger than the head cap
    head = (
        b"POST /v1/decisions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + fields
        + b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with _connect(edge_service.url) as conn:
        conn.sendall(head[:-1])  # the blank line's last byte comes with the body
        conn.sendall(head[-1:] + body)
        answer = conn.recv(65536)
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:200]


# -- malformed HTTP ---------------------------------------------------------------------------

_MALFORMED = {
    "content-length and transfer-encoding": (
        b"POST /v1/decisions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "two content-lengths": (
        b"POST /v1/decisions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
    ),
    "a request line that is not HTTP": b"GET / SPDY/9\r\nHost: localhost\r\n\r\n",
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_http_gets_a_json_400_with_a_request_id(
    edge_service: ServiceProcess, case: str
) -> None:
    with _connect(edge_service.url) as conn:
        conn.sendall(_MALFORMED[case])
        answer = _read_until_closed(conn)
    assert _status_and_error(answer) == (400, "bad_request")
    assert b"content-type: application/json" in answer.lower()


def test_an_unknown_method_gets_json_with_a_request_id(edge_service: ServiceProcess) -> None:
    # httptools refuses the method itself (400); h11 hands it to the app (405).
    with _connect(edge_service.url) as conn:
        conn.sendall(b"BREW /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answer = _read_until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert status in (400, 405), head
    assert re.search(rb"(?im)^x-request-id: ", head), head
    assert json.loads(body)["error"]["code"] in ("bad_request", "method_not_allowed")


# -- what HTTP/1.1 forbids, whichever parser and edge read it --------------------------------

#: (parser, loop, edge): both parsers behind the guarded edge, and stock uvicorn.
ALL_STACKS = [(*stack, "guarded") for stack in STACKS] + [("httptools", "uvloop", "plain")]


@pytest.fixture(params=ALL_STACKS, ids=["-".join(stack) for stack in ALL_STACKS], scope="module")
def any_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    http, loop, edge = request.param
    cwd = tmp_path_factory.mktemp("any")
    with ServiceProcess(
        cwd, *_stack_args(http, loop), "--edge", edge, "--sink", "sqlite:///o.db"
    ) as service:
        yield service


def _exchange(service: ServiceProcess, raw: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    with _connect(service.url) as conn:
        conn.sendall(raw)
        answer = _read_until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines[1:])
    }
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(body) if body else {}


def _code(body: dict[str, object]) -> object:
    error = body.get("error")
    return error.get("code") if isinstance(error, dict) else None


_BODY = decision("hostile-1").to_json()


@pytest.mark.parametrize(
    ("case", "raw", "status", "code"),
    [
        ("no host", b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n", 400, "bad_request"),
        (
            "two hosts",
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.com\r\n"
            b"Connection: close\r\n\r\n",
            400,
            "bad_request",
        ),
        (
            "expect 200-ok",
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nExpect: 200-ok\r\n"
            b"Connection: close\r\n\r\n",
            417,
            "expectation_failed",
        ),
        (
            "gzip body",
            b"POST /v1/decisions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (len(_BODY), _BODY),
            415,
            "unsupported_media_type",
        ),
        (
            "fullwidth digit",
            b"GET /v1/outbox?limit=%EF%BC%95 HTTP/1.1\r\nHost: localhost\r\n"
            b"Connection: close\r\n\r\n",
            422,
            "invalid_parameter",
        ),
        (
            "arabic-indic digit",
            b"GET /v1/outbox?after=%D9%A3 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            422,
            "invalid_parameter",
        ),
        (
            "put without content type",
            b"PUT /v1/decisions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n"
            b"Connection: close\r\n\r\n{}",
            405,
            "method_not_allowed",
        ),
        (
            "patch with a text body",
            b"PATCH /v1/decisions HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 2\r\nConnection: close\r\n\r\nhi",
            405,
            "method_not_allowed",
        ),
    ],
)
def test_what_http_forbids_is_refused_with_the_right_4xx(
    any_service: ServiceProcess, case: str, raw: bytes, status: int, code: str
) -> None:
    got, headers, body = _exchange(any_service, raw)
    assert (got, _code(body)) == (status, code), (case, body)
    assert headers["x-request-id"] == body["error"]["request_id"]  # type: ignore[index]
    if status == 405:
        # /v1/decisions also lists decisions (GET, and so HEAD); Starlette's order varies.
        assert set(headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}
    # Nothing was dispatched.
    with httpx.Client(base_url=any_service.url) as client:
        assert client.get("/v1/decisions/hostile-1").status_code == 404


def test_ascii_digits_and_one_host_still_pass(any_service: ServiceProcess) -> None:
    got, _headers, body = _exchange(
        any_service,
        b"GET /v1/outbox?limit=5&after=0 HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert got == 200 and body["has_more"] is False
    got, _headers, _body = _exchange(
        any_service, b"GET /healthz HTTP/1.0\r\n\r\n"
    )  # HTTP/1.0 needs no Host
    assert got == 200
