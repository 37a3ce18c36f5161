"""``POST /v1/decisions`` in one ASGI function, in front of the app's stack.

Between uvicorn and the handler the stack puts the boundary, the browser
guard, the bearer-token check, the content-type check, the lean router and a
Starlette ``Request``: six frames, each resumed at every ``await`` of the
request, and a ``send`` wrapper per message. For the request that makes up
nearly all of a busy service's load, the plain submission, :class:`DecisionsFront`
does their work in one function:

* it takes a ``POST /v1/decisions`` with exactly one ``Host`` that the guard
  allows, exactly one ``Content-Length`` within ``max_body_bytes``, a plain
  ``application/json`` ``Content-Type``, no ``Origin``, ``Expect``,
  ``Transfer-Encoding`` or ``Content-Encoding``, and a valid token when the
  service has tokens;
* for it, it runs what those layers would: the request id (the boundary's
  rule), the server span when tracing is on (the boundary's own
  :func:`.boundary.start_server_span`), the handler's body
  (:func:`.handlers.answer_post`), the answer with ``X-Request-Id``, and
  the boundary's own request metric and access line
  (:meth:`.boundary.BoundaryMiddleware.finish`); a request that ends
  abnormally is answered by the boundary's :class:`.boundary.Answer`;
* every other request goes down the stack untouched, so every refusal (and
  every CORS answer) is the stack's own.

The rules it checks are the stack's objects' own (it finds the boundary, the
guard and the auth layer in the stack and asks them), so a setting cannot
mean one thing here and another there. ``tests/test_service_lean.py``
compares its answers with Starlette's own stack, request by request.
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import tracing as _tracing
from .auth import AuthMiddleware
from .boundary import Answer, BoundaryMiddleware, end_server_span, start_server_span
from .guards import BrowserGuardMiddleware, JsonContentTypeMiddleware
from .handlers import AppContext, answer_post, read_decision
from .inputs import declared_over
from .logs import new_request_id, request_id_for, request_id_var

__all__ = ["DECISIONS_PATH", "DecisionsFront"]

#: The one path (and route template) the front answers.
DECISIONS_PATH = "/v1/decisions"
#: Headers that send a request down the stack: each asks for a rule the front
#: does not run (CORS, 100-continue, chunked framing, a compressed body).
_STACK_HEADERS = frozenset({b"origin", b"expect", b"transfer-encoding", b"content-encoding"})
#: The headers above (True: down the stack) and those a server span's parent is
#: extracted from (False: when none came, no parent is looked for).
_OTHER_HEADERS = {name: True for name in _STACK_HEADERS} | dict.fromkeys(
    _tracing.CONTEXT_HEADERS, False
)
_JSON = b"application/json"


class DecisionsFront:
    """The plain ``POST /v1/decisions`` in one function; everything else to ``app``."""

    def __init__(self, app: ASGIApp, context: AppContext) -> None:
        #: The app's stack (boundary outermost), which answers everything else.
        self.app = app
        self.context = context
        boundary = guard = auth = json = None
        layer: object = app
        while layer is not None:
            if isinstance(layer, BoundaryMiddleware):
                boundary = layer
            elif isinstance(layer, BrowserGuardMiddleware):
                guard = layer
            elif isinstance(layer, AuthMiddleware):
                auth = layer
            elif isinstance(layer, JsonContentTypeMiddleware):
                json = layer
            layer = getattr(layer, "app", None)
        self._boundary = boundary
        self._guard = guard
        #: The auth layer, unless it lets every POST /v1/decisions through.
        self._auth = auth if auth is not None and DECISIONS_PATH not in auth.public else None
        #: Off unless the stack is the one ``create_app`` builds (boundary outermost).
        self.enabled = (
            boundary is app and guard is not None and json is not None and boundary is not None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != DECISIONS_PATH
            or scope["method"] != "POST"
            or not self.enabled
            or scope.get("root_path")
            or self.context.service is None
        ):
            await self.app(scope, receive, send)
            return
        # One pass over the headers for every rule of the layers it stands in for.
        host = declared = content_type = None
        prefer: list[str] | None = None
        hosts = lengths = 0
        has_id = has_trace = False
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
                hosts += 1
            elif name == b"content-length":
                declared = value
                lengths += 1
            elif name == b"content-type":
                content_type = value  # the last one, as the content-type check reads it
            elif name == b"prefer":
                if prefer is None:
                    prefer = []
                prefer.append(value.decode("latin-1"))
            elif name == b"x-request-id":
                has_id = True
            else:
                stack = _OTHER_HEADERS.get(name)
                if stack:
                    await self.app(scope, receive, send)
                    return
                if stack is not None:
                    has_trace = True
        guard = self._guard
        if (
            hosts != 1
            or lengths != 1
            or host is None
            or declared is None
            or content_type is None
            or guard is None
            or content_type.split(b";", 1)[0].strip().lower() != _JSON
            or not declared.isdigit()
            or declared_over(declared, self.context.settings.max_body_bytes)
            or (guard.check_host and not guard.host_allowed(host))
            or (self._auth is not None and self._auth.refusal(scope) is not None)
        ):
            await self.app(scope, receive, send)
            return
        await self._answer(scope, receive, send, declared, prefer, has_id, has_trace)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        declared: bytes,
        prefer: list[str] | None,
        has_id: bool,
        has_trace: bool,
    ) -> None:
        started = time.perf_counter()
        request_id = request_id_for(scope) if has_id else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        # The server span (tracing on), as the boundary opens it: same name, attributes, parent.
        server_span = (
            start_server_span(scope, request_id, DECISIONS_PATH, extract=has_trace)
            if _tracing.active()
            else None
        )
        context = self.context
        service = context.service
        assert service is not None
        status = 500
        sent = 0
        body_pending = True
        head_sent = False
        try:
            decision, read_whole = await read_decision(context, service, receive, declared)
            body_pending = not read_whole  # a 413 sent before the body was read whole
            if isinstance(decision, Response):
                response = decision
            else:
                response = await answer_post(context, service, decision, prefer, started)
            headers = [*response.raw_headers, (b"x-request-id", request_id.encode("ascii"))]
            if body_pending:
                headers.append((b"connection", b"close"))
            status = response.status_code
            head_sent = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            sent = len(response.body)
            await send({"type": "http.response.body", "body": response.body})
            if response.background is not None:
                await response.background()
        except (asyncio.CancelledError, Exception) as error:
            # A disconnect, the end of the shutdown grace period, a bug: the boundary's answers.
            answer = Answer(
                send,
                receive,
                request_id,
                body_pending=body_pending,
                status=status,
                sent=sent,
                response_started=head_sent,
            )
            await answer.end_abnormally(error, scope)
            status, sent = answer.status, answer.sent
        finally:
            assert self._boundary is not None
            self._boundary.finish(request_id, scope, DECISIONS_PATH, status, sent, started)
            if server_span is not None:
                end_server_span(server_span, scope, None, status)  # named as it started
            request_id_var.reset(token)
