"""Outbox readers that stop reading, and streams against the connection cap (issue 38,
items 1 and 2), on a real ``flowdecision serve``.

Not a timed test: results in docs/BENCHMARKS.md, "Outbox streams and slow readers". Run
alone::

    flock /tmp/team/bench.lock .venv/bin/python bench/slow_readers.py sse 15
    flock /tmp/team/bench.lock .venv/bin/python bench/slow_readers.py json 5
    flock /tmp/team/bench.lock .venv/bin/python bench/slow_readers.py cap

``sse N`` / ``json N``: 120 decisions of 400 KB are posted, then N clients ask for the
outbox (an event stream, or a page of ``limit=1000``) with a 4 KB receive buffer and
never read. Printed: the server's RSS before, its peak over 8 s (``/healthz`` asked
every 200 ms, its slowest answer), and its RSS 3 s and 38 s after the clients closed.

``cap``: with ``--max-connections 100``, 100 event streams (then 100 long-polls
waiting for a row that does not come) are opened; printed: what ``/healthz`` and a
``POST`` answer meanwhile, and what one more stream gets.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAD = "x" * 400_000


def _decision(decision_id: str, pad: str = "") -> bytes:
    return (
        '{"decision_id":"%s","run_id":"run-1","authority_branch_id":"production",'  # noqa: UP031
        '"causation_event_id":"evt-%s","decision":{"type":"complete","output":{"pad":"%s"}}}'
        % (decision_id, decision_id, pad)
    ).encode()


def _serve(directory: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0", *args],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(directory / "serve.log", "wb"),  # the server's whole life
    )
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode()
        if line.startswith("flowdecision serving on "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split()[-1]
    raise SystemExit(f"serve did not start: see {directory / 'serve.log'}")


def _rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


def _request(url: str, path: str, body: bytes | None = None) -> tuple[int, float]:
    req = urllib.request.Request(
        url + path, data=body, headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=60) as answer:
            answer.read()
            return answer.status, time.perf_counter() - started
    except urllib.error.HTTPError as error:
        error.read()
        return error.code, time.perf_counter() - started


def _open(url: str, path: str, accept: str, rcvbuf: int = 0) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: {accept}\r\n\r\n".encode())
    return sock


def slow(mode: str, clients: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _serve(Path(tmp), "--no-access-log")
        try:
            for n in range(120):
                assert _request(url, "/v1/decisions", _decision(f"big-{n}", PAD))[0] == 201
            time.sleep(1)
            before = _rss_mb(proc.pid)
            accept = "text/event-stream" if mode == "sse" else "application/json"
            path = "/v1/outbox" if mode == "sse" else "/v1/outbox?limit=1000"
            held = [_open(url, path, accept, rcvbuf=4096) for _ in range(clients)]
            peak, slowest = before, 0.0
            until = time.monotonic() + 8
            while time.monotonic() < until:
                peak = max(peak, _rss_mb(proc.pid))
                slowest = max(slowest, _request(url, "/healthz")[1])
                time.sleep(0.2)
            for sock in held:
                sock.close()
            time.sleep(3)
            after3 = _rss_mb(proc.pid)
            time.sleep(35)
            print(
                f"{clients} {mode} readers that never read: RSS {before} MB before, peak "
                f"{peak} MB (+{peak - before}), /healthz slowest {slowest * 1000:.0f} ms; "
                f"{after3} MB 3 s and {_rss_mb(proc.pid)} MB 38 s after they closed"
            )
        finally:
            proc.terminate()
            proc.wait(30)


def cap() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _serve(Path(tmp), "--no-access-log", "--max-connections", "100")
        try:
            for path, accept in (
                ("/v1/outbox", "text/event-stream"),
                ("/v1/outbox?after=1000000&wait=30", "application/json"),
            ):
                held = [_open(url, path, accept) for _ in range(100)]
                time.sleep(1)
                health = _request(url, "/healthz")[0]
                posted = _request(url, "/v1/decisions", _decision(f"d-{time.time_ns()}"))[0]
                extra = _open(url, path, accept)
                extra.settimeout(10)
                head = extra.recv(200).split(b"\r\n")[0].decode()
                print(f"100 x {path}: /healthz {health}, POST {posted}, one more: {head}")
                for sock in [*held, extra]:
                    sock.close()
                time.sleep(1)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    if sys.argv[1:2] == ["cap"]:
        cap()
    else:
        slow(sys.argv[1], int(sys.argv[2]))
