"""Versioned SQL migrations shipped as ``.sql`` files inside the package.

Used by the ledgers (``flowdecision/ledger/sql/<dialect>/``) and the outbox
(``flowdecision/sinks/sql/<dialect>/``). Files are named ``NNNN_name.sql``
and must be numbered 1..n without gaps.

Each set is read once per process (at import, where the schema versions are
computed) and kept: a running process applies the SQL of the code it runs,
even if the installed files are later replaced by an upgrade or become
unreadable to it (a process that dropped privileges, a checkout in a private
home directory).
"""

from __future__ import annotations

import functools
import sqlite3
from importlib import resources
from typing import ClassVar

from .errors import FlowDecisionError

__all__ = ["MigrationError", "load_migrations", "split_statements"]


class MigrationError(FlowDecisionError, ValueError):
    """The shipped migrations are malformed (a packaging bug, not user data)."""

    code: ClassVar[str] = "migration_invalid"


@functools.cache
def load_migrations(package: str, dialect: str) -> tuple[tuple[int, str, str], ...]:
    """The ``(version, name, sql)`` migrations in ``package``/sql/``dialect``, in order.

    Cached per process (see the module docs).
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


def split_statements(script: str) -> list[str]:
    """Split a migration script into complete SQL statements (comments dropped at the end)."""
    statements: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            if pending.strip():
                statements.append(pending.strip())
            pending = ""
    if pending.strip() and not all(
        not part.strip() or part.strip().startswith("--") for part in pending.splitlines()
    ):
        raise MigrationError(f"incomplete SQL statement in migration: {pending.strip()!r}")
    return statements
