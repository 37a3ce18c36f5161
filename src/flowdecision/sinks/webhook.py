"""The webhook sink: POST each decision to an HTTP endpoint of the workflow engine.

Every delivery is ``POST <url>`` with the request's exact wire bytes
(:meth:`DecisionRequest.to_json`) and the headers

* ``Content-Type: application/json``
* ``Idempotency-Key: <decision_id>`` -- the receiver must deduplicate on it;
* ``X-Flow-Attempt: <attempt>`` -- the claim's fencing token (grows on takeover);
* ``Authorization: Bearer <token>`` when a token is configured;
* ``traceparent`` (and ``tracestate``) when tracing is on: the W3C trace
  context of the dispatch's ``flowdecision.sink.submit`` span, so the
  receiver's spans join the decision's trace (docs/OBSERVABILITY.md).

Any 2xx means accepted. Only transient failures are retried, at most
``max_attempts`` tries in all, with jittered exponential backoff: connection
failures and timeouts, 5xx, and 429. A ``Retry-After`` on a 429 or 503 is
honoured (seconds or an HTTP date); one longer than ``max_retry_after_s`` ends
the retries at once instead of holding the claim. Any other status (3xx, 4xx)
fails immediately with :class:`WebhookRejectedError`. Retrying after a timeout
is safe only because the receiver deduplicates on ``Idempotency-Key``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import ClassVar, Self

import httpx

from ..backoff import parse_retry_after
from ..closing import Openable
from ..defaults import (
    WEBHOOK_BACKOFF_BASE_S,
    WEBHOOK_BACKOFF_MAX_S,
    WEBHOOK_MAX_ATTEMPTS,
    WEBHOOK_MAX_RETRY_AFTER_S,
    WEBHOOK_TIMEOUT_S,
)
from ..errors import InvalidArgumentError, WebhookError, WebhookRejectedError
from ..model import DecisionRequest
from ..tracing import active, inject

__all__ = [
    "TRANSIENT_ERRORS",
    "WebhookError",
    "WebhookRejectedError",
    "WebhookSink",
    "parse_retry_after",
]

log = logging.getLogger("flowdecision.sinks.webhook")

#: Transport failures worth another try (the connection failed or timed out).
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.TimeoutException,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


class WebhookSink(Openable):
    """Deliver decisions by HTTP POST; see the module docstring for the contract."""

    #: What error messages call the receiver.
    name: ClassVar[str] = "webhook"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = WEBHOOK_TIMEOUT_S,
        max_attempts: int = WEBHOOK_MAX_ATTEMPTS,
        backoff_base_s: float = WEBHOOK_BACKOFF_BASE_S,
        backoff_max_s: float = WEBHOOK_BACKOFF_MAX_S,
        max_retry_after_s: float = WEBHOOK_MAX_RETRY_AFTER_S,
        token: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1:
            raise InvalidArgumentError(f"max_attempts must be at least 1, got {max_attempts}")
        self.url = url
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_retry_after_s = max_retry_after_s
        self._token = token
        self._rng = rng or random.Random()
        self._client: httpx.AsyncClient | None = None

    async def open(self) -> Self:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                follow_redirects=False,
                headers={"User-Agent": "flowdecision-webhook"},
            )
        return self

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def backoff_s(self, retry: int) -> float:
        """Delay before retry number ``retry`` (1-based): half fixed, half random."""
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** (retry - 1))
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": request.decision_id,
            "X-Flow-Attempt": str(attempt),
        }
        await self.post(self.url, request.to_json(), headers, request.decision_id)

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], decision_id: str
    ) -> httpx.Response:
        """POST ``body`` to ``url`` with the retries above; the 2xx response.

        Adds ``Authorization`` when a token is configured. Subclasses that speak
        an engine's ingress protocol (the Restate sink) reuse this loop.
        """
        client = self._client
        if client is None:
            await self.open()
            client = self._client
            assert client is not None
        if self._token:
            headers = {**headers, "Authorization": f"Bearer {self._token}"}
        if active():  # traceparent/tracestate of the dispatch's sink span
            headers = dict(headers)
            inject(headers)
        tries = 0
        while True:
            tries += 1
            wait: float | None = None
            try:
                response = await client.post(url, content=body, headers=headers)
            except TRANSIENT_ERRORS as error:
                problem = f"{type(error).__name__}: {error}".rstrip(": ")
                status = None
            else:
                status = response.status_code
                if 200 <= status < 300:
                    return response
                problem = f"HTTP {status}"
                if status != 429 and status < 500:
                    raise WebhookRejectedError(
                        f"{self.name} rejected the decision with HTTP {status}{_snippet(response)}",
                        status=status,
                        tries=tries,
                    )
                if status in (429, 503):
                    wait = parse_retry_after(response.headers.get("Retry-After"))
            if tries >= self.max_attempts:
                raise WebhookError(
                    f"{self.name} failed after {tries} tries: {problem}", status=status, tries=tries
                )
            if wait is not None and wait > self.max_retry_after_s:
                raise WebhookError(
                    f"{self.name} asked to retry after {wait:.0f}s (more than "
                    f"{self.max_retry_after_s:.0f}s): {problem}",
                    status=status,
                    tries=tries,
                )
            delay = max(wait, self.backoff_s(tries)) if wait is not None else self.backoff_s(tries)
            log.warning(
                "webhook delivery failed, retrying",
                extra={
                    "decision_id": decision_id,
                    "try": tries,
                    "problem": problem,
                    "retry_in_s": round(delay, 3),
                },
            )
            await asyncio.sleep(delay)


def _snippet(response: httpx.Response) -> str:
    text = response.text.strip().replace("\n", " ")
    return f": {text[:200]}" if text else ""
