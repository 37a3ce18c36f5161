"""Open any ledger from a URL: ``memory:``, ``file:///dir``, ``sqlite:///path``,
``postgresql://...``."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import LedgerError
from .base import Ledger

__all__ = ["SCHEMES", "open_ledger", "parse_ledger_url", "sqlite_path"]

SCHEMES = ("memory:", "file:///dir", "sqlite:///path", "postgresql://...")


def parse_ledger_url(url: str) -> tuple[str, str]:
    """Split a ledger URL into ``(kind, target)``; a bare path means a file ledger dir."""
    if url == "memory:" or url == "memory://":
        return "memory", ""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "":
        return "file", url
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise LedgerError(f"ledger URL `{url}`: file URLs must name a local path")
        return "file", unquote(parts.path)
    if scheme == "sqlite":
        return "sqlite", sqlite_path(url)
    if scheme in ("postgres", "postgresql"):
        return "postgresql", url
    raise LedgerError(
        f"unsupported ledger URL scheme `{parts.scheme}` in `{url}`: "
        f"expected one of {', '.join(SCHEMES)}"
    )


def sqlite_path(url: str) -> str:
    """The file a ``sqlite:`` URL names, SQLAlchemy-style.

    ``sqlite:///relative/path.db`` is relative to the working directory and
    ``sqlite:////absolute/path.db`` is absolute (three slashes, then the path).
    """
    parts = urlsplit(url)
    if parts.netloc:
        raise LedgerError(
            f"ledger URL `{url}`: sqlite URLs have no host; use sqlite:///relative.db "
            "or sqlite:////absolute.db"
        )
    path = unquote(parts.path)[1:]  # drop the slash that ends the empty authority
    if not path:
        raise LedgerError(f"ledger URL `{url}`: sqlite URLs need a path (sqlite:///path)")
    return path


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
