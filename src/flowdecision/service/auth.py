"""Bearer-token authentication (constant-time), with HTTP Basic for browsers."""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Callable, Sequence

from starlette.responses import Response

from .errors import error_response

__all__ = ["Auth", "presented_token", "token_matches"]


def token_matches(presented: bytes, tokens: Sequence[bytes]) -> bool:
    """Whether ``presented`` is one of ``tokens`` (constant-time: every token is compared)."""
    matched = False
    for token in tokens:  # every token is compared: no early exit
        matched |= hmac.compare_digest(presented, token)
    return matched


def presented_token(authorization: bytes | None) -> bytes | None:
    """The bearer token (or Basic password) an ``Authorization`` header presents, if any."""
    if authorization is None:
        return None
    scheme, _, credentials = authorization.partition(b" ")
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


class Auth:
    """Bearer-token auth (constant-time) for every path except the public ones.

    Two kinds of token (docs/SERVICE.md, "Auth"): a submit token (``tokens``)
    opens every route; an admin token (``admin_tokens``) only the routes
    ``admin_may(method, path)`` names (the operator's queries and actions), and
    elsewhere gets 403 ``forbidden``: least privilege, an operator's token does
    not submit decisions or read the outbox. Without a submit token the other
    routes are open (the service then listens on loopback only, or with
    ``allow_no_auth``).
    """

    def __init__(
        self,
        *,
        tokens: Sequence[bytes],
        public: frozenset[str],
        admin_tokens: Sequence[bytes] = (),
        admin_may: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.tokens = tuple(tokens)
        self.public = public
        self.admin_tokens = tuple(admin_tokens)
        self.admin_may = admin_may
        #: Without any token every request passes: nothing to ask.
        self.enabled = bool(self.tokens or self.admin_tokens)

    def refusal(self, method: str, path: str, authorization: bytes | None) -> Response | None:
        """None when the request may pass; else the 401 or 403 to answer."""
        if not self.enabled or path in self.public:
            return None
        presented = presented_token(authorization)
        if presented is not None and token_matches(presented, self.tokens):
            return None
        if (
            presented is not None
            and self.admin_tokens
            and token_matches(presented, self.admin_tokens)
        ):
            if self.admin_may is not None and self.admin_may(method, path):
                return None
            return error_response(
                403,
                "forbidden",
                "the admin token is for the operator's queries and actions; "
                "this route needs a submit token",
            )
        if presented is None and not self.tokens:
            return None  # no submit token configured: the other routes are open
        response = error_response(
            401,
            "unauthorized",
            "missing or invalid bearer token" if presented is None else "invalid token",
        )
        response.raw_headers.append((b"www-authenticate", b'Bearer realm="flowdecision"'))
        response.raw_headers.append((b"www-authenticate", b'Basic realm="flowdecision"'))
        return response
