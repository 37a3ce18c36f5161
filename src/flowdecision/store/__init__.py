"""Storage: everything SQL-specific that the ledger and the outbox share.

* :mod:`.component` -- what a component (ledger, outbox) is as a SQL store:
  tables, version table, migrations, error classes;
* :mod:`.migrations` -- the ``.sql`` migrations and the one runner, with the
  one policy: SQLite migrates on open, PostgreSQL only when asked;
* :mod:`.sqlite` -- opening SQLite (WAL, ``0600`` files, read-only opens) and
  translating its errors; :mod:`.sqlite_thread` -- the connection thread with
  group commit; :mod:`.checkpoint` -- its WAL checkpoints, off the commit path;
* :mod:`.postgres` -- the asyncpg pool, error translation, the database clock;
* :mod:`.batching` -- answering the callers of a group-commit batch, and its settings;

This package imports neither :mod:`flowdecision.ledger` nor
:mod:`flowdecision.sinks`; both import it. Its classes are parameterized by a
:class:`~.component.Component` instead. Store URLs are read in
:mod:`flowdecision.connections.urls`.
"""

from .component import Component, ErrorKinds

__all__ = ["Component", "ErrorKinds"]
