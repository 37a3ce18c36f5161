"""Opening SQLite databases the way every flowdecision store needs them.

Shared by the SQLite ledger and the SQLite outbox: WAL journal (readers never
block the writer, and commits stay durable with ``synchronous=FULL``), our own
``BEGIN``/``COMMIT`` (``isolation_level=None``), and a busy timeout so
processes queue for the write lock instead of failing.

A database this module creates is created ``0600`` (owner only, like the JSON
ledger): stores hold full decision payloads. SQLite gives the ``-wal`` and
``-shm`` files the permissions of the database file. ``create=False`` opens an
existing database only and leaves its journal mode alone, so a read never
creates or changes a file.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

__all__ = ["STORE_FILE_MODE", "WalUnavailableError", "connect_wal", "create_private_file"]

#: Permissions of every store file flowdecision creates (before the umask).
STORE_FILE_MODE = 0o600


class WalUnavailableError(sqlite3.OperationalError):
    """The database refused WAL mode (e.g. an in-memory or read-only database)."""


def create_private_file(path: Path) -> None:
    """Create ``path`` empty with mode ``0600`` unless it exists (an empty file is
    a valid empty SQLite database, so SQLite then never creates it ``0644``)."""
    # Any other failure (a missing or read-only directory) is left to SQLite's
    # own open, which reports it the way callers already translate.
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, STORE_FILE_MODE))


def connect_wal(
    path: Path, *, busy_timeout_ms: int, synchronous: str = "FULL", create: bool = True
) -> sqlite3.Connection:
    """Connect to ``path`` in WAL mode with ``synchronous`` and a busy timeout.

    With ``create`` a missing file is created ``0600`` and switched to WAL.
    Without it the file must exist (``sqlite3.OperationalError`` "unable to
    open database file" otherwise) and its journal mode is not changed.
    Raises :class:`sqlite3.Error` (callers translate it into their own errors,
    naming the file); the connection is closed on failure.
    """
    if create:
        create_private_file(path)
        target: str | Path = path
    else:
        # mode=rw: open read-write but never create (a plain connect would).
        target = f"file:{quote(str(path.absolute()))}?mode=rw"
    conn = sqlite3.connect(
        target,
        timeout=busy_timeout_ms / 1000,
        isolation_level=None,  # callers issue BEGIN/COMMIT themselves
        check_same_thread=True,
        uri=not create,
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if create:
            _switch_to_wal(conn, busy_timeout_ms)
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        conn.close()
        raise
    return conn


def _switch_to_wal(conn: sqlite3.Connection, busy_timeout_ms: int) -> None:
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
