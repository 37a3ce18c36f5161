"""The blocking client, :class:`SyncDecisionClient` (over ``httpx.Client``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from ..connections.transport import ResponseLike
from ..errors import FlowDecisionError
from .async_client import DecisionClient
from .base import HTTP_DEFAULTS, BaseClient, send_kwargs
from .protocol import Send

__all__ = ["SyncDecisionClient"]

P = ParamSpec("P")
T = TypeVar("T")


def _blocking(
    call: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[SyncDecisionClient, P], T]:
    """:class:`DecisionClient`'s ``call``, run to its end on a blocking client.

    The blocking client's ``_send`` and ``_sleep`` block instead of awaiting, so
    the call's coroutine never suspends: one ``send(None)`` runs it to its
    result, with no event loop. Each call is so written once, for both clients.
    """

    @functools.wraps(call)
    def run(self: SyncDecisionClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        coroutine = call(self, *args, **kwargs)
        try:
            coroutine.send(None)
        except StopIteration as done:
            result: T = done.value
            return result
        coroutine.close()
        raise FlowDecisionError(f"SyncDecisionClient.{call.__name__} suspended")

    return run


class SyncDecisionClient(BaseClient[httpx.Client]):
    """The blocking twin of :class:`DecisionClient`: same arguments, same results and errors.

    It sends through httpx's blocking client (measured as fast as the service allows one
    caller at a time: docs/BENCHMARKS.md); ``http`` takes an ``httpx.Client``, and
    ``max_connections`` bounds its pool (for threads sharing one client).
    """

    submit = _blocking(DecisionClient.submit)
    get = _blocking(DecisionClient.get)
    health = _blocking(DecisionClient.health)
    outbox = _blocking(DecisionClient.outbox)
    list = _blocking(DecisionClient.list)
    run = _blocking(DecisionClient.run)
    audit = _blocking(DecisionClient.audit)
    release = _blocking(DecisionClient.release)
    forget = _blocking(DecisionClient.forget)
    parked = _blocking(DecisionClient.parked)
    retry_parked = _blocking(DecisionClient.retry_parked)
    skip_parked = _blocking(DecisionClient.skip_parked)
    approve = _blocking(DecisionClient.approve)
    reject = _blocking(DecisionClient.reject)
    approve_run = _blocking(DecisionClient.approve_run)
    reject_run = _blocking(DecisionClient.reject_run)
    wait = _blocking(DecisionClient.wait)

    def _new_http(self, max_connections: int) -> httpx.Client:
        return httpx.Client(**HTTP_DEFAULTS, limits=httpx.Limits(max_connections=max_connections))

    async def _send(self, step: Send) -> ResponseLike:
        return self._http.request(step.method, step.url, **send_kwargs(step))

    async def _sleep(self, seconds: float) -> None:
        # Blocking on purpose: this coroutine is run by _blocking, never by a loop.
        time.sleep(seconds)  # noqa: ASYNC251

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
