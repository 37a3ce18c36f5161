"""The service's routes: a path, an endpoint and its methods; and how a path finds one.

A route is declared as ``Route("/v1/decisions/{decision_id:path}", endpoint,
methods=["GET"])``: ``{name}`` takes one path segment, ``{name:path}`` the
rest of the path (slashes included). A route taking ``GET`` also takes
``HEAD``. Several routes may share a path, each for its own methods (one
endpoint per method: no endpoint dispatches on the method itself).
:class:`Router` finds a path's routes by a dictionary lookup on the path, or
for a path with parameters by its pattern, in the order the paths were first
given (the first whose template matches decides).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidArgumentError

__all__ = ["Endpoint", "PathRoutes", "Route", "RouteMatch", "Router"]

#: An endpoint: a Starlette request in, a Starlette response out.
Endpoint = Callable[[Request], Awaitable[Response]]

_PARAMETER = re.compile(r"\{([a-zA-Z_][a-zA-Z0-9_]*)(?::(path|str))?\}")


def _compile(path: str) -> tuple[re.Pattern[str] | None, tuple[str, ...]]:
    names: list[str] = []
    pattern = ""
    end = 0
    for match in _PARAMETER.finditer(path):
        name, kind = match.group(1), match.group(2) or "str"
        if name in names:
            raise InvalidArgumentError(f"route `{path}` names parameter `{name}` twice")
        names.append(name)
        pattern += re.escape(path[end : match.start()])
        pattern += f"(?P<{name}>.*)" if kind == "path" else f"(?P<{name}>[^/]+)"
        end = match.end()
    if not names:
        return None, ()
    return re.compile(pattern + re.escape(path[end:]) + r"\Z"), tuple(names)


@dataclass(frozen=True, slots=True, init=False)
class Route:
    """One endpoint at one path template, for the methods it takes."""

    path: str
    endpoint: Endpoint
    methods: frozenset[str]

    def __init__(self, path: str, endpoint: Endpoint, *, methods: Iterable[str]) -> None:
        if not path.startswith("/"):
            raise InvalidArgumentError(f"route path `{path}` must start with `/`")
        _compile(path)  # a malformed template fails here, where the route is declared
        taken = {method.upper() for method in methods}
        if not taken:
            raise InvalidArgumentError(f"route `{path}` takes no method")
        if "GET" in taken:
            taken.add("HEAD")
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "methods", frozenset(taken))


@dataclass(frozen=True, slots=True)
class PathRoutes:
    """Every route of one path template: its endpoint per method."""

    path: str
    endpoints: dict[str, Endpoint]
    #: The methods as the ``Allow`` header of a 405 lists them (sorted).
    allow: str
    pattern: re.Pattern[str] | None = field(repr=False)

    @classmethod
    def of(cls, routes: Sequence[Route]) -> PathRoutes:
        endpoints: dict[str, Endpoint] = {}
        for route in routes:
            for method in sorted(route.methods):
                if method in endpoints:
                    raise InvalidArgumentError(f"two routes take {method} {route.path}")
                endpoints[method] = route.endpoint
        path = routes[0].path
        return cls(path, endpoints, ", ".join(sorted(endpoints)), _compile(path)[0])

    def match(self, path: str) -> dict[str, Any] | None:
        """The path parameters when ``path`` is this template's, else None."""
        if self.pattern is None:
            return {} if path == self.path else None
        found = self.pattern.match(path)
        return None if found is None else found.groupdict()


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """The routes a path found, and its parameters."""

    routes: PathRoutes
    params: dict[str, Any]


class Router:
    """Finds the routes of a path: by dictionary on plain paths, by pattern otherwise."""

    def __init__(self, routes: Sequence[Route]) -> None:
        grouped: dict[str, list[Route]] = {}
        for route in routes:
            grouped.setdefault(route.path, []).append(route)
        self.paths = tuple(PathRoutes.of(same) for same in grouped.values())
        #: Plain path -> its routes, unless an earlier template takes that path.
        self._exact: dict[str, RouteMatch] = {}
        for index, entry in enumerate(self.paths):
            shadowed = any(
                earlier.pattern is not None and earlier.match(entry.path) is not None
                for earlier in self.paths[:index]
            )
            if entry.pattern is None and not shadowed:
                self._exact[entry.path] = RouteMatch(entry, {})

    def find(self, path: str) -> RouteMatch | None:
        """The routes of the first template that matches ``path``."""
        found = self._exact.get(path)
        if found is not None:
            return found
        for entry in self.paths:
            params = entry.match(path)
            if params is not None:
                return RouteMatch(entry, params)
        return None

    def redirect(self, path: str) -> str | None:
        """The path with its trailing slash added or removed, when that one has a route
        and this one has none (the redirect a client that got the slash wrong is sent)."""
        if path == "/":
            return None
        other = path[:-1] if path.endswith("/") else path + "/"
        return other if self.find(other) is not None else None
