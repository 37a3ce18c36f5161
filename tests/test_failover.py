"""Failover in the project's own harness: ``flowdecision chaos`` with its failover fault.

A primary and a streaming standby (``pg_basebackup -R``, a physical replication
slot, both run as the unprivileged ``postgres`` account), the standby
synchronous (``synchronous_standby_names='*'``, ``synchronous_commit=on``).
Chaos workers dispatch through the co-located ledger and outbox on one
multi-host DSN (``?host=A,B&target_session_attrs=read-write``) while the harness,
every few seconds, runs the failover command: SIGKILL the primary (postmaster
and every backend), promote the standby, rebuild the old primary as the new
standby.

On the survivor every acknowledged decision must be completed, with exactly one
outbox row, by the owner that was told "submitted": 0 lost, 0 repeated. The
bounded version runs here; ``bench/failover_bench.py`` runs the full one in both
modes (synchronous and asynchronous) for docs/RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.postgres_server import ReplicatedPostgres, running

ROOT = Path(__file__).resolve().parent.parent
FAILOVERS = 3
DECISIONS = 800


@pytest.fixture
def sync_pair() -> Iterator[ReplicatedPostgres]:
    with running(ReplicatedPostgres(synchronous=True), "a primary and a standby") as pair:
        yield pair


async def _create_database(url: str, name: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


def test_chaos_failover_with_a_synchronous_standby_loses_and_repeats_nothing(
    sync_pair: ReplicatedPostgres, tmp_path: Path
) -> None:
    asyncio.run(_create_database(sync_pair.url(), "chaos"))
    url = sync_pair.url("chaos")
    command = f"{sys.executable} {ROOT / 'tests' / 'postgres_server.py'} failover {sync_pair.state}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowdecision.cli",
            "chaos",
            "--ledger",
            url,
            "--decisions",
            str(DECISIONS),
            "--workers",
            "6",
            "--lease-ms",
            "300",
            # The fault under test is the database's: no worker kills or pauses
            # (tests/test_chaos.py has those), so every second goes to failovers.
            "--kill-every-ms",
            "0",
            "--pause-every-ms",
            "0",
            "--failover-command",
            command,
            "--failover-every-ms",
            "500",
            "--failovers",
            str(FAILOVERS),
            "--seed",
            "19",
            "--timeout",
            "240",
            "--workdir",
            str(tmp_path / "chaos"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")},
            "PYTHONPATH": str(ROOT / "src"),
        },
        check=False,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    figures, checks = report["figures"], report["checks"]
    failed = {name: c["detail"] for name, c in checks.items() if not c["passed"]}
    assert report["ok"] and proc.returncode == 0, (failed, proc.stderr[-3000:])
    # The fault really happened, under load, and the harness saw it.
    assert figures["failovers"] == FAILOVERS and len(figures["failover_s"]) == FAILOVERS
    assert figures["ledger_failures"] > 0, "no dispatch noticed a failover"
    # Each decision was acknowledged to the owner that completed it, or completed by a
    # call whose answer the failover cut off (its owner's retry was told duplicate).
    assert figures["acknowledged"] + figures["completed_unanswered"] == DECISIONS
    assert (figures["lost_after_ack"], figures["repeated_after_ack"]) == (0, 0)
    assert checks["acknowledged_by_owner"]["passed"]
    assert checks["outbox_one_row"]["passed"]
    # The survivor is the pair's current primary, and the old ones stand by.
    assert json.loads(sync_pair.state.read_text())["failovers"] == FAILOVERS
