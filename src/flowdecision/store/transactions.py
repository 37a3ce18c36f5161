"""The one SQLite write transaction helper, for every store, migration and prune."""

from __future__ import annotations

import sqlite3

__all__ = ["sqlite_transaction"]


class sqlite_transaction:
    """``with sqlite_transaction(conn):`` -- ``BEGIN IMMEDIATE`` ... ``COMMIT``,
    rolled back if the body raises.

    Every SQLite write transaction flowdecision opens goes through here: a
    group-commit batch, a migration, an outbox delivery, a prune. A class, not
    a generator-based context manager: it runs once per committed batch, on
    the connection thread's hot path. ``begun``: the caller has already run
    ``BEGIN IMMEDIATE`` itself (to learn whether the write lock was free).
    """

    __slots__ = ("begun", "conn")

    def __init__(self, conn: sqlite3.Connection, begun: bool = False) -> None:
        self.conn = conn
        self.begun = begun

    def __enter__(self) -> sqlite3.Connection:
        if not self.begun:
            self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        conn = self.conn
        if exc_type is None:
            try:
                conn.execute("COMMIT")
                return
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        if conn.in_transaction:
            conn.execute("ROLLBACK")
