"""Write coalescing: one ``send`` per small response (a performance job, nothing else).

uvicorn writes a response's head and its body in separate ``write`` calls, and
each becomes a ``send`` system call (two TCP segments for one small answer).
:class:`EdgeTransport` is the transport uvicorn's protocol sees: while a
response is incomplete its writes are held and go out together, in one write,
when it completes, when the connection closes, past :data:`HOLD_BYTES`, or at
the end of the current event-loop iteration (streamed bodies and ``100
Continue`` are never held longer than that). ``close()`` is handed to the
connection (:meth:`.ConnectionState.close_requested`), which decides between a
plain and a lingering close (:mod:`.linger`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

__all__ = ["HOLD_BYTES", "JOIN_BYTES", "EdgeTransport", "TransportOwner"]

#: Bytes of a response held back before they are sent anyway.
HOLD_BYTES = 64 * 1024
#: Held writes up to this size are joined into one buffer (larger ones go out as a writev).
JOIN_BYTES = 16 * 1024


class TransportOwner(Protocol):
    """The connection a transport belongs to (:class:`.base.ConnectionState`)."""

    def close_requested(self) -> None:
        """The app or uvicorn closed the transport: the connection decides how."""

    def response_in_progress(self) -> bool:
        """Whether a response has started and not completed."""


class EdgeTransport(asyncio.Transport):
    """The connection's real transport, with a response's writes sent together."""

    def __init__(self, real: asyncio.Transport, owner: TransportOwner) -> None:
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
        self._owner.close_requested()

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
