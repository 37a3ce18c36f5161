"""The blocking client, :class:`SyncDecisionClient` (over ``httpx.Client``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx

from ..model import DecisionRequest
from .base import HTTP_DEFAULTS, BaseClient, send_kwargs
from .protocol import Exchange, Sleep
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
