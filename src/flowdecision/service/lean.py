"""A shorter path through a Starlette app: the same routes, middleware and handlers.

Between uvicorn and an endpoint Starlette puts about ten ASGI layers: its
error middleware and its exception middleware (each wrapping ``send`` again),
the router trying each route's regex in turn, the route, and the
request-response adapter (which wraps ``send`` once more). An awaiting
endpoint passes back through all of them at every resumption: for a ``POST``
that waits for a commit, that was about a fifth of its CPU.

:func:`lean_stack` builds the stack the app's ``middleware`` list describes
around a :class:`LeanRouter`, which finds a route by a dictionary lookup on
the path (or, for a route with path parameters, its own regex), calls the
endpoint, and answers an exception through the app's ``exception_handlers``,
as Starlette's exception middleware would. What it does not take (a method the
route does not accept, an unknown path, a redirect to add or remove a trailing
slash, a mounted ``root_path``, the lifespan) goes through Starlette's own
exception middleware and router, so every answer is the one Starlette gives;
``tests/test_service_lean.py`` compares the two on every route.

Starlette's outermost error middleware is left out: the service's boundary
middleware (:mod:`.boundary`) already answers every exception and is the
outermost layer that can raise.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["LeanRouter", "lean_stack"]


def lean_stack(app: Starlette) -> ASGIApp:
    """The ASGI stack of ``app`` with :class:`LeanRouter` in place of Starlette's layers.

    Set it as ``app.middleware_stack`` once the app is built (no middleware can
    be added after that, as after Starlette's first request).
    """
    if getattr(app, "max_body_size", None) is not None:
        return app.build_middleware_stack()  # a layer the lean path does not reproduce
    handlers = dict(app.exception_handlers)
    below = {k: v for k, v in handlers.items() if k not in (500, Exception)}
    fallback = ExceptionMiddleware(app.router, handlers=below, debug=app.debug)
    stack: ASGIApp = LeanRouter(app.router, below, fallback)
    for cls, args, kwargs in reversed(app.user_middleware):
        stack = cls(stack, *args, **kwargs)
    return stack


def _plain_endpoint(route: BaseRoute) -> bool:
    """Whether ``route`` is an ``async def endpoint(request)`` route with nothing wrapped
    around it (no per-route middleware), so calling the endpoint is all its layers do."""
    return (
        type(route) is Route
        and inspect.iscoroutinefunction(route.endpoint)
        and getattr(route.app, "__qualname__", "") == "request_response.<locals>.app"
    )


class LeanRouter:
    """Finds the route, calls the endpoint, answers its exceptions; else the fallback."""

    def __init__(
        self,
        router: Router,
        exception_handlers: Mapping[Any, Any],
        fallback: ASGIApp,
    ) -> None:
        self.router = router
        self.fallback = fallback
        self._status_handlers = {
            key: value for key, value in exception_handlers.items() if isinstance(key, int)
        }
        self._class_handlers = {
            key: value for key, value in exception_handlers.items() if isinstance(key, type)
        }
        #: Path -> its route, for routes without path parameters that no earlier route shadows.
        self.exact: dict[str, Route] = {}
        #: Routes with path parameters (or shadowed), in the router's order.
        self.patterned: list[Route] = []
        earlier: list[BaseRoute] = []
        for route in router.routes:
            if not _plain_endpoint(route):
                earlier.append(route)
                continue
            assert isinstance(route, Route)
            shadowed = any(
                isinstance(other, Route) and other.path_regex.match(route.path) for other in earlier
            )
            if route.param_convertors or shadowed or not route.methods:
                self.patterned.append(route)
            else:
                self.exact.setdefault(route.path, route)
            earlier.append(route)
        # With a route the lean path cannot call (a mount, an ASGI endpoint, per-route
        # middleware), every request takes Starlette's router, in its order.
        self._ordered = all(_plain_endpoint(route) for route in router.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("root_path") or not self._ordered:
            await self.fallback(scope, receive, send)
            return
        route = self.exact.get(scope["path"])
        params: dict[str, Any] = {}
        if route is None:
            route, params = self._match(scope)
        if route is None or scope["method"] not in (route.methods or ()):
            await self.fallback(scope, receive, send)  # 404, 405, a slash redirect
            return
        # What Starlette's router adds to the scope for this route.
        scope["router"] = self.router
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = params
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request)
        except Exception as error:
            handler = self._handler_for(error)
            if handler is None:
                raise
            response = handler(request, error)
            if inspect.isawaitable(response):
                response = await response
            error.__traceback__ = None  # as Starlette: reused exceptions keep no frames
        await response(scope, receive, send)

    def _match(self, scope: Scope) -> tuple[Route | None, dict[str, Any]]:
        for route in self.patterned:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return route, child["path_params"]
        return None, {}

    def _handler_for(self, error: Exception) -> Any:
        if isinstance(error, HTTPException):
            handler = self._status_handlers.get(error.status_code)
            if handler is not None:
                return handler
        for cls in type(error).__mro__:
            if cls in self._class_handlers:
                return self._class_handlers[cls]
        return None
