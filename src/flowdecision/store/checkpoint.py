"""WAL checkpoints off the commit path, on a thread and a connection of their own.

In WAL mode SQLite copies the log back into the database file (a checkpoint)
from inside the ``COMMIT`` that takes the log past ``wal_autocheckpoint``
pages (1,000 by default). That commit, and with group commit every caller in
its batch, then waits for the copy: hundreds of page reads and writes and an
fsync of the database file. A group-commit store's :class:`Checkpointer`
runs them instead: each commit wakes it, and it runs a ``PASSIVE``
checkpoint (one that never waits for, nor blocks, a reader or the writer) at
most every ``interval_s``, so the log still grows by only a few hundred pages
between checkpoints.

The writer keeps SQLite's own checkpoints as a backstop: its
``wal_autocheckpoint`` is raised to
:data:`~flowdecision.core.defaults.SQLITE_CHECKPOINT_BACKSTOP_PAGES`. If this
thread falls behind, or cannot checkpoint (a full disk; its connection
cannot be opened), the writer's commits checkpoint as before once
the log reaches that size, so the log stays bounded either way. A failed
checkpoint loses nothing: the frames stay in the log, and the next
checkpoint, this thread's or the writer's, copies them.

A lone mutation committed on its caller's event loop (:mod:`.sqlite_thread`,
``inline_max_ms``) wakes this thread too, but checkpoints itself past
SQLite's own 1,000 pages, not the backstop: the log restarts only when a
checkpoint has copied all of it before the next write begins, which a
caller writing without a pause never allows this thread (its PASSIVE
checkpoints take milliseconds, the gap between two commits a tenth of one).
"""

from __future__ import annotations

import sqlite3
import threading

from .sqlite import SqliteOpener, connect_wal

__all__ = ["Checkpointer"]


class Checkpointer:
    """Runs a store's WAL checkpoints on a daemon thread (see the module docs).

    :meth:`wake` after a commit (cheap, from any thread); :meth:`close` stops
    the thread and closes its connection. The counters (checkpoints run,
    checkpoints that failed, the last failure's text) are for tests and
    benchmarks.
    """

    def __init__(self, opener: SqliteOpener, *, interval_s: float) -> None:
        self.opener = opener
        self.interval_s = interval_s
        self.checkpoints = 0
        self.failures = 0
        self.last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve,
            name=f"flowdecision-sqlite-{opener.component.name}-checkpoint",
            daemon=True,
        )
        self._thread.start()

    def wake(self) -> None:
        """Ask for a checkpoint (the log just grew)."""
        if not self._wake.is_set():  # set() takes a lock and notifies, every commit
            self._wake.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (after a checkpoint in progress) and close its connection."""
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _serve(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                self._wake.wait()
                if self._stop.is_set():
                    return
                self._wake.clear()
                try:
                    if conn is None:
                        # The writer created and migrated the file before it woke us.
                        conn = connect_wal(
                            self.opener.path,
                            busy_timeout_ms=0,  # a PASSIVE checkpoint never waits anyway
                            synchronous=self.opener.synchronous,
                            create=False,
                        )
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.checkpoints += 1
                except sqlite3.Error as error:
                    # The writer's backstop checkpoints while this fails.
                    self.failures += 1
                    self.last_error = str(error)
                    if conn is not None:
                        conn.close()
                        conn = None
                # Let a few commits' pages gather: each checkpoint writes a page once,
                # however many commits changed it.
                if self._stop.wait(self.interval_s):
                    return
        finally:
            if conn is not None:
                conn.close()
