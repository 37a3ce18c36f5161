"""The blocking client, :class:`SyncDecisionClient` (over ``httpx.Client``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx

from ..ledger.query import AuditPage, DecisionPage
from ..ledger.states import AuditEntry
from ..model import DecisionRequest
from .base import HTTP_DEFAULTS, BaseClient, send_kwargs
from .protocol import Exchange, Sleep, audit_params, query_params, run_path
from .results import DecisionState, OutboxPage, ServiceHealth, SubmitResult

__all__ = ["SyncDecisionClient"]

T = TypeVar("T")


class SyncDecisionClient(BaseClient[httpx.Client]):
    """The blocking twin of :class:`DecisionClient`: same arguments, same results and errors."""

    def _new_http(self) -> httpx.Client:
        return httpx.Client(**HTTP_DEFAULTS)

    def submit(
        self,
        request: DecisionRequest | bytes | Mapping[str, Any],
        *,
        wait_s: float | None = None,
        request_id: str | None = None,
    ) -> SubmitResult:
        """See :meth:`DecisionClient.submit`."""
        return self._drive(self._protocol.submit(request, wait_s=wait_s, request_id=request_id))

    def get(self, decision_id: str, *, request_id: str | None = None) -> DecisionState | None:
        """See :meth:`DecisionClient.get`."""
        return self._drive(self._protocol.get(decision_id, request_id=request_id))

    def health(self, *, request_id: str | None = None) -> ServiceHealth:
        """See :meth:`DecisionClient.health`."""
        return self._drive(self._protocol.health(request_id=request_id))

    def outbox(
        self, after: int = 0, limit: int = 100, *, request_id: str | None = None
    ) -> OutboxPage:
        """See :meth:`DecisionClient.outbox`."""
        return self._drive(self._protocol.outbox(after, limit, request_id=request_id))

    def list(
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
        return self._drive(self._protocol.decisions("/v1/decisions", params, request_id=request_id))

    def run(
        self,
        run_id: str,
        *,
        cursor: str | None = None,
        limit: int | None = None,
        request_id: str | None = None,
    ) -> DecisionPage:
        """One run's decisions, in the order they were first claimed (``GET /v1/runs/{id}``)."""
        params = query_params(None, None, None, None, cursor, limit)
        return self._drive(
            self._protocol.decisions(run_path(run_id), params, request_id=request_id)
        )

    def audit(
        self,
        *,
        decision_id: str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
        request_id: str | None = None,
    ) -> AuditPage:
        """A page of the audit trail of operator actions, oldest first."""
        params = audit_params(decision_id, cursor, limit)
        return self._drive(self._protocol.audit(params, request_id=request_id))

    def release(
        self,
        decision_id: str,
        *,
        actor: str,
        reason: str,
        admin_token: str | None = None,
        request_id: str | None = None,
    ) -> AuditEntry:
        """Release a pending claim, fenced (its old owner can never complete); audited.

        Needs an admin token: ``admin_token``, or the client's own token if that is one.
        """
        return self._drive(
            self._protocol.action(
                "release", decision_id, actor=actor, reason=reason,
                admin_token=admin_token, request_id=request_id,
            )
        )  # fmt: skip

    def forget(
        self,
        decision_id: str,
        *,
        actor: str,
        reason: str,
        admin_token: str | None = None,
        request_id: str | None = None,
    ) -> AuditEntry:
        """Forget a completed decision or tombstone so its id can be used again; audited."""
        return self._drive(
            self._protocol.action(
                "forget", decision_id, actor=actor, reason=reason,
                admin_token=admin_token, request_id=request_id,
            )
        )  # fmt: skip

    def _drive(self, exchange: Exchange[T]) -> T:
        try:
            step = next(exchange)
            while True:
                if isinstance(step, Sleep):
                    time.sleep(step.seconds)
                    step = exchange.send(None)
                    continue
                try:
                    response = self._http.request(step.method, step.url, **send_kwargs(step))
                except httpx.TransportError as error:
                    step = exchange.throw(error)
                else:
                    step = exchange.send(response)
        except StopIteration as stop:
            result: T = stop.value
            return result

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> SyncDecisionClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
