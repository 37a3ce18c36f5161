"""Store URLs: ``memory:``, ``file:///dir``, ``sqlite:///path``, ``postgresql://...``;
and DSNs described without credentials, for messages."""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import FlowDecisionError

__all__ = ["SCHEMES", "describe_dsn", "parse_store_url", "sqlite_path"]

SCHEMES = ("memory:", "file:///dir", "sqlite:///path", "postgresql://...")


def parse_store_url(url: str, *, what: str, error: type[FlowDecisionError]) -> tuple[str, str]:
    """Split a store URL into ``(kind, target)``; a bare path means a file directory.

    ``kind`` is ``memory``, ``file``, ``sqlite`` or ``postgresql``. ``what``
    names the store in messages (``ledger``, ``outbox``); a bad URL raises
    ``error``.
    """
    if url == "memory:" or url == "memory://":
        return "memory", ""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "":
        return "file", _no_nul(url, url, what, error)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise error(f"{what} URL `{url}`: file URLs must name a local path")
        return "file", _no_nul(unquote(parts.path), url, what, error)
    if scheme == "sqlite":
        return "sqlite", _no_nul(sqlite_path(url, what=what, error=error), url, what, error)
    if scheme in ("postgres", "postgresql"):
        return "postgresql", url
    raise error(
        f"unsupported {what} URL scheme `{parts.scheme}` in `{url}`: "
        f"expected one of {', '.join(SCHEMES)}"
    )


def _no_nul(path: str, url: str, what: str, error: type[FlowDecisionError]) -> str:
    # The OS cannot name such a file; say so instead of failing deep in os.open.
    if "\x00" in path:
        raise error(f"{what} URL `{url}`: the path contains a NUL character")
    return path


def sqlite_path(url: str, *, what: str, error: type[FlowDecisionError]) -> str:
    """The file a ``sqlite:`` URL names, SQLAlchemy-style.

    ``sqlite:///relative/path.db`` is relative to the working directory and
    ``sqlite:////absolute/path.db`` is absolute (three slashes, then the path).
    """
    parts = urlsplit(url)
    if parts.netloc:
        raise error(
            f"{what} URL `{url}`: sqlite URLs have no host; use sqlite:///relative.db "
            "or sqlite:////absolute.db"
        )
    path = unquote(parts.path)[1:]  # drop the slash that ends the empty authority
    if not path:
        raise error(f"{what} URL `{url}`: sqlite URLs need a path (sqlite:///path)")
    return path


def describe_dsn(dsn: str) -> str:
    """``host:port/database`` (or the socket directory) without credentials, for messages."""
    try:
        parts = urlsplit(dsn)
        query = parse_qs(parts.query)
        host = parts.hostname or (query.get("host") or [""])[0] or os.environ.get("PGHOST", "")
        port = parts.port or (query.get("port") or [""])[0] or os.environ.get("PGPORT", "5432")
        database = parts.path.lstrip("/") or (query.get("dbname") or [""])[0]
        host = host or "localhost"
        where = f"{host}:{port}" if not host.startswith("/") else f"{host} (unix socket)"
        return f"{where}/{database}" if database else where
    except ValueError:
        return "<unparseable PostgreSQL URL>"
