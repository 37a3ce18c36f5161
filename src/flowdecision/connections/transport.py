"""The async HTTP transport of :class:`~flowdecision.client.DecisionClient` and the HTTP sinks.

One :class:`HttpPool` is one aiohttp ``ClientSession`` with its own connection pool
(``max_connections``, 64 by default: 64 concurrent calls never wait for a connection). It
is opened on the first request, inside the running event loop, and is safe to share
between any number of tasks of that loop.

Why aiohttp and not httpx's ``AsyncClient``: httpx's async pool does not scale with
concurrency (encode/httpx#3215); measured side by side against ``flowdecision serve``,
64 concurrent submitters got a few percent of what plain aiohttp gets, and httpx with
aiohttp underneath (httpx-aiohttp) 0.6-0.8x, because httpx's own request and response
layers cost about as much CPU as aiohttp's whole exchange (docs/ARCHITECTURE.md, "The
HTTP transport"). aiohttp is imported on the first request, so importing the client or a
sink costs nothing; it comes with the ``client``, ``service`` and ``restate`` extras.

A failure comes out as a :class:`TransportError` named by what happened, which says
whether the request may have reached the server (``sent``): the client's retry rules and
the sinks' transient/permanent split read that, never aiohttp's exception tree. Messages
go through :func:`~flowdecision.observability.redact.redact_text`: aiohttp names the URL in some of
them, and a sink URL can carry a token in its query string.

Nothing here logs (aiohttp's client does not log requests either): no URL reaches a log.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..core.defaults import HTTP_POOL_CONNECTIONS
from ..errors import FlowDecisionError, InvalidArgumentError
from ..observability.redact import redact_text

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "TRANSIENT_ERRORS",
    "ConnectError",
    "ConnectTimeoutError",
    "HttpPool",
    "HttpResponse",
    "ReadError",
    "ReadTimeoutError",
    "ResponseLike",
    "TransportError",
    "pool_size",
]


class TransportError(FlowDecisionError, code="transport_failed"):
    """No HTTP answer. ``sent`` says whether the request may have reached the server.

    This class itself (not a subclass) is a request that cannot be sent at all, such as
    an unsupported URL: retrying it cannot help. The aiohttp error is ``__cause__``.
    """

    #: May the server have seen (part of) the request?
    sent: ClassVar[bool] = False


class ConnectError(TransportError, code="connect_failed"):
    """No connection: refused, unreachable, a name that does not resolve, a TLS failure."""


class ConnectTimeoutError(TransportError, code="connect_timeout"):
    """No connection within the connect timeout (waiting for a pooled one included)."""


class ReadTimeoutError(TransportError, code="read_timeout"):
    """The request was sent, and no answer came within the read timeout."""

    sent = True


class ReadError(TransportError, code="connection_lost"):
    """The connection broke after the request started: dropped, reset, a malformed answer."""

    sent = True


#: Failures worth another try (for a POST only where the receiver deduplicates).
TRANSIENT_ERRORS: tuple[type[TransportError], ...] = (
    ConnectError,
    ConnectTimeoutError,
    ReadTimeoutError,
    ReadError,
)


class _Path(Protocol):
    @property
    def path(self) -> str: ...


class ResponseLike(Protocol):
    """What the client's decoders read from an answer: an :class:`HttpResponse`, or an
    ``httpx.Response`` (the blocking client's, and hand-built ones in tests)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def text(self) -> str: ...

    @property
    def reason_phrase(self) -> str: ...

    @property
    def url(self) -> _Path: ...

    def json(self) -> Any: ...


class HttpResponse:
    """An answer read in full: status, headers (case-insensitive), body bytes and URL."""

    __slots__ = ("content", "headers", "reason_phrase", "status_code", "url")

    def __init__(
        self,
        status_code: int,
        headers: Mapping[str, str],
        content: bytes,
        reason_phrase: str,
        url: _Path,
    ) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content
        self.reason_phrase = reason_phrase
        self.url = url

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (a :class:`ValueError` when it is not)."""
        # JSON is UTF-8 (RFC 8259): decoding first skips json's encoding detection.
        return json.loads(self.content.decode("utf-8"))


class HttpPool:
    """One aiohttp session and its connection pool; see the module docstring.

    ``max_connections`` bounds the connections open at once (a call beyond it waits
    for one, within its connect timeout); ``headers`` go with every request.
    """

    def __init__(
        self,
        *,
        max_connections: int = HTTP_POOL_CONNECTIONS,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.max_connections = pool_size(max_connections)
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        # The URLs already parsed (a client sends to a few), and the timeouts built.
        self._urls: dict[str, Any] = {}
        self._timeouts: dict[
            tuple[float | None, float | None, float | None], aiohttp.ClientTimeout
        ] = {}

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            # An API client keeps no cookies between calls. trust_env stays off: with
            # it, aiohttp reads the proxy variables and ~/.netrc in a worker thread on
            # every request (two thread hops per call, a third of the client's CPU).
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        return self._session

    def _timeout(
        self, connect: float | None, read: float | None, pool: float | None
    ) -> aiohttp.ClientTimeout:
        key = (connect, read, pool)
        timeout = self._timeouts.get(key)
        if timeout is None:
            import aiohttp

            # aiohttp's `connect` covers the wait for a pooled connection and the new
            # connection's set-up; `sock_connect` the set-up alone; `sock_read` the
            # longest silence while reading. There is no write timeout.
            waiting = None if connect is None or pool is None else connect + pool
            timeout = aiohttp.ClientTimeout(
                total=None, connect=waiting, sock_connect=connect, sock_read=read
            )
            self._timeouts[key] = timeout
        return timeout

    def _url(self, url: str) -> Any:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= _URL_CACHE:
                self._urls.clear()
            parsed = self._urls[url] = _as_sent(url)
        return parsed

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
        params: Mapping[str, str | int] | None = None,
        connect_s: float | None,
        read_s: float | None,
        pool_s: float | None = None,
    ) -> HttpResponse:
        """Send one request and read its whole answer; redirects are not followed.

        Raises a :class:`TransportError` when no answer came (see the module docstring).
        """
        import aiohttp

        session = self._session or self._open()
        try:
            async with session.request(
                method,
                self._url(url),
                headers=headers,
                data=content,
                params=params,
                timeout=self._timeout(connect_s, read_s, pool_s),
                allow_redirects=False,
            ) as response:
                body = await response.read()
                return HttpResponse(
                    response.status, response.headers, body, response.reason or "", response.url
                )
        # ValueError: a URL that does not parse (yarl's, before aiohttp's own checks).
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            raise _mapped(error) from error

    async def close(self) -> None:
        """Close the pool's connections; the next request opens a new pool."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def pool_size(max_connections: int) -> int:
    """``max_connections``, checked (callers that build their pool later check it early)."""
    if max_connections < 1:
        raise InvalidArgumentError(f"max_connections must be at least 1, got {max_connections}")
    return max_connections


#: Parsed URLs a pool keeps (a webhook sink keyed by run id sees many).
_URL_CACHE = 256


def _as_sent(url: str) -> Any:
    """``url`` as aiohttp should send it: verbatim when it is already percent-encoded.

    The client percent-encodes its paths (a decision id ``..`` is ``%2E%2E``); parsed
    as a plain string, yarl would decode and then drop such a segment as a dot
    segment. A URL with anything that still needs encoding is left to yarl.
    """
    if url.isascii() and url.isprintable() and " " not in url:
        import yarl

        return yarl.URL(url, encoded=True)
    return url


def _mapped(error: BaseException) -> TransportError:
    """The :class:`TransportError` for an aiohttp failure (most specific first)."""
    import aiohttp

    kind: type[TransportError]
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        kind = ConnectTimeoutError
    elif isinstance(error, aiohttp.ClientConnectorError):
        kind = ConnectError
    elif isinstance(error, aiohttp.SocketTimeoutError | TimeoutError):
        kind = ReadTimeoutError
    elif isinstance(error, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError | ValueError):
        kind = TransportError  # cannot be sent: retrying cannot help
    else:  # disconnected, reset, a malformed or truncated answer
        kind = ReadError
    detail = redact_text(str(error)) or type(error).__name__
    return kind(detail)
