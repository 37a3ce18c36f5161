"""Browser and host safety: checks every HTTP request passes before it reaches a handler.

A web page in the operator's browser can send requests to the service: a
"simple" cross-origin ``POST`` (``Content-Type: text/plain``) needs no CORS
preflight, and a DNS-rebinding page can even make the browser address a
loopback service under the attacker's host name. So:

- :class:`BrowserGuardMiddleware` (before auth) first refuses what HTTP/1.1
  itself forbids, whichever parser read it: no ``Host`` on an HTTP/1.1
  request, or two (400 ``bad_request``, RFC 9112 §3.2); two
  ``Content-Length`` fields, or one with ``Transfer-Encoding`` (400: a
  request-smuggling shape, §6.3); an ``Expect`` other than ``100-continue``
  (417 ``expectation_failed``). Then it refuses a ``Host`` that names
  neither loopback nor an ``allowed_hosts`` entry when the service listens on
  loopback (or whenever ``allowed_hosts`` is set): 421 ``host_not_allowed``;
  and any ``Origin`` not in ``allowed_origins`` (empty by default, so every
  request a browser sends from another site): 403 ``origin_not_allowed``. For
  an allowed origin it answers CORS preflights and adds the CORS headers, so a
  console served from that origin can call the API with its bearer token.
- :class:`JsonContentTypeMiddleware` (after auth, so unauthenticated callers
  still learn nothing but 401) refuses a ``POST`` whose ``Content-Type`` is not
  ``application/json``, or whose body is compressed (``Content-Encoding``
  other than ``identity``): 415 ``unsupported_media_type``. No HTML form can
  send that type, and a script can only send it after a preflight. Only the
  methods a route accepts are checked: ``PUT /v1/decisions`` is the router's
  405 (with ``Allow``), whatever its content type.

Non-browser clients (curl, SDKs, load balancers) send no ``Origin``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from starlette.middleware import Middleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .config import Settings, is_loopback, normalize_host_name, normalize_origin
from .errors import error_response

__all__ = ["BrowserGuardMiddleware", "JsonContentTypeMiddleware", "has_body"]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_JSON = "application/json"
#: What a console on an allowed origin may send and read (CORS).
_CORS_PREFLIGHT = [
    (b"access-control-allow-methods", b"GET, POST"),
    (b"access-control-allow-headers", b"authorization, content-type, x-request-id, prefer"),
    (b"access-control-max-age", b"600"),
]
_CORS_EXPOSE = (b"access-control-expose-headers", b"retry-after, x-request-id")
#: How many distinct ``Host`` values BrowserGuardMiddleware remembers its verdict on.
_HOST_VERDICTS_MAX = 256


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


class BrowserGuardMiddleware:
    """Pure ASGI middleware enforcing the ``Host`` and ``Origin`` rules (and CORS)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_origins: Iterable[str],
        allowed_hosts: Iterable[str],
        check_host: bool,
    ) -> None:
        self.app = app
        self.allowed_origins = frozenset(
            normalize_origin(origin, setting="allowed_origins") for origin in allowed_origins
        )
        self.allowed_hosts = frozenset(
            normalize_host_name(name, setting="allowed_hosts") for name in allowed_hosts
        )
        self.check_host = check_host or bool(self.allowed_hosts)
        #: ``Host`` header -> allowed, for the few values clients send (parsing an IP
        #: literal on every request was a few percent of a ``POST``'s CPU).
        self._host_verdicts: dict[bytes, bool] = {}

    @classmethod
    def middleware(cls, settings: Settings) -> Middleware:
        """This middleware, configured by ``settings``, for a Starlette middleware list."""
        return Middleware(
            cls,
            allowed_origins=settings.allowed_origins,
            allowed_hosts=settings.allowed_hosts,
            check_host=is_loopback(settings.host),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # One pass over the headers for every rule below.
        host = origin = expect = None
        hosts = lengths = 0
        chunked = False
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
                hosts += 1
            elif name == b"origin":
                origin = value
            elif name == b"content-length":
                lengths += 1
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"expect":
                expect = value
        problem = _framing_problem(scope, hosts, lengths, chunked)
        if problem is not None:
            await error_response(400, "bad_request", problem)(scope, receive, send)
            return
        if expect is not None and expect.strip().lower() != b"100-continue":
            shown = bytes(expect).decode("latin-1")[:100]
            problem = f"`Expect: {shown}` cannot be met; the only expectation is `100-continue`"
            await error_response(417, "expectation_failed", problem)(scope, receive, send)
            return
        if self.check_host and host is not None and not self.host_allowed(host):
            shown = host.decode("latin-1")[:200]
            refusal = error_response(
                421,
                "host_not_allowed",
                f"`Host: {shown}` is not a name of this service; it answers to localhost, "
                "127.0.0.1 and [::1] (and the names in allowed_hosts)",
            )
            await refusal(scope, receive, send)
            return
        if origin is None:
            await self.app(scope, receive, send)
            return
        text = origin.decode("latin-1")
        if normalize_origin(text) not in self.allowed_origins:
            refusal = error_response(
                403,
                "origin_not_allowed",
                f"requests from origin `{text[:200]}` are not allowed "
                "(add it to allowed_origins to let that web page call the service)",
            )
            await refusal(scope, receive, send)
            return
        allow = [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method"):
            await Response(status_code=204, headers=None)(
                scope, receive, _adding(send, allow + _CORS_PREFLIGHT)
            )
            return
        await self.app(scope, receive, _adding(send, [*allow, _CORS_EXPOSE]))

    def host_allowed(self, header: bytes) -> bool:
        """Whether a ``Host`` header names this service (loopback or ``allowed_hosts``)."""
        verdict = self._host_verdicts.get(header)
        if verdict is None:
            verdict = self._judge_host(header)
            if len(self._host_verdicts) >= _HOST_VERDICTS_MAX:
                self._host_verdicts.clear()  # a client making up names: start over
            self._host_verdicts[header] = verdict
        return verdict

    def _judge_host(self, header: bytes) -> bool:
        text = header.decode("latin-1").strip().lower()
        if text.startswith("["):  # [v6]:port
            name = text[1 : text.find("]")] if "]" in text else text
        else:
            name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
        name = name.rstrip(".")
        return bool(name) and (is_loopback(name) or name in self.allowed_hosts)


def _framing_problem(scope: Scope, hosts: int, lengths: int, chunked: bool) -> str | None:
    """What makes the request's framing or ``Host`` ambiguous (RFC 9112), if anything."""
    if hosts > 1 or (hosts == 0 and scope.get("http_version") == "1.1"):
        return f"an HTTP/1.1 request needs exactly one `Host` header, got {hosts}"
    if lengths > 1:
        return f"the request has {lengths} `Content-Length` headers; send one"
    if lengths and chunked:
        return "the request has both `Content-Length` and `Transfer-Encoding`; send one"
    return None


def _adding(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *headers]}
        await send(message)

    return send_with_headers


class JsonContentTypeMiddleware:
    """Refuses a request body that is not plain ``application/json`` (415).

    With ``routes`` (path -> the methods with a body its route accepts), only
    those requests are checked: a method no route accepts (``PUT /healthz``,
    ``PATCH /v1/decisions``) then gets the router's 405 with ``Allow``, not a
    415 that suggests another content type would work (found by Schemathesis).
    """

    def __init__(self, app: ASGIApp, *, routes: Mapping[str, Iterable[str]] | None = None) -> None:
        self.app = app
        self.routes = (
            None
            if routes is None
            else {path: frozenset(methods) & _BODY_METHODS for path, methods in routes.items()}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        if self.routes is not None and scope["method"] not in self.routes.get(scope["path"], ()):
            await self.app(scope, receive, send)
            return
        content_type = encoding = b""
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"content-encoding":
                encoding = value
        if encoding.strip().lower() not in (b"", b"identity"):
            shown = bytes(encoding).decode("latin-1")[:100]
            problem = f"`Content-Encoding: {shown}` is not supported; send the body uncompressed"
            await error_response(415, "unsupported_media_type", problem)(scope, receive, send)
            return
        if content_type.split(b";", 1)[0].strip().lower() == _JSON.encode():
            await self.app(scope, receive, send)
            return
        shown = bytes(content_type).decode("latin-1")[:100] or "none"
        # The body is not read: the boundary marks the answer Connection: close
        # and the edge drains the body (lingering close), so the client reads the 415.
        refusal = error_response(
            415,
            "unsupported_media_type",
            f"{scope['method']} needs `Content-Type: {_JSON}`, got `{shown}`",
        )
        await refusal(scope, receive, send)


def has_body(scope: Scope) -> bool:
    """Whether the request has a body (chunked, or a ``Content-Length`` other than 0)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False
