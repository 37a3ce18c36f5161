"""The base of ledgers that store nothing themselves.

:class:`~.base.Ledger` is what the dispatcher, the service, the CLI and
operator tools use. Anything that stores nothing itself -- a wrapper that
journals or injects faults, a scripted test double -- extends
:class:`DelegatingLedger` and overrides what it changes.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, NoReturn, TypeVar

from ..core.identity import ResultReceipt
from ..errors import LedgerError
from ..store.joint import StoreKey
from .base import Ledger, LedgerEntry, PruneProgress
from .machine import ClaimRecord
from .query import AuditPage, AuditQuery, DecisionPage, DecisionQuery
from .states import (
    Acted,
    AuditEntry,
    ClaimOutcome,
    ClaimState,
    JointOutcome,
    RunState,
)

__all__ = ["DelegatingLedger"]

T = TypeVar("T")


async def _stores_nothing(self: Ledger, *args: Any, **kwargs: Any) -> NoReturn:
    raise LedgerError(f"{type(self).__name__} stores nothing: it forwards every public call")


class DelegatingLedger(Ledger):
    """A :class:`Ledger` that forwards every call to ``inner``.

    Extend it to observe or alter calls of a real ledger and override only
    what changes: :meth:`intercept` sees each mutation (``claim``, ``renew``,
    ``complete``, ``release``, ``joint_commit``) as it is forwarded, and
    :meth:`around` sees it with its decision id; any method can be overridden
    as well. Closing it closes ``inner``.

    The mutations, :meth:`inspect` and :meth:`prune_completed` forward their
    arguments as given (``inner`` checks them), so their signatures are written
    once, on :class:`Ledger`.
    """

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner

    # Every public call is forwarded, so the storage primitives are never reached.
    _apply = _read = _prune = _act = _list = _count = _audit = _stores_nothing

    async def intercept(self, operation: str, call: Awaitable[T]) -> T:
        """Await one forwarded mutation (``operation`` names it); returns its result.

        The default awaits ``call``. An override may act before or after it, or
        raise instead (then it must ``close()`` the coroutine it did not await).
        """
        return await call

    async def around(self, operation: str, decision_id: str, call: Awaitable[T]) -> T:
        """Like :meth:`intercept`, with the call's decision id; the default hands
        the call to :meth:`intercept` (override either one)."""
        return await self.intercept(operation, call)

    async def claim(self, decision_id: str, *args: Any, **kwargs: Any) -> ClaimOutcome:
        return await self.around(
            "claim", decision_id, self.inner.claim(decision_id, *args, **kwargs)
        )

    async def renew(self, decision_id: str, *args: Any, **kwargs: Any) -> bool:
        return await self.around(
            "renew", decision_id, self.inner.renew(decision_id, *args, **kwargs)
        )

    async def complete(self, decision_id: str, *args: Any, **kwargs: Any) -> bool:
        call = self.inner.complete(decision_id, *args, **kwargs)
        return await self.around("complete", decision_id, call)

    async def release(self, decision_id: str, *args: Any, **kwargs: Any) -> None:
        call = self.inner.release(decision_id, *args, **kwargs)
        await self.around("release", decision_id, call)

    async def joint_commit(self, decision_id: str, *args: Any, **kwargs: Any) -> JointOutcome:
        call = self.inner.joint_commit(decision_id, *args, **kwargs)
        return await self.around("joint_commit", decision_id, call)

    async def inspect(self, *args: Any, **kwargs: Any) -> ClaimState:
        return await self.inner.inspect(*args, **kwargs)

    async def lookup(self, decision_id: str) -> LedgerEntry | None:
        return await self.inner.lookup(decision_id)

    async def read_record(self, decision_id: str) -> ClaimRecord | None:
        return await self.inner.read_record(decision_id)

    async def completed_receipt(self, decision_id: str) -> ResultReceipt | None:
        return await self.inner.completed_receipt(decision_id)

    async def prune_completed(self, *args: Any, **kwargs: Any) -> int:
        return await self.inner.prune_completed(*args, **kwargs)

    async def prune_tombstones(
        self, before_ms: int, *, progress: PruneProgress | None = None
    ) -> int:
        return await self.inner.prune_tombstones(before_ms, progress=progress)

    async def list_decisions(
        self, query: DecisionQuery, *, now_ms: int | None = None
    ) -> DecisionPage:
        return await self.inner.list_decisions(query, now_ms=now_ms)

    async def count_decisions(self, query: DecisionQuery, *, now_ms: int | None = None) -> int:
        return await self.inner.count_decisions(query, now_ms=now_ms)

    async def operator_release(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        return await self.intercept(
            "operator_release",
            self.inner.operator_release(decision_id, actor=actor, reason=reason),
        )

    async def forget(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        return await self.intercept(
            "forget", self.inner.forget(decision_id, actor=actor, reason=reason)
        )

    async def approve(self, decision_id: str, *args: Any, **kwargs: Any) -> Acted:
        call = self.inner.approve(decision_id, *args, **kwargs)
        return await self.around("approve", decision_id, call)

    async def reject(self, decision_id: str, *, actor: str, reason: str) -> AuditEntry:
        return await self.intercept(
            "reject", self.inner.reject(decision_id, actor=actor, reason=reason)
        )

    async def expire_hold(self, decision_id: str, **kwargs: Any) -> AuditEntry:
        return await self.intercept("expire_hold", self.inner.expire_hold(decision_id, **kwargs))

    async def expire_holds(self, *, now_ms: int | None = None) -> list[AuditEntry]:
        return await self.inner.expire_holds(now_ms=now_ms)

    async def audit(self, query: AuditQuery) -> AuditPage:
        return await self.inner.audit(query)

    async def run_state(self, run_id: str) -> RunState:
        return await self.inner.run_state(run_id)

    @property
    def run_invariants(self) -> bool:
        """``inner``'s: a wrapper keeps the run invariants exactly when its ledger does."""
        return self.inner.run_invariants

    @run_invariants.setter
    def run_invariants(self, on: bool) -> None:
        self.inner.run_invariants = on

    @property
    def runs_supported(self) -> bool:
        """``inner``'s."""
        return self.inner.runs_supported

    def now_ms(self) -> int:
        return self.inner.now_ms()

    def store_key(self) -> StoreKey | None:
        return self.inner.store_key()

    async def close(self) -> None:
        await self.inner.close()
