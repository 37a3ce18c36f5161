"""Browser and host safety: the checks every HTTP request passes before auth and routing.

A web page in the operator's browser can send requests to the service: a
"simple" cross-origin ``POST`` (``Content-Type: text/plain``) needs no CORS
preflight, and a DNS-rebinding page can even make the browser address a
loopback service under the attacker's host name. :class:`RequestGuardMiddleware`
refuses, in this order:

1. a ``Host`` that names neither loopback nor an ``allowed_hosts`` entry, when
   the service listens on loopback (or whenever ``allowed_hosts`` is set): 421
   ``host_not_allowed``;
2. any ``Origin`` header not in ``allowed_origins`` (empty by default, so every
   browser-sent cross-site request is refused): 403 ``origin_not_allowed``;
3. a ``POST`` whose ``Content-Type`` is not ``application/json``: 415
   ``unsupported_media_type`` (no HTML form can send that type, and a script can
   only send it after a preflight, which rule 2 refuses).

Non-browser clients (curl, SDKs, load balancers) send no ``Origin`` and are not
affected by rule 2.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .config import Settings, is_loopback, normalize_host_name, normalize_origin
from .errors import error_response

__all__ = ["RequestGuardMiddleware", "UnreadBodyMiddleware"]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_JSON = "application/json"


class RequestGuardMiddleware:
    """Pure ASGI middleware enforcing the ``Host``, ``Origin`` and ``Content-Type`` rules."""

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
        host = origin = content_type = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
            elif name == b"content-type":
                content_type = value
        refusal = self._refusal(scope["method"], host, origin, content_type)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, code, message = refusal
        # The request body (if any) is never read: the connection layer drains or
        # closes it (see transport.py), so the client can read this answer.
        await error_response(status, code, message)(scope, receive, send)

    def _refusal(
        self,
        method: str,
        host: bytes | None,
        origin: bytes | None,
        content_type: bytes | None,
    ) -> tuple[int, str, str] | None:
        if self.check_host and host is not None and not self._host_allowed(host):
            shown = host.decode("latin-1")[:200]
            return (
                421,
                "host_not_allowed",
                f"`Host: {shown}` is not a name of this service; it answers to localhost, "
                "127.0.0.1 and [::1] (and the names in allowed_hosts)",
            )
        if origin is not None:
            text = origin.decode("latin-1")
            if normalize_origin(text) not in self.allowed_origins:
                return (
                    403,
                    "origin_not_allowed",
                    f"requests from origin `{text[:200]}` are not allowed "
                    "(add it to allowed_origins to let that web page call the service)",
                )
        if method in _BODY_METHODS:
            media = (content_type or b"").split(b";", 1)[0].strip().lower()
            if media != _JSON.encode():
                shown = (content_type or b"").decode("latin-1")[:100] or "none"
                return (
                    415,
                    "unsupported_media_type",
                    f"{method} needs `Content-Type: {_JSON}`, got `{shown}`",
                )
        return None

    def _host_allowed(self, header: bytes) -> bool:
        text = header.decode("latin-1").strip().lower()
        if text.startswith("["):  # [v6]:port
            name = text[1 : text.find("]")] if "]" in text else text
        else:
            name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
        name = name.rstrip(".")
        return bool(name) and (is_loopback(name) or name in self.allowed_hosts)


class UnreadBodyMiddleware:
    """Marks a response sent before the request body was read ``Connection: close``.

    A refusal (401, 413 on ``Content-Length``, 415...) is sent without reading
    the body. The connection then cannot carry another request, and a client
    that reuses it (a ``requests`` session) would see it closed under its next
    request; told ``Connection: close``, it opens a new one. The connection layer
    drains the unread body meanwhile (transport.py, lingering close).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        body_read = False

        async def receive_and_note() -> Message:
            nonlocal body_read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read = True
            return message

        async def send_with_close(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_read:
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive_and_note, send_with_close)


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False
