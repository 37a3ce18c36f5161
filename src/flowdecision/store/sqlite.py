"""The SQLite store code: opening databases the way every flowdecision store
needs them, and translating SQLite's errors into the store's own (the one
transaction helper is :func:`.transactions.sqlite_transaction`).

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
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from ..errors import FlowDecisionError, WalUnavailableError
from .component import Component
from .migrations import sqlite_check, sqlite_migrate

__all__ = [
    "STORE_FILE_MODE",
    "SqliteOpener",
    "WalUnavailableError",
    "connect_wal",
    "create_private_file",
    "full_disk",
]

#: Permissions of every store file flowdecision creates (before the umask).
STORE_FILE_MODE = 0o600


def create_private_file(path: Path) -> None:
    """Create ``path`` empty with mode ``0600`` unless it exists (an empty file is
    a valid empty SQLite database, so SQLite then never creates it ``0644``)."""
    # Any other failure (a missing or read-only directory) is left to SQLite's
    # own open, which reports it the way callers already translate.
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, STORE_FILE_MODE))


def connect_wal(
    path: Path,
    *,
    busy_timeout_ms: int,
    synchronous: str = "FULL",
    create: bool = True,
    shared: bool = False,
) -> sqlite3.Connection:
    """Connect to ``path`` in WAL mode with ``synchronous`` and a busy timeout.

    With ``create`` a missing file is created ``0600`` and switched to WAL.
    Without it the file must exist (``sqlite3.OperationalError`` "unable to
    open database file" otherwise) and its journal mode is not changed.
    ``shared``: the connection may be used from more than one thread (the
    caller serializes every use with a lock of its own).
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
        check_same_thread=not shared,
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


def _on_read_only_filesystem(path: Path) -> bool:
    """Whether the directory holding ``path`` is on a read-only mount."""
    try:
        return bool(os.statvfs(path.absolute().parent).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def full_disk(error: BaseException) -> bool:
    """``SQLITE_FULL`` (the file could not grow), or an I/O error that was ENOSPC."""
    if not isinstance(error, sqlite3.Error):
        return False
    code = getattr(error, "sqlite_errorcode", None)
    return (code is not None and code & 0xFF == sqlite3.SQLITE_FULL) or (
        "database or disk is full" in str(error)
    )


@dataclass(slots=True)
class SqliteOpener:
    """How one store opens its SQLite file: where, how durably, and for whom.

    :meth:`connect` (run on the store's connection thread) creates the parent
    directory and migrates (``create=True``), or only checks that a current
    schema is there (``create=False``); :meth:`translate` turns
    :class:`sqlite3.Error` into the component's own errors, naming the file.
    ``pragmas`` run on every new connection. ``shared``: see :func:`connect_wal`.
    """

    component: Component
    path: Path
    busy_timeout_ms: int
    synchronous: str = "FULL"
    create: bool = True
    pragmas: tuple[str, ...] = ()
    shared: bool = False
    #: The schema version found when the database was opened (before migrating).
    version_at_open: int | None = field(default=None, init=False)

    @property
    def where(self) -> str:
        """The store, for messages."""
        return f"sqlite {self.component.name} `{self.path}`"

    def connect(self) -> sqlite3.Connection:
        """Open the database and bring (or check) its schema; raises the component's errors."""
        errors = self.component.errors
        if self.create:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise errors.unavailable(
                    f"create directory for {self.where}: {error.strerror or error}"
                ) from error
        try:
            conn = connect_wal(
                self.path,
                busy_timeout_ms=self.busy_timeout_ms,
                synchronous=self.synchronous,
                create=self.create,
                shared=self.shared,
            )
        except sqlite3.OperationalError as error:
            if not self.create and not self.path.exists():
                raise errors.missing(
                    f"{self.where} does not exist (nothing was created)"
                ) from error
            raise self.translate(error) from error
        except sqlite3.Error as error:
            raise self.translate(error) from error
        try:
            for pragma in self.pragmas:
                conn.execute(pragma)
            if self.create:
                before, _ = sqlite_migrate(conn, self.component, self.where)
            else:
                before = sqlite_check(conn, self.component, self.where)
            if self.version_at_open is None:
                self.version_at_open = before
            # A batch's multi-row INSERT keeps a statement journal; past 64 KiB SQLite
            # spills it to a temporary file, created and unlinked once per batch. In
            # memory it costs what the batch's pages cost. Set after migrating, whose
            # index builds may sort a whole table (those may spill to disk).
            conn.execute("PRAGMA temp_store = MEMORY")
        except sqlite3.Error as error:
            conn.close()
            raise self.translate(error) from error
        except BaseException:
            conn.close()
            raise
        return conn

    def translate(self, error: sqlite3.Error) -> FlowDecisionError:
        """The component's error for ``error``, naming the file."""
        errors = self.component.errors
        text = str(error)
        if full_disk(error):
            return errors.out_of_space()(
                f"{self.where}: the disk is full ({text}); nothing was written, "
                "free space and retry"
            )
        if isinstance(error, sqlite3.OperationalError):
            if "locked" in text or "busy" in text:
                return errors.unavailable(
                    f"{self.where} stayed locked by another writer for more "
                    f"than {self.busy_timeout_ms} ms: {text}"
                )
            if "no such table" in text:
                return errors.schema(f"{self.where} has no {self.component.name} table: {text}")
            if _on_read_only_filesystem(self.path):
                # SQLite says only "unable to open database file" (or "readonly").
                return errors.unavailable(
                    f"{self.where}: the filesystem holding it is read-only ({text}); a WAL "
                    "database must create its -wal and -shm files beside it, even to read: "
                    "mount it read-write, or copy the file (with any -wal file) to a "
                    "writable directory and open the copy"
                )
            return errors.unavailable(f"{self.where}: {text}")
        if isinstance(error, sqlite3.DatabaseError) and (
            "not a database" in text or "malformed" in text
        ):
            return errors.corrupt(f"{self.where} is corrupt: {text}")
        return errors.unavailable(f"{self.where}: {text}")
