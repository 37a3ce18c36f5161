"""The service's one request path: every request to every route takes it.

uvicorn calls :class:`Pipeline` with each request; it does, in order, in one
function:

1. **the head**: one pass over the headers (:class:`.head.RequestHead`), which
   every rule below reads;
2. **the boundary** (:mod:`.boundary`): the request id, the route the path
   finds (:mod:`.routing`) and the server span named for it when tracing is
   on, and an :class:`~.boundary.Answer` that has the last word however the
   request ends;
3. **the rules**, each written once and asked in this order, the first refusal
   answered: framing, ``Expect``, ``Host`` and ``Origin`` (a CORS preflight is
   answered here) (:mod:`.guards`); the token (:mod:`.auth`); no route (404,
   or a 307 to the path with its trailing slash added or removed); a method
   the route does not take (405 with ``Allow``); a body that is not plain
   JSON (415, for methods the route takes);
4. **the endpoint**, with a Starlette ``Request`` in and a ``Response`` out
   (Starlette's public value types: no Starlette layer runs); an
   ``HTTPException`` it raises is answered from the error table;
5. the answer sent, counted and logged (access line, request metric).

The lifespan (startup and shutdown of the service) is the ASGI lifespan
protocol, answered here too. docs/ARCHITECTURE.md walks one ``POST`` through it.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from types import SimpleNamespace

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..observability import tracing as _tracing
from .auth import Auth
from .boundary import Answer, RequestRecord, end_server_span, start_server_span
from .errors import http_error
from .guards import BrowserGuard, Cors, content_type_refusal
from .head import RequestHead
from .logs import request_id_for, request_id_var
from .routing import Route, RouteMatch, Router

__all__ = ["Pipeline"]

#: The route template of a request no route took (access line, metric).
UNMATCHED = "<unmatched>"


class Pipeline:
    """The ASGI app: the lifespan, and every HTTP request through one path (module doc).

    ``state`` holds what the endpoints read as ``request.app.state``.
    """

    def __init__(
        self,
        routes: Sequence[Route],
        *,
        guard: BrowserGuard,
        auth: Auth,
        record: RequestRecord,
        lifespan: Callable[[Pipeline], AbstractAsyncContextManager[None]],
        state: SimpleNamespace | None = None,
    ) -> None:
        self.router = Router(routes)
        self.guard = guard
        self.auth = auth
        self.record = record
        self.lifespan = lifespan
        self.state = state if state is not None else SimpleNamespace()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._other(scope, receive, send)
            return
        # One function for the whole request: each frame here is resumed at every await.
        started = time.perf_counter()
        head = RequestHead.of(scope)
        request_id = request_id_for(head.request_id)
        token = request_id_var.set(request_id)
        found = self.router.find(scope["path"])
        template = UNMATCHED if found is None else found.routes.path
        server_span = (
            start_server_span(
                scope, request_id, None if found is None else template, extract=head.traced
            )
            if _tracing.active()
            else None
        )
        answer = Answer(send, receive, request_id, body_pending=head.has_body)
        try:
            response = self._refusal(scope, head, found, answer)
            if response is None:
                assert found is not None
                scope["app"] = self
                scope["path_params"] = found.params
                # While a body is unread the endpoint reads it through the answer, which
                # then knows whether the connection can carry another request.
                request = Request(scope, answer.receive if answer.body_pending else receive)
                try:
                    response = await found.routes.endpoints[scope["method"]](request)
                except HTTPException as error:
                    headers = dict(error.headers) if error.headers else None
                    response = http_error(error.status_code, error.detail, headers=headers)
            await answer.respond(response, scope)
        except (asyncio.CancelledError, Exception) as error:
            await answer.end_abnormally(error, scope)
        finally:
            self.record.finish(request_id, scope, template, answer.status, answer.sent, started)
            if server_span is not None:
                end_server_span(server_span, answer.status)
            request_id_var.reset(token)

    def _refusal(
        self, scope: Scope, head: RequestHead, found: RouteMatch | None, answer: Answer
    ) -> Response | None:
        """The answer of the first rule that refuses the request (or answers a CORS
        preflight); None when the endpoint is to answer it."""
        verdict = self.guard.refusal(scope, head)
        if verdict is not None:
            if not isinstance(verdict, Cors):
                return verdict
            answer.extra = verdict.headers
            if verdict.preflight:
                return Response(status_code=204)
        method = scope["method"]
        path = scope["path"]
        if self.auth.enabled:
            refusal = self.auth.refusal(method, path, head.authorization)
            if refusal is not None:
                return refusal
        if found is None:
            moved = self.router.redirect(path)
            if moved is None:
                return http_error(404, f"no such endpoint: {method} {path}")
            query = scope.get("query_string", b"")
            location = moved + ("?" + query.decode("latin-1") if query else "")
            return Response(status_code=307, headers={"location": location})
        routes = found.routes
        if method not in routes.endpoints:
            return http_error(405, "", headers={"Allow": routes.allow})
        return content_type_refusal(method, head)

    async def _other(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:  # a websocket: none is served
            await send({"type": "websocket.close", "code": 1000})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """The ASGI lifespan protocol around the ``lifespan`` context manager."""
        started = False
        await receive()  # lifespan.startup
        try:
            async with self.lifespan(self):
                await send({"type": "lifespan.startup.complete"})
                started = True
                await receive()  # lifespan.shutdown
        except BaseException:
            failed = "lifespan.shutdown.failed" if started else "lifespan.startup.failed"
            await send({"type": failed, "message": traceback.format_exc()})
            raise
        await send({"type": "lifespan.shutdown.complete"})
