"""What kind of store a connection serves (the ledger or the outbox): its tables,
where its schema version is kept, its migrations, and the errors it raises."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

from ..errors import FlowDecisionError, MigrationError

__all__ = ["Component", "ErrorKinds", "load_migrations"]


@dataclass(frozen=True, slots=True)
class ErrorKinds:
    """The exception classes a component raises, by what went wrong."""

    #: the component's root error (also: used after close)
    base: type[FlowDecisionError]
    #: cannot reach, lock, read or write the store (nothing was written)
    unavailable: type[FlowDecisionError]
    #: the schema is missing, older or newer than this code
    schema: type[FlowDecisionError]
    #: the store's bytes are damaged
    corrupt: type[FlowDecisionError]
    #: opened with ``create=False``, the store does not exist (nothing was created)
    missing: type[FlowDecisionError]
    #: the disk or the database server is out of space (nothing was written);
    #: None: reported as ``unavailable``
    full: type[FlowDecisionError] | None = None

    def out_of_space(self) -> type[FlowDecisionError]:
        """The class for a full disk: :attr:`full`, else :attr:`unavailable`."""
        return self.full or self.unavailable


@dataclass(frozen=True, slots=True)
class Component:
    """One kind of store kept in SQLite or PostgreSQL.

    Its schema lives in ``<package>/sql/<dialect>/NNNN_name.sql`` and its
    version in ``version_table`` (one row per applied migration), the same
    scheme in both dialects.
    """

    #: ``ledger`` or ``outbox``, for messages
    name: str
    #: the package whose ``sql/<dialect>/`` folder holds the migrations
    package: str
    #: one row per applied migration: ``(version, name, applied_at...)``
    version_table: str
    #: the table whose presence says the store holds this component
    main_table: str
    #: ``pg_advisory_xact_lock`` key serializing concurrent migrators
    pg_lock: int
    errors: ErrorKinds
    #: how an operator upgrades a store that is behind (ends a message)
    migrate_hint: str
    #: SQLite only: releases before the store package kept the ledger's version in
    #: ``PRAGMA user_version``; it is read as a version too, and kept equal to the newest
    legacy_user_version: bool = False
    #: SQLite only: refuse to create the schema in a database holding other tables
    refuse_foreign: bool = False
    #: tables of other components that may share the database (not "foreign"):
    #: the outbox beside the ledger, for the transactional outbox
    shares_with: tuple[str, ...] = ()
    #: the dialects it ships migrations for
    dialects: tuple[str, ...] = ("sqlite", "postgres")

    def __post_init__(self) -> None:
        # Read every migration once, now (at import for the shipped components):
        # a running process then applies the SQL of the code it runs, even if the
        # installed files are later replaced by an upgrade or become unreadable to
        # it (a process that dropped privileges, a checkout in a private directory).
        for dialect in self.dialects:
            load_migrations(self.package, dialect)

    def migrations(self, dialect: str) -> tuple[tuple[int, str, str], ...]:
        """The ``(version, name, sql)`` migrations shipped for ``dialect``, in order."""
        return load_migrations(self.package, dialect)

    def newest(self, dialect: str) -> int:
        """The schema version this code writes."""
        return len(self.migrations(dialect))


@functools.cache
def load_migrations(package: str, dialect: str) -> tuple[tuple[int, str, str], ...]:
    """The ``(version, name, sql)`` migrations in ``package``/sql/``dialect``, in order.

    Read once per process and kept (see :class:`Component`).
    """
    folder = resources.files(package).joinpath("sql", dialect)
    found: list[tuple[int, str, str]] = []
    for entry in folder.iterdir():
        name = entry.name
        prefix = name.split("_", 1)[0]
        if name.endswith(".sql") and prefix.isdigit():
            found.append((int(prefix), name, entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [version for version, _, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"{package} {dialect} migrations are not numbered 1..n: {versions}")
    return tuple(found)
