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
failures and timeouts, 5xx, 408, 429, and a 409 that carries ``Retry-After`` (a
receiver busy with the same id, as flowdecision's own service answers). A
``Retry-After`` on a 409, 429 or 503 is honoured (seconds or an HTTP date); one
longer than ``max_retry_after_s`` ends the retries at once instead of holding the
claim. Any other status (3xx, 4xx) fails immediately with
:class:`WebhookRejectedError`: the receiver refuses the decision for good (a
:class:`~flowdecision.errors.SinkRefusedError`, which a relay parks). Retrying after a timeout
is safe only because the receiver deduplicates on ``Idempotency-Key``.

Requests go through one aiohttp connection pool per sink
(:class:`~flowdecision.connections.transport.HttpPool`, ``max_connections``, 64 by default), so one
sink serves many concurrent submissions (inline under ``serve``, or a relay's): it is
safe to call from any number of tasks of one event loop.

Logs: one warning per distinct failure of a decision, not one per try. A failure that
repeats (the same status, the same transport error) for the same decision is logged at
DEBUG until it changes or the delivery succeeds (then one INFO line says so). No log
line and no error message names the sink's URL unredacted (a token can sit in its
query string); neither aiohttp nor this module logs requests.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from typing import Any, ClassVar, Self

from ..connections.backoff import parse_retry_after
from ..connections.closing import Openable
from ..connections.transport import TRANSIENT_ERRORS, HttpPool, HttpResponse, pool_size
from ..core.defaults import (
    HTTP_POOL_CONNECTIONS,
    WEBHOOK_BACKOFF_BASE_S,
    WEBHOOK_BACKOFF_MAX_S,
    WEBHOOK_MAX_ATTEMPTS,
    WEBHOOK_MAX_RETRY_AFTER_S,
    WEBHOOK_TIMEOUT_S,
)
from ..core.model import DecisionRequest
from ..errors import InvalidArgumentError, WebhookError, WebhookRejectedError
from ..observability.tracing import active, inject

__all__ = [
    "TRANSIENT_ERRORS",
    "WebhookError",
    "WebhookRejectedError",
    "WebhookSink",
    "parse_retry_after",
]

log = logging.getLogger("flowdecision.sinks.webhook")

#: How many failing decisions a sink remembers the last logged failure of.
_REMEMBERED_FAILURES = 1024


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
        max_connections: int = HTTP_POOL_CONNECTIONS,
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
        #: Connections the sink's pool keeps open at once (concurrent POSTs beyond wait).
        self.max_connections = pool_size(max_connections)
        self._client: HttpPool | None = None
        # decision id -> the failure last logged as a warning for it (oldest first).
        self._failing: OrderedDict[str, str] = OrderedDict()

    async def open(self) -> Self:
        if self._client is None:
            self._client = HttpPool(
                max_connections=self.max_connections,
                headers={"User-Agent": "flowdecision-webhook"},
            )
        return self

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _pool(self) -> HttpPool:
        if self._client is None:
            await self.open()
        assert self._client is not None
        return self._client

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> HttpResponse:
        """One request through the sink's pool, every timeout ``timeout_s``."""
        pool = await self._pool()
        return await pool.request(
            method, url, headers=headers, content=body,
            connect_s=self.timeout_s, read_s=self.timeout_s, pool_s=self.timeout_s,
        )  # fmt: skip

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
    ) -> HttpResponse:
        """POST ``body`` to ``url`` with the retries above; the 2xx answer.

        Adds ``Authorization`` when a token is configured. Subclasses that speak
        an engine's ingress protocol (the Restate sink) reuse this loop.
        """
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
                response = await self._send("POST", url, body, headers)
            except TRANSIENT_ERRORS as error:
                problem = f"{type(error).__name__}: {error}".rstrip(": ")
                status = None
            else:
                status = response.status_code
                if 200 <= status < 300:
                    self._recovered(decision_id, tries)
                    return response
                problem = f"HTTP {status}"
                if status < 500 and not _busy(status, response.headers):
                    self._failing.pop(decision_id, None)
                    raise WebhookRejectedError(
                        f"{self.name} rejected the decision with HTTP {status}{_snippet(response)}",
                        status=status,
                        tries=tries,
                    )
                if status in (409, 429, 503):
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
            self._failed(decision_id, tries, problem, delay)
            await asyncio.sleep(delay)

    def _failed(self, decision_id: str, tries: int, problem: str, delay: float) -> None:
        """Log a failed try: a warning when it differs from the last one logged for this
        decision (by this sink, across calls), DEBUG when it repeats."""
        repeated = self._failing.get(decision_id) == problem
        if not repeated:
            self._failing[decision_id] = problem
            self._failing.move_to_end(decision_id)
            while len(self._failing) > _REMEMBERED_FAILURES:
                self._failing.popitem(last=False)
        log.log(
            logging.DEBUG if repeated else logging.WARNING,
            "webhook delivery failed, retrying",
            extra={
                "decision_id": decision_id,
                "try": tries,
                "problem": problem,
                "retry_in_s": round(delay, 3),
            },
        )

    def _recovered(self, decision_id: str, tries: int) -> None:
        if self._failing.pop(decision_id, None) is not None:
            log.info(
                "webhook delivery succeeded after failures",
                extra={"decision_id": decision_id, "try": tries},
            )


def _busy(status: int, headers: Any) -> bool:
    """A status worth retrying below 500: a timeout (408), too many requests (429), or a
    409 with ``Retry-After`` (busy with the same id, not a conflict of content)."""
    return status in (408, 429) or (status == 409 and "Retry-After" in headers)


def _snippet(response: HttpResponse) -> str:
    text = response.text.strip().replace("\n", " ")
    return f": {text[:200]}" if text else ""
