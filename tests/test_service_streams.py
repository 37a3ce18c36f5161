"""Outbox streams against a real ``flowdecision serve`` (issue 38, items 1 and 2): their own
bound below the connection cap, pages with a byte budget, and a write timeout for a
client that stops reading."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import requests

from .service_process import ServiceProcess, decision, wait_for

JSON = {"Content-Type": "application/json"}
#: A decision of about 400 KB: a few of them pass a page's 1 MiB budget.
PAD = "x" * 400_000


def _big(decision_id: str) -> bytes:
    return decision(decision_id).to_json().replace(b'"n":', b'"pad":"%s","n":' % PAD.encode())


def _open(url: str, path: str, accept: str = "text/event-stream", rcvbuf: int = 0) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: {accept}\r\n\r\n".encode())
    return sock


def _status(sock: socket.socket) -> tuple[int, bytes]:
    sock.settimeout(30)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return int(head.split()[1]), head


def _stream_taken(url: str) -> bool:
    """Whether one more event stream is taken (200) rather than refused."""
    sock = _open(url, "/v1/outbox")
    status, _head = _status(sock)
    sock.close()
    return status == 200


def test_streams_have_their_own_bound_and_requests_are_still_answered(tmp_path: Path) -> None:
    # 20 connections: streams get at most half of them, whatever max_streams says.
    with ServiceProcess(tmp_path, "--max-connections", "20") as svc:
        streams = [_open(svc.url, "/v1/outbox") for _ in range(19)]
        polls = [_open(svc.url, "/v1/outbox?after=999&wait=30", "application/json")]
        answers = [_status(sock) for sock in [*streams, *polls]]
        statuses = [status for status, _head in answers]
        assert statuses.count(200) == 10, statuses
        refused = [head for status, head in answers if status == 503]
        assert len(refused) == 10 and all(b"too_many_streams" in head for head in refused)
        assert all(b"retry-after: 1" in head.lower() for head in refused)
        # The connections left serve requests.
        assert requests.get(f"{svc.url}/healthz", timeout=30).status_code == 200
        posted = requests.post(
            f"{svc.url}/v1/decisions", data=decision().to_json(), headers=JSON, timeout=30
        )
        assert posted.status_code == 201, posted.text
        # A stream that ends gives its place back.
        held = [sock for sock, (status, _) in zip(streams, answers, strict=False) if status == 200]
        held[0].close()
        wait_for(lambda: _stream_taken(svc.url), timeout=30, interval=0.2)
        for sock in [*streams, *polls]:
            sock.close()


def test_a_page_stops_at_its_byte_budget(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path) as svc:
        for n in range(5):
            posted = requests.post(
                f"{svc.url}/v1/decisions", data=_big(f"big-{n}"), headers=JSON, timeout=30
            )
            assert posted.status_code == 201, posted.text
        seen: list[str] = []
        after, pages = 0, 0
        while True:
            answer = requests.get(f"{svc.url}/v1/outbox?after={after}&limit=1000", timeout=30)
            assert answer.status_code == 200
            assert len(answer.content) <= 1024 * 1024 + 1000  # the budget and the envelope
            page = answer.json()
            seen += [entry["decision_id"] for entry in page["entries"]]
            after, pages = page["next_after"], pages + 1
            if not page["has_more"]:
                break
        assert seen == [f"big-{n}" for n in range(5)]
        assert pages >= 3  # 2 MB of rows, 1 MiB a page
        # The event stream reads the same rows within the same budget, in order.
        stream = requests.get(
            f"{svc.url}/v1/outbox",
            headers={"Accept": "text/event-stream"},
            stream=True,
            timeout=30,
        )
        ids = []
        for line in stream.iter_lines():
            if line.startswith(b"data: "):
                ids.append(json.loads(line[6:])["decision_id"])
                if len(ids) == 5:
                    break
        stream.close()
        assert ids == seen


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(tmp_path: Path) -> None:
    with ServiceProcess(
        tmp_path, "--write-timeout-s", "1", "--max-streams", "1", "--max-connections", "8"
    ) as svc:
        for n in range(12):
            posted = requests.post(
                f"{svc.url}/v1/decisions", data=_big(f"stuck-{n}"), headers=JSON, timeout=30
            )
            assert posted.status_code == 201, posted.text
        stuck = _open(svc.url, "/v1/outbox", rcvbuf=4096)  # and never read
        time.sleep(0.5)
        second = _open(svc.url, "/v1/outbox")
        assert _status(second)[0] == 503  # the one stream allowed is the stuck one
        second.close()
        # The server stops writing to it after 1 s: its place is free again...
        wait_for(lambda: _stream_taken(svc.url), timeout=30, interval=0.3)
        # ...and its connection is gone: what it can still read ends.
        stuck.settimeout(30)
        received = 0
        try:
            while chunk := stuck.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        stuck.close()
        assert received < 12 * len(PAD)  # it never got the whole outbox
        wait_for(lambda: "write_timeout" in svc.log_text(), timeout=30)
