"""The service's connection edge (service/edge/) on a real socket: TCP_NODELAY, the
Host/Origin/Content-Type guard with both HTTP parsers, header/body/keep-alive timeouts,
slow clients against a 1024-descriptor limit, and a 413 that urllib and requests can read."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import requests

from flowdecision.core.model import DecisionRequest
from flowdecision.service.config import ConfigError, Settings, load_settings
from flowdecision.service.edge import effective_max_connections
from flowdecision.service.server import _optional, bind_socket, event_loop_factory, serve
from tests.service_process import ServiceProcess, decision, wait_for

T = TypeVar("T")

#: Both HTTP stacks the service can run: the default (uvloop + httptools) and the fallback.
STACKS = [("httptools", "uvloop"), ("h11", "asyncio")]


def _stack_args(http: str, loop: str) -> tuple[str, ...]:
    return ("--http", http, "--loop", loop)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _run_in_process(settings: Settings, check: Callable[[str], Awaitable[T]]) -> T:
    """Run ``serve()`` (the code ``flowdecision serve`` runs) in this process, call ``check``
    with its URL, then stop it with SIGTERM as an operator would."""
    sock = bind_socket(settings.host, settings.port)

    async def main() -> T:
        ready = asyncio.Event()
        urls: list[str] = []

        def on_ready(url: str) -> None:
            urls.append(url)
            ready.set()

        task = asyncio.ensure_future(serve(settings, sock, on_ready))
        try:
            await asyncio.wait_for(ready.wait(), 30)
            return await check(urls[0])
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: a graceful stop
            await asyncio.wait_for(task, 30)

    try:
        with asyncio.Runner(loop_factory=event_loop_factory(settings)) as runner:
            return runner.run(main())
    finally:
        sock.close()


def _server_side_socket(client: socket.socket) -> socket.socket:
    """The accepted socket (a duplicate) at the other end of ``client``, found in this process."""
    local, peer = client.getsockname()[:2], client.getpeername()[:2]
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            candidate = socket.fromfd(fd, client.family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            if candidate.getsockname()[:2] == peer and candidate.getpeername()[:2] == local:
                return candidate
        except OSError:
            pass
        candidate.close()
    raise AssertionError("the accepted socket was not found")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(
    ("host", "fixed_port"),
    [("127.0.0.1", True), ("127.0.0.1", False), ("::1", False)],
    ids=["host-and-port", "port-0", "ipv6"],
)
def test_accepted_connections_have_tcp_nodelay(
    tmp_path: Path, host: str, fixed_port: bool, loop: str
) -> None:
    port = _free_port(host) if fixed_port else 0
    settings = Settings(
        host=host,
        port=port,
        ledger="memory:",
        sink=f"sqlite:///{tmp_path / 'outbox.db'}",
        loop=loop,
    ).validate()

    async def check(url: str) -> tuple[int, int]:
        if fixed_port:
            assert url.endswith(f":{port}")
        bound = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(bound[0].strip("[]"), int(bound[1]))
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 30)
        client = writer.get_extra_info("socket")
        with _server_side_socket(client) as accepted:
            nodelay = accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        return int(status_line.split()[1]), nodelay

    status, nodelay = _run_in_process(settings, check)
    assert status == 200
    assert nodelay != 0


# -- the guard, with both HTTP stacks ---------------------------------------------------


@pytest.fixture(params=STACKS, ids=[f"{h}-{lp}" for h, lp in STACKS])
def guarded(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServiceProcess]:
    http, loop = request.param
    with ServiceProcess(
        tmp_path,
        *_stack_args(http, loop),
        "--allowed-origins",
        "https://console.example, http://localhost:3000",
        "--allowed-hosts",
        "flow.internal",
    ) as service:
        yield service


def test_guard_refuses_wrong_content_type_foreign_origin_and_foreign_host(
    guarded: ServiceProcess,
) -> None:
    json_type = {"Content-Type": "application/json"}
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        refused = {
            "text/plain": client.post(
                "/v1/decisions",
                content=(plain := decision()).to_json(),
                headers={"Content-Type": "text/plain"},
            ),
            "no type": client.post("/v1/decisions", content=(untyped := decision()).to_json()),
            "foreign origin": client.post(
                "/v1/decisions",
                content=(foreign := decision()).to_json(),
                headers={**json_type, "Origin": "http://evil.example"},
            ),
            "rebound host": client.post(
                "/v1/decisions",
                content=(rebound := decision()).to_json(),
                headers={**json_type, "Host": "evil.test:8080"},
            ),
        }
        expected = {
            "text/plain": (415, "unsupported_media_type"),
            "no type": (415, "unsupported_media_type"),
            "foreign origin": (403, "origin_not_allowed"),
            "rebound host": (421, "host_not_allowed"),
        }
        for case, response in refused.items():
            code = response.json()["error"]["code"]
            assert (response.status_code, code) == expected[case], (case, response.text)
        assert "text/plain" in refused["text/plain"].json()["error"]["message"]
        for request in (plain, untyped, foreign, rebound):  # nothing was recorded
            assert client.get(f"/v1/decisions/{request.decision_id}").status_code == 404

        accepted = [
            client.post(
                "/v1/decisions",
                content=decision().to_json(),
                headers={"Content-Type": "application/json; charset=utf-8"},
            ),
            client.post(
                "/v1/decisions",
                content=decision().to_json(),
                headers={**json_type, "Origin": "https://console.example:443"},
            ),
            client.post(
                "/v1/decisions",
                content=decision().to_json(),
                headers={**json_type, "Host": "flow.internal:8080"},
            ),
            client.post(
                "/v1/decisions",
                content=decision().to_json(),
                headers={**json_type, "Host": "[::1]:9"},
            ),
        ]
        assert [r.status_code for r in accepted] == [201] * 4, [r.text for r in accepted]
        assert client.get("/healthz", headers={"Host": "localhost"}).status_code == 200
        assert client.get("/healthz", headers={"Host": "evil.test"}).status_code == 421


def test_host_check_is_off_on_a_public_bind_unless_names_are_configured(tmp_path: Path) -> None:
    from flowdecision.service.guards import BrowserGuard

    public = Settings(host="0.0.0.0", token="t" * 32)
    assert BrowserGuard.from_settings(public).check_host is False
    assert BrowserGuard.from_settings(Settings()).check_host is True
    named = Settings(host="0.0.0.0", token="t" * 32, allowed_hosts=("api.example",))
    assert BrowserGuard.from_settings(named).check_host is True


# -- timeouts ------------------------------------------------------------------------------


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
    return conn


def _read_until_closed(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket timeout)."""
    chunks = []
    while True:
        try:
            chunk = conn.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _read_response(conn: socket.socket) -> bytes:
    """One whole response with a ``content-length`` (the connection stays open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def _status_and_error(raw: bytes) -> tuple[int, str]:
    """Status and error code of a raw answer, which carries its request id (header and body)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error = json.loads(body)["error"]
    request_ids = re.findall(rb"(?im)^x-request-id: *([^\r\n]+)", head)
    assert [value.decode() for value in request_ids] == [error["request_id"]], head
    return status, error["code"]


@pytest.mark.parametrize(("http", "loop"), STACKS, ids=[f"{h}-{lp}" for h, lp in STACKS])
def test_slow_headers_slow_bodies_and_idle_connections_are_closed(
    tmp_path: Path, http: str, loop: str
) -> None:
    limits = (
        "--header-timeout-s",
        "0.5",
        "--body-timeout-s",
        "0.5",
        "--keep-alive-timeout-s",
        "0.5",
    )
    with ServiceProcess(tmp_path, *_stack_args(http, loop), *limits) as service:
        # Headers that never finish: 408 JSON, then the connection is closed.
        with _connect(service.url) as slow_head:
            slow_head.sendall(b"POST /v1/decisions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
            assert _status_and_error(_read_until_closed(slow_head)) == (408, "request_timeout")

        # A body that stops half-way: 408, and nothing is recorded.
        request = decision()
        body = request.to_json()
        with _connect(service.url) as slow_body:
            slow_body.sendall(
                b"POST /v1/decisions HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % len(body)
                + body[:10]
            )
            assert _status_and_error(_read_until_closed(slow_body)) == (408, "request_timeout")

        # A connection that never sends anything, and an idle keep-alive connection: closed.
        with _connect(service.url) as silent:
            assert _read_until_closed(silent) == b""
        with _connect(service.url) as idle:
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            answer = _read_until_closed(idle)  # the 200, then the close after 0.5 s idle
            assert answer.startswith(b"HTTP/1.1 200 ")

        # Pipelined requests are all answered (the timeouts follow each request).
        with _connect(service.url) as pipelined:
            ask = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
            pipelined.sendall(ask * 2 + ask.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
            assert _read_until_closed(pipelined).count(b"HTTP/1.1 200 ") == 3

        with httpx.Client(base_url=service.url, headers=service.headers) as client:
            assert client.get(f"/v1/decisions/{request.decision_id}").status_code == 404
            assert client.post("/v1/decisions", content=decision().to_json()).status_code == 201


# -- slow clients against a 1024-descriptor limit -----------------------------------------

SLOW_CLIENTS = 1100
FD_LIMIT = 1024


def _limit_descriptors() -> None:  # runs in the service's process, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@contextlib.contextmanager
def _raised_descriptor_limit(needed: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if target < needed:
        pytest.fail(f"this test needs {needed} open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class _Slowloris:
    """``count`` clients, each sending a request head one byte a second, reconnecting when cut."""

    HEAD = b"POST /v1/decisions HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 200

    def __init__(self, host: str, port: int, count: int) -> None:
        self.host, self.port, self.count = host, port, count
        self.connected = 0
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> _Slowloris:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(self.count)))

    async def _client(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                _reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), 10
                )
            except (OSError, TimeoutError):
                await asyncio.sleep(0.2)
                continue
            if first:
                self.connected += 1
                first = False
            else:
                self.reconnects += 1
            try:
                for byte in self.HEAD:
                    if self._stop.is_set():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(1.0)
            except OSError:
                pass
            finally:
                writer.close()


@pytest.mark.parametrize(("http", "loop"), STACKS, ids=[f"{h}-{lp}" for h, lp in STACKS])
def test_1100_slow_clients_against_1024_descriptors_do_not_lock_out_a_good_client(
    tmp_path: Path, http: str, loop: str
) -> None:
    with (
        _raised_descriptor_limit(SLOW_CLIENTS + 500),
        ServiceProcess(
            tmp_path, *_stack_args(http, loop), preexec_fn=_limit_descriptors
        ) as service,
    ):
        host, port = service.url.removeprefix("http://").rsplit(":", 1)
        with _Slowloris(host, int(port), SLOW_CLIENTS) as attack:
            wait_for(lambda: attack.connected == SLOW_CLIENTS, timeout=60)
            wait_for(lambda: "connection_limits" in service.log_text(), timeout=30)
            # For 5 s (evicted slow clients reconnect meanwhile), a fresh connection
            # every 0.5 s, each answered within 2 s (or httpx raises).
            for _ in range(10):
                time.sleep(0.5)
                with httpx.Client(base_url=service.url, headers=service.headers, timeout=2) as ok:
                    response = ok.post("/v1/decisions", content=decision().to_json())
                    assert response.status_code == 201, response.text
        service.stop()
        enforced = [
            json.loads(line)
            for line in service.log_text().splitlines()
            if '"connection_limits"' in line
        ]
        # The cap (under 1024 descriptors) really was reached: slow clients were evicted.
        assert sum(entry.get("evicted", 0) for entry in enforced) > 0, enforced
        log_bytes = len(service.log_text().encode()) + sum(
            len(line) + 1 for line in service.stdout_lines
        )
        assert log_bytes < 1_000_000, service.log_text()[-2000:]
        assert "Traceback" not in service.log_text()


# -- a 413 the client can read ------------------------------------------------------------


@pytest.mark.parametrize(("http", "loop"), STACKS, ids=[f"{h}-{lp}" for h, lp in STACKS])
def test_413_on_a_3mb_body_is_readable_by_urllib_and_requests(
    tmp_path: Path, http: str, loop: str
) -> None:
    body = b'{"pad":"' + b"x" * (3 * 1024 * 1024) + b'"}'
    json_type = {"Content-Type": "application/json"}
    with ServiceProcess(tmp_path, *_stack_args(http, loop)) as service:
        url = f"{service.url}/v1/decisions"
        statuses: list[int] = []
        for _ in range(50):
            req = urllib.request.Request(url, data=body, headers=json_type, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as answered:
                    statuses.append(answered.status)
            except urllib.error.HTTPError as error:
                assert json.loads(error.read())["error"]["code"] == "payload_too_large"
                statuses.append(error.code)
        with requests.Session() as session:
            for _ in range(50):
                response = session.post(url, data=body, headers=json_type, timeout=30)
                assert response.json()["error"]["code"] == "payload_too_large"
                statuses.append(response.status_code)
    assert statuses == [413] * 100


# -- the cap when every connection is serving a request ------------------------------------


def test_at_the_cap_requests_in_progress_are_kept_idle_ones_evicted_new_ones_refused(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    entered = Path(f"{gate}.entered")
    with (
        ServiceProcess(
            tmp_path,
            "--max-connections",
            "2",
            "--sink",
            "python:tests.service_sinks:make_gate_sink",
            env={"FLOWDECISION_TEST_GATE": str(gate)},
        ) as service,
        ThreadPoolExecutor(2) as pool,
        contextlib.ExitStack() as stack,
    ):

        def post(request: DecisionRequest) -> int:
            with httpx.Client(base_url=service.url, headers=service.headers, timeout=60) as c:
                return c.post("/v1/decisions", content=request.to_json()).status_code

        first, second = decision(), decision()
        held = [pool.submit(post, first)]
        stack.callback(gate.touch)  # release the sink whatever happens
        wait_for(lambda: entered.exists() and entered.read_text() == first.decision_id)
        with _connect(service.url) as idle:
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert _read_response(idle).startswith(b"HTTP/1.1 200 ")
            # The cap is full (one request in progress, one idle connection): the next
            # connection evicts the idle one.
            held.append(pool.submit(post, second))
            assert _read_until_closed(idle) == b""
        wait_for(lambda: entered.read_text() == second.decision_id)
        # Both connections serve requests: a third is refused at once, not queued.
        with _connect(service.url) as third:
            assert _status_and_error(_read_until_closed(third)) == (503, "overloaded")
        gate.touch()
        assert [future.result(60) for future in held] == [201, 201]


# -- settings ----------------------------------------------------------------------------


def test_transport_settings_from_flags_env_and_toml(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        'allowed_origins = ["https://Console.Example:443"]\nallowed_hosts = ["flow.internal"]\n'
        "header_timeout_s = 2.5\n"
    )
    env = {
        "FLOWDECISION_ALLOWED_HOSTS": "a.internal, b.internal",
        "FLOWDECISION_MAX_CONNECTIONS": "50",
    }
    settings = load_settings(
        {"keep_alive_timeout_s": 1.5, "http": "h11"}, env=env, config_file=str(config)
    )
    assert settings.allowed_origins == ("https://Console.Example:443",)
    assert settings.allowed_hosts == ("a.internal", "b.internal")  # env over TOML
    assert (settings.header_timeout_s, settings.keep_alive_timeout_s) == (2.5, 1.5)
    assert (settings.max_connections, settings.http, settings.loop) == (50, "h11", "auto")
    assert load_settings({}, env={}).allowed_origins == ()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"allowed_origins": "evil.example"}, "allowed_origins: `evil.example` is not an origin"),
        ({"allowed_origins": "https://a.example/path"}, "is not an origin"),
        ({"allowed_hosts": "https://flow.internal"}, "allowed_hosts: `https://flow.internal`"),
        ({"allowed_hosts": "flow.internal:8080"}, "without scheme, port or path"),
        ({"header_timeout_s": float("nan")}, "header_timeout_s must be a finite positive number"),
        ({"body_timeout_s": 0}, "body_timeout_s must be a finite positive number"),
        ({"max_connections": 0}, "max_connections must be at least 1"),
        ({"http": "zttp"}, "http must be one of auto, httptools, h11"),
        ({"loop": "trio"}, "loop must be one of auto, uvloop, asyncio"),
    ],
)
def test_bad_transport_settings_are_named(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_settings(flags, env={})


def test_the_connection_cap_leaves_descriptors_for_everything_else() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        assert effective_max_connections(1000) == 864
        assert effective_max_connections(100) == 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_optional_module_resolves_auto_and_refuses_to_be_named_when_missing() -> None:
    # The one rule behind --http and --loop, checked with a module no machine has.
    missing = "flowdecision_no_such_module"
    assert _optional("loop", "auto", missing, "asyncio") == "asyncio"
    assert _optional("loop", "asyncio", missing, "asyncio") == "asyncio"
    assert _optional("http", "auto", "json", "h11") == "json"
    with pytest.raises(ConfigError, match=f"loop = {missing}, but {missing} is not installed"):
        _optional("loop", missing, missing, "asyncio")
