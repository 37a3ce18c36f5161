"""open_ledger / parse_ledger_url: every scheme, and clear errors for bad ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowdecision.connections.urls import parse_ledger_url
from flowdecision.errors import LedgerError
from flowdecision.ledger import JsonFileLedger, MemoryLedger, open_ledger


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("memory:", ("memory", "")),
        ("file:///var/lib/fd", ("file", "/var/lib/fd")),
        ("/var/lib/fd", ("file", "/var/lib/fd")),
        ("relative/dir", ("file", "relative/dir")),
        ("sqlite:///.flowdecision/ledger.db", ("sqlite", ".flowdecision/ledger.db")),
        ("sqlite:////abs/ledger.db", ("sqlite", "/abs/ledger.db")),
        ("sqlite:///with%20space.db", ("sqlite", "with space.db")),
        ("postgresql://u@h:5432/db", ("postgresql", "postgresql://u@h:5432/db")),
        ("postgres://u@h/db", ("postgresql", "postgres://u@h/db")),
    ],
)
def test_parse(url: str, expected: tuple[str, str]) -> None:
    assert parse_ledger_url(url) == expected


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://h/0", "unsupported ledger URL scheme `redis`"),
        ("file://otherhost/dir", "file URLs must name a local path"),
        ("sqlite://host/x.db", "sqlite URLs have no host"),
        ("sqlite:///", "sqlite URLs need a path"),
    ],
)
def test_bad_urls_name_the_problem(url: str, fragment: str) -> None:
    with pytest.raises(LedgerError, match=fragment):
        parse_ledger_url(url)


async def test_open_memory_and_file(tmp_path: Path) -> None:
    assert isinstance(await open_ledger("memory:"), MemoryLedger)
    ledger = await open_ledger(f"file://{tmp_path}")
    assert isinstance(ledger, JsonFileLedger) and ledger.root == tmp_path


async def test_open_unreachable_postgres_is_a_clear_error() -> None:
    with pytest.raises(LedgerError, match=r"127\.0\.0\.1:1"):
        await open_ledger("postgresql://nobody@127.0.0.1:1/db?connect_timeout=2")
