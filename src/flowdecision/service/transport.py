"""The connection layer under uvicorn: accept control, TCP_NODELAY, timeouts, lingering close.

uvicorn leaves four gaps that a hostile or careless client can use:

- no timeout while it waits for request headers or a request body, so a
  client that sends a byte now and then holds its connection (and a file
  descriptor) for ever;
- no connection cap that protects file descriptors: asyncio's accept loop takes
  every pending connection until ``accept()`` fails with ``EMFILE``, then logs
  a traceback for each failure (tens of MB a minute);
- a response sent before the request body was read (a 413 on
  ``Content-Length``, a refusal) is followed by a plain ``close()``: the kernel
  answers the unread body with a reset, and a client that writes its whole
  body before reading (urllib, requests) sees a broken pipe instead of the 413;
- a listening socket made by ``socket.create_server`` has protocol number 0, so
  asyncio never sets ``TCP_NODELAY`` on accepted connections and every response
  waits for a delayed ACK (about 40 ms).

:class:`Acceptor` replaces uvicorn's listening server: it accepts connections
itself, sets ``TCP_NODELAY``, and keeps the number of open connections under a
cap derived from ``RLIMIT_NOFILE``. At the cap it evicts the connection that has
waited longest for a request head (a slow or idle client, never one whose
request is being served); if every connection is serving a request it answers
503 at once. :func:`guarded_protocol` wraps uvicorn's HTTP protocol class (h11
or httptools, unchanged) with the header, body and keep-alive timeouts and the
lingering close. Repeated events are logged as one summary line per interval.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

__all__ = [
    "LINGER_S",
    "Acceptor",
    "ConnectionTable",
    "TransportLimits",
    "effective_max_connections",
    "guarded_protocol",
]

log = logging.getLogger("flowdecision.service.transport")

#: How long a lingering close keeps reading (and discarding) a request body the
#: app did not read, so the client can finish sending and read the answer.
LINGER_S = 5.0
#: Connections accepted per readiness event (bounds the descriptors that can be
#: in flight between an accept and the eviction it causes).
ACCEPT_BATCH = 32
#: Bytes of a response held back before they are sent anyway (see _LingeringTransport).
HOLD_BYTES = 64 * 1024
#: Held writes up to this size are joined into one buffer (larger ones go out as a writev).
JOIN_BYTES = 16 * 1024
#: Descriptors kept free for everything else: the ledger, the sink, log files...
FD_RESERVE_MIN = 64
#: One summary log line per this many seconds, however many events.
LOG_INTERVAL_S = 10.0
#: After an accept() failure for lack of descriptors or memory, wait this long.
ACCEPT_PAUSE_S = 0.5

_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """The per-connection limits (seconds) and the connection cap."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1000
    linger_s: float = LINGER_S


def effective_max_connections(configured: int) -> int:
    """``configured``, lowered so open connections can never exhaust file descriptors.

    Keeps ``max(64, soft limit / 8)`` descriptors (plus one accept batch) free
    below ``RLIMIT_NOFILE``'s soft limit: with the usual limit of 1024 the cap is
    at most 864.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    room = soft - max(FD_RESERVE_MIN, soft // 8) - ACCEPT_BATCH
    return max(1, min(configured, room))


def _raw_response(status: int, reason: str, code: str, message: str, *extra: str) -> bytes:
    """A complete HTTP/1.1 JSON error response with ``Connection: close``.

    Used where no request exists yet (or its app cannot answer), in the one
    error shape of service/errors.py.
    """
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


_HEADER_TIMEOUT = _raw_response(
    408, "Request Timeout", "request_timeout", "the request headers did not arrive in time"
)
_BODY_TIMEOUT = _raw_response(
    408, "Request Timeout", "request_timeout", "the request body did not arrive in time"
)
_OVERLOADED = _raw_response(
    503,
    "Service Unavailable",
    "overloaded",
    "too many open connections; retry",
    "retry-after: 1",
)


class _EventLog:
    """Counts repeated transport events and logs them as one line per interval."""

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


class ConnectionTable:
    """Open connections: how many, and which ones wait for a request head (evictable)."""

    def __init__(self, limits: TransportLimits) -> None:
        self.limits = limits
        self.cap = effective_max_connections(limits.max_connections)
        self.open = 0
        #: Connections waiting for a request head or lingering, oldest first.
        self.waiting: OrderedDict[int, _GuardMixin] = OrderedDict()
        self.events = _EventLog()
        self.on_release: Callable[[], None] | None = None

    def wait(self, connection: _GuardMixin) -> None:
        self.waiting.pop(id(connection), None)
        self.waiting[id(connection)] = connection

    def busy(self, connection: _GuardMixin) -> None:
        self.waiting.pop(id(connection), None)

    def evict_oldest(self) -> bool:
        """Close the connection that has waited longest for a request head, if any."""
        while self.waiting:
            _key, victim = self.waiting.popitem(last=False)
            if victim.evict():
                self.events.count("evicted")
                return True
        return False

    def release(self) -> None:
        self.open -= 1
        if self.on_release is not None:
            self.on_release()


# -- the protocol wrapper ----------------------------------------------------------------

_HEAD, _REQUEST, _LINGER, _CLOSED = "head", "request", "linger", "closed"


class _LingeringTransport(asyncio.Transport):
    """The transport uvicorn's protocol sees: one send per response, lingering close.

    uvicorn writes a response's head and its body in separate ``write`` calls,
    and each becomes a ``send`` system call (two TCP segments for one small
    answer). While a response is incomplete its writes are held here and go
    out together, in one ``writelines``, when it completes, when the
    connection closes, past :data:`HOLD_BYTES`, or at the end of the current
    event-loop iteration (streamed bodies and ``100 Continue`` are never held
    longer than that).
    """

    def __init__(self, real: asyncio.Transport, owner: _GuardMixin) -> None:
        super().__init__()
        self._real = real
        self._owner = owner
        self._closing = False
        self._held: list[bytes | bytearray | memoryview] = []
        self._held_size = 0
        self._flush_scheduled = False

    def close(self) -> None:
        if self._closing:
            return
        self.flush_held()
        self._closing = True
        if self._owner.request_body_pending() and self._real.can_write_eof():
            self._owner.start_linger()
        else:
            self._real.close()

    def is_closing(self) -> bool:
        return self._closing or self._real.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return  # h11 writes b"" at the end of each message
        if not self._owner.response_in_progress():
            self.flush_held()
            self._real.write(data)
            return
        self._held.append(data)
        self._held_size += len(data)
        if self._held_size >= HOLD_BYTES:
            self.flush_held()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._scheduled_flush)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush_held(self) -> None:
        """Send the held writes (one system call for a head and its body)."""
        if not self._held:
            return
        held, total = self._held, self._held_size
        self._held, self._held_size = [], 0
        if self._real.is_closing():
            return
        # One write: uvloop and asyncio send a buffer with one send() when the socket
        # takes it (a small head and body are joined; large bodies are not copied).
        if len(held) == 1:
            self._real.write(held[0])
        elif total <= JOIN_BYTES:
            self._real.write(b"".join(held))
        else:
            self._real.writelines(held)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush_held()

    def write_eof(self) -> None:
        self.flush_held()
        self._real.write_eof()

    def can_write_eof(self) -> bool:
        return self._real.can_write_eof()

    def abort(self) -> None:
        self._closing = True
        self._held.clear()
        self._real.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._real.pause_reading()

    def resume_reading(self) -> None:
        self._real.resume_reading()

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._real.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._real.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._real.get_protocol()


class _GuardMixin(asyncio.Protocol):
    """Mixed in before uvicorn's ``H11Protocol`` or ``HttpToolsProtocol``.

    It relies on what both share: ``cycle`` (the current request, replaced when
    a request head is complete, with ``more_body``, ``response_started``,
    ``response_complete``, ``disconnected``), ``on_response_complete()`` and
    ``_unset_keepalive_if_required()``. uvicorn's own keep-alive timer is
    replaced by ours, so that ``keep_alive_timeout_s`` can be a float.
    """

    _table: ConnectionTable
    _real: asyncio.Transport
    _proxy: _LingeringTransport
    _phase: str
    _head_started: bool
    _idle: bool
    _timer: asyncio.TimerHandle | None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._real = cast(asyncio.Transport, transport)
        self._timer = None
        self._phase = _HEAD
        self._head_started = False
        self._idle = False
        self._proxy = _LingeringTransport(self._real, self)
        super().connection_made(self._proxy)
        self._table.wait(self)
        # A fresh connection must deliver its first request head in time.
        self._arm(self._table.limits.header_timeout_s, self._on_head_timeout)

    def data_received(self, data: bytes) -> None:
        if self._phase == _LINGER:
            return  # discarded: the answer is sent, the client is finishing its body
        if self._phase == _CLOSED:
            return
        if self._phase == _HEAD and not self._head_started:
            self._head_started = True
            if self._idle:  # an idle keep-alive connection starts its next request
                self._idle = False
                self._arm(self._table.limits.header_timeout_s, self._on_head_timeout)
        before = self._cycle()
        super().data_received(data)
        self._after_parse(before)

    def eof_received(self) -> bool | None:
        if self._phase == _LINGER:
            self._close_now()
            return None
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._phase != _CLOSED:
            self._phase = _CLOSED
        self._cancel_timer()
        self._table.busy(self)
        self._table.release()
        super().connection_lost(exc)

    # -- uvicorn hooks ------------------------------------------------------------------

    def on_response_complete(self) -> None:
        self._proxy.flush_held()  # the whole response, head and body, in one send
        if self._phase == _REQUEST and self.request_body_pending():
            # Answered before the body was read (413, 415...): close, but linger so
            # the client can finish sending and read the answer.
            self._close_via_proxy()
        super().on_response_complete()  # type: ignore[misc]
        if self._phase != _REQUEST or self._proxy_closing():
            return
        cycle = self._cycle()
        if cycle is not None and not cycle.response_complete:
            return  # a pipelined request is already being served
        # Idle keep-alive: replace uvicorn's timer (whole seconds) by ours.
        getattr(self, "_unset_keepalive_if_required")()  # noqa: B009 - uvicorn's, not ours
        self._phase = _HEAD
        self._head_started = False
        self._idle = True
        self._table.wait(self)
        self._arm(self._table.limits.keep_alive_timeout_s, self._on_idle_timeout)

    # -- used by the table and the transport ---------------------------------------------

    def response_in_progress(self) -> bool:
        """Whether a response is being written (its writes may be held and sent together)."""
        cycle = self._cycle()
        return cycle is not None and not cycle.response_complete and not cycle.disconnected

    def request_body_pending(self) -> bool:
        """Whether the client may still be sending the body of the current request."""
        cycle = self._cycle()
        return (
            self._phase == _REQUEST
            and cycle is not None
            and bool(cycle.more_body)
            and not cycle.disconnected
        )

    def start_linger(self) -> None:
        self._phase = _LINGER
        self._cancel_timer()
        self._table.wait(self)  # evictable: the request is answered
        self._real.write_eof()  # FIN after the answer; keep reading what the client sends
        if not self._real.is_reading():
            self._real.resume_reading()  # flow control may have paused it on a big body
        self._arm(self._table.limits.linger_s, self._close_now)

    def evict(self) -> bool:
        """Close at once (the connection cap needs the descriptor); False if gone already."""
        if self._phase == _CLOSED or self._real.is_closing():
            return False
        self._phase = _CLOSED
        self._cancel_timer()
        self._real.abort()
        return True

    # -- internals ------------------------------------------------------------------------

    def _cycle(self) -> Any:
        return getattr(self, "cycle", None)

    def _proxy_closing(self) -> bool:
        transport = getattr(self, "transport", None)
        return transport is None or bool(transport.is_closing())

    def _close_via_proxy(self) -> None:
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()

    def _after_parse(self, before: Any) -> None:
        if self._phase not in (_HEAD, _REQUEST) or self._real.is_closing():
            return
        cycle = self._cycle()
        if cycle is not None and cycle is not before and not cycle.response_complete:
            # A request head is complete: the request is being served.
            self._phase = _REQUEST
            self._table.busy(self)
            self._cancel_timer()
            if cycle.more_body:
                self._arm(self._table.limits.body_timeout_s, self._on_body_timeout)
        elif self._phase == _REQUEST and cycle is not None and not cycle.more_body:
            self._cancel_timer()  # the whole body arrived

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_head_timeout(self) -> None:
        self._timer = None
        if self._phase != _HEAD:
            return
        if self._head_started:
            self._table.events.count("header_timeout")
            self._answer_and_close(_HEADER_TIMEOUT)
        else:
            self._table.events.count("idle_timeout")
            self._close_now()

    def _on_idle_timeout(self) -> None:
        self._timer = None
        if self._phase == _HEAD and not self._head_started:
            self._close_now()  # a keep-alive connection nobody used: close quietly

    def _on_body_timeout(self) -> None:
        self._timer = None
        cycle = self._cycle()
        if self._phase != _REQUEST or cycle is None or not cycle.more_body:
            return
        self._table.events.count("body_timeout")
        if cycle.response_started:
            self._close_now()  # cannot answer twice; the client is too slow anyway
        else:
            # The app sees a disconnect and stops waiting for the body.
            self._answer_and_close(_BODY_TIMEOUT)

    def _answer_and_close(self, response: bytes) -> None:
        self._phase = _CLOSED
        if not self._real.is_closing():
            self._real.write(response)
            self._real.close()

    def _close_now(self) -> None:
        self._timer = None
        self._phase = _CLOSED
        if not self._real.is_closing():
            self._real.close()


def guarded_protocol(
    base: type[asyncio.Protocol], table: ConnectionTable
) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol class) with the limits of ``table``."""
    return type(f"Guarded{base.__name__}", (_GuardMixin, base), {"_table": table})


# -- accepting connections ---------------------------------------------------------------


class Acceptor:
    """Accepts connections on a listening socket in place of ``loop.create_server``.

    Looks like the ``asyncio.Server`` uvicorn keeps in ``Server.servers``
    (``close()`` and ``wait_closed()``), so uvicorn's shutdown sequence stops it.
    """

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        table: ConnectionTable,
    ) -> None:
        self.sock = sock
        self.protocol_factory = protocol_factory
        self.table = table
        self.loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._reading = False
        self._closed = False
        self._resume_at: asyncio.TimerHandle | None = None
        self._starting: set[asyncio.Task[None]] = set()
        sock.setblocking(False)
        table.on_release = self._maybe_resume

    def start(self) -> None:
        self._resume()

    # -- asyncio.Server look-alike ----------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pause()
        if self._resume_at is not None:
            self._resume_at.cancel()
        self.table.events.flush()
        self.table.events.close()

    async def wait_closed(self) -> None:
        if self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)

    # -- accepting ----------------------------------------------------------------------------

    def _pause(self) -> None:
        if self._reading:
            self.loop.remove_reader(self._fd)
            self._reading = False

    def _resume(self) -> None:
        if not self._reading and not self._closed:
            self.loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _maybe_resume(self) -> None:
        if self._resume_at is None and self.table.open < self.table.cap + ACCEPT_BATCH:
            self._resume()

    def _on_readable(self) -> None:
        table = self.table
        for _ in range(ACCEPT_BATCH):
            if table.open >= table.cap + ACCEPT_BATCH:
                # Evicted connections have not released their descriptors yet:
                # wait for them (on_release resumes) rather than risk EMFILE.
                self._pause()
                return
            try:
                conn, _address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as error:
                table.events.count("accept_error")
                if error.errno in _EXHAUSTED:
                    self._pause()
                    self._resume_at = self.loop.call_later(ACCEPT_PAUSE_S, self._resume_later)
                    return
                log.warning("accept() failed", extra={"error": str(error)})
                return
            if table.open >= table.cap and not table.evict_oldest():
                self._refuse(conn)
                continue
            self._start(conn)

    def _resume_later(self) -> None:
        self._resume_at = None
        self._resume()

    def _refuse(self, conn: socket.socket) -> None:
        """Every connection is serving a request: answer 503 now instead of queueing."""
        self.table.events.count("refused")
        try:
            conn.setblocking(False)
            conn.send(_OVERLOADED)
        except OSError:
            pass
        finally:
            conn.close()

    def _start(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        # A listening socket made without IPPROTO_TCP hands out sockets asyncio does not
        # recognise as TCP, so it would leave Nagle's algorithm on (a delayed ACK per response).
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.table.open += 1
        task = self.loop.create_task(self._connect(conn))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        made = False

        def factory() -> asyncio.Protocol:
            nonlocal made
            made = True
            return self.protocol_factory()

        try:
            await self.loop.connect_accepted_socket(factory, sock=conn)
        except (OSError, RuntimeError) as error:
            # The client left before the transport existed (or the loop is closing).
            if not made:
                conn.close()
                self.table.release()
            log.debug("connection setup failed", extra={"error": str(error)})
