"""``serve --workers N`` with real processes: both workers serve, metrics add up across
them, TCP_NODELAY in the workers, SIGTERM stops everything cleanly, a killed worker is
replaced, and the setting is validated."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowdecision.service.config import ConfigError, load_settings
from tests.service_process import ROOT, ServiceProcess, decision, wait_for

#: Linux's pidfd_getfd(2) system call number (the same on x86-64 and arm64).
SYS_PIDFD_GETFD = 438


def _records(service: ServiceProcess) -> list[dict[str, Any]]:
    out = []
    for line in service.log_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _worker_pids(service: ServiceProcess | _Holder) -> list[int]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    pid = service.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        found = [int(child) for child in children.read().split()]
    return [child for child in found if b"spawn_main" in _cmdline(child)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # it exited (a killed worker, reaped)
        return b""


def _access_pids(service: ServiceProcess) -> set[int]:
    return {r["pid"] for r in _records(service) if r.get("event") == "http_request"}


def _fresh_connection_requests(service: ServiceProcess, count: int) -> None:
    """``count`` GET /healthz, each on a new connection (any worker may accept it)."""
    for _ in range(count):
        with httpx.Client(base_url=service.url) as client:
            assert client.get("/healthz").status_code == 200


def _metric(text: str, prefix: str) -> float:
    """The sum of the samples whose line starts with ``prefix`` (a name, or a name and labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix) and line[len(prefix)] in " {,":
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_workers_serve_add_up_their_metrics_and_stop_on_sigterm(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--workers", "2") as service:
        workers = _worker_pids(service)
        assert len(workers) == 2
        # New connections until both workers have accepted some (a liveness bound).
        wait_for(lambda: _fresh_connection_requests(service, 10) or len(_access_pids(service)) == 2)
        assert _access_pids(service) == set(workers)

        posted: list[str] = []
        for _ in range(20):
            request = decision()
            with httpx.Client(base_url=service.url, headers=service.headers) as client:
                answer = client.post("/v1/decisions", content=request.to_json())
            assert answer.status_code == 201, answer.text
            posted.append(request.decision_id)
        served_by = {
            r["pid"]
            for r in _records(service)
            if r.get("event") == "http_request" and r["route"] == "/v1/decisions"
        }

        def totals() -> tuple[float, float]:
            text = httpx.get(f"{service.url}/metrics").text
            return (
                _metric(text, "flowdecision_dispatch_completed_total"),
                _metric(text, 'flowdecision_http_requests_total{method="POST"'),
            )

        # Every worker's share shows, whichever worker answers the scrape.
        wait_for(lambda: totals() == (20.0, 20.0))
        if len(served_by) < 2:  # the totals above must span workers to prove anything
            pytest.fail(f"all 20 decisions went to one worker: {served_by}")

        service.terminate()
        assert service.wait(60) == 0
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    log = service.log_text()
    assert "Traceback" not in log
    assert sum(r.get("message") == "service stopped" for r in _records(service)) == 2


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _socket_of(pid: int, local: tuple[str, int], peer: tuple[str, int]) -> socket.socket | None:
    """The socket in process ``pid`` connected from ``peer`` to ``local`` (pidfd_getfd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(name), 0)
            if fd < 0:
                error = ctypes.get_errno()
                raise OSError(error, f"pidfd_getfd: {os.strerror(error)}")
            try:
                candidate = socket.socket(fileno=fd)
            except OSError:
                os.close(fd)
                continue
            try:
                if candidate.getsockname()[:2] == local and candidate.getpeername()[:2] == peer:
                    return candidate
            except OSError:
                pass
            candidate.close()
    finally:
        os.close(pidfd)
    return None


def test_connections_accepted_by_workers_have_tcp_nodelay(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--workers", "2", "--ledger", "memory:") as service:
        host, port = service.url.removeprefix("http://").rsplit(":", 1)
        checked: set[int] = set()

        def check_one() -> bool:
            with socket.create_connection((host, int(port))) as client:
                client.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
                assert client.recv(64).startswith(b"HTTP/1.1 200")
                mine, theirs = client.getsockname()[:2], client.getpeername()[:2]
                for pid in _worker_pids(service):
                    accepted = _socket_of(pid, theirs, mine)
                    if accepted is not None:
                        with accepted:
                            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                        checked.add(pid)
            return len(checked) == 2

        wait_for(check_one)  # until a connection to each worker has been checked


def test_a_killed_worker_is_replaced_and_the_service_keeps_serving(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--workers", "2", "--ledger", "memory:") as service:
        first, second = _worker_pids(service)
        os.kill(first, signal.SIGKILL)

        def replaced() -> bool:
            pids = [p for p in _worker_pids(service) if not _is_zombie(p)]
            return len(pids) == 2 and first not in pids

        wait_for(replaced)
        newcomer = next(p for p in _worker_pids(service) if p not in (first, second))
        exits = [r for r in _records(service) if r.get("message", "").startswith("worker exited")]
        assert exits and exits[0]["exit_code"] == -signal.SIGKILL and exits[0]["pid"] == first
        wait_for(
            lambda: _fresh_connection_requests(service, 5) or newcomer in _access_pids(service)
        )
        service.terminate()
        assert service.wait(60) == 0
    assert "Traceback" not in service.log_text()


def test_sigterm_while_workers_start_stops_everything_cleanly(tmp_path: Path) -> None:
    # SIGTERM as soon as the workers exist, while they import and open the stores:
    # not one is left behind, and the supervisor still exits 0.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    log = tmp_path / "serve.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0", "--workers", "3"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            holder = _Holder(proc)
            wait_for(lambda: len(_worker_pids(holder)) == 3, interval=0.005)
            workers = _worker_pids(holder)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wait_for(lambda: all(_is_zombie(pid) for pid in workers))
    assert "Traceback" not in log.read_text()


class _Holder:
    """Just enough of a ServiceProcess for :func:`_worker_pids`."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc


def test_workers_whose_supervisor_is_killed_shut_down_by_themselves(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--workers", "2", "--ledger", "memory:") as service:
        workers = _worker_pids(service)
        service.proc.kill()  # SIGKILL: no chance to stop them
        service.proc.wait()
        wait_for(lambda: all(_is_zombie(pid) for pid in workers))
    stopped = [r for r in _records(service) if r.get("message") == "service stopped"]
    assert {r["pid"] for r in stopped} == set(workers)  # each one's graceful shutdown


def test_workers_setting_from_flags_env_and_toml(tmp_path: Path) -> None:
    assert load_settings({"workers": 3}).workers == 3
    assert load_settings({}, env={"FLOWDECISION_WORKERS": "2"}).workers == 2
    config = tmp_path / "serve.toml"
    config.write_text("[serve]\nworkers = 4\n")
    assert load_settings({}, config_file=str(config)).workers == 4
    assert load_settings({}).workers == 1
    for bad in (0, 65):
        with pytest.raises(ConfigError, match=r"workers must be in 1\.\.64"):
            load_settings({"workers": bad})
