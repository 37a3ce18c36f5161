"""The crash harness's approval phase: held decisions approved in bulk by operator
processes that race each other and are SIGKILLed, on SQLite (one file, and the
outbox apart) and PostgreSQL; each must be delivered once and approved once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowdecision.chaos import ChaosConfig, ChaosReport, run_chaos
from flowdecision.errors import InvalidArgumentError
from tests.ledger_fixtures import _create_database, _migrate
from tests.service_process import ROOT

#: A small dispatch phase (its checks run as always), then the approval phase.
SHORT = {
    "workers": 2,
    "decisions": 50,
    "approvals": 400,
    "lease_ms": 200,
    "concurrency": 3,
    "kill_every_ms": 300,
    "pause_every_ms": 0,
    "timeout_s": 120.0,
    "seed": 3,
}
APPROVAL_CHECKS = {"approvals_held", "approvals_delivered", "approvals_audited_once", "audit_chain"}


def _assert_approved_once(report: ChaosReport) -> None:
    failed = {name: detail for name, (ok, detail) in report.checks.items() if not ok}
    assert not failed, json.dumps(report.to_dict(), indent=2)
    assert APPROVAL_CHECKS <= set(report.checks)
    figures = report.figures
    assert figures["approvals"] == 400
    assert figures["approval_kills"] >= 1
    assert report.checks["approvals_audited_once"][1].startswith("400 of 400 approved exactly once")
    if figures["layout"] == "shared":
        # The approval, the claim and the outbox row are one transaction: a kill leaves
        # the decision held (approved by a later round) or approved, never half.
        assert figures["approval_takeovers"] == 0, figures


@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_approvals_survive_killed_operators_on_sqlite(layout: str, tmp_path: Path) -> None:
    report = run_chaos(
        ChaosConfig(
            ledger_url=f"sqlite:///{tmp_path / 'chaos.db'}",
            workdir=str(tmp_path / "work"),
            layout=layout,
            **SHORT,
        )
    )
    _assert_approved_once(report)


async def test_approvals_survive_killed_operators_on_postgres(
    pg_server_url: str, tmp_path: Path
) -> None:
    url = await _create_database(pg_server_url, "flowdecision_chaos_approvals")
    await _migrate(url)
    config = ChaosConfig(ledger_url=url, workdir=str(tmp_path / "work"), **SHORT)
    report = await asyncio.to_thread(run_chaos, config)
    _assert_approved_once(report)
    assert report.config["outbox_url"] == url


def test_the_cli_runs_the_approval_phase(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "chaos",
         "--ledger", f"sqlite:///{tmp_path / 'chaos.db'}", "--workers", "2",
         "--decisions", "20", "--approvals", "200", "--kill-every-ms", "300",
         "--pause-every-ms", "0", "--seed", "4", "--timeout", "120", "--json",
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.stdout.startswith("{"), done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"], json.dumps(report, indent=2)
    assert APPROVAL_CHECKS <= set(report["checks"])
    assert report["figures"]["approvals"] == 200


def test_the_approval_phase_needs_a_ledger_that_holds(tmp_path: Path) -> None:
    base = {"workdir": str(tmp_path), "decisions": 10}
    with pytest.raises(InvalidArgumentError, match="keeps holds"):
        ChaosConfig(ledger_url=f"file://{tmp_path / 'l'}", approvals=5, **base).resolved()
    with pytest.raises(InvalidArgumentError, match="approvals must be 0 or more"):
        ChaosConfig(ledger_url=f"sqlite:///{tmp_path / 'l.db'}", approvals=-1, **base).resolved()
    with pytest.raises(InvalidArgumentError, match="decisions and approvals in all"):
        ChaosConfig(
            ledger_url=f"sqlite:///{tmp_path / 'l.db'}",
            approvals=995,
            sink="temporal://127.0.0.1:7233",
            **base,
        ).resolved()
