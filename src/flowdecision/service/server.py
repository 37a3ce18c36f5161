"""Run the app under uvicorn: bind, print where it listens, shut down gracefully.

uvicorn parses HTTP and runs the app. With ``edge = "guarded"`` (the default)
the connections themselves are accepted and policed by the edge,
:mod:`.edge` (connection cap, timeouts, request-head cap, lingering close,
write coalescing); with ``edge = "plain"`` uvicorn accepts them itself, for
deployments behind a reverse proxy that does that work. The HTTP parser
(``http``: httptools or h11) and the event loop (``loop``: uvloop or asyncio)
are settings; ``auto`` picks the faster one when it is installed.

Shutdown has one deadline. On SIGTERM or SIGINT uvicorn stops accepting
connections and the service starts its grace period (``shutdown_grace_s``):
requests in progress may finish until then. At the deadline the service
cancels the dispatches still running and their requests are answered JSON 503
``shutting_down``. uvicorn's own timeout is set a little later, as a backstop
for any other request still open (reading a slow body, say): it cancels them,
and the boundary middleware answers those 503 ``shutting_down`` too. Then the
lifespan closes the sink and the ledger.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import importlib.util
import math
import os
import platform
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core.model import DecisionRequest, DecisionStep, ScheduleStep
from ..observability.tracing import start_sdk
from .app import create_app
from .config import ConfigError, Settings
from .edge import EdgeLimits, contract_problems, serve_through_edge
from .logs import flush_logs
from .metrics import ServiceMetrics
from .runtime import UNWIND_S, Service

__all__ = [
    "LISTEN_BACKLOG",
    "bind_socket",
    "check_edge",
    "curl_example",
    "edge_limits",
    "event_loop_factory",
    "http_protocol_class",
    "serve",
    "service_url",
]

#: Connections the kernel queues before the service accepts them.
LISTEN_BACKLOG = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 picks a free port).

    The socket is made with ``IPPROTO_TCP`` (``socket.create_server`` leaves the
    protocol number 0), so whatever accepts from it treats connections as TCP.
    """
    infos = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if hasattr(socket, "SO_REUSEADDR"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _optional(setting: str, choice: str, module: str, fallback: str) -> str:
    """``choice`` with ``auto`` resolved: ``module`` if it is installed, else ``fallback``.

    Naming ``module`` explicitly when it is not installed is a :class:`ConfigError`.
    """
    if choice == "auto":
        return module if importlib.util.find_spec(module) else fallback
    if choice == module and importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{setting} = {module}, but {module} is not installed (pip install {module})"
        )
    return choice


def http_protocol_class(settings: Settings) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol for ``settings.http`` (``auto``: httptools if installed)."""
    if _optional("http", settings.http, "httptools", "h11") == "h11":
        return H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


def event_loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for ``settings.loop`` (``auto``: uvloop if installed); None: asyncio's."""
    if _optional("loop", settings.loop, "uvloop", "asyncio") == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def check_edge(settings: Settings) -> None:
    """Refuse the guarded edge on a uvicorn whose internals it relies on have moved."""
    if settings.edge != "guarded":
        return
    problems = contract_problems()
    if problems:
        raise ConfigError(
            "the installed uvicorn is not one the service edge was tested with ("
            + "; ".join(problems)
            + "): install the version pyproject.toml pins, or run with edge = plain "
            "behind a reverse proxy"
        )


def edge_limits(settings: Settings) -> EdgeLimits:
    """The connection limits the settings ask for."""
    return EdgeLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        keep_alive_timeout_s=settings.keep_alive_timeout_s,
        max_connections=settings.max_connections,
        write_timeout_s=settings.write_timeout_s,
    )


def service_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def curl_example(url: str, settings: Settings) -> str:
    """A ``curl`` command that submits a valid decision to this service."""
    example = DecisionRequest(
        decision_id="dec-example-1",
        run_id="run-example",
        authority_branch_id=settings.production_branch,
        causation_event_id="event-example-1",
        decision=ScheduleStep(
            step=DecisionStep(step_id="step-1", step_name="fetch", input={"n": 1})
        ),
    )
    auth = ""
    if settings.tokens():
        auth = ' -H "Authorization: Bearer $FLOWDECISION_TOKEN"'
    body = example.to_json().decode("utf-8").replace("'", "'\\''")
    return (
        f"curl -sS -X POST {url}/v1/decisions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        on_ready: Callable[[], None],
        on_exit: Callable[[], None],
        limits: EdgeLimits | None = None,
        *,
        every_second: Callable[[], None] | None = None,
        supervised: bool = False,
    ) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._on_exit = on_exit
        #: None: plain uvicorn (its own listening server, no edge).
        self._limits = limits
        self._every_second = every_second
        self._supervised = supervised

    async def on_tick(self, counter: int) -> bool:
        # uvicorn ticks every 0.1 s; piggyback the once-a-second chores on it.
        if counter % 10 == 0 and self._every_second is not None:
            self._every_second()
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self._limits is None:
            await super().startup(sockets=sockets)
        else:
            # uvicorn runs the lifespan but listens on nothing; the edge accepts.
            await super().startup(sockets=[])
            if self.started and not self.should_exit:
                serve_through_edge(self, sockets or [], self._limits)
        if not self.started or self.should_exit:
            return
        quiet_collector()
        self._on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._supervised:
            if sig == signal.SIGINT:
                return  # Ctrl-C reaches the whole process group; the supervisor decides
            if self.should_exit:
                self.force_exit = True  # the supervisor's second signal: stop waiting
        super().handle_exit(sig, frame)
        self._on_exit()

    def leave(self) -> None:
        """Shut down gracefully, as on SIGTERM (the supervisor is gone)."""
        if not self.should_exit:
            self.should_exit = True
            self._on_exit()


#: Collector thresholds while serving (Python's defaults: 700, 10, 10).
GC_THRESHOLDS = (20_000, 50, 100)


def quiet_collector() -> None:
    """Keep the garbage collector's pauses out of request latency.

    Everything built before the first request (modules, the app, the service)
    lives as long as the process: ``gc.freeze`` moves it out of the collector's
    sight, so a full collection scans only what requests allocate. A request
    frees almost everything it allocates by reference counting, so a young
    collection mostly rescans the live objects of the requests in flight: with
    700 allocations between them, Python's default, a ``POST`` at 50 clients
    paid about a thousand collections per 14,000 requests, about 7% of the
    event loop, with pauses of 20-36 ms in the full ones (p99 55-70 ms; 29-41
    ms with the collector off). :data:`GC_THRESHOLDS` makes that about ten
    times fewer; reference cycles are still collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks at least this large get a mapping of their own, unmapped when freed.
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_large_blocks() -> None:
    """Give the memory of large freed blocks back to the system (glibc only).

    glibc maps a block over 128 KiB on its own, but each time such a block is
    freed it raises that threshold (up to 32 MiB): after a burst of large rows
    (an outbox of 400 KB decisions read by slow clients), their buffers come
    from the heap, and the heap keeps the memory (RSS stayed at 1.1 GB after the
    clients left). A fixed threshold keeps them mapped, and a fixed trim
    threshold returns the heap's free top.
    """
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # a libc without mallopt: its own policy stands
        return


async def serve(
    settings: Settings,
    sock: socket.socket,
    on_ready: Callable[[str], None],
    *,
    supervised: bool = False,
) -> None:
    """Open the service, serve on ``sock`` until a signal, then shut down gracefully.

    ``supervised``: this process is one of several workers (see :mod:`.workers`):
    SIGINT is left to the supervisor, a second SIGTERM cancels what is left, and
    the worker shuts down by itself if its supervisor disappears.
    """
    check_edge(settings)
    return_large_blocks()
    stop_tracing = start_sdk() if settings.otel else None
    service = await Service.start(settings)
    app = create_app(settings, service=service)
    grace_s = settings.shutdown_grace_s
    guarded = settings.edge == "guarded"
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,  # the app writes its own structured access log
        lifespan="on",
        # A backstop after the service's own deadline (see the module docstring).
        timeout_graceful_shutdown=math.ceil(grace_s + UNWIND_S),
        server_header=False,
        http=http_protocol_class(settings),
        ws="none",
        backlog=LISTEN_BACKLOG,
        # h11 refuses (400) an incomplete head past this; the edge's 431 comes first.
        h11_max_incomplete_event_size=2 * edge_limits(settings).head_max_bytes if guarded else None,
        # The edge faces clients itself: X-Forwarded-* headers are not trusted (and
        # the layer that reads them is left out). Plain, behind a proxy: uvicorn's
        # proxy headers, from the addresses in FORWARDED_ALLOW_IPS (127.0.0.1).
        proxy_headers=not guarded,
        # Plain: uvicorn's own keep-alive timer (whole seconds); the edge has its own.
        timeout_keep_alive=max(1, math.ceil(settings.keep_alive_timeout_s)),
    )
    loop = asyncio.get_running_loop()

    def on_exit() -> None:
        # Called from the signal handler: hand over to the loop, the safe way.
        loop.call_soon_threadsafe(service.begin_shutdown, grace_s)

    metrics: ServiceMetrics = app.state.metrics
    parent = os.getppid()
    early_stop: list[int] = []

    def every_second() -> None:
        metrics.publish()  # several workers: this one's health counters to the shared files
        if supervised and (early_stop or os.getppid() != parent):
            server.leave()

    server = _Server(
        config,
        lambda: on_ready(service_url(sock)),
        on_exit,
        edge_limits(settings) if guarded else None,
        every_second=every_second,
        supervised=supervised,
    )

    # uvicorn re-raises the signal it caught after a graceful shutdown; make that a no-op
    # so the process exits 0 instead of dying by the signal. A worker's SIGTERM before
    # uvicorn's handlers are in place is remembered instead of lost: every_second()
    # then stops the server as soon as it runs.
    def remember(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            early_stop.append(signum)

    handler = remember if supervised else _ignore
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        await server.serve(sockets=[sock])
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if not service.stopped:  # startup failed before the lifespan took ownership
            await service.stop(0)
        metrics.publish()
        if stop_tracing is not None:
            stop_tracing()  # export what the batch processor still holds
        await asyncio.sleep(0)
        flush_logs()


def _ignore(signum: int, frame: object) -> None:
    return None
