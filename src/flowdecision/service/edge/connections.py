"""The connection cap: accept connections ourselves, and never run out of descriptors.

asyncio's accept loop takes every pending connection until ``accept()`` fails
with ``EMFILE``, then logs a traceback for each failure (tens of MB a minute),
and uvicorn's ``limit_concurrency`` only answers 503 to requests on connections
already accepted. :class:`Acceptor` replaces uvicorn's listening server: it
accepts connections itself and keeps their number under a cap derived from
``RLIMIT_NOFILE``. At the cap it evicts the connection that has waited longest
for a request head (a slow or idle client, never one whose request is being
served); if every connection is serving a request it answers 503
``overloaded`` at once.

``TCP_NODELAY`` is not set here: the listening socket is made with
``IPPROTO_TCP`` (``server.bind_socket``), so asyncio's and uvloop's transports
set it on every accepted connection themselves.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
from collections import OrderedDict
from collections.abc import Callable

from .base import ConnectionState, EdgeLimits, EventLog, edge_answer, log

__all__ = ["ACCEPT_BATCH", "Acceptor", "ConnectionTable", "effective_max_connections"]

#: Connections accepted per readiness event (bounds the descriptors that can be
#: in flight between an accept and the eviction it causes).
ACCEPT_BATCH = 32
#: Descriptors kept free for everything else: the ledger, the sink, log files...
FD_RESERVE_MIN = 64
#: After an accept() failure for lack of descriptors or memory, wait this long.
ACCEPT_PAUSE_S = 0.5

_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


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


class ConnectionTable:
    """Open connections: how many, and which ones wait for a request head (evictable)."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits
        self.cap = effective_max_connections(limits.max_connections)
        self.open = 0
        #: Connections waiting for a request head or lingering, oldest first.
        self.waiting: OrderedDict[int, ConnectionState] = OrderedDict()
        self.events = EventLog()
        self.on_release: Callable[[], None] | None = None

    def wait(self, connection: ConnectionState) -> None:
        self.waiting.pop(id(connection), None)
        self.waiting[id(connection)] = connection

    def busy(self, connection: ConnectionState) -> None:
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
        answer = edge_answer(
            503,
            "overloaded",
            "too many open connections; retry",
            headers=["retry-after: 1"],
        )
        try:
            conn.setblocking(False)
            conn.send(answer)
        except OSError:
            pass
        finally:
            conn.close()

    def _start(self, conn: socket.socket) -> None:
        conn.setblocking(False)
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
