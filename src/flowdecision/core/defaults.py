"""Every default, in one place: where the stores live when none is named, and
the default of every constructor's tuning argument (the constructors, ``serve``'s
settings and the CLI read them from here, so they cannot drift apart).

**Where the stores live** (``serve``, the CLI, ``SqliteLedger()``, ``OutboxSink``).

The default layout keeps the ledger and the outbox in ONE SQLite file, so each
accepted decision is claimed, written to the outbox and completed in one
transaction (the transactional outbox; docs/OPERATIONS.md, "Store layout").
A working directory laid out the old way (``ledger.db`` and ``outbox.db``) and
without the new file keeps its layout: its stores are never silently replaced
by new, empty ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

__all__ = [
    "BATCH_CONCURRENCY",
    "CLIENT_TIMEOUT_S",
    "DEFAULT_STORE_PATH",
    "DEFAULT_STORE_URL",
    "HTTP_POOL_CONNECTIONS",
    "LEASE_MS",
    "LEGACY_LEDGER_URL",
    "LEGACY_OUTBOX_URL",
    "MAX_BATCH",
    "MAX_WAIT_MS",
    "PG_COMMAND_TIMEOUT_S",
    "PG_CONNECT_TIMEOUT_S",
    "PG_MAX_SIZE",
    "PG_MIN_SIZE",
    "RETRY_BACKOFF_BASE_S",
    "RETRY_BACKOFF_MAX_S",
    "RETRY_MAX_RETRY_AFTER_S",
    "RETRY_MAX_TRIES",
    "SERVICE_HOST",
    "SERVICE_PORT",
    "SERVICE_URL",
    "SHARED_STORE_SCHEMES",
    "SQLITE_BUSY_TIMEOUT_MS",
    "SQLITE_CACHE_KIB",
    "SQLITE_INLINE_MAX_MS",
    "SQLITE_SYNCHRONOUS",
    "WEBHOOK_BACKOFF_BASE_S",
    "WEBHOOK_BACKOFF_MAX_S",
    "WEBHOOK_MAX_ATTEMPTS",
    "WEBHOOK_MAX_RETRY_AFTER_S",
    "WEBHOOK_TIMEOUT_S",
    "default_ledger_path",
    "default_ledger_url",
    "default_outbox_url",
    "default_sink_url",
    "legacy_layout_only",
    "legacy_outbox_exists",
]

#: The ledger and the outbox, together (relative to the working directory).
DEFAULT_STORE_PATH = Path(".flowdecision") / "flowdecision.db"
DEFAULT_STORE_URL = f"sqlite:///{DEFAULT_STORE_PATH.as_posix()}"
#: The two-file layout of releases before the transactional outbox.
LEGACY_LEDGER_URL = "sqlite:///.flowdecision/ledger.db"
LEGACY_OUTBOX_URL = "sqlite:///.flowdecision/outbox.db"


def _file(url: str) -> Path:
    return Path(urlsplit(url).path[1:])


def legacy_layout_only() -> bool:
    """The old default ledger file exists here and the new default file does not."""
    return _file(LEGACY_LEDGER_URL).exists() and not _file(DEFAULT_STORE_URL).exists()


def legacy_outbox_exists() -> bool:
    """The old default outbox file (``.flowdecision/outbox.db``) exists here."""
    return _file(LEGACY_OUTBOX_URL).exists()


def default_ledger_url() -> str:
    """The ledger used here when none is named: the shared file, or the legacy
    ``ledger.db`` in a working directory still laid out the old way."""
    return LEGACY_LEDGER_URL if legacy_layout_only() else DEFAULT_STORE_URL


def default_outbox_url() -> str:
    """The outbox used here when none is named (see :func:`default_ledger_url`)."""
    return LEGACY_OUTBOX_URL if legacy_layout_only() else DEFAULT_STORE_URL


#: URL schemes of the stores that hold the outbox beside the ledger (one store).
SHARED_STORE_SCHEMES = ("sqlite", "postgres", "postgresql")


def default_sink_url(ledger: str) -> str:
    """The sink ``serve`` uses with ``ledger`` named and no sink: the ledger's own store
    (SQLite, PostgreSQL) unless this directory keeps the old ``.flowdecision/outbox.db``,
    which is used then (as for any other ledger). ``flowdecision approve`` delivers
    there too."""
    shared = urlsplit(ledger).scheme.lower() in SHARED_STORE_SCHEMES
    return ledger if shared and not legacy_outbox_exists() else LEGACY_OUTBOX_URL


def default_ledger_path() -> Path:
    """The SQLite ledger file used here when none is named (``SqliteLedger()``):
    the one the CLI and ``serve`` use (see :func:`default_ledger_url`), so a
    library call never creates the shared file beside an old ``ledger.db`` and
    flips this directory's layout under ``serve``."""
    return _file(default_ledger_url())


# -- the dispatcher -------------------------------------------------------------------

#: A claim's lease: how long another owner waits before taking over a silent one.
LEASE_MS = 30_000

# -- SQLite stores (ledger and outbox) --------------------------------------------------

#: ``PRAGMA synchronous``: FULL, a committed claim survives power loss.
SQLITE_SYNCHRONOUS: Final = "FULL"
#: How long a write waits for another process's transaction before failing.
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: The SQLite ledger's page cache (``PRAGMA cache_size``), in KiB.
SQLITE_CACHE_KIB = 16_384
#: The SQLite ledger commits a lone mutation on its caller's event loop (no thread
#: hand-off) while such commits take at most this long (0: always on its own thread).
SQLITE_INLINE_MAX_MS = 5.0
#: The SQLite ledger checkpoints its WAL on a thread of its own, at most this often
#: while commits come (0: inside the commits, as SQLite does by default).
SQLITE_CHECKPOINT_INTERVAL_MS = 100.0
#: ... and its commits checkpoint only once the WAL holds this many pages (SQLite's
#: ``wal_autocheckpoint``; its default is 1,000): a backstop if that thread falls behind.
SQLITE_CHECKPOINT_BACKSTOP_PAGES = 4_000

# -- group commit (the SQL ledgers) -----------------------------------------------------

#: At most this many mutations share one commit.
MAX_BATCH = 64
#: How long a started batch waits for more (0: never; in flight together is enough).
MAX_WAIT_MS = 0.0
#: PostgreSQL ledger: batches committing at once.
BATCH_CONCURRENCY = 2

# -- PostgreSQL pools (ledger and outbox) ---------------------------------------------

PG_MIN_SIZE = 1
PG_MAX_SIZE = 10
PG_CONNECT_TIMEOUT_S = 10.0
PG_COMMAND_TIMEOUT_S: float | None = 60.0

# -- the async HTTP transport (DecisionClient, the webhook and Restate sinks) ----------

#: Connections one pool keeps open at once: 64 concurrent calls never wait for one.
HTTP_POOL_CONNECTIONS = 64

# -- the webhook sink -------------------------------------------------------------------

WEBHOOK_TIMEOUT_S = 10.0
WEBHOOK_MAX_ATTEMPTS = 4
WEBHOOK_BACKOFF_BASE_S = 0.2
WEBHOOK_BACKOFF_MAX_S = 5.0
WEBHOOK_MAX_RETRY_AFTER_S = 30.0

# -- the HTTP client (flowdecision.client, ``flowdecision submit``) ----------------------

#: Where ``serve`` listens by default, and where the client looks.
SERVICE_HOST = "127.0.0.1"
SERVICE_PORT = 8080
SERVICE_URL = f"http://{SERVICE_HOST}:{SERVICE_PORT}"
#: Per HTTP request.
CLIENT_TIMEOUT_S = 10.0
#: ``RetryOptions``: HTTP requests per call (first included) and the backoff.
RETRY_MAX_TRIES = 5
RETRY_BACKOFF_BASE_S = 0.1
RETRY_BACKOFF_MAX_S = 10.0
RETRY_MAX_RETRY_AFTER_S = 60.0

#: The service's log levels, most verbose first (``serve --log-level``).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
