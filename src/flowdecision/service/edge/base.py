"""What every part of the edge shares: the limits, the JSON answers it sends itself,
the summary log of enforced limits, and the per-connection state the protocol parts
(timeouts, lingering close) read and change."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol, cast

from ..logs import new_request_id
from .coalesce import EdgeTransport

__all__ = [
    "HEAD_MAX_BYTES",
    "HEAD_MAX_FIELDS",
    "LINGER_S",
    "EdgeLimits",
    "EventLog",
    "edge_answer",
]

log = logging.getLogger("flowdecision.service.edge")

#: How long a lingering close keeps reading (and discarding) a request body the
#: app did not read, so the client can finish sending and read the answer.
LINGER_S = 5.0
#: The largest request head (request line and header fields, up to the blank line).
HEAD_MAX_BYTES = 64 * 1024
#: The most header fields one request may carry.
HEAD_MAX_FIELDS = 100
#: One summary log line per this many seconds, however many events.
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The per-connection limits (seconds, bytes, fields) and the connection cap."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1000
    #: How long the transport's write buffer may stay full (the client not reading).
    write_timeout_s: float = 30.0
    linger_s: float = LINGER_S
    head_max_bytes: int = HEAD_MAX_BYTES
    head_max_fields: int = HEAD_MAX_FIELDS


def edge_answer(
    status: int, code: str, message: str, *, headers: Sequence[str] = (), **details: Any
) -> bytes:
    """A complete HTTP/1.1 JSON error response with ``Connection: close``.

    For answers the edge sends itself, where no request reached the app (a
    head too slow or too large, malformed HTTP, no room for a connection): the
    error shape of service/errors.py, with a new request id in ``X-Request-Id``
    and in the body, as every other answer of the service.
    """
    request_id = new_request_id()
    error = {"code": code, "message": message, **details, "request_id": request_id}
    body = json.dumps({"error": error}).encode()
    head = [  # the reason phrase is informative only (RFC 9112)
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        f"x-request-id: {request_id}",
        "connection: close",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class EventLog:
    """Counts repeated edge events and logs them as one line per interval."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.counts: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self._flush_at: asyncio.TimerHandle | None = None
        self._last = 0.0

    def count(self, event: str) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1
        self.totals[event] = self.totals.get(event, 0) + 1
        if self._flush_at is None:
            delay = max(0.0, self._last + self.interval_s - time.monotonic())
            self._flush_at = asyncio.get_running_loop().call_later(delay, self.flush)

    def flush(self) -> None:
        self._flush_at = None
        self._last = time.monotonic()
        if self.counts:
            counts, self.counts = self.counts, {}
            log.warning(
                "connection limits enforced",
                extra={"event": "connection_limits", **counts},
            )

    def close(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None


# -- per-connection state -----------------------------------------------------------------

#: Where a connection is: waiting for a request head, serving a request, lingering
#: after an answer sent before its body was read, closed.
HEAD, REQUEST, LINGER, CLOSED = "head", "request", "linger", "closed"


class ConnectionRegistry(Protocol):
    """Where a connection is counted (:class:`.connections.ConnectionTable`)."""

    limits: EdgeLimits
    events: EventLog

    def wait(self, connection: ConnectionState) -> None:
        """The connection waits for a request head (it may be evicted)."""

    def busy(self, connection: ConnectionState) -> None:
        """The connection serves a request (or is gone): never evicted."""

    def release(self) -> None:
        """The connection closed: its place is free."""


class ConnectionState(asyncio.Protocol):
    """The state the protocol parts share, mixed in before uvicorn's HTTP protocol.

    Of uvicorn's protocol it reads ``cycle`` (the current request, replaced when
    a request head is complete: ``more_body``, ``response_started``,
    ``response_complete``, ``disconnected``) and ``transport``; see
    :mod:`.contract` for the whole list.
    """

    _table: ConnectionRegistry
    _real: asyncio.Transport
    _proxy: EdgeTransport
    _phase: str
    _timer: asyncio.TimerHandle | None
    _write_timer: asyncio.TimerHandle | None

    # -- asyncio.Protocol and uvicorn's hook, passed on down the chain of parts ------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._real = cast(asyncio.Transport, transport)
        self._timer = None
        self._write_timer = None
        self._phase = HEAD
        self._proxy = EdgeTransport(self._real, self)
        self._table.wait(self)
        super().connection_made(self._proxy)

    def connection_lost(self, exc: Exception | None) -> None:
        self._phase = CLOSED
        self._cancel_timer()
        self._cancel_write_timer()
        self._table.busy(self)
        self._table.release()
        super().connection_lost(exc)

    # -- the write timeout: a client that stops reading its answer ----------------------
    # The transport pauses the protocol past its buffer's high-water mark (uvicorn then
    # awaits the drain before the next write): a response, or an event stream, written
    # to a client that does not read waits there, holding its buffers, for ever.

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            delay = self._table.limits.write_timeout_s
            self._write_timer = asyncio.get_running_loop().call_later(delay, self._write_stuck)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stuck(self) -> None:
        self._write_timer = None
        self._table.events.count("write_timeout")
        self._phase = CLOSED
        self._cancel_timer()
        self._real.abort()  # the buffered answer goes; uvicorn sees the disconnect

    def on_response_complete(self) -> None:
        # Sends what the response held back: its head and body, in one write.
        self._proxy.flush_held()
        super().on_response_complete()  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refuses, as the service's JSON 400.

        (``Content-Length`` with ``Transfer-Encoding``, two ``Content-Length``
        headers, an unknown method, a malformed request line...)
        """
        self._table.events.count("malformed")
        self._proxy.flush_held()
        self._answer_and_close(
            edge_answer(
                400,
                "bad_request",
                "the request is not valid HTTP/1.1 (the connection is closed)",
            )
        )

    # -- what the parts share ---------------------------------------------------------------

    def _cycle(self) -> Any:
        return getattr(self, "cycle", None)

    def request_body_pending(self) -> bool:
        """Whether the client may still be sending the body of the current request."""
        cycle = self._cycle()
        return (
            self._phase == REQUEST
            and cycle is not None
            and bool(cycle.more_body)
            and not cycle.disconnected
        )

    def response_in_progress(self) -> bool:
        """Whether a response is being written (its writes may be held and sent together)."""
        cycle = self._cycle()
        return cycle is not None and not cycle.response_complete and not cycle.disconnected

    def close_requested(self) -> None:
        """uvicorn closed the transport: close it (the lingering close overrides this)."""
        self._real.close()

    def evict(self) -> bool:
        """Close at once (the connection cap needs the descriptor); False if gone already."""
        if self._phase == CLOSED or self._real.is_closing():
            return False
        self._phase = CLOSED
        self._cancel_timer()
        self._real.abort()
        return True

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _answer_and_close(self, response: bytes) -> None:
        self._phase = CLOSED
        self._cancel_timer()
        if not self._real.is_closing():
            self._real.write(response)
            self._real.close()

    def answer_unread(self, response: bytes) -> None:
        """Answer and close while the client may still be sending (linger.py lingers)."""
        self._answer_and_close(response)

    def _close_now(self) -> None:
        self._timer = None
        self._phase = CLOSED
        if not self._real.is_closing():
            self._real.close()
