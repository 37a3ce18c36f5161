"""Open any ledger from a URL: ``memory:``, ``file:///dir``, ``sqlite:///path``,
``postgresql://...``."""

from __future__ import annotations

from pathlib import Path

from ..errors import LedgerError
from ..store.url import SCHEMES, parse_store_url
from ..store.url import sqlite_path as store_sqlite_path
from .protocol import Ledger

__all__ = ["SCHEMES", "open_ledger", "parse_ledger_url", "sqlite_path"]


def parse_ledger_url(url: str) -> tuple[str, str]:
    """Split a ledger URL into ``(kind, target)``; a bare path means a file ledger dir."""
    return parse_store_url(url, what="ledger", error=LedgerError)


def sqlite_path(url: str) -> str:
    """The file a ``sqlite:`` ledger URL names (see :func:`flowdecision.store.url.sqlite_path`)."""
    return store_sqlite_path(url, what="ledger", error=LedgerError)


async def open_ledger(url: str, *, create: bool = True) -> Ledger:
    """Open (and for SQL stores, connect to) the ledger a URL names.

    ``create=False`` opens an existing ledger only, for tools that read or
    prune one: no file or directory is created and no schema is migrated; a
    missing store raises :class:`~flowdecision.errors.StoreMissingError`.
    (PostgreSQL ledgers are never migrated on open: see ``flowdecision migrate``.)
    """
    kind, target = parse_ledger_url(url)
    if kind == "memory":
        from .memory import MemoryLedger

        return MemoryLedger()
    if kind == "file":
        from .jsonfile import JsonFileLedger

        return JsonFileLedger(Path(target), create=create)
    if kind == "sqlite":
        from .sqlite import SqliteLedger

        return await SqliteLedger.open(target, create=create)
    from .postgres import PostgresLedger

    return await PostgresLedger.connect(target)
