"""The per-request shortcuts keep behaviour: the direct access line is the line the JSON
formatter writes, buffered lines are written by the end of the loop iteration and at
exit, request ids stay unique, the written-out health dict is ``asdict``'s, cached
request counters count, and a response leaves in one write."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import os
import select
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from flowdecision.observability.health import HealthMetrics, HealthSnapshot
from flowdecision.service import logs
from flowdecision.service.edge import ConnectionTable, EdgeLimits, edge_protocol
from flowdecision.service.metrics import ServiceMetrics
from tests.service_process import ROOT

ACCESS = dict(
    request_id="r\u00e9q-1",
    method="GET",
    path='/odd "path"\\\u00e9',
    route="<unmatched>",
    status=404,
    sent=17,
    duration_ms=1.25,
    client="127.0.0.1:5555",
)


class _Stream(io.StringIO):
    """A text stream that records each write (a write is one system call on a real file)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logs._writer = None


def _formatter_line(pid: bool, access: dict[str, object] = ACCESS) -> str:
    """What JsonFormatter writes for the access record :func:`write_access_line` replaces."""
    record = logging.getLogger(logs.ACCESS_LOGGER).makeRecord(
        logs.ACCESS_LOGGER,
        logging.INFO,
        __file__,
        1,
        "http request",
        (),
        None,
        extra={
            "event": "http_request",
            **{("bytes" if k == "sent" else k): v for k, v in access.items()},
        },
    )
    return logs.JsonFormatter(pid=pid).format(record)


@pytest.mark.parametrize("pid", [False, True], ids=["one-process", "workers"])
def test_the_direct_access_line_is_the_formatters_line(restore_logging: None, pid: bool) -> None:
    stream = _Stream()
    logs.configure_logging("info", stream, pid=pid)
    logs.write_access_line(**ACCESS)  # type: ignore[arg-type]
    [line] = stream.getvalue().splitlines()
    expected = _formatter_line(pid)
    got, want = json.loads(line), json.loads(expected)
    assert abs(got.pop("ts") - want.pop("ts")) < 5
    assert list(got.items()) == list(want.items())  # same fields, same order, same values
    assert line.split(", ", 1)[1] == expected.split(", ", 1)[1]  # byte for byte after ts


def test_each_requests_target_has_its_own_fields_however_many_paths_come(
    restore_logging: None,
) -> None:
    # The method, path and route fields are remembered per target (a bounded table):
    # every line still carries its own, past the table's size and back again.
    stream = _Stream()
    logs.configure_logging("info", stream)
    paths = [f'/p/{n}/\u202e"q"' for n in range(logs._ACCESS_TARGETS_MAX + 3)]
    sent = [dict(ACCESS, path=path, method=("GET", "POST")[n % 2]) for n, path in enumerate(paths)]
    sent += sent[:3]  # the first targets again, after the table was cleared
    for access in sent:
        logs.write_access_line(**access)  # type: ignore[arg-type]
    logs.flush_logs()
    lines = stream.getvalue().splitlines()
    assert len(lines) == len(sent)
    assert len(logs._access_targets) <= logs._ACCESS_TARGETS_MAX
    for line, access in zip(lines, sent, strict=True):
        assert line.split(", ", 1)[1] == _formatter_line(False, access).split(", ", 1)[1]


def test_an_access_line_goes_through_logging_when_the_writer_is_not_in_place(
    restore_logging: None, caplog: pytest.LogCaptureFixture
) -> None:
    logs._writer = None
    with caplog.at_level(logging.INFO, logger=logs.ACCESS_LOGGER):
        logs.write_access_line(**ACCESS)  # type: ignore[arg-type]
    [record] = caplog.records
    assert record.status == 404 and record.request_id == "r\u00e9q-1"  # type: ignore[attr-defined]


def test_access_lines_honour_the_log_level(restore_logging: None) -> None:
    stream = _Stream()
    logs.configure_logging("warning", stream)
    logs.write_access_line(**ACCESS)  # type: ignore[arg-type]
    logs.flush_logs()
    assert stream.getvalue() == ""


def test_lines_are_buffered_until_the_end_of_the_loop_iteration(restore_logging: None) -> None:
    stream = _Stream()
    logs.configure_logging("info", stream)
    service_log = logging.getLogger("flowdecision.service")

    async def main() -> tuple[str, str, list[str]]:
        for _ in range(3):
            logs.write_access_line(**ACCESS)  # type: ignore[arg-type]
        service_log.info("in between", extra={"n": 1})
        during = stream.getvalue()
        await asyncio.sleep(0)  # the next iteration
        after, writes = stream.getvalue(), list(stream.writes)
        service_log.warning("urgent")  # warnings are written at once (with what is buffered)
        logs.write_access_line(**ACCESS)  # type: ignore[arg-type]
        return during, after, writes

    during, after, writes = asyncio.run(main())
    assert during == ""
    lines = after.splitlines()
    assert len(lines) == 4 and json.loads(lines[3])["message"] == "in between"
    assert len(writes) == 1  # four lines, one write
    assert json.loads(stream.getvalue().splitlines()[4])["message"] == "urgent"
    logs.flush_logs()  # what interpreter exit does for the last access line
    assert len(stream.getvalue().splitlines()) == 6


def test_max_write_keeps_every_write_whole_lines_under_the_bound(restore_logging: None) -> None:
    stream = _Stream()
    logs.configure_logging("info", stream, max_write=select.PIPE_BUF)

    async def main() -> None:
        for _ in range(100):
            logs.write_access_line(**ACCESS)  # type: ignore[arg-type]

    asyncio.run(main())
    logs.flush_logs()
    assert len(stream.writes) > 1
    for chunk in stream.writes:
        assert len(chunk.encode()) <= select.PIPE_BUF and chunk.endswith("\n")
    assert len(stream.getvalue().splitlines()) == 100


def test_buffered_lines_are_written_when_the_process_exits() -> None:
    code = (
        "import asyncio\n"
        "from flowdecision.service import logs\n"
        "logs.configure_logging('info')\n"
        "async def main():\n"
        "    logs.write_access_line('id-1', 'GET', '/', '/', 200, 0, 1.0, None)\n"
        "asyncio.run(main())\n"  # the loop closes before the scheduled flush runs
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        check=True,
    )
    assert json.loads(done.stderr)["request_id"] == "id-1"


def test_request_ids_are_unique_alphanumeric_and_differ_across_processes() -> None:
    ids = {logs.new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(i.isalnum() and len(i) <= 64 for i in ids)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(writer, logs.new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(reader, 100).decode()
    os.close(reader)
    os.close(writer)
    assert child[:16] != logs.new_request_id()[:16]


def test_health_to_dict_is_asdict_with_the_status_value() -> None:
    metrics = HealthMetrics()
    metrics.record_success(duplicate=False)
    snapshot = metrics.snapshot()
    expected = dataclasses.asdict(snapshot)
    expected["status"] = snapshot.status.value
    assert snapshot.to_dict() == expected
    assert list(snapshot.to_dict()) == [f.name for f in dataclasses.fields(HealthSnapshot)]


def test_cached_request_counters_count_every_request() -> None:
    metrics = ServiceMetrics(lambda: None)
    for _ in range(3):
        metrics.count_request("GET", "/healthz", 200)
    metrics.count_request("GET", "/healthz", 503)
    text = metrics.exposition().decode()
    assert (
        'flowdecision_http_requests_total{method="GET",route="/healthz",status="200"} 3.0' in text
    )
    assert (
        'flowdecision_http_requests_total{method="GET",route="/healthz",status="503"} 1.0' in text
    )


# -- one write per response ----------------------------------------------------------------

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def _plain_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = b'{"ok":true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _stream_app(release: asyncio.Event) -> ASGIApp:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await release.wait()  # the client must see the first chunk before this returns
        await send({"type": "http.response.body", "body": b"last"})

    return app


async def _serve_one(
    app: ASGIApp, base: type[asyncio.Protocol], until: bytes
) -> tuple[list[bytes], bytes]:
    """Serve one GET on a real socket pair with the guarded ``base`` protocol.

    Returns the writes the guarded protocol made to the real transport, and
    what the client read until ``until`` arrived.
    """
    loop = asyncio.get_running_loop()
    config = uvicorn.Config(app, http=base, lifespan="off", log_config=None)  # type: ignore[arg-type]
    config.load()
    protocol_class = edge_protocol(base, ConnectionTable(EdgeLimits()))
    served, client = socket.socketpair()
    client.setblocking(False)

    def factory() -> asyncio.Protocol:
        return protocol_class(config=config, server_state=ServerState(), app_state={})  # type: ignore[call-arg]

    transport, _protocol = await loop.connect_accepted_socket(factory, sock=served)
    writes: list[bytes] = []
    real_write = transport.write

    def counting_write(data: bytes) -> None:  # counts, then really writes
        writes.append(bytes(data))
        real_write(data)

    transport.write = counting_write  # type: ignore[method-assign]
    try:
        await loop.sock_sendall(client, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while until not in received:
            received += await asyncio.wait_for(loop.sock_recv(client, 4096), 10)
        return writes, received
    finally:
        transport.close()
        client.close()


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_a_response_head_and_body_leave_in_one_write(base: type[asyncio.Protocol]) -> None:
    writes, received = asyncio.run(_serve_one(_plain_app, base, b"true}"))
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(b'{"ok":true}')
    assert writes == [received]  # head and body: one write to the socket's transport


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_a_streamed_chunk_is_not_held_back(base: type[asyncio.Protocol]) -> None:
    async def main() -> bytes:
        release = asyncio.Event()
        try:
            # Read the first chunk while the app still waits: it was sent, not held.
            _writes, received = await _serve_one(_stream_app(release), base, b"first")
            return received
        finally:
            release.set()

    assert b"first" in asyncio.run(main())
