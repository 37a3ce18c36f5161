"""An in-process ledger: the reference backend for tests and single-process hosts."""

from __future__ import annotations

import threading
from typing import TypeVar

from .base import Operation, PruneProgress, StoredLedger
from .machine import ClaimRecord, is_prunable

__all__ = ["MemoryLedger"]

T = TypeVar("T")


class MemoryLedger(StoredLedger):
    """Records in a dict; nothing survives the process.

    Operations never await, so they are atomic within one event loop; the lock
    only matters when the ledger is shared across threads.
    """

    def __init__(self) -> None:
        self._records: dict[str, ClaimRecord] = {}
        self._lock = threading.Lock()

    async def _apply(self, decision_id: str, op: Operation[T]) -> T:
        with self._lock:
            transition = op(self._records.get(decision_id), self.now_ms())
            if transition.changed and transition.record is not None:
                self._records[decision_id] = transition.record
            return transition.result

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        return self._records.get(decision_id)

    async def _prune(self, before_ms: int, progress: PruneProgress | None) -> int:
        with self._lock:
            doomed = [key for key, rec in self._records.items() if is_prunable(rec, before_ms)]
            for key in doomed:
                del self._records[key]
        if progress is not None:
            progress(len(doomed))
        return len(doomed)

    def __len__(self) -> int:
        return len(self._records)
