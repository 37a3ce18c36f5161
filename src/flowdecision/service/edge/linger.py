"""Lingering close: a client that writes its whole body before reading gets to read the answer.

An answer sent before the request body was read (a 413 on ``Content-Length``,
a 401 or 415 refusal) is followed, in uvicorn, by a plain ``close()``: the
kernel answers the unread body with a reset, and a client that writes its
whole body before reading (urllib, requests) sees a broken pipe instead of
the 413. The same holds for the edge's 431 to a request head past the cap.
Here the connection half-closes instead (FIN after the answer) and reads and
discards what the client still sends, for up to ``linger_s``, then closes.
A lingering connection is evictable at the connection cap.
"""

from __future__ import annotations

from .base import CLOSED, LINGER, REQUEST, ConnectionState

__all__ = ["LingeringClose"]


class LingeringClose(ConnectionState):
    """Half-close and drain, instead of a reset, when an answer leaves a body unread."""

    def close_requested(self) -> None:
        if self.request_body_pending() and self._real.can_write_eof():
            self._start_linger()
        else:
            super().close_requested()

    def answer_unread(self, response: bytes) -> None:
        if not self._real.can_write_eof():
            super().answer_unread(response)
            return
        self._cancel_timer()
        if not self._real.is_closing():
            self._real.write(response)
            self._start_linger()

    def data_received(self, data: bytes) -> None:
        if self._phase == LINGER or self._phase == CLOSED:
            return  # discarded: the answer is sent, the client is finishing its body
        super().data_received(data)

    def eof_received(self) -> bool | None:
        if self._phase == LINGER:
            self._close_now()
            return None
        return super().eof_received()

    def on_response_complete(self) -> None:
        if self._phase == REQUEST and self.request_body_pending():
            # Answered before the body was read (413, 415...): close, lingering.
            self._proxy.close()
        super().on_response_complete()

    def _start_linger(self) -> None:
        self._phase = LINGER
        self._cancel_timer()
        self._table.wait(self)  # evictable: the request is answered
        self._real.write_eof()  # FIN after the answer; keep reading what the client sends
        if not self._real.is_reading():
            self._real.resume_reading()  # flow control may have paused it on a big body
        self._arm(self._table.limits.linger_s, self._close_now)
