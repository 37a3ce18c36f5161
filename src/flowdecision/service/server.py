"""Run the app under uvicorn: bind, print where it listens, shut down gracefully.

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
import math
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from ..model import DecisionRequest, DecisionStep, ScheduleStep
from .app import create_app
from .config import Settings
from .runtime import UNWIND_S, Service

__all__ = ["bind_socket", "curl_example", "serve", "service_url"]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 picks a free port)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = infos[0][0]
    sock = socket.create_server((host, port), family=family, reuse_port=False, dualstack_ipv6=False)
    sock.set_inheritable(True)
    return sock


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
    ) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._on_exit = on_exit

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._on_exit()


async def serve(settings: Settings, sock: socket.socket, on_ready: Callable[[str], None]) -> None:
    """Open the service, serve on ``sock`` until a signal, then shut down gracefully."""
    service = await Service.start(settings)
    app = create_app(settings, service=service)
    grace_s = settings.shutdown_grace_s
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,  # the app writes its own structured access log
        lifespan="on",
        # A backstop after the service's own deadline (see the module docstring).
        timeout_graceful_shutdown=math.ceil(grace_s + UNWIND_S),
        server_header=False,
    )
    loop = asyncio.get_running_loop()

    def on_exit() -> None:
        # Called from the signal handler: hand over to the loop, the safe way.
        loop.call_soon_threadsafe(service.begin_shutdown, grace_s)

    server = _Server(config, lambda: on_ready(service_url(sock)), on_exit)
    # uvicorn re-raises the signal it caught after a graceful shutdown; make that a no-op
    # so the process exits 0 instead of dying by the signal.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        await server.serve(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not service.stopped:  # startup failed before the lifespan took ownership
            await service.stop(0)
        await asyncio.sleep(0)


def _ignore(signum: int, frame: object) -> None:
    return None
