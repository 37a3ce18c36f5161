"""Timeouts and the request-head cap: what a connection may take, in time and in bytes.

uvicorn has no timeout while it waits for request headers or a request body
(its issue #157), so a client that sends a byte now and then holds its
connection, and a descriptor, for ever; and httptools puts no bound on a
request head (a 32 MB header was read into memory and answered 200). Here:

- a request head must arrive within ``header_timeout_s`` (counted from the
  accept, or from the first byte of the next request on a kept-alive
  connection) and hold at most ``head_max_bytes`` and ``head_max_fields``
  header fields: **408** or **431**, and the connection is closed. The head is
  measured before the parser sees it, so an oversized head never reaches
  memory beyond one read;
- a body must arrive within ``body_timeout_s`` from the end of its head:
  **408**, close, and the app sees a disconnect (nothing is dispatched);
- an idle kept-alive connection is closed after ``keep_alive_timeout_s``
  (uvicorn's own timer, whole seconds, is replaced so the limit can be a float).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from .base import HEAD, REQUEST, ConnectionState, edge_answer

__all__ = ["Timeouts"]

#: The blank line that ends a request head (a bare LF is tolerated by the parsers).
_HEAD_END = re.compile(rb"\r?\n\r?\n")


class Timeouts(ConnectionState):
    """Header, body and keep-alive timeouts, and the request-head cap (size and fields)."""

    _head_started: bool
    _idle: bool
    #: Whether the bytes arriving now belong to a request head (counted against the cap).
    _in_head: bool
    _head_bytes: int
    _head_lines: int
    _head_tail: bytes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._head_started = False
        self._idle = False
        self._start_head()
        super().connection_made(transport)
        # A fresh connection must deliver its first request head in time.
        self._arm(self._table.limits.header_timeout_s, self._on_head_timeout)

    def data_received(self, data: bytes) -> None:
        if self._phase == HEAD and not self._head_started:
            self._head_started = True
            if self._idle:  # an idle keep-alive connection starts its next request
                self._idle = False
                self._arm(self._table.limits.header_timeout_s, self._on_head_timeout)
        if self._in_head and not self._head_fits(data):
            return
        before = self._cycle()
        super().data_received(data)
        self._after_parse(before)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._phase != REQUEST or self._proxy.is_closing():
            return
        cycle = self._cycle()
        if cycle is not None and not cycle.response_complete:
            return  # a pipelined request is already being served
        # Idle keep-alive: replace uvicorn's timer (whole seconds) by ours.
        getattr(self, "_unset_keepalive_if_required")()  # noqa: B009 - uvicorn's, not ours
        self._phase = HEAD
        self._head_started = False
        self._idle = True
        self._table.wait(self)
        self._arm(self._table.limits.keep_alive_timeout_s, self._on_idle_timeout)

    # -- the head cap ---------------------------------------------------------------------

    def _start_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._head_lines = 0
        self._head_tail = b""

    def _head_fits(self, data: bytes) -> bool:
        """Count ``data``'s share of the current request head; answer 431 past the cap."""
        tail = self._head_tail
        window = tail + data if tail else data
        end = _HEAD_END.search(window)
        if end is None:
            used = len(data)
            self._head_tail = window[-3:]
        else:
            used = end.end() - len(tail)
            self._in_head = False  # what follows is a body, or the next request's head
        self._head_bytes += used
        self._head_lines += data.count(b"\n", 0, used)
        limits = self._table.limits
        # Lines: the request line, one per field, and the blank line.
        if self._head_bytes <= limits.head_max_bytes and (
            self._head_lines <= limits.head_max_fields + 2
        ):
            return True
        self._table.events.count("head_too_large")
        self.answer_unread(
            edge_answer(
                431,
                "request_head_too_large",
                f"the request head exceeds {limits.head_max_bytes} bytes "
                f"or {limits.head_max_fields} header fields",
            )
        )
        return False

    # -- phases ---------------------------------------------------------------------------

    def _after_parse(self, before: Any) -> None:
        if self._phase not in (HEAD, REQUEST) or self._real.is_closing():
            return
        cycle = self._cycle()
        if cycle is not None and cycle is not before and not cycle.response_complete:
            # A request head is complete: the request is being served.
            self._phase = REQUEST
            self._table.busy(self)
            self._cancel_timer()
            self._start_head()
            self._in_head = not cycle.more_body
            if cycle.more_body:
                self._arm(self._table.limits.body_timeout_s, self._on_body_timeout)
        elif self._phase == REQUEST and cycle is not None and not cycle.more_body:
            self._cancel_timer()  # the whole body arrived
            self._in_head = True  # anything more is the next (pipelined) request's head

    def _on_head_timeout(self) -> None:
        self._timer = None
        if self._phase != HEAD:
            return
        if self._head_started:
            self._table.events.count("header_timeout")
            self._answer_and_close(
                edge_answer(408, "request_timeout", "the request headers did not arrive in time")
            )
        else:
            self._table.events.count("idle_timeout")
            self._close_now()

    def _on_idle_timeout(self) -> None:
        self._timer = None
        if self._phase == HEAD and not self._head_started:
            self._close_now()  # a keep-alive connection nobody used: close quietly

    def _on_body_timeout(self) -> None:
        self._timer = None
        cycle = self._cycle()
        if self._phase != REQUEST or cycle is None or not cycle.more_body:
            return
        self._table.events.count("body_timeout")
        if cycle.response_started:
            self._close_now()  # cannot answer twice; the client is too slow anyway
        else:
            # The app sees a disconnect and stops waiting for the body.
            self._answer_and_close(
                edge_answer(408, "request_timeout", "the request body did not arrive in time")
            )
