"""Browser and host safety: rules every HTTP request passes before it reaches a handler.

A web page in the operator's browser can send requests to the service: a
"simple" cross-origin ``POST`` (``Content-Type: text/plain``) needs no CORS
preflight, and a DNS-rebinding page can even make the browser address a
loopback service under the attacker's host name. So:

- :class:`BrowserGuard` (before auth) first refuses what HTTP/1.1
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
- :func:`content_type_refusal` (after auth, so unauthenticated callers
  still learn nothing but 401) refuses a ``POST`` whose ``Content-Type`` is not
  ``application/json``, or whose body is compressed (``Content-Encoding``
  other than ``identity``): 415 ``unsupported_media_type``. No HTML form can
  send that type, and a script can only send it after a preflight. Only the
  methods a route accepts are checked: ``PUT /v1/decisions`` is the router's
  405 (with ``Allow``), whatever its content type.

Non-browser clients (curl, SDKs, load balancers) send no ``Origin``.

The rules read the request's head (:class:`.head.RequestHead`); the pipeline
(:mod:`.pipeline`) asks them in order and answers the first refusal.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import Response
from starlette.types import Scope

from .config import Settings, is_loopback, normalize_host_name, normalize_origin
from .errors import error_response
from .head import RequestHead

__all__ = ["BODY_METHODS", "BrowserGuard", "Cors", "content_type_refusal"]

#: Methods whose request carries a body the content-type rule checks.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_JSON = b"application/json"
#: What a console on an allowed origin may send and read (CORS).
_CORS_PREFLIGHT = (
    (b"access-control-allow-methods", b"GET, POST"),
    (b"access-control-allow-headers", b"authorization, content-type, x-request-id, prefer"),
    (b"access-control-max-age", b"600"),
)
_CORS_EXPOSE = (b"access-control-expose-headers", b"retry-after, x-request-id")
#: How many distinct ``Host`` values BrowserGuard remembers its verdict on.
_HOST_VERDICTS_MAX = 256


class Cors:
    """An allowed origin's verdict: the headers its answers carry, and whether the
    request is a preflight (answered 204 at once)."""

    __slots__ = ("headers", "preflight")

    def __init__(self, origin: bytes, preflight: bool) -> None:
        allow = [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        self.preflight = preflight
        self.headers = [*allow, *_CORS_PREFLIGHT] if preflight else [*allow, _CORS_EXPOSE]


class BrowserGuard:
    """The ``Host``, ``Origin`` (CORS) and framing rules (module docstring)."""

    def __init__(
        self,
        *,
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
        check_host: bool,
    ) -> None:
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
    def from_settings(cls, settings: Settings) -> BrowserGuard:
        """The guard ``settings`` configure (the host rule is on when listening on loopback)."""
        return cls(
            allowed_origins=settings.allowed_origins,
            allowed_hosts=settings.allowed_hosts,
            check_host=is_loopback(settings.host),
        )

    def refusal(self, scope: Scope, head: RequestHead) -> Response | Cors | None:
        """The answer refusing the request (400, 417, 421, 403); else its CORS verdict
        when it came from an allowed origin; else None (no ``Origin``: not a browser's)."""
        problem = _framing_problem(scope, head)
        if problem is not None:
            return error_response(400, "bad_request", problem)
        expect = head.expect
        if expect is not None and expect.strip().lower() != b"100-continue":
            shown = bytes(expect).decode("latin-1")[:100]
            problem = f"`Expect: {shown}` cannot be met; the only expectation is `100-continue`"
            return error_response(417, "expectation_failed", problem)
        host = head.host
        if self.check_host and host is not None and not self.host_allowed(host):
            shown = host.decode("latin-1")[:200]
            return error_response(
                421,
                "host_not_allowed",
                f"`Host: {shown}` is not a name of this service; it answers to localhost, "
                "127.0.0.1 and [::1] (and the names in allowed_hosts)",
            )
        origin = head.origin
        if origin is None:
            return None
        text = origin.decode("latin-1")
        if normalize_origin(text) not in self.allowed_origins:
            return error_response(
                403,
                "origin_not_allowed",
                f"requests from origin `{text[:200]}` are not allowed "
                "(add it to allowed_origins to let that web page call the service)",
            )
        return Cors(origin, scope["method"] == "OPTIONS" and head.access_control_request)

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


def _framing_problem(scope: Scope, head: RequestHead) -> str | None:
    """What makes the request's framing or ``Host`` ambiguous (RFC 9112), if anything."""
    hosts, lengths = head.hosts, head.lengths
    if hosts > 1 or (hosts == 0 and scope.get("http_version") == "1.1"):
        return f"an HTTP/1.1 request needs exactly one `Host` header, got {hosts}"
    if lengths > 1:
        return f"the request has {lengths} `Content-Length` headers; send one"
    if lengths and head.chunked:
        return "the request has both `Content-Length` and `Transfer-Encoding`; send one"
    return None


def content_type_refusal(method: str, head: RequestHead) -> Response | None:
    """415 for a body that is not plain ``application/json`` (or is compressed).

    The pipeline asks only for a method the route takes: ``PUT /healthz`` gets the
    405 with ``Allow``, not a 415 that suggests another content type would work
    (found by Schemathesis).
    """
    if method not in BODY_METHODS:
        return None
    encoding = head.content_encoding
    if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
        shown = bytes(encoding).decode("latin-1")[:100]
        problem = f"`Content-Encoding: {shown}` is not supported; send the body uncompressed"
        return error_response(415, "unsupported_media_type", problem)
    content_type = head.content_type or b""
    if content_type.split(b";", 1)[0].strip().lower() == _JSON:
        return None
    shown = bytes(content_type).decode("latin-1")[:100] or "none"
    # The body is not read: the answer says Connection: close and the edge drains
    # the body (lingering close), so the client reads the 415.
    return error_response(
        415,
        "unsupported_media_type",
        f"{method} needs `Content-Type: application/json`, got `{shown}`",
    )
