"""The outermost middleware: what every request gets, however it ends.

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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import tracing as _tracing
from .errors import error_response, static_error
from .guards import has_body
from .logs import request_id_for, request_id_var, write_access_line

__all__ = ["CLIENT_CLOSED", "Answer", "BoundaryMiddleware"]

log = logging.getLogger("flowdecision.service")

#: Status recorded (never sent) for a request whose client went away.
CLIENT_CLOSED = 499


class BoundaryMiddleware:
    """Request id, access log, request metric and the last word on every request.

    ``on_response(method, route, status)`` feeds the request counter metric.
    The access-log record holds: method, path (no query string), route
    template, status, bytes, duration, client address, request id. Headers are
    never logged.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        access_log_enabled: bool = True,
        on_response: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.access_log_enabled = access_log_enabled
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_for(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        # The server span (tracing on): continues the caller's traceparent/tracestate.
        server_span = start_server_span(scope, request_id) if _tracing.active() else None
        # A body not read whole when the answer starts (a refusal, a 413 on
        # Content-Length...): the answer says Connection: close (module docstring).
        answer = Answer(send, receive, request_id, body_pending=has_body(scope))
        app_receive = answer.receive if answer.body_pending else receive
        try:
            await self.app(scope, app_receive, answer.send)
        except (asyncio.CancelledError, Exception) as error:
            await answer.end_abnormally(error, scope)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            self.finish(request_id, scope, template, answer.status, answer.sent, started)
            if server_span is not None:
                end_server_span(server_span, scope, template, answer.status)
            request_id_var.reset(token)

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
    """One request's ``send`` (and ``receive``) as the boundary passes them down.

    ``send`` adds ``X-Request-Id`` (and ``Connection: close`` while the body is
    unread) to the answer's head and notes its status and size; ``receive``
    notes when the body has been read whole.
    """

    __slots__ = (
        "_receive",
        "_send",
        "body_pending",
        "request_id",
        "response_started",
        "sent",
        "status",
    )

    def __init__(
        self,
        send: Send,
        receive: Receive,
        request_id: str,
        *,
        body_pending: bool,
        status: int = 500,
        sent: int = 0,
        response_started: bool = False,
    ) -> None:
        self._send = send
        self._receive = receive
        self.request_id = request_id
        self.body_pending = body_pending
        self.status = status
        self.sent = sent
        self.response_started = response_started

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_pending = False
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
            self.status = message["status"]
            headers = list(message.get("headers", []))
            headers.append((b"x-request-id", self.request_id.encode("ascii")))
            if self.body_pending:
                headers.append((b"connection", b"close"))
            message = {**message, "headers": headers}
        elif message["type"] == "http.response.body":
            self.sent += len(message.get("body", b""))
        await self._send(message)

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
                await static_error("shutting_down")(scope, self._receive, self.send)
            log.info("request cancelled at the end of the shutdown grace period")
        elif isinstance(error, Exception):
            log.error("unhandled error while serving a request", exc_info=error)
            if not self.response_started:
                response = error_response(500, "internal", "internal server error")
                await response(scope, self._receive, self.send)
        else:  # pragma: no cover - only the two kinds above are caught
            raise error


def start_server_span(
    scope: Scope, request_id: str, route: str | None = None, *, extract: bool = True
) -> _tracing.SpanScope:
    """Open and make current the request's server span (ended by :func:`end_server_span`).

    ``route``: the route template when it is known before routing (the front's one
    path), so the span is named for it from the start; ``extract=False`` when the
    caller saw that no header carries trace context.
    """
    method = scope["method"]
    headers = scope.get("headers")
    attributes = {
        "http.request.method": method,
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "flowdecision.request_id": request_id,
    }
    if route is not None:
        attributes["http.route"] = route
    server = _tracing.span(
        # without a route: renamed to "METHOD route" once routing found it
        method if route is None else f"{method} {route}",
        kind=_tracing.SERVER,
        parent=_tracing.extract(headers) if headers and extract else None,
        attributes=attributes,
    )
    server.open()
    return server


def end_server_span(
    server: _tracing.SpanScope, scope: Scope, route: str | None, status: int
) -> None:
    """Name the span for ``route`` (None: named when it started), record ``status`` and end it."""
    current = server.span
    if route is not None and route != "<unmatched>":
        current.update_name(f"{scope['method']} {route}")
        current.set_attributes({"http.route": route, "http.response.status_code": status})
    else:
        current.set_attribute("http.response.status_code", status)
    if status >= 500:
        _tracing.fail_status(current, str(status))
    server.close()
