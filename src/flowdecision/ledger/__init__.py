"""Claim ledgers: one state machine (:mod:`.machine`), several stores."""

from .base import Ledger, LedgerEntry, wall_clock_ms
from .jsonfile import JsonFileLedger
from .machine import ClaimRecord, ClaimStatus
from .memory import MemoryLedger
from .postgres import PostgresLedger
from .sqlite import SqliteLedger
from .states import (
    AlreadyCompleted,
    Busy,
    Claimed,
    ClaimOutcome,
    ClaimState,
    Completed,
    Conflict,
    Missing,
    Pending,
    Unavailable,
)
from .url import open_ledger

__all__ = [
    "AlreadyCompleted",
    "Busy",
    "ClaimOutcome",
    "ClaimRecord",
    "ClaimState",
    "ClaimStatus",
    "Claimed",
    "Completed",
    "Conflict",
    "JsonFileLedger",
    "Ledger",
    "LedgerEntry",
    "MemoryLedger",
    "Missing",
    "Pending",
    "PostgresLedger",
    "SqliteLedger",
    "Unavailable",
    "open_ledger",
    "wall_clock_ms",
]
