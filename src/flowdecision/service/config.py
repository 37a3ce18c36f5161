"""Service settings: CLI flags > ``FLOWDECISION_*`` environment > TOML file > defaults.

Every setting has one name used in all three places: the TOML key is the
field name (``lease_ms``), the environment variable is ``FLOWDECISION_`` plus
the upper-cased name (``FLOWDECISION_LEASE_MS``) and the flag is ``--`` plus
the name with dashes (``--lease-ms``). The bearer token itself is never a flag
(it would show in ``ps``): give it in ``FLOWDECISION_TOKEN`` or a token file.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..connections.urls import redact_url
from ..core.approvals import ApprovalPolicy
from ..core.defaults import (
    DEFAULT_STORE_URL,
    LEGACY_LEDGER_URL,
    LEGACY_OUTBOX_URL,
    LOG_LEVELS,
    SERVICE_HOST,
    SERVICE_PORT,
    SHARED_STORE_SCHEMES,
    WEBHOOK_MAX_ATTEMPTS,
    WEBHOOK_TIMEOUT_S,
    default_outbox_url,
    default_sink_url,
    legacy_layout_only,
    legacy_outbox_exists,
)
from ..core.dispatcher import DEFAULT_LEASE_MS
from ..core.limits import identifier_problem
from ..errors import ConfigError, FlowDecisionError

__all__ = [
    "DEFAULT_LEDGER_URL",
    "DEFAULT_SINK_URL",
    "EDGES",
    "ENV_PREFIX",
    "EVENT_LOOPS",
    "HTTP_IMPLEMENTATIONS",
    "LEGACY_LEDGER_URL",
    "LEGACY_SINK_URL",
    "MAX_WORKERS",
    "MIN_TOKEN_CHARS",
    "ConfigError",
    "Settings",
    "default_outbox_url",
    "is_loopback",
    "load_settings",
    "normalize_host_name",
    "normalize_origin",
]

_log = logging.getLogger("flowdecision.service")

ENV_PREFIX = "FLOWDECISION_"
#: ``http`` values: uvicorn's HTTP/1.1 parsers (``auto`` is httptools when installed).
HTTP_IMPLEMENTATIONS = ("auto", "httptools", "h11")
#: ``loop`` values (``auto`` is uvloop when installed).
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
#: ``edge`` values: the service's own connection edge, or stock uvicorn behind a proxy.
EDGES = ("guarded", "plain")
#: Most server processes ``workers`` may ask for.
MAX_WORKERS = 64
#: Shortest bearer token accepted on a non-loopback address (``serve`` warns on loopback).
MIN_TOKEN_CHARS = 16
#: The default layout: ledger and outbox in ONE SQLite file (flowdecision.core.defaults).
DEFAULT_LEDGER_URL = DEFAULT_STORE_URL
DEFAULT_SINK_URL = DEFAULT_STORE_URL
LEGACY_SINK_URL = LEGACY_OUTBOX_URL


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``flowdecision serve`` can be told. See docs/SERVICE.md for the table."""

    host: str = SERVICE_HOST
    port: int = SERVICE_PORT
    ledger: str = DEFAULT_LEDGER_URL
    sink: str = DEFAULT_SINK_URL
    production_branch: str = "production"
    lease_ms: int = DEFAULT_LEASE_MS
    max_body_bytes: int = 2 * 1024 * 1024
    #: The most JSON values and containers a decision body may hold (counted by a byte
    #: scan before it is parsed): what one body can cost the event loop.
    max_body_values: int = 20_000
    lossy_numbers: bool = False
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    auth_healthz: bool = False
    allow_no_auth: bool = False
    shutdown_grace_s: float = 10.0
    recent_limit: int = 50
    status_refresh_s: int = 5
    webhook_timeout_s: float = WEBHOOK_TIMEOUT_S
    webhook_max_attempts: int = WEBHOOK_MAX_ATTEMPTS
    webhook_token: str | None = field(default=None, repr=False)
    log_level: str = "info"
    access_log: bool = True
    #: While a store is down: seconds between the outage log's summary lines.
    outage_summary_s: float = 30.0
    # -- transport edge (docs/SERVICE.md, "Safety limits") ---------------------------
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1000
    #: A response the client stops reading is dropped after this long (the guarded edge).
    write_timeout_s: float = 30.0
    #: Open event streams and waiting long-polls of ``GET /v1/outbox``, at most; never
    #: more than half of ``max_connections``, so requests keep connections to run on.
    max_streams: int = 100
    http: str = "auto"
    loop: str = "auto"
    #: ``guarded``: connections go through service/edge/; ``plain``: stock uvicorn.
    edge: str = "guarded"
    #: Server processes sharing the listening socket (docs/SERVICE.md, "Workers").
    workers: int = 1
    #: OpenTelemetry SDK and OTLP exporter on (docs/OBSERVABILITY.md); needs the extra.
    otel: bool = False
    #: A sink URL: run an outbox relay inside the service, draining the outbox
    #: sink into it (docs/OPERATIONS.md, "Relays").
    relay_to: str | None = None
    #: The in-service relay's name: its durable cursor in the outbox.
    relay_name: str = "default"
    #: Runs the in-service relay delivers at once (each run's rows stay in order).
    relay_concurrency: int = 32
    #: Operator actions over HTTP (release, forget) need this token, never the
    #: submit token: ``FLOWDECISION_ADMIN_TOKEN`` or a file. Without one they are refused.
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: str | None = None
    #: Prunes of this service's ledger keep tombstones (docs/OPERATIONS.md).
    keep_tombstones: bool = False
    #: The run invariants (docs/PROTOCOL.md, "Runs") on ledgers that keep them
    #: (SQLite, PostgreSQL, memory); the JSON file ledger never does.
    run_invariants: bool = True
    # -- approval holds (docs/PROTOCOL.md, "Approval holds") ------------------------
    #: Decision kinds held for an operator's approval (schedule_step, schedule_steps,
    #: complete, fail).
    approve_kinds: tuple[str, ...] = ()
    #: Step-name globs (fnmatch): a decision scheduling a matching step is held.
    approve_steps: tuple[str, ...] = ()
    #: Run ids whose every new decision is held.
    approve_runs: tuple[str, ...] = ()
    #: A hold not acted on within this many ms is rejected (audited); 0: never.
    hold_expire_ms: int = 0
    #: Rejecting a hold closes its run (with the run invariants on).
    reject_closes_run: bool = False
    #: An http(s) URL told of each new hold (a JSON POST; service/holds.py).
    hold_notify_url: str | None = None
    #: Sent as ``Authorization: Bearer`` to ``hold_notify_url``.
    hold_notify_token: str | None = field(default=None, repr=False)

    # -- derived -----------------------------------------------------------------

    def tokens(self) -> tuple[bytes, ...]:
        """The accepted bearer tokens: ``token`` plus every non-empty line of ``token_file``.

        Several lines let an operator rotate tokens without downtime.
        """
        return _bearer_tokens(self.token, self.token_file, "token_file", need_one=True)

    def admin_tokens(self) -> tuple[bytes, ...]:
        """The accepted admin tokens (``admin_token`` and ``admin_token_file``'s lines).

        An admin token that is also a submit token is refused by :meth:`validate`.
        """
        return _bearer_tokens(
            self.admin_token, self.admin_token_file, "admin_token_file", need_one=False
        )

    def validate(self) -> Settings:
        """Check ranges and the auth rule; return self."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        for name in (
            "lease_ms",
            "max_body_bytes",
            "max_body_values",
            "recent_limit",
            "webhook_max_attempts",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        floats = [name for name, kind in _TYPES.items() if kind is float]
        for name in (*floats, "status_refresh_s"):
            value = getattr(self, name)
            # `not value > 0` also refuses nan; inf would make timeouts never fire.
            if not value > 0 or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite positive number, got {value}")
        self._validate_transport()
        if not self.production_branch.strip():
            raise ConfigError("production_branch must not be empty")
        problem = identifier_problem(self.production_branch)
        if problem is not None:
            raise ConfigError(f"production_branch {problem}")
        self._validate_relay()
        if self.hold_expire_ms < 0:
            raise ConfigError(
                f"hold_expire_ms must be 0 (never) or more, got {self.hold_expire_ms}"
            )
        self.approval_policy()
        if self.hold_notify_url is not None:
            scheme = urlsplit(self.hold_notify_url).scheme.lower()
            if scheme not in ("http", "https"):
                raise ConfigError(
                    f"hold_notify_url must be an http(s) URL, got "
                    f"`{redact_url(self.hold_notify_url)}`"
                )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        tokens = self.tokens()
        admin = self.admin_tokens()
        if set(admin) & set(tokens):
            raise ConfigError("the admin token must differ from every submit token")
        if any(len(token.decode("utf-8")) < MIN_TOKEN_CHARS for token in admin):
            raise ConfigError(
                f"refusing an admin token shorter than {MIN_TOKEN_CHARS} characters: use a "
                "long random one"
            )
        if not is_loopback(self.host):
            if not tokens and not self.allow_no_auth:
                raise ConfigError(
                    f"refusing to listen on `{self.host}` without a token: set "
                    "FLOWDECISION_TOKEN or token_file, or set allow_no_auth = true to serve "
                    "unauthenticated"
                )
            if self.short_token_count():
                raise ConfigError(
                    f"refusing to listen on `{self.host}` with a token shorter than "
                    f"{MIN_TOKEN_CHARS} characters: use a long random one "
                    "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
                )
        return self

    def approval_policy(self) -> ApprovalPolicy | None:
        """The approval policy these settings describe (None: nothing is held)."""
        try:
            policy = ApprovalPolicy(
                kinds=self.approve_kinds,
                steps=self.approve_steps,
                runs=self.approve_runs,
                expire_ms=self.hold_expire_ms or None,
                reject_closes_run=self.reject_closes_run,
            )
        except FlowDecisionError as error:
            raise ConfigError(str(error)) from None
        return policy if policy.enabled else None

    def stream_limit(self) -> int:
        """Streams open at once: ``max_streams``, at most half of ``max_connections``."""
        return max(1, min(self.max_streams, self.max_connections // 2))

    def short_token_count(self) -> int:
        """How many accepted tokens are shorter than :data:`MIN_TOKEN_CHARS` characters."""
        return sum(len(token.decode("utf-8")) < MIN_TOKEN_CHARS for token in self.tokens())

    def _validate_relay(self) -> None:
        if not self.relay_name.strip():
            raise ConfigError("relay_name must not be empty")
        problem = identifier_problem(self.relay_name)
        if problem is not None:
            raise ConfigError(f"relay_name {problem}")
        if not 1 <= self.relay_concurrency <= 1000:
            raise ConfigError(f"relay_concurrency must be in 1..1000, got {self.relay_concurrency}")
        if self.relay_to is None:
            return
        from ..sinks.loader import check_sink_url, sink_kind

        try:
            check_sink_url(self.relay_to)
            ours = sink_kind(self.sink)
        except FlowDecisionError as error:
            raise ConfigError(f"relay_to: {error}") from None
        if ours != "outbox":
            raise ConfigError(
                "relay_to needs the outbox as the sink (sqlite:/// or postgresql://, the "
                f"default layout); the sink is a {ours} sink"
            )

    def _validate_transport(self) -> None:
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.max_streams < 1:
            raise ConfigError(f"max_streams must be at least 1, got {self.max_streams}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be in 1..{MAX_WORKERS}, got {self.workers}")
        if self.http not in HTTP_IMPLEMENTATIONS:
            raise ConfigError(
                f"http must be one of {', '.join(HTTP_IMPLEMENTATIONS)}, got {self.http!r}"
            )
        if self.loop not in EVENT_LOOPS:
            raise ConfigError(f"loop must be one of {', '.join(EVENT_LOOPS)}, got {self.loop!r}")
        if self.edge not in EDGES:
            raise ConfigError(f"edge must be one of {', '.join(EDGES)}, got {self.edge!r}")
        for origin in self.allowed_origins:
            normalize_origin(origin, setting="allowed_origins")
        for name in self.allowed_hosts:
            normalize_host_name(name, setting="allowed_hosts")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP literal, IPv6 with or without brackets) is loopback."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_origin(origin: str, *, setting: str | None = None) -> str:
    """``origin`` as a browser writes it in an ``Origin`` header: ``scheme://host[:port]``.

    Lower-cases scheme and host and drops a default port, so a configured
    ``HTTPS://App.Example:443`` matches the header ``https://app.example``.
    With ``setting`` a malformed value raises :class:`ConfigError` naming it;
    without, it returns ``""`` (an incoming header that can match nothing).
    """
    text = origin.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (
        parts is None
        or parts.scheme.lower() not in _DEFAULT_PORTS
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        if setting is None:
            return ""
        raise ConfigError(
            f"{setting}: `{origin}` is not an origin; write it as scheme://host[:port], "
            "e.g. https://app.example.com"
        )
    scheme = parts.scheme.lower()
    host = parts.hostname.lower()
    shown = f"[{host}]" if ":" in host else host
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{shown}"
    return f"{scheme}://{shown}:{port}"


def normalize_host_name(name: str, *, setting: str) -> str:
    """A configured host name, lower-cased, without IPv6 brackets or a trailing dot."""
    text = name.strip().lower().rstrip(".")
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not bare or any(c in bare for c in "/@?# ") or (":" in bare and not _is_ipv6(bare)):
        raise ConfigError(
            f"{setting}: `{name}` is not a host name; give the name alone, without scheme, "
            "port or path (e.g. flow.internal)"
        )
    return bare


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


# -- loading ------------------------------------------------------------------------

_FIELDS = {f.name: f for f in fields(Settings)}
_TYPES: dict[str, type] = {
    "host": str,
    "port": int,
    "ledger": str,
    "sink": str,
    "production_branch": str,
    "lease_ms": int,
    "max_body_bytes": int,
    "max_body_values": int,
    "lossy_numbers": bool,
    "token": str,
    "token_file": str,
    "auth_healthz": bool,
    "allow_no_auth": bool,
    "shutdown_grace_s": float,
    "recent_limit": int,
    "status_refresh_s": int,
    "webhook_timeout_s": float,
    "webhook_max_attempts": int,
    "webhook_token": str,
    "log_level": str,
    "access_log": bool,
    "outage_summary_s": float,
    "allowed_origins": tuple,
    "allowed_hosts": tuple,
    "header_timeout_s": float,
    "body_timeout_s": float,
    "keep_alive_timeout_s": float,
    "max_connections": int,
    "write_timeout_s": float,
    "max_streams": int,
    "http": str,
    "loop": str,
    "edge": str,
    "workers": int,
    "otel": bool,
    "relay_to": str,
    "relay_name": str,
    "relay_concurrency": int,
    "admin_token": str,
    "admin_token_file": str,
    "keep_tombstones": bool,
    "run_invariants": bool,
    "approve_kinds": tuple,
    "approve_steps": tuple,
    "approve_runs": tuple,
    "hold_expire_ms": int,
    "reject_closes_run": bool,
    "hold_notify_url": str,
    "hold_notify_token": str,
}
assert set(_TYPES) == set(_FIELDS)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = _TYPES[name]
    where = f"{source}: `{name}`"
    if kind is tuple:
        # A TOML array, or a comma-separated string (flags and environment).
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return tuple(item.strip() for item in items if item.strip())
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{where} must be a boolean (true/false), got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _from_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"cannot read config file `{path}`: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file `{path}` is not valid TOML: {error}") from None
    # Either top-level keys or a [serve] table.
    table = data.get("serve", data)
    if not isinstance(table, dict):
        raise ConfigError(f"config file `{path}`: `serve` must be a table")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _FIELDS:
            raise ConfigError(
                f"config file `{path}`: unknown setting `{key}` "
                f"(known: {', '.join(sorted(_FIELDS))})"
            )
        out[key] = _coerce(key, value, f"config file `{path}`")
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            out[name] = _coerce(name, raw, f"environment {ENV_PREFIX}{name.upper()}")
    return out


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Settings:
    """Merge the layers (flags > env > TOML file > defaults) and validate.

    ``flags`` maps setting names to values; ``None`` values mean "not given".
    The TOML file is ``config_file`` or ``FLOWDECISION_CONFIG``; none by default.
    """
    env = os.environ if env is None else env
    path = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    merged: dict[str, Any] = {}
    if path:
        merged.update(_from_toml(path))
    merged.update(_from_env(env))
    for name, value in (flags or {}).items():
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting `{name}`")
        if value is not None:
            merged[name] = _coerce(name, value, "command line")
    _default_stores(merged)
    return replace(Settings(), **merged).validate()


def _default_stores(merged: dict[str, Any]) -> None:
    """Fill in the ledger and sink left unset (docs/OPERATIONS.md, "Store layout").

    Neither set: the shared SQLite file, unless this directory still has the
    old two-file layout (and not the new file), which is then kept as it is.
    Only the ledger set: a SQLite or PostgreSQL ledger's own store holds the
    outbox too, unless the old default ``.flowdecision/outbox.db`` exists here
    (earlier releases put the outbox there whatever the ledger): it is kept, so
    its consumers' ``seq`` cursors stay valid. Any other ledger (memory, file)
    gets that separate SQLite outbox. Existing stores are never silently
    replaced by new, empty ones.
    """
    if "ledger" not in merged and "sink" not in merged:
        if legacy_layout_only():
            merged["ledger"], merged["sink"] = LEGACY_LEDGER_URL, LEGACY_SINK_URL
            _log.warning(
                "keeping the two-file store layout found here (.flowdecision/ledger.db "
                "and outbox.db); see docs/OPERATIONS.md, 'Store layout', to move to one store"
            )
        return
    if "sink" not in merged:
        ledger = merged["ledger"]
        shared = urlsplit(ledger).scheme.lower() in SHARED_STORE_SCHEMES
        if shared and legacy_outbox_exists():
            _log.warning(
                "keeping the existing outbox .flowdecision/outbox.db; name --sink to move "
                "the outbox into the ledger's store (docs/OPERATIONS.md, 'Store layout')"
            )
        merged["sink"] = default_sink_url(ledger)


def _bearer_tokens(
    token: str | None, token_file: str | None, setting: str, *, need_one: bool
) -> tuple[bytes, ...]:
    """``token`` plus every non-empty line of ``token_file`` (named ``setting`` in errors).

    ``need_one``: a file that leaves no token at all is an error.
    """
    found: list[bytes] = []
    if token:
        found.append(token.strip().encode("utf-8"))
    if token_file:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read {setting} `{token_file}`: {error}") from None
        found += [line.strip().encode("utf-8") for line in text.splitlines() if line.strip()]
        if need_one and not found:
            raise ConfigError(f"{setting} `{token_file}` holds no token")
    return tuple(value for value in found if value)
