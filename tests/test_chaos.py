"""The crash harness, short: real worker processes SIGKILLed and SIGSTOPped while
they dispatch through each durable ledger into the outbox, then verified."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from flowdecision.chaos import ChaosConfig, ChaosReport, run_chaos, verify
from flowdecision.ledger.machine import ClaimRecord

SHORT = {
    "workers": 3,
    "decisions": 400,
    "lease_ms": 200,
    "concurrency": 3,
    "kill_every_ms": 250,
    "pause_every_ms": 400,
    "timeout_s": 120.0,
    "seed": 7,
}


def _assert_passed(report: ChaosReport, decisions: int = 400) -> None:
    failed = {name: detail for name, (ok, detail) in report.checks.items() if not ok}
    assert not failed, json.dumps(report.to_dict(), indent=2)
    assert set(report.checks) == {
        "ledger_exactly_once",
        "outbox_one_row",
        "no_conflicting_content",
        "no_stale_completion",
        "acknowledged_by_owner",
        "health_adds_up",
        "drained",
    }
    figures = report.figures
    print(json.dumps(figures))
    assert figures["kills"] >= 1 and figures["pauses"] >= 1
    assert figures["incarnations"] == 3 + figures["kills"] + figures["crashes"]
    assert figures["crashes"] == 0
    assert figures["conflicts_refused"] >= 1  # conflicting reuses were really proposed
    assert (
        figures["duplicates_suppressed_dispatcher"] >= decisions
    )  # every decision has 2 proposers


def _assert_exactly_once_without_replays(report: ChaosReport) -> None:
    """The shared layout: nothing for the outbox to absorb, not merely nothing lost."""
    figures = report.figures
    assert figures["layout"] == "shared"
    assert figures["duplicates_suppressed_outbox"] == 0, figures
    assert figures["outbox_rows_replayed"] == 0, figures
    # A kill can no longer leave a claim without its completion: nothing to take over.
    assert figures["takeovers_ledger"] == 0, figures


@pytest.mark.parametrize(
    ("kind", "layout"), [("file", "separate"), ("sqlite", "separate"), ("sqlite", "shared")]
)
def test_short_chaos_run_on_a_local_ledger(kind: str, layout: str, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'ledger'}" if kind == "file" else f"sqlite:///{tmp_path / 'l.db'}"
    # The file ledger rewrites its whole file per mutation: fewer decisions, same faults.
    short = {**SHORT, "decisions": 150} if kind == "file" else SHORT
    report = run_chaos(
        ChaosConfig(ledger_url=url, workdir=str(tmp_path / "work"), layout=layout, **short)
    )
    _assert_passed(report, short["decisions"])
    if layout == "shared":
        assert report.config["outbox_url"] == url  # one SQLite file
        _assert_exactly_once_without_replays(report)


@pytest.mark.parametrize("layout", ["separate", "shared"])
def test_short_chaos_run_on_postgres(pg_url: str, layout: str, tmp_path: Path) -> None:
    import asyncpg

    async def empty() -> None:  # verify flags rows of an earlier run as unexpected
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute("TRUNCATE flowdecision_claims, flow_decision_outbox")
        finally:
            await conn.close()

    asyncio.run(empty())
    report = run_chaos(
        ChaosConfig(ledger_url=pg_url, workdir=str(tmp_path / "work"), layout=layout, **SHORT)
    )
    _assert_passed(report)
    assert report.config["outbox_url"] == pg_url
    if layout == "shared":
        _assert_exactly_once_without_replays(report)


def test_verify_catches_a_missing_row_and_a_completion_after_expiry(tmp_path: Path) -> None:
    """The checks are not vacuous: tamper with the stores and they fail."""
    db = tmp_path / "l.db"
    cfg = ChaosConfig(
        ledger_url=f"sqlite:///{db}",
        workdir=str(tmp_path / "work"),
        **{**SHORT, "decisions": 20, "kill_every_ms": 0, "pause_every_ms": 0},
    ).resolved()
    report = run_chaos(cfg)
    assert report.ok, report.to_dict()
    first = f"chaos-{cfg.run_id}-000000"
    second = f"chaos-{cfg.run_id}-000001"
    assert cfg.layout == "shared"  # the default: the outbox is in the ledger's file
    outbox = sqlite3.connect(db, isolation_level=None)
    outbox.execute("DELETE FROM flow_decision_outbox WHERE decision_id = ?", (first,))
    outbox.close()
    ledger = sqlite3.connect(db, isolation_level=None)
    (text,) = ledger.execute(
        "SELECT record FROM flowdecision_claims WHERE decision_id = ?", (second,)
    ).fetchone()
    record = json.loads(text)
    ClaimRecord.from_dict(second, record)
    record["completed_at_ms"] += 3_600_000  # "completed" an hour after its lease
    ledger.execute(
        "UPDATE flowdecision_claims SET record = ? WHERE decision_id = ?",
        (json.dumps(record), second),
    )
    ledger.close()
    again = asyncio.run(verify(cfg))
    assert not again.checks["outbox_one_row"][0]
    assert first in again.checks["outbox_one_row"][1]
    assert not again.checks["no_stale_completion"][0]
    assert second in again.checks["no_stale_completion"][1]
    assert again.checks["ledger_exactly_once"][0]
