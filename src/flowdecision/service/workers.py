"""``serve --workers N``: N server processes accepting on one listening socket.

The supervisor (the ``flowdecision serve`` process) binds the socket once
(:func:`~.server.bind_socket`), checks and migrates the stores once, then
starts N worker processes (``multiprocessing``'s *spawn*: a fresh interpreter,
no state copied from a forked parent) that inherit that socket and each run
the ordinary single-process server on it (:func:`~.server.serve`).

Why a shared inherited socket rather than one ``SO_REUSEPORT`` socket per
worker: the kernel queues connections in one accept queue and whichever
worker is idle accepts next (a busy worker does not, so load follows free
capacity); with ``SO_REUSEPORT`` the kernel hashes each connection to one
worker's queue whether that worker is busy or not, a worker that exits takes
the connections queued on its socket with it, and ``port 0`` needs a
reserve-then-rebind dance. The shared socket also works wherever ``serve``
does.

What the workers share: the ledger and the outbox (SQLite and PostgreSQL
are safe across processes), the metrics (prometheus_client's multiprocess
mode in a directory the supervisor creates for the run and removes at exit;
``/metrics`` from any worker shows the totals, see :mod:`.metrics`) and the
log (each writes whole JSON lines to the inherited stderr, with its ``pid``,
in writes of at most ``PIPE_BUF`` bytes so lines never interleave).
``/healthz`` and the status page are per worker.

Signals and exits:

* SIGTERM or SIGINT to the supervisor: it sends SIGTERM to every worker,
  each runs its own graceful shutdown (``shutdown_grace_s``), and the
  supervisor exits 0 once all have exited 0. A second SIGINT (Ctrl-C) or
  SIGTERM is passed on and makes the workers cancel what is left at once.
  Workers ignore SIGINT themselves: Ctrl-C reaches the whole process group,
  and the supervisor decides.
* A worker that exits while serving is logged (``worker exited``, with its
  exit code) and replaced. More than :data:`RESTARTS_MAX` exits within
  :data:`RESTART_WINDOW_S` means something is wrong with every worker: the
  supervisor stops the others and exits 1. A worker that fails to start
  stops the run the same way.
* A worker whose supervisor died (SIGKILL, say) notices within a second and
  shuts down gracefully.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead

from ..errors import FlowDecisionError
from .config import Settings
from .logs import configure_logging, flush_logs
from .metrics import MULTIPROC_ENV
from .runtime import Service

__all__ = ["RESTARTS_MAX", "RESTART_WINDOW_S", "prepare_stores", "run_workers"]

log = logging.getLogger("flowdecision.service.workers")

#: Worker exits tolerated within :data:`RESTART_WINDOW_S` before the supervisor gives up.
RESTARTS_MAX = 5
#: The window (seconds) over which worker exits are counted.
RESTART_WINDOW_S = 60.0
#: How often the supervisor looks at its workers when nothing else happens (seconds).
_POLL_S = 0.5


async def prepare_stores(settings: Settings) -> None:
    """Open (creating and migrating as needed) and close the ledger and sink once.

    Done by the supervisor before any worker starts, so N workers never race to
    create the same schema, and a bad store is reported once, as ``serve``
    reports it without workers.
    """
    service = await Service.start(settings)
    await service.stop(0)


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    ready: Connection
    started: bool = False
    signalled: int = 0
    exits: list[float] = field(default_factory=list)


def _worker_main(settings: Settings, sock: socket.socket, index: int, ready: Connection) -> None:
    """A worker process: the single-process server on the inherited socket."""
    from .server import event_loop_factory, serve

    # Until the server's own handlers are in place: Ctrl-C is the supervisor's to
    # handle, and a SIGTERM during startup ends this worker quietly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_quietly)
    configure_logging(settings.log_level, pid=True, max_write=select.PIPE_BUF)

    def on_ready(url: str) -> None:
        ready.send(os.getpid())
        ready.close()

    try:
        with asyncio.Runner(loop_factory=event_loop_factory(settings)) as runner:
            runner.run(serve(settings, sock, on_ready, supervised=True))
    except FlowDecisionError as error:
        log.error("worker failed", extra={"worker": index, "error": str(error)})
        flush_logs()
        sys.exit(1)
    finally:
        flush_logs()


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


class _Supervisor:
    def __init__(self, settings: Settings, sock: socket.socket, metrics_dir: str) -> None:
        self.settings = settings
        self.sock = sock
        self.metrics_dir = metrics_dir
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.stopping = False
        self.signals = 0
        self.exit_code = 0

    def start(self, index: int, exits: list[float] | None = None) -> None:
        reader, writer = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=_worker_main,
            args=(self.settings, self.sock, index, writer),
            name=f"flowdecision-worker-{index}",
            daemon=False,
        )
        process.start()
        writer.close()  # the worker holds its own copy
        self.workers.append(_Worker(index, process, reader, exits=exits or []))
        if self.stopping:  # a signal arrived while it was being started
            self.forward()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes: sets flags and sends signals.
        self.signals += 1
        self.stopping = True
        self.forward()

    def forward(self) -> None:
        """Send each worker one SIGTERM per signal received (the first graceful, then forced)."""
        for worker in self.workers:
            while worker.signalled < self.signals and worker.process.exitcode is None:
                worker.signalled += 1
                if worker.process.pid is not None:
                    try:
                        os.kill(worker.process.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass

    def stop_all(self, exit_code: int) -> None:
        if self.exit_code == 0:
            self.exit_code = exit_code
        self.stopping = True
        self.signals = max(self.signals, 1)
        self.forward()

    def run(self, on_ready: Callable[[], None]) -> int:
        for index in range(self.settings.workers):
            if self.stopping:
                break
            self.start(index)
        announced = False
        while self.workers:
            waitables: list[object] = [w.process.sentinel for w in self.workers]
            waitables += [w.ready for w in self.workers if not w.started]
            wait(waitables, timeout=_POLL_S)  # type: ignore[arg-type]
            for worker in self.workers:
                if not worker.started and worker.ready.poll():
                    try:
                        worker.ready.recv()
                        worker.started = True
                    except EOFError:
                        pass  # it exited before it was ready: handled below
            if not announced and all(w.started for w in self.workers):
                announced = True
                on_ready()
            for worker in [w for w in self.workers if w.process.exitcode is not None]:
                self.reap(worker, announced)
        return self.exit_code

    def reap(self, worker: _Worker, announced: bool) -> None:
        self.workers.remove(worker)
        worker.ready.close()
        code = worker.process.exitcode or 0
        pid = worker.process.pid
        if pid is not None:
            mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        if self.stopping:
            # -SIGTERM: our SIGTERM reached it before it could handle signals (still starting).
            if code not in (0, -signal.SIGTERM) and self.exit_code == 0:
                self.exit_code = 1
            return
        if not worker.started or not announced:
            log.error("worker failed to start", extra={"worker": worker.index, "exit_code": code})
            self.stop_all(code or 1)
            return
        now = time.monotonic()
        exits = [t for t in worker.exits if now - t < RESTART_WINDOW_S] + [now]
        recent = exits + [t for w in self.workers for t in w.exits if now - t < RESTART_WINDOW_S]
        if len(recent) > RESTARTS_MAX:
            log.error(
                "workers keep exiting; stopping",
                extra={"worker": worker.index, "exit_code": code, "exits": len(recent)},
            )
            self.stop_all(1)
            return
        log.warning(
            "worker exited; starting a new one",
            extra={"worker": worker.index, "pid": pid, "exit_code": code},
        )
        self.start(worker.index, exits)


def run_workers(settings: Settings, sock: socket.socket, on_ready: Callable[[], None]) -> int:
    """Serve with ``settings.workers`` processes on ``sock`` until a signal; the exit code.

    ``on_ready`` is called once every worker accepts connections.
    """
    metrics_dir = tempfile.mkdtemp(prefix="flowdecision-metrics-")
    previous_env = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by the workers spawned below
    supervisor = _Supervisor(settings, sock, metrics_dir)
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in handled}
    try:
        return supervisor.run(on_ready)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous_env is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous_env
        shutil.rmtree(metrics_dir, ignore_errors=True)
