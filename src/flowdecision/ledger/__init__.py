"""Claim ledgers: one public API (:class:`Ledger`, written once over a few storage
primitives), one state machine (:mod:`.machine`), several stores."""

from .base import Ledger, LedgerEntry, PruneProgress, wall_clock_ms
from .delegating import DelegatingLedger
from .jsonfile import JsonFileLedger
from .machine import ClaimRecord, ClaimStatus
from .memory import MemoryLedger
from .opening import open_ledger
from .postgres import PostgresLedger
from .sqlite import SqliteLedger
from .states import (
    AlreadyCompleted,
    AlreadyRejected,
    AwaitingApproval,
    Busy,
    Claimed,
    ClaimKey,
    ClaimOutcome,
    ClaimState,
    Completed,
    Conflict,
    Held,
    Missing,
    Pending,
    Rejected,
    RunClosed,
    RunState,
    RunStatus,
    Unavailable,
)

__all__ = [
    "AlreadyCompleted",
    "AlreadyRejected",
    "AwaitingApproval",
    "Busy",
    "ClaimKey",
    "ClaimOutcome",
    "ClaimRecord",
    "ClaimState",
    "ClaimStatus",
    "Claimed",
    "Completed",
    "Conflict",
    "DelegatingLedger",
    "Held",
    "JsonFileLedger",
    "Ledger",
    "LedgerEntry",
    "MemoryLedger",
    "Missing",
    "Pending",
    "PostgresLedger",
    "PruneProgress",
    "Rejected",
    "RunClosed",
    "RunState",
    "RunStatus",
    "SqliteLedger",
    "Unavailable",
    "open_ledger",
    "wall_clock_ms",
]
