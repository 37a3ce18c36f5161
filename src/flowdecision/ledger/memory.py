"""An in-process ledger: the reference backend for tests and single-process hosts.

Operator queries scan every record (:func:`~.query.scan_page`); there is no index.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TypeVar

from ..errors import LedgerError
from .base import HoldOperation, Operation, PruneMode, PruneProgress, RunBound, ScanningLedger
from .machine import ClaimRecord, Creation, tombstone_of
from .query import StoredDecision
from .states import Acted, AuditEntry, RunState

__all__ = ["MemoryLedger"]

T = TypeVar("T")


class MemoryLedger(ScanningLedger):
    """Records in a dict; nothing survives the process.

    Operations never await, so they are atomic within one event loop; the lock
    only matters when the ledger is shared across threads.
    ``keep_tombstones``: what :meth:`prune_completed` does when not told.
    ``run_invariants`` (off by default: the seed's in-memory ledger kept none)
    turns the run rules on (docs/PROTOCOL.md, "Runs").
    """

    @property
    def runs_supported(self) -> bool:
        return True

    def __init__(self, *, keep_tombstones: bool = False, run_invariants: bool = False) -> None:
        self._records: dict[str, ClaimRecord] = {}
        self._created: dict[str, Creation] = {}
        self._runs: dict[str, RunState] = {}
        self.run_invariants = bool(run_invariants)
        self._audit_trail: list[AuditEntry] = []
        self._lock = threading.Lock()
        self.keep_tombstones = bool(keep_tombstones)

    async def _apply(self, decision_id: str, op: Operation[T] | RunBound[T]) -> T:
        with self._lock:
            record = self._records.get(decision_id)
            if isinstance(op, RunBound):
                transition = op.op(record, self._runs.get(op.run_id), self.now_ms())
                if transition.run is not None:
                    self._runs[op.run_id] = transition.run
            else:
                transition = op(record, self.now_ms())
            if transition.changed and transition.record is not None:
                self._records[decision_id] = transition.record
                if transition.created is not None:
                    self._created[decision_id] = transition.created
            return transition.result

    async def _read_run(self, run_id: str) -> RunState | None:
        return self._runs.get(run_id)

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        return self._records.get(decision_id)

    async def _prune(self, before_ms: int, progress: PruneProgress | None, mode: PruneMode) -> int:
        with self._lock:
            doomed = [key for key, rec in self._records.items() if mode.selects(rec, before_ms)]
            for key in doomed:
                if mode is PruneMode.TOMBSTONE:
                    self._records[key] = tombstone_of(self._records[key])
                else:
                    del self._records[key]
                    self._created.pop(key, None)
        if progress is not None:
            progress(len(doomed))
        return len(doomed)

    async def _act(self, decision_id: str, op: Operation[AuditEntry]) -> AuditEntry:
        with self._lock:
            transition = op(self._records.get(decision_id), self.now_ms())
            if transition.record is None:
                self._records.pop(decision_id, None)
                self._created.pop(decision_id, None)
            else:
                self._records[decision_id] = transition.record
            return self._append(transition.result)

    def _append(self, entry: AuditEntry) -> AuditEntry:
        """Chain ``entry`` to the trail and append it (the lock is held)."""
        trail = self._audit_trail
        last = trail[-1].row_hash if trail else None
        chained = dataclasses.replace(entry.chained(last), seq=len(trail) + 1)
        trail.append(chained)
        return chained

    async def _act_on_hold(self, decision_id: str, op: HoldOperation) -> Acted:
        if op.row is not None:  # never: no store to join (store_key() is None)
            raise LedgerError("the memory ledger cannot write other rows in its transactions")
        with self._lock:
            run = None if op.run_id is None else self._runs.get(op.run_id)
            applied = op.apply(self._records.get(decision_id), run, self.now_ms())
            acted = applied.acted
            if applied.record is not None:
                self._records[decision_id] = applied.record
            if applied.run is not None:
                self._runs[applied.run.run_id] = applied.run
            if acted.entry is None:
                return acted
            return dataclasses.replace(acted, entry=self._append(acted.entry))

    async def _scanned(self) -> list[StoredDecision]:
        with self._lock:
            return [
                StoredDecision(key, record, self._created.get(key))
                for key, record in self._records.items()
            ]

    async def _trail(self) -> list[AuditEntry]:
        with self._lock:
            return list(self._audit_trail)

    def __len__(self) -> int:
        return len(self._records)
