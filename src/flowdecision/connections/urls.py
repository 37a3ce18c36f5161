"""Every URL flowdecision reads or shows, in one place.

* Store URLs: ``memory:``, ``file:///dir``, ``sqlite:///path``,
  ``postgresql://...`` (:func:`parse_store_url`, :func:`parse_ledger_url`,
  :func:`sqlite_path`), and PostgreSQL DSNs read (:func:`parse_pg_dsn`) or
  described without credentials (:func:`describe_dsn`).
* Engine sink URLs, ``ENGINE+STORE_URL?…``: split into the store's URL and the
  sink's own parameters (:func:`split_engine_url`), and the ``module:attribute``
  specs they name imported (:func:`load_attribute`).
* :func:`redact_url`: a URL with its secrets masked, for every message, log
  line and status page (``observability.redact`` applies it inside texts).
"""

from __future__ import annotations

import getpass
import importlib
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from ..errors import FlowDecisionError, InvalidArgumentError, LedgerError, SinkConfigError

__all__ = [
    "KIND_SCHEMES",
    "OUTBOX_KINDS",
    "SCHEMES",
    "PgTarget",
    "describe_dsn",
    "load_attribute",
    "parse_ledger_url",
    "parse_pg_dsn",
    "parse_store_url",
    "redact_url",
    "split_engine_url",
    "sqlite_path",
]

#: Each store kind and how its URL looks (for messages).
KIND_SCHEMES = {
    "memory": "memory:",
    "file": "file:///dir",
    "sqlite": "sqlite:///path",
    "postgresql": "postgresql://...",
}
SCHEMES = tuple(KIND_SCHEMES.values())
#: The kinds of store an outbox can live in.
OUTBOX_KINDS = ("sqlite", "postgresql")


def parse_store_url(
    url: str,
    *,
    what: str,
    error: type[FlowDecisionError],
    kinds: tuple[str, ...] = tuple(KIND_SCHEMES),
) -> tuple[str, str]:
    """Split a store URL into ``(kind, target)``; a bare path means a file directory.

    ``kind`` is ``memory``, ``file``, ``sqlite`` or ``postgresql``. ``what``
    names the store in messages (``ledger``, ``outbox``); a bad URL, or one of a
    kind not in ``kinds``, raises ``error``, whose message offers only ``kinds``.
    """
    kind, target = _split_store_url(url, what, error, kinds)
    if kind not in kinds:
        raise error(
            f"{what} URL `{redact_url(url)}` names a {kind} store: "
            f"expected one of {_expected(kinds)}"
        )
    return kind, target


def parse_ledger_url(url: str) -> tuple[str, str]:
    """Split a ledger URL into ``(kind, target)``; a bare path means a file ledger dir."""
    return parse_store_url(url, what="ledger", error=LedgerError)


def _expected(kinds: tuple[str, ...]) -> str:
    return ", ".join(KIND_SCHEMES[kind] for kind in kinds)


def _split_store_url(
    url: str, what: str, error: type[FlowDecisionError], kinds: tuple[str, ...]
) -> tuple[str, str]:
    if url == "memory:" or url == "memory://":
        return "memory", ""
    shown = redact_url(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "":
        return "file", _no_nul(url, url, what, error)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise error(f"{what} URL `{shown}`: file URLs must name a local path")
        return "file", _no_nul(unquote(parts.path), url, what, error)
    if scheme == "sqlite":
        return "sqlite", _no_nul(sqlite_path(url, what=what, error=error), url, what, error)
    if scheme in ("postgres", "postgresql"):
        return "postgresql", url
    raise error(
        f"unsupported {what} URL scheme `{parts.scheme}` in `{shown}`: "
        f"expected one of {_expected(kinds)}"
    )


def _no_nul(path: str, url: str, what: str, error: type[FlowDecisionError]) -> str:
    # The OS cannot name such a file; say so instead of failing deep in os.open.
    if "\x00" in path:
        raise error(f"{what} URL `{redact_url(url)}`: the path contains a NUL character")
    return path


def sqlite_path(url: str, *, what: str, error: type[FlowDecisionError]) -> str:
    """The file a ``sqlite:`` URL names, SQLAlchemy-style.

    ``sqlite:///relative/path.db`` is relative to the working directory and
    ``sqlite:////absolute/path.db`` is absolute (three slashes, then the path).
    """
    parts = urlsplit(url)
    if parts.netloc:
        raise error(
            f"{what} URL `{redact_url(url)}`: sqlite URLs have no host; use sqlite:///relative.db "
            "or sqlite:////absolute.db"
        )
    path = unquote(parts.path)[1:]  # drop the slash that ends the empty authority
    if not path:
        raise error(f"{what} URL `{redact_url(url)}`: sqlite URLs need a path (sqlite:///path)")
    return path


@dataclass(frozen=True, slots=True)
class PgTarget:
    """Where a PostgreSQL DSN points: every ``(host, port)`` in the order given
    (a unix-socket directory is a host starting with ``/``), the database and
    the user, with the defaults asyncpg applies filled in. No credentials.
    """

    hosts: tuple[tuple[str, int], ...]
    database: str
    user: str

    def describe(self) -> str:
        """``user@host:port[,host:port...]/database``, for messages."""
        return self._show(self.hosts)

    def identity(self) -> str:
        """:meth:`describe` with the hosts in a canonical order: two DSNs reach the
        same database on the same hosts (as the same user) when these are equal."""
        return self._show(tuple(sorted(set(self.hosts))))

    def _show(self, hosts: tuple[tuple[str, int], ...]) -> str:
        shown = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in hosts
        )
        return f"{self.user}@{shown}/{self.database}"


def parse_pg_dsn(dsn: str) -> PgTarget:
    """The hosts, database and user a ``postgresql://`` URL names, as asyncpg reads it.

    Understands multi-host URLs (``postgresql://u@h1:5432,h2:5433/db``, IPv6
    in brackets, percent-encoded socket directories) and libpq's query-string
    spellings (``?host=h1,h2&port=5432,5433&dbname=db&user=u``); a missing
    part takes the environment's default (``PGHOST``, ``PGPORT``, ``PGUSER``,
    ``PGDATABASE``, then localhost, 5432, the OS user, the user's name).
    Raises :class:`~flowdecision.errors.InvalidArgumentError` saying what is wrong.
    """
    parts = urlsplit(dsn)
    if parts.scheme.lower() not in ("postgres", "postgresql"):
        raise InvalidArgumentError(
            f"not a PostgreSQL URL (scheme `{parts.scheme}`): expected postgresql://..."
        )
    # The netloc by hand: urlsplit's .hostname and .port stop at the first host.
    auth, at, hostlist = parts.netloc.rpartition("@")
    user = unquote(auth.partition(":")[0]) if at else ""
    try:
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    except ValueError as error:  # pragma: no cover - parse_qs is lenient by default
        raise InvalidArgumentError(f"bad query string: {error}") from error
    ports = _ports(query.get("port", ""))
    if hostlist:
        hosts = _hostlist(hostlist, ports=None, encoded=True)
    elif query.get("host"):
        hosts = _hostlist(query["host"], ports=ports, encoded=False)
    else:
        hosts = _hostlist(os.environ.get("PGHOST") or "localhost", ports=ports, encoded=False)
    database = unquote(parts.path[1:]) if parts.path.startswith("/") else unquote(parts.path)
    user = user or query.get("user", "") or os.environ.get("PGUSER", "") or _os_user()
    database = (
        (database or query.get("dbname", "") or query.get("database", ""))
        or os.environ.get("PGDATABASE", "")
        or user
    )
    return PgTarget(hosts=hosts, database=database, user=user)


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return ""


def _ports(spec: str) -> list[int]:
    return [_port(item) for item in spec.split(",")] if spec else []


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise InvalidArgumentError(f"port `{text}` is not a number from 1 to 65535")
    return int(text)


def _hostlist(spec: str, *, ports: list[int] | None, encoded: bool) -> tuple[tuple[str, int], ...]:
    """``h1[:p1],h2[:p2]`` -> ``((h1, p1), (h2, p2))``: a port written with the
    host wins, then ``ports`` (one for all, or one per host), then ``PGPORT``."""
    specs = spec.split(",")
    defaults = ports or _ports(os.environ.get("PGPORT", "")) or [5432]
    if len(defaults) == 1:
        defaults = defaults * len(specs)
    elif len(defaults) != len(specs):
        raise InvalidArgumentError(
            f"{len(specs)} hosts but {len(defaults)} ports: give one port, or one per host"
        )
    hosts = []
    for item, default in zip(specs, defaults, strict=True):
        if item.startswith("/"):
            host, port = item, ""
        elif item.startswith("["):
            host, bracket, rest = item[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise InvalidArgumentError(f"bad IPv6 host `{item}`")
            port = rest[1:]
        else:
            host, _, port = item.partition(":")
        host = unquote(host) if encoded else host
        if not host:
            raise InvalidArgumentError(f"an empty host in `{spec}`")
        if not host.startswith("/"):
            host = host.lower()  # DNS names are case-insensitive; socket paths are not
        hosts.append((host, _port(unquote(port)) if port else default))
    return tuple(hosts)


def describe_dsn(dsn: str) -> str:
    """``user@host:port[,host:port...]/database`` without credentials, for messages
    (or, for a DSN that cannot be read, why, with the password hidden)."""
    try:
        return parse_pg_dsn(dsn).describe()
    except (InvalidArgumentError, ValueError) as error:
        return f"<invalid PostgreSQL URL: {error}>"


# -- secrets ------------------------------------------------------------------

_SECRET_PARAMS = ("password", "pass", "pwd", "token", "secret", "key", "sig", "signature", "auth")


def redact_url(url: str) -> str:
    """``url`` with secrets replaced by ``***`` (for messages, logs and the status page).

    Masks the userinfo password (of any scheme: ``mysql://``,
    ``procrastinate+postgresql://``, a multi-host ``postgresql://u:pw@h1,h2/db``)
    and the value of any query parameter whose name looks secret
    (``password``, ``token``, ``api_key``, ``sig`` ...).
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable URL>"
    changed = False
    if password is not None:
        # Keep the netloc as written (IPv6 brackets, several hosts), minus the password.
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
        changed = True
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        masked = [
            (name, "***" if any(word in name.lower() for word in _SECRET_PARAMS) else value)
            for name, value in pairs
        ]
        if masked != pairs:
            parts = parts._replace(query=urlencode(masked, safe="*/"))
            changed = True
    # Rebuild only when something was masked: urlunsplit would drop the empty
    # authority of sqlite:///relative URLs.
    return urlunsplit(parts) if changed else url


# -- engine sink URLs ---------------------------------------------------------


def split_engine_url(
    url: str, engine: str, own_params: tuple[str, ...]
) -> tuple[str, dict[str, str]]:
    """Split ``ENGINE+STORE_URL?...`` into the store URL and the sink's own parameters.

    The parameters named in ``own_params`` are removed from the query (each may
    appear once); all others stay in the returned store URL (``sslmode`` …).
    """
    prefix = f"{engine}+"
    if not url.lower().startswith(prefix):
        raise SinkConfigError(f"`{redact_url(url)}` is not a {engine}+… sink URL")
    target = url[len(prefix) :]
    # Cut the query textually: urlunsplit would rewrite sqlite:////abs/path.
    base, _, query = target.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as error:
        raise SinkConfigError(
            f"{engine} sink URL `{redact_url(url)}` is malformed: {error}"
        ) from error
    own: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for name, value in pairs:
        if name in own_params:
            if name in own:
                raise SinkConfigError(f"{engine} sink URL `{redact_url(url)}` sets `{name}` twice")
            own[name] = value
        else:
            rest.append((name, value))
    store = f"{base}?{urlencode(rest)}" if rest else base
    return store, own


def load_attribute(url: str, spec: str) -> Any:
    """Import ``module:attribute`` (the attribute may be dotted) for the sink ``url``."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise SinkConfigError(
            f"sink URL `{redact_url(url)}`: `{spec}` must look like module:attribute"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SinkConfigError(
            f"sink `{redact_url(url)}`: cannot import `{module_name}`: {error}"
        ) from error
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise SinkConfigError(
                f"sink `{redact_url(url)}`: `{module_name}` has no attribute `{attribute}`"
            ) from None
    return target
