"""Where flowdecision keeps its stores when none is named (``serve``, the CLI).

The default layout keeps the ledger and the outbox in ONE SQLite file, so each
accepted decision is claimed, written to the outbox and completed in one
transaction (the transactional outbox; docs/OPERATIONS.md, "Store layout").
A working directory laid out the old way (``ledger.db`` and ``outbox.db``) and
without the new file keeps its layout: its stores are never silently replaced
by new, empty ones.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

__all__ = [
    "DEFAULT_STORE_URL",
    "LEGACY_LEDGER_URL",
    "LEGACY_OUTBOX_URL",
    "default_ledger_url",
    "default_outbox_url",
    "legacy_layout_only",
    "legacy_outbox_exists",
]

#: The ledger and the outbox, together.
DEFAULT_STORE_URL = "sqlite:///.flowdecision/flowdecision.db"
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
