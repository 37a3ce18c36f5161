"""Ledgers that misbehave on purpose (the seed's test ledgers)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from flowdecision.errors import LedgerError
from flowdecision.ledger import Claimed, Ledger, MemoryLedger
from flowdecision.ledger.base import Operation
from flowdecision.ledger.machine import ClaimRecord, Transition

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


class _ScriptedLedger(Ledger):
    """Base for ledgers whose answers are scripted rather than stored."""

    async def _apply(self, decision_id: str, op: Operation[T]) -> T:
        raise AssertionError("scripted ledger has no storage")

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        return None

    async def _prune(self, before_ms: int, progress: object) -> int:
        return 0


class LeaseLosingLedger(_ScriptedLedger):
    """Always grants the claim, never renews it."""

    async def claim(self, *args, **kwargs) -> Claimed:  # type: ignore[no-untyped-def, override]
        return Claimed(1)

    async def renew(self, *args, **kwargs) -> bool:  # type: ignore[no-untyped-def]
        return False

    async def complete(self, *args, **kwargs) -> bool:  # type: ignore[no-untyped-def]
        return True

    async def release(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        return None


class ClaimFailingLedger(_ScriptedLedger):
    """Fails every claim with ``ledger unavailable``."""

    async def claim(self, *args, **kwargs) -> Claimed:  # type: ignore[no-untyped-def, override]
        raise LedgerError("ledger unavailable")


__all__ = ["ClaimFailingLedger", "LeaseLosingLedger", "RenewalNotifyingLedger", "Transition"]
