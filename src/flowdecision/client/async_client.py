"""The async client, :class:`DecisionClient`
(over :class:`~flowdecision.connections.transport.HttpPool`)."""

from __future__ import annotations

import asyncio
import builtins
import math
import time
from collections.abc import Mapping
from typing import Any, Unpack

import httpx

from ..connections.closing import Closable
from ..connections.transport import HttpPool, ResponseLike
from ..core.model import DecisionRequest
from ..errors import InvalidArgumentError
from ..ledger.query import AuditPage, DecisionPage
from ..ledger.states import AuditEntry
from ..sinks.parking import OutboxAuditEntry, ParkedRow
from .base import USER_AGENT, BaseClient, send_headers, send_kwargs
from .protocol import ActionArguments, Send, audit_params, query_params, run_path
from .results import (
    ApprovalResult,
    BulkActionResult,
    DecisionState,
    OutboxPage,
    ServiceHealth,
    SubmitResult,
)

__all__ = ["MAX_DECISION_WAIT_S", "DecisionClient"]

#: The longest one ``GET /v1/decisions/{id}?wait=N`` waits (the service's cap).
MAX_DECISION_WAIT_S = 30


class DecisionClient(BaseClient[HttpPool | httpx.AsyncClient], Closable):
    """Async client for the decision service. Use ``async with`` or call :meth:`aclose`.

    ``url`` is the service's base URL; ``token`` its bearer token (None when it
    runs without auth); ``timeout`` bounds each HTTP request (seconds, or an
    ``httpx.Timeout``: its connect, read and pool parts are kept; aiohttp has no
    write timeout); ``retry`` says when to retry; ``wait_s`` sends
    ``Prefer: wait=N`` with every submission, so a service that supports it
    answers with another owner's result instead of ``busy``; ``on_retry`` is
    called before each retry's sleep.

    Requests go through an aiohttp connection pool
    (:class:`~flowdecision.connections.transport.HttpPool`)
    of ``max_connections`` connections (64 by default), which keeps up with the service at
    any concurrency; one client is safe to share between many tasks of one event loop. Pass
    ``http`` to use another pool (an ``HttpPool`` shared by several clients, or an
    ``httpx.AsyncClient`` for its TLS and proxy settings, at httpx's speed); it is not
    closed here.
    """

    def _new_http(self, max_connections: int) -> HttpPool:
        return HttpPool(max_connections=max_connections, headers={"User-Agent": USER_AGENT})

    async def submit(
        self,
        request: DecisionRequest | bytes | Mapping[str, Any],
        *,
        wait_s: float | None = None,
        request_id: str | None = None,
    ) -> SubmitResult:
        """Submit one decision; ``submitted`` or ``duplicate``, otherwise a :class:`ServiceError`.

        ``request`` is a :class:`DecisionRequest`, its JSON bytes (sent
        verbatim) or a dict (JSON-encoded). ``wait_s`` overrides the client's
        ``Prefer: wait`` for this call.
        """
        return await self._drive(
            self._protocol.submit(request, wait_s=wait_s, request_id=request_id)
        )

    async def get(self, decision_id: str, *, request_id: str | None = None) -> DecisionState | None:
        """The claim record of ``decision_id``, or None if the service has none."""
        return await self._drive(self._protocol.get(decision_id, request_id=request_id))

    async def health(self, *, request_id: str | None = None) -> ServiceHealth:
        """The health snapshot; a degraded service (HTTP 503) is an answer, not an error."""
        return await self._drive(self._protocol.health(request_id=request_id))

    async def outbox(
        self, after: int = 0, limit: int = 100, *, request_id: str | None = None
    ) -> OutboxPage:
        """Accepted decisions with ``seq > after``, in commit order (outbox sinks only)."""
        return await self._drive(self._protocol.outbox(after, limit, request_id=request_id))

    async def list(
        self,
        *,
        run_id: str | None = None,
        state: str | None = None,
        before_ms: int | None = None,
        after_ms: int | None = None,
        by: str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
        request_id: str | None = None,
    ) -> DecisionPage:
        """One keyset page of decisions by run, state and age (``GET /v1/decisions``).

        ``before_ms``/``after_ms`` filter on the time ``by`` names: ``"claimed"``
        (first claimed, the default order) or ``"completed"`` (completion order;
        completed and tombstoned decisions only). Pass the page's ``next_cursor``
        as ``cursor`` for the next one.
        """
        params = query_params(run_id, state, before_ms, after_ms, cursor, limit, by)
        return await self._drive(
            self._protocol.decisions("/v1/decisions", params, request_id=request_id)
        )

    async def run(
        self,
        run_id: str,
        *,
        cursor: str | None = None,
        limit: int | None = None,
        request_id: str | None = None,
    ) -> DecisionPage:
        """One run's decisions, in the order they were first claimed (``GET /v1/runs/{id}``)."""
        params = query_params(None, None, None, None, cursor, limit)
        return await self._drive(
            self._protocol.decisions(run_path(run_id), params, request_id=request_id)
        )

    async def audit(
        self,
        *,
        decision_id: str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
        request_id: str | None = None,
    ) -> AuditPage:
        """A page of the audit trail of operator actions, oldest first."""
        params = audit_params(decision_id, cursor, limit)
        return await self._drive(self._protocol.audit(params, request_id=request_id))

    async def release(self, decision_id: str, **action: Unpack[ActionArguments]) -> AuditEntry:
        """Release a pending claim, fenced (its old owner can never complete); audited.

        Needs an admin token: ``admin_token``, or the client's own token if that is one.
        """
        return await self._drive(self._protocol.action("release", decision_id, **action))

    async def forget(self, decision_id: str, **action: Unpack[ActionArguments]) -> AuditEntry:
        """Forget a completed decision or tombstone so its id can be used again; audited."""
        return await self._drive(self._protocol.action("forget", decision_id, **action))

    async def approve(self, decision_id: str, **action: Unpack[ActionArguments]) -> ApprovalResult:
        """Approve a held decision: the service dispatches it exactly once; audited.

        Needs an admin token, as :meth:`release`. A decision an earlier approval
        delivered answers ``duplicate`` with ``audit`` None.
        """
        return await self._drive(self._protocol.approve(decision_id, **action))

    async def reject(self, decision_id: str, **action: Unpack[ActionArguments]) -> AuditEntry:
        """Reject a held decision: it is never sent (its POST answers 409
        ``decision_rejected`` from then on); audited. Needs an admin token."""
        return await self._drive(self._protocol.action("reject", decision_id, **action))

    async def approve_run(self, run_id: str, **action: Unpack[ActionArguments]) -> BulkActionResult:
        """Approve every held decision of ``run_id`` (each dispatched exactly once, in its
        own transaction); needs an admin token."""
        return await self._drive(self._protocol.bulk("approve", run_id, **action))

    async def reject_run(self, run_id: str, **action: Unpack[ActionArguments]) -> BulkActionResult:
        """Reject every held decision of ``run_id``; needs an admin token."""
        return await self._drive(self._protocol.bulk("reject", run_id, **action))

    async def wait(
        self,
        decision_id: str,
        # The service does the waiting (and the blocking twin has no asyncio.timeout).
        timeout: float = 30.0,  # noqa: ASYNC109
        *,
        request_id: str | None = None,
    ) -> DecisionState | None:
        """Wait until ``decision_id`` is no longer ``held`` (approved, rejected, expired), or
        ``timeout`` seconds pass; its state then (None: the service has no such decision).

        A long-poll (``GET /v1/decisions/{id}?wait=N``, at most 30 s per request, again
        until the timeout): no busy polling from here.
        """
        if not timeout >= 0:
            raise InvalidArgumentError(f"timeout must be a non-negative number, got {timeout!r}")
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            wait_s = max(0, min(MAX_DECISION_WAIT_S, math.ceil(left)))
            state = await self._drive(
                self._protocol.get(decision_id, request_id=request_id, wait_s=wait_s)
            )
            if state is None or not state.held or deadline - time.monotonic() <= 0:
                return state

    async def parked(
        self, *, relay: str | None = None, request_id: str | None = None
    ) -> builtins.list[ParkedRow]:  # (``list`` is a method of this class)
        """The rows outbox relays parked (their sink refused them for good) and the rows
        held behind them (``GET /v1/outbox/parked``); ``relay`` narrows to one relay."""
        return await self._drive(self._protocol.parked(relay, request_id=request_id))

    async def retry_parked(
        self, decision_id: str, *, relay: str = "default", **action: Unpack[ActionArguments]
    ) -> OutboxAuditEntry:
        """Deliver a parked row again: next in its run, then the run's held rows; audited.

        Needs an admin token, as :meth:`release`.
        """
        return await self._drive(
            self._protocol.parked_action("retry", decision_id, relay, **action)
        )

    async def skip_parked(
        self, decision_id: str, *, relay: str = "default", **action: Unpack[ActionArguments]
    ) -> OutboxAuditEntry:
        """Drop a parked row: it is never delivered and its run goes on; audited."""
        return await self._drive(self._protocol.parked_action("skip", decision_id, relay, **action))

    async def _send(self, step: Send) -> ResponseLike:
        http = self._http
        if isinstance(http, httpx.AsyncClient):
            return await http.request(step.method, step.url, **send_kwargs(step))
        timeout = step.timeout
        return await http.request(
            step.method,
            step.url,
            headers=send_headers(step),
            content=step.content,
            params=step.params,
            connect_s=timeout.connect,
            read_s=timeout.read,
            pool_s=timeout.pool,
        )

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def close(self) -> None:
        """Close the HTTP connection pool if this client created it (``async with`` does)."""
        if self._owns_http and isinstance(self._http, HttpPool):
            await self._http.close()

    #: httpx's spelling of :meth:`close`.
    aclose = close
