"""When the client retries: :class:`RetryOptions`, and the :class:`RetryEvent`
passed to ``on_retry`` (what is retried is in :mod:`flowdecision.client`'s docs;
the loop itself is :meth:`.protocol.ServiceProtocol.exchange`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ..connections import transport
from ..core.defaults import (
    RETRY_BACKOFF_BASE_S,
    RETRY_BACKOFF_MAX_S,
    RETRY_MAX_RETRY_AFTER_S,
    RETRY_MAX_TRIES,
)
from ..errors import FlowDecisionError, InvalidArgumentError

__all__ = ["MAYBE_SENT", "NOT_SENT", "TRANSPORT_ERRORS", "OnRetry", "RetryEvent", "RetryOptions"]


@dataclass(frozen=True, slots=True)
class RetryOptions:
    """When and how long to retry; see the module docstring for *what* is retried."""

    #: HTTP requests per call, the first included (1 = never retry).
    max_tries: int = RETRY_MAX_TRIES
    #: Full-jitter backoff: retry n waits uniform(0, min(backoff_max_s, backoff_base_s·2^(n-1))).
    backoff_base_s: float = RETRY_BACKOFF_BASE_S
    backoff_max_s: float = RETRY_BACKOFF_MAX_S
    #: A ``Retry-After`` longer than this ends the retries at once (the error is raised).
    max_retry_after_s: float = RETRY_MAX_RETRY_AFTER_S
    #: Total time budget of one call, sleeps included (None: bounded by ``max_tries`` only).
    deadline_s: float | None = None
    #: Resend a decision after a failure that may have reached the service (see above).
    resend_after_ambiguous: bool = False

    def __post_init__(self) -> None:
        if self.max_tries < 1:
            raise InvalidArgumentError(f"max_tries must be at least 1, got {self.max_tries}")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0 or self.max_retry_after_s < 0:
            raise InvalidArgumentError("backoff and Retry-After bounds must not be negative")


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """Passed to ``on_retry`` before each retry's sleep."""

    method: str
    path: str
    #: The try that failed (1-based); the retry will be ``try_number + 1``.
    try_number: int
    #: How long the client sleeps before the retry (never less than ``retry_after_s``).
    delay_s: float
    #: The server's ``Retry-After``, when it sent one.
    retry_after_s: float | None
    #: What failed: a :class:`ServiceError` (an answer) or a :class:`ServiceConnectionError`.
    error: FlowDecisionError


OnRetry = Callable[[RetryEvent], None]

# The async client's transport is flowdecision.connections.transport (aiohttp), the blocking
# client's httpx: each tuple names both.

#: The request cannot have reached the service.
NOT_SENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    transport.ConnectError,
    transport.ConnectTimeoutError,
)
#: The request may have reached the service (or part of it did).
MAYBE_SENT: tuple[type[Exception], ...] = (
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    transport.ReadTimeoutError,
    transport.ReadError,
)
#: Any failure without an answer; those in neither tuple above are final.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.TransportError, transport.TransportError)
