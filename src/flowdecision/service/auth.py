"""Bearer-token authentication (constant-time), with HTTP Basic for browsers."""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

__all__ = ["AuthMiddleware", "presented_token", "token_matches"]


def token_matches(presented: bytes, tokens: Sequence[bytes]) -> bool:
    """Whether ``presented`` is one of ``tokens`` (constant-time: every token is compared)."""
    matched = False
    for token in tokens:  # every token is compared: no early exit
        matched |= hmac.compare_digest(presented, token)
    return matched


def presented_token(scope: Scope) -> bytes | None:
    """The bearer token (or Basic password) a request presents, if any."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, credentials = value.partition(b" ")
            scheme = scheme.lower()
            if scheme == b"bearer":
                return bytes(credentials.strip())
            if scheme == b"basic":  # browsers: any user name, the token as password
                try:
                    decoded = base64.b64decode(credentials.strip(), validate=True)
                except (binascii.Error, ValueError):
                    return None
                return bytes(decoded.partition(b":")[2])
            return None
    return None


class AuthMiddleware:
    """Bearer-token auth (constant-time) for every path except the public ones."""

    def __init__(self, app: ASGIApp, *, tokens: Sequence[bytes], public: frozenset[str]) -> None:
        self.app = app
        self.tokens = tuple(tokens)
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tokens or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        presented = presented_token(scope)
        if presented is not None and token_matches(presented, self.tokens):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            "unauthorized",
            "missing or invalid bearer token" if presented is None else "invalid token",
        )
        response.raw_headers.append((b"www-authenticate", b'Bearer realm="flowdecision"'))
        response.raw_headers.append((b"www-authenticate", b'Basic realm="flowdecision"'))
        await response(scope, receive, send)
