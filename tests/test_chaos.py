"""The crash harness, short: real worker processes SIGKILLed and SIGSTOPped while
they dispatch through each durable ledger into the outbox, then verified."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from flowdecision.chaos import ChaosConfig, ChaosReport, run_chaos, verify
from flowdecision.chaos.health_check import check_health
from flowdecision.chaos.journal import outcome_unknown
from flowdecision.chaos.verify import Evidence, check_ledger, check_stale
from flowdecision.errors import LedgerCorruptError, LedgerUnavailableError, StoreFullError
from flowdecision.ledger.machine import ClaimRecord, ClaimStatus

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


def _in_doubt_evidence(unknown: bool, workdir: Path) -> Evidence:
    """One decision, completed (attempt 1) by owner ``o1``, whose journal shows a
    claim-and-complete answered with an error (outcome ``unknown`` or not), then a
    retry told ``completed``:
    what a failover leaves when the primary committed and died before answering."""
    cfg = ChaosConfig(
        ledger_url="sqlite:///unused.db", decisions=1, workers=1, lease_ms=300, workdir=str(workdir)
    )
    record = ClaimRecord(
        request_hash="h",
        status=ClaimStatus.COMPLETED,
        owner_id="o1",
        lease_expires_at_ms=0,
        attempts=1,
        completed_at_ms=1_000,
    )
    events: list[dict[str, object]] = [
        {"o": "o1", "e": "joint0", "d": "d1", "t0": 900},
        {"o": "o1", "e": "claim", "d": "d1", "t0": 900, "t1": 1_200, "r": "error", "u": unknown},
        {"o": "o1", "e": "joint0", "d": "d1", "t0": 1_300},
        {"o": "o1", "e": "claim", "d": "d1", "t0": 1_300, "t1": 1_310, "r": "completed"},
    ]
    evidence = Evidence(
        cfg=cfg, ids=["d1"], proposals=1, proposed_hashes={"h"}, records={"d1": record}
    )
    evidence.events_by_worker[0] = events
    for event in events:
        evidence.scan(event)
    return evidence


def test_verify_accepts_a_commit_whose_answer_was_lost_and_nothing_else(tmp_path: Path) -> None:
    """A claim-and-complete whose connection died around the commit may have
    committed: its owner completing the decision with no ``claimed`` line passes, and
    the unjournaled attempt is within the bound. The same journal with an error that
    wrote nothing (a refused connection) fails both checks."""
    doubtful = _in_doubt_evidence(True, tmp_path)
    (passed, detail), unanswered = check_ledger(doubtful)
    assert passed and unanswered == 1, detail
    assert check_stale(doubtful)[0][0]
    health = check_health(
        doubtful.cfg, doubtful.events_by_worker, doubtful.records, doubtful.claims, Counter()
    )
    assert health.check[0], health.check[1]
    assert "1 calls in doubt" in health.check[1]

    refused = _in_doubt_evidence(False, tmp_path)
    (passed, detail), unanswered = check_ledger(refused)
    assert not passed and "has no journaled claim of attempt 1" in detail and unanswered == 0
    assert not check_stale(refused)[0][0]
    health = check_health(
        refused.cfg, refused.events_by_worker, refused.records, refused.claims, Counter()
    )
    assert not health.check[0] and "1 unjournaled, allowed 0..0" in health.check[1]


def test_an_outcome_is_unknown_only_when_the_store_went_away_mid_call() -> None:
    lost = LedgerUnavailableError("cannot use PostgreSQL ledger: connection closed")
    lost.__cause__ = ConnectionResetError("reset by peer")
    refused = LedgerUnavailableError("cannot use PostgreSQL ledger: server unreachable")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert outcome_unknown(lost)
    assert not outcome_unknown(refused)
    assert not outcome_unknown(StoreFullError("disk full: nothing was written"))
    assert not outcome_unknown(LedgerCorruptError("undecodable record"))
