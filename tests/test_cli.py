"""The console script, run as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from flowdecision.ledger import JsonFileLedger

CLI = [sys.executable, "-m", "flowdecision.cli"]


def flowdecision(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_demo_shows_every_fate_and_the_health_snapshot(tmp_path: Path) -> None:
    result = flowdecision("demo", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for fate in (
        "submitted",
        "duplicate (not resubmitted)",
        "UnauthorizedBranchError",
        "DecisionConflictError",
        "SinkError",
        "DecisionBusyError",
        "after the lease expired (takeover)",
    ):
        assert fate in out
    health = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert health["completed"] == 3 and health["takeovers"] == 2 and health["in_flight"] == 0
    # The demo ran through the real seed-format file.
    records = asyncio.run(JsonFileLedger(tmp_path).records())
    assert {"dec-submit", "dec-retry", "dec-race", "dec-orphan"} <= set(records)
    assert all(r.status.value == "completed" for r in records.values())


def test_inspect_and_prune_a_file_ledger(tmp_path: Path) -> None:
    async def seed() -> None:
        ledger = JsonFileLedger(tmp_path)
        await ledger.claim("done", "hash-d", "secret-owner", lease_ms=1000, now_ms=100)
        await ledger.complete("done", "hash-d", "secret-owner", completed_at_ms=200)
        await ledger.claim("live", "hash-l", "secret-owner", lease_ms=1000, now_ms=100)

    asyncio.run(seed())
    shown = flowdecision("inspect", "--ledger", str(tmp_path), "live", "--request-hash", "hash-l")
    assert shown.returncode == 0, shown.stderr
    assert "pending" in shown.stdout and "1100" in shown.stdout
    assert "secret-owner" not in shown.stdout

    as_json = flowdecision("inspect", "--ledger", f"file://{tmp_path}", "done", "--json")
    assert json.loads(as_json.stdout)["state"] == "completed"
    assert json.loads(as_json.stdout)["completed_at_ms"] == 200

    missing = flowdecision("inspect", "--ledger", str(tmp_path), "nope")
    assert missing.returncode == 3 and "missing" in missing.stdout

    mismatch = flowdecision("inspect", "--ledger", str(tmp_path), "live", "--request-hash", "x")
    assert mismatch.returncode == 1
    assert "request hash conflicts with its claim" in mismatch.stderr

    pruned = flowdecision("prune", "--ledger", str(tmp_path), "--before", "201", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout) == {"before_ms": 201, "pruned": 1}
    assert set(asyncio.run(JsonFileLedger(tmp_path).records())) == {"live"}


def test_prune_older_than_uses_the_ledger_clock(tmp_path: Path) -> None:
    async def seed() -> None:
        ledger = JsonFileLedger(tmp_path)
        await ledger.claim("old", "h", "o", lease_ms=10, now_ms=1)
        await ledger.complete("old", "h", "o", completed_at_ms=5)

    asyncio.run(seed())
    result = flowdecision("prune", "--ledger", str(tmp_path), "--older-than", "7d")
    assert result.returncode == 0, result.stderr
    assert "pruned 1" in result.stdout
    assert "pruning... 1 removed" in result.stderr  # the live progress counter


def test_usage_and_store_errors_have_distinct_exit_codes(tmp_path: Path) -> None:
    bad_scheme = flowdecision("inspect", "--ledger", "redis://x", "d")
    assert bad_scheme.returncode == 1
    assert "unsupported ledger URL scheme `redis`" in bad_scheme.stderr
    bad_duration = flowdecision("prune", "--ledger", str(tmp_path), "--older-than", "soon")
    assert bad_duration.returncode == 2 and "not a duration" in bad_duration.stderr
    both = flowdecision("prune", "--ledger", str(tmp_path), "--before", "1", "--older-than", "1d")
    assert both.returncode == 2
    (tmp_path / "flow-decisions.json").write_text("{not json")
    corrupt = flowdecision("inspect", "--ledger", str(tmp_path), "d")
    assert corrupt.returncode == 1 and "flow-decisions.json" in corrupt.stderr


def test_migrate_then_inspect_postgres_and_sqlite(pg_empty_url: str, tmp_path: Path) -> None:
    before = flowdecision("inspect", "--ledger", pg_empty_url, "d")
    assert before.returncode == 1 and "flowdecision migrate" in before.stderr
    migrated = flowdecision("migrate", "--ledger", pg_empty_url, "--json")
    assert migrated.returncode == 0, migrated.stderr
    assert json.loads(migrated.stdout) == {
        "migrated": True,
        "version_before": 0,
        "version_after": json.loads(migrated.stdout)["version_after"],
    }
    assert json.loads(migrated.stdout)["version_after"] >= 1
    after = flowdecision("inspect", "--ledger", pg_empty_url, "d")
    assert after.returncode == 3 and "missing" in after.stdout
    lite = flowdecision("migrate", "--ledger", f"sqlite:///{tmp_path}/l.db")
    assert lite.returncode == 0 and "ledger schema at version" in lite.stdout
    assert (tmp_path / "l.db").exists()


def test_migrate_json_reports_nothing_migrated_on_an_up_to_date_store(
    pg_empty_url: str, tmp_path: Path
) -> None:
    for url in (pg_empty_url, f"sqlite:///{tmp_path}/l.db"):
        first = flowdecision("migrate", "--ledger", url, "--json")
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["migrated"] is True
        version = json.loads(first.stdout)["version_after"]
        again = flowdecision("migrate", "--ledger", url, "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == {
            "migrated": False,
            "version_before": version,
            "version_after": version,
        }
        text = flowdecision("migrate", "--ledger", url)
        assert "already up to date" in text.stdout
