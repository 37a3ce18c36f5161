"""What both clients share: their arguments, the sans-I/O core and the HTTP client."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import httpx

from ..connections.transport import ResponseLike, pool_size
from ..core.defaults import CLIENT_TIMEOUT_S, HTTP_POOL_CONNECTIONS, SERVICE_URL
from ..errors import InvalidArgumentError
from ..observability import tracing
from .protocol import Exchange, Send, ServiceProtocol, Sleep
from .retry import TRANSPORT_ERRORS, OnRetry, RetryOptions

__all__ = [
    "DEFAULT_URL",
    "HTTP_DEFAULTS",
    "USER_AGENT",
    "BaseClient",
    "read_token_file",
    "send_headers",
    "send_kwargs",
]

DEFAULT_URL = SERVICE_URL

USER_AGENT = "flowdecision-client"


def send_headers(step: Send) -> Mapping[str, str]:
    """The step's headers, plus the caller's trace context (W3C ``traceparent``) when
    tracing is on, so the caller's trace continues in the service."""
    headers = step.headers
    if tracing.active():
        headers = dict(headers)
        tracing.inject(headers)
    return headers


def send_kwargs(step: Send) -> dict[str, Any]:
    """httpx's arguments for the step (the blocking client, or a given ``httpx.AsyncClient``)."""
    return {
        "headers": send_headers(step),
        "content": step.content,
        "params": step.params,
        "timeout": step.timeout,
    }


H = TypeVar("H")
T = TypeVar("T")

#: The settings of the httpx client a client builds (and owns) when none is given.
HTTP_DEFAULTS: Final[dict[str, Any]] = {
    "headers": {"User-Agent": USER_AGENT},
    "follow_redirects": False,
}


class BaseClient(Generic[H]):
    """What :class:`DecisionClient` and :class:`SyncDecisionClient` share: the
    arguments, the sans-I/O core and the HTTP client (built here unless given)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float | httpx.Timeout = CLIENT_TIMEOUT_S,
        retry: RetryOptions | None = None,
        wait_s: float | None = None,
        on_retry: OnRetry | None = None,
        http: H | None = None,
        rng: random.Random | None = None,
        max_connections: int = HTTP_POOL_CONNECTIONS,
    ) -> None:
        self._protocol = ServiceProtocol(
            url,
            token=token,
            timeout=timeout,
            retry=retry or RetryOptions(),
            wait_s=wait_s,
            on_retry=on_retry,
            rng=rng,
        )
        self._owns_http = http is None
        self._http: H = self._new_http(pool_size(max_connections)) if http is None else http

    @property
    def url(self) -> str:
        return self._protocol.base_url

    def _new_http(self, max_connections: int) -> H:
        raise NotImplementedError

    async def _send(self, step: Send) -> ResponseLike:
        """Send one request (the async client awaits it, the blocking one blocks)."""
        raise NotImplementedError

    async def _sleep(self, seconds: float) -> None:
        """Wait before a retry (the async client awaits, the blocking one blocks)."""
        raise NotImplementedError

    async def _drive(self, exchange: Exchange[T]) -> T:
        """Carry out one operation's steps (:mod:`.protocol`); return its result."""
        try:
            step = next(exchange)
            while True:
                if isinstance(step, Sleep):
                    await self._sleep(step.seconds)
                    step = exchange.send(None)
                    continue
                try:
                    response = await self._send(step)
                except TRANSPORT_ERRORS as error:
                    step = exchange.throw(error)
                else:
                    step = exchange.send(response)
        except StopIteration as stop:
            result: T = stop.value
            return result


def read_token_file(path: str | Path) -> str:
    """The first non-blank line of a token file (the service's token files list one per line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"cannot read token file `{path}`: {error}") from error
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    raise InvalidArgumentError(f"token file `{path}` has no token")
