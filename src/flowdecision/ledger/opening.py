"""Open any ledger from a URL: ``memory:``, ``file:///dir``, ``sqlite:///path``,
``postgresql://...`` (read by :func:`flowdecision.connections.urls.parse_ledger_url`)."""

from __future__ import annotations

from pathlib import Path

from ..connections.urls import parse_ledger_url
from .base import Ledger

__all__ = ["open_ledger"]


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
