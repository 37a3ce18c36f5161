"""Ledgers that misbehave on purpose (the seed's test ledgers)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import TypeVar

from flowdecision.core.identity import ExecutionIdentity, ResultReceipt
from flowdecision.errors import LedgerError
from flowdecision.ledger import Claimed, ClaimOutcome, DelegatingLedger, MemoryLedger
from flowdecision.ledger.machine import DecisionOrigin, Transition

T = TypeVar("T")


class RenewalNotifyingLedger(MemoryLedger):
    """A memory ledger that sets ``renewed`` after each successful renewal."""

    def __init__(self) -> None:
        super().__init__()
        self.renewed = asyncio.Event()

    async def renew(self, *args, **kwargs) -> bool:  # type: ignore[no-untyped-def]
        renewed = await super().renew(*args, **kwargs)
        if renewed:
            self.renewed.set()
        return renewed


class _ScriptedLedger(DelegatingLedger):
    """Base for ledgers whose mutations are scripted rather than stored (reads go
    to an empty memory ledger)."""

    def __init__(self) -> None:
        super().__init__(MemoryLedger())


class LeaseLosingLedger(_ScriptedLedger):
    """Always grants the claim, never renews it."""

    async def claim(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
        origin: DecisionOrigin | None = None,
    ) -> ClaimOutcome:
        return Claimed(1)

    async def renew(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
    ) -> bool:
        return False

    async def complete(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        completed_at_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
        receipt: ResultReceipt | None = None,
        traceparent: str | None = None,
    ) -> bool:
        return True

    async def release(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> None:
        return None


class ClaimFailingLedger(_ScriptedLedger):
    """Fails every claim with ``ledger unavailable``."""

    async def intercept(self, operation: str, call: Awaitable[T]) -> T:
        if operation == "claim":
            if isinstance(call, Coroutine):
                call.close()
            raise LedgerError("ledger unavailable")
        return await call


__all__ = ["ClaimFailingLedger", "LeaseLosingLedger", "RenewalNotifyingLedger", "Transition"]
