"""What every request gets, however it ends (the pipeline, :mod:`.pipeline`, applies it).

* a request id (the client's ``X-Request-Id`` if short and plain, else a new
  one) in the ``X-Request-Id`` response header, in every error body and on
  every log record written while serving it;
* ``Connection: close`` on an answer that starts before the request body was
  read whole (a refusal, a 413 on ``Content-Length``): the connection cannot
  carry another request, and a client that reuses it (a ``requests``
  session) would see it closed under its next request; told, it opens a new
  one. The edge drains the unread body meanwhile (lingering close);
* one access-log record and one ``flowdecision_http_requests_total`` count;
* an answer for each way a request can end abnormally, so uvicorn never sees
  an exception (it would log a traceback and send a plain-text 500):

  - the client disconnected (mid-body): nothing is sent; logged and counted
    with status 499 (nginx's "client closed request"), at INFO;
  - the request was cancelled (uvicorn's shutdown grace period ran out): JSON
    503 ``shutting_down``, at INFO, no traceback;
  - any other exception (a bug): JSON 500 ``internal`` with a generic message;
    the traceback is logged at ERROR under the request id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from ..observability import tracing as _tracing
from .errors import error_response, static_error
from .logs import write_access_line

__all__ = ["CLIENT_CLOSED", "Answer", "RequestRecord", "end_server_span", "start_server_span"]

log = logging.getLogger("flowdecision.service")

#: Status recorded (never sent) for a request whose client went away.
CLIENT_CLOSED = 499


class RequestRecord:
    """Counts each request and writes its access line.

    ``on_response(method, route, status)`` feeds the request counter metric.
    The access-log record holds: method, path (no query string), route
    template, status, bytes, duration, client address, request id. Headers are
    never logged.
    """

    def __init__(
        self,
        *,
        access_log_enabled: bool = True,
        on_response: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.access_log_enabled = access_log_enabled
        self.on_response = on_response

    def finish(
        self,
        request_id: str,
        scope: Scope,
        template: str,
        status: int,
        sent: int,
        started: float,
    ) -> None:
        """Count the request and write its access line (``started``: ``perf_counter()``)."""
        if self.on_response is not None:
            self.on_response(scope["method"], template, status)
        if self.access_log_enabled:
            client = scope.get("client")
            write_access_line(
                request_id,
                scope["method"],
                scope["path"],
                template,
                status,
                sent,
                round((time.perf_counter() - started) * 1000, 3),
                f"{client[0]}:{client[1]}" if client else None,
            )


class Answer:
    """One request's answer: its ``send`` (and ``receive``) as the pipeline passes them on.

    Every answer's head gets ``X-Request-Id``, ``Connection: close`` while the
    body is unread, and the ``extra`` headers (an allowed origin's CORS
    headers); the answer's status and size are noted for the access line.
    ``receive`` notes when the body has been read whole.
    """

    __slots__ = (
        "_receive",
        "_send",
        "body_pending",
        "extra",
        "request_id",
        "response_started",
        "sent",
        "status",
    )

    def __init__(
        self, send: Send, receive: Receive, request_id: str, *, body_pending: bool
    ) -> None:
        self._send = send
        self._receive = receive
        self.request_id = request_id
        self.body_pending = body_pending
        self.extra: list[tuple[bytes, bytes]] = []
        self.status = 500
        self.sent = 0
        self.response_started = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_pending = False
        return message

    def _head(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        headers.append((b"x-request-id", self.request_id.encode("ascii")))
        if self.body_pending:
            headers.append((b"connection", b"close"))
        headers.extend(self.extra)
        return headers

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
            self.status = message["status"]
            message = {**message, "headers": self._head(list(message.get("headers", [])))}
        elif message["type"] == "http.response.body":
            self.sent += len(message.get("body", b""))
        await self._send(message)

    async def respond(self, response: Response, scope: Scope) -> None:
        """Send ``response``: a whole body in two messages, a stream through :meth:`send`."""
        body = getattr(response, "body", None)
        if body is None:  # a StreamingResponse: it sends as it goes
            await response(scope, self.receive, self.send)
            return
        self.response_started = True
        self.status = status = response.status_code
        headers = self._head(list(response.raw_headers))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        self.sent = len(body)
        await self._send({"type": "http.response.body", "body": body})
        if response.background is not None:
            await response.background()

    async def end_abnormally(self, error: BaseException, scope: Scope) -> None:
        """Answer a request that ended in ``error`` (module docstring); re-raise the rest."""
        if isinstance(error, ClientDisconnect):
            # The client hung up while we read its body: no one to answer.
            self.status = CLIENT_CLOSED
        elif isinstance(error, asyncio.CancelledError):
            # Only uvicorn cancels a request task, and only when the shutdown
            # grace period is over. The task ends here (it is uvicorn's own), so
            # the cancellation is answered rather than re-raised into uvicorn.
            if not self.response_started:
                await self.respond(static_error("shutting_down"), scope)
            log.info("request cancelled at the end of the shutdown grace period")
        elif isinstance(error, Exception):
            log.error("unhandled error while serving a request", exc_info=error)
            if not self.response_started:
                await self.respond(error_response(500, "internal", "internal server error"), scope)
        else:  # pragma: no cover - only the two kinds above are caught
            raise error


def start_server_span(
    scope: Scope, request_id: str, route: str | None, *, extract: bool
) -> _tracing.SpanScope:
    """Open and make current the request's server span (ended by :func:`end_server_span`).

    ``route``: the template of the route the path found (None: none did), which
    names the span; ``extract``: whether a header carries trace context to continue.
    """
    method = scope["method"]
    attributes = {
        "http.request.method": method,
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "flowdecision.request_id": request_id,
    }
    if route is not None:
        attributes["http.route"] = route
    server = _tracing.SpanScope(
        method if route is None else f"{method} {route}",
        kind=_tracing.SERVER,
        parent=_tracing.extract(scope["headers"]) if extract else None,
        attributes=attributes,
    )
    server.open()
    return server


def end_server_span(server: _tracing.SpanScope, status: int) -> None:
    """Record ``status`` on the request's server span and end it."""
    current = server.span
    current.set_attribute("http.response.status_code", status)
    if status >= 500:
        _tracing.fail_status(current, str(status))
    server.close()
