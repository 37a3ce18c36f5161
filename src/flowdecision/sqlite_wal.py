"""Opening SQLite databases the way every flowdecision store needs them.

Shared by the SQLite ledger and the SQLite outbox: WAL journal (readers never
block the writer, and commits stay durable with ``synchronous=FULL``), our own
``BEGIN``/``COMMIT`` (``isolation_level=None``), and a busy timeout so
processes queue for the write lock instead of failing.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import ClassVar

from .errors import FlowDecisionError

__all__ = ["WalUnavailableError", "connect_wal"]


class WalUnavailableError(FlowDecisionError, sqlite3.OperationalError):
    """The database refused WAL mode (e.g. an in-memory or read-only database).

    Still a :class:`sqlite3.OperationalError`, so callers translating SQLite
    errors into their own see it as one.
    """

    code: ClassVar[str] = "wal_unavailable"


def connect_wal(
    path: Path, *, busy_timeout_ms: int, synchronous: str = "FULL"
) -> sqlite3.Connection:
    """Connect to ``path`` in WAL mode with ``synchronous`` and a busy timeout.

    Raises :class:`sqlite3.Error` (callers translate it into their own errors,
    naming the file); the connection is closed on failure.
    """
    conn = sqlite3.connect(
        path,
        timeout=busy_timeout_ms / 1000,
        isolation_level=None,  # callers issue BEGIN/COMMIT themselves
        check_same_thread=True,
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        # Switching to WAL (once per database; it persists) takes an exclusive
        # lock and does not wait on the busy handler, so retry it ourselves.
        deadline = time.monotonic() + busy_timeout_ms / 1000
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode").fetchone()
                if mode is None or str(mode[0]).lower() != "wal":
                    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
                break
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        if mode is None or str(mode[0]).lower() != "wal":
            raise WalUnavailableError(f"cannot enable WAL mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        conn.close()
        raise
    return conn
