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

__all__ = ["CLIENT_CLOSED", "BoundaryMiddleware"]

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
        server_span = _start_server_span(scope, request_id) if _tracing.active() else None
        status = 500
        sent = 0
        response_started = False
        # A body not read whole when the answer starts (a refusal, a 413 on
        # Content-Length...): the answer says Connection: close (module docstring).
        body_pending = has_body(scope)

        async def receive_noting_the_body() -> Message:
            nonlocal body_pending
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_pending = False
            return message

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("ascii")))
                if body_pending:
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        app_receive = receive_noting_the_body if body_pending else receive
        try:
            await self.app(scope, app_receive, send_wrapper)
        except ClientDisconnect:
            # The client hung up while we read its body: no one to answer.
            status = CLIENT_CLOSED
        except asyncio.CancelledError:
            # Only uvicorn cancels a request task, and only when the shutdown
            # grace period is over. The task ends here (it is uvicorn's own), so
            # the cancellation is answered rather than re-raised into uvicorn.
            if not response_started:
                await static_error("shutting_down")(scope, receive, send_wrapper)
            log.info("request cancelled at the end of the shutdown grace period")
        except Exception:
            log.exception("unhandled error while serving a request")
            if not response_started:
                response = error_response(500, "internal", "internal server error")
                await response(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
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
            if server_span is not None:
                _end_server_span(server_span, scope, template, status)
            request_id_var.reset(token)


def _start_server_span(scope: Scope, request_id: str) -> _tracing.SpanScope:
    """Open and make current the request's server span (ended by :func:`_end_server_span`)."""
    method = scope["method"]
    headers = scope.get("headers")
    server = _tracing.span(
        method,  # renamed to "METHOD route" once the route is known
        kind=_tracing.SERVER,
        parent=_tracing.extract(headers) if headers else None,
        attributes={
            "http.request.method": method,
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
            "flowdecision.request_id": request_id,
        },
    )
    server.open()
    return server


def _end_server_span(server: _tracing.SpanScope, scope: Scope, route: str, status: int) -> None:
    current = server.span
    if route != "<unmatched>":
        current.update_name(f"{scope['method']} {route}")
        current.set_attributes({"http.route": route, "http.response.status_code": status})
    else:
        current.set_attribute("http.response.status_code", status)
    if status >= 500:
        _tracing.fail_status(current, str(status))
    server.close()
