"""A request's head, read in one pass over its headers, for every rule that reads one.

The pipeline (:mod:`.pipeline`) reads it once per request; the rules of
:mod:`.guards` and :mod:`.auth`, the request id (:mod:`.logs`) and the server
span take what they need from it, so no rule walks the headers again.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

from ..observability import tracing as _tracing

__all__ = ["RequestHead"]

#: Where the pipeline keeps a request's head in its ASGI scope, for the endpoint.
_SCOPE_KEY = "flowdecision.head"

#: Headers that carry trace context: a parent is only looked for when one came.
_TRACE_HEADERS = frozenset(_tracing.CONTEXT_HEADERS)


class RequestHead:
    """What the rules read of a request's headers (names are lower case in ASGI).

    Where a header may come twice, the rules read: the first ``Authorization``,
    ``Content-Length`` and ``X-Request-Id``; the last ``Content-Type``,
    ``Content-Encoding``, ``Origin`` and ``Expect``; every ``Prefer``; and
    the number of ``Host`` and ``Content-Length`` fields (two are refused).
    """

    __slots__ = (
        "access_control_request",
        "authorization",
        "chunked",
        "content_encoding",
        "content_type",
        "declared",
        "expect",
        "has_body",
        "host",
        "hosts",
        "lengths",
        "origin",
        "prefer",
        "request_id",
        "traced",
    )

    def __init__(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        host = declared = content_type = encoding = origin = expect = None
        authorization = request_id = None
        prefer: list[str] | None = None
        hosts = lengths = 0
        chunked = traced = preflight = False
        for name, value in headers:
            if name == b"host":
                host = value
                hosts += 1
            elif name == b"content-length":
                if declared is None:
                    declared = value
                lengths += 1
            elif name == b"content-type":
                content_type = value
            elif name == b"authorization":
                if authorization is None:
                    authorization = value
            elif name == b"x-request-id":
                if request_id is None:
                    request_id = value
            elif name == b"prefer":
                if prefer is None:
                    prefer = []
                prefer.append(value.decode("latin-1"))
            elif name == b"origin":
                origin = value
            elif name == b"content-encoding":
                encoding = value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"expect":
                expect = value
            elif name == b"access-control-request-method":
                preflight = True
            elif name in _TRACE_HEADERS:
                traced = True
        self.host: bytes | None = host
        self.hosts = hosts
        self.declared: bytes | None = declared
        self.lengths = lengths
        self.content_type: bytes | None = content_type
        self.content_encoding: bytes | None = encoding
        self.authorization: bytes | None = authorization
        self.request_id: bytes | None = request_id
        self.prefer = prefer
        self.origin: bytes | None = origin
        self.chunked = chunked
        self.expect: bytes | None = expect
        #: An ``Access-Control-Request-Method`` came (with ``OPTIONS``: a CORS preflight).
        self.access_control_request = preflight
        #: A header carrying trace context came.
        self.traced = traced
        #: The request has a body (chunked, or a ``Content-Length`` other than 0).
        self.has_body = chunked or (declared is not None and declared.strip() != b"0")

    @classmethod
    def of(cls, scope: MutableMapping[str, Any]) -> RequestHead:
        """The head of the request ``scope`` describes: read once, then kept in the scope."""
        head: RequestHead | None = scope.get(_SCOPE_KEY)
        if head is None:
            head = scope[_SCOPE_KEY] = cls(scope["headers"])
        return head
