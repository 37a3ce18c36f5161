"""``flowdecision list / release / forget / audit / prune --keep-tombstones``, as real processes.

Each test starts where docs/OPERATIONS.md starts: an empty directory, decisions
submitted through the library, then the operator's commands.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowdecision import Dispatcher, DispatchOutcome
from flowdecision.ledger import SqliteLedger

from .helpers import RecordingSink, step_request

CLI = [sys.executable, "-m", "flowdecision.cli"]


def flowdecision(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def _seed(path: Path) -> None:
    """Run a: 3 decisions submitted; run b: 2 claims left by an owner that died."""

    async def go() -> None:
        ledger = await SqliteLedger.open(path)
        try:
            dispatcher = Dispatcher("production", RecordingSink(), ledger)
            for i in range(3):
                await dispatcher.dispatch(step_request(f"a-{i}", run_id="run-a"))
            for i in range(2):
                await ledger.claim(f"b-{i}", "h", "died", lease_ms=1)
        finally:
            await ledger.close()

    asyncio.run(go())


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    _seed(tmp_path / "ledger.db")
    return f"sqlite:///{tmp_path / 'ledger.db'}"


def test_list_by_run_and_state_as_a_table_and_as_json(ledger_url: str) -> None:
    table = flowdecision("list", "--ledger", ledger_url, "--run", "run-a", "--count")
    assert table.returncode == 0, table.stderr
    run_line, *lines = table.stdout.splitlines()
    assert run_line == "run run-a: open"  # the run's state first (issue 40)
    assert lines[0].split() == [
        "decision_id", "state", "attempts", "created_at_ms", "lease/completion", "run_id",
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[2:5]] == ["a-0", "a-1", "a-2"]
    assert lines[-1] == "3 decision(s) match"
    stuck = flowdecision(
        "list", "--ledger", ledger_url, "--state", "pending_expired", "--limit", "1", "--json"
    )
    body = json.loads(stuck.stdout)
    assert [row["decision_id"] for row in body["decisions"]] == ["b-0"]
    after = flowdecision(
        "list", "--ledger", ledger_url, "--state", "pending_expired", "--cursor",
        body["next_cursor"], "--json",
    )  # fmt: skip
    assert [row["decision_id"] for row in json.loads(after.stdout)["decisions"]] == ["b-1"]
    bad = flowdecision("list", "--ledger", ledger_url, "--before", "yesterday")
    assert bad.returncode == 2 and "is not a time" in bad.stderr


def test_bulk_release_previews_then_acts_with_yes_and_is_audited(ledger_url: str) -> None:
    preview = flowdecision(
        "release", "--ledger", ledger_url, "--state", "pending_expired", "--reason", "owner died"
    )
    assert preview.returncode == 2
    assert "2 decision(s) match; nothing was done" in preview.stdout
    done = flowdecision(
        "release", "--ledger", ledger_url, "--state", "pending_expired", "--reason",
        "owner died", "--actor", "alice", "--yes", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    entries = json.loads(done.stdout)["audit"]
    assert [(e["decision_id"], e["attempts"], e["actor"]) for e in entries] == [
        ("b-0", 2, "alice"), ("b-1", 2, "alice"),
    ]  # fmt: skip
    # A refusal exits 3 as README says (1 is for ledger and store errors).
    refused = flowdecision("release", "--ledger", ledger_url, "a-0", "--reason", "x")
    assert refused.returncode == 3 and "only a pending claim can be released" in refused.stderr
    trail = flowdecision("audit", "--ledger", ledger_url, "--json")
    assert [e["reason"] for e in json.loads(trail.stdout)["entries"]] == ["owner died"] * 2


def test_forget_needs_a_reason_and_frees_the_id(ledger_url: str, tmp_path: Path) -> None:
    missing = flowdecision("forget", "--ledger", ledger_url, "a-0")
    assert missing.returncode == 2 and "--reason" in missing.stderr
    forgot = flowdecision("forget", "--ledger", ledger_url, "a-0", "--reason", "resend it")
    assert forgot.returncode == 0, forgot.stderr
    assert forgot.stdout.startswith("forgot `a-0` (was completed")
    audit = flowdecision("audit", "--ledger", ledger_url, "--decision", "a-0")
    assert "forget" in audit.stdout and "resend it" in audit.stdout

    async def resubmit() -> bool:
        ledger = await SqliteLedger.open(tmp_path / "ledger.db")
        try:
            sink = RecordingSink()
            await Dispatcher("production", sink, ledger).dispatch(
                step_request("a-0", run_id="run-a")
            )
            return sink.ids == ["a-0"]
        finally:
            await ledger.close()

    assert asyncio.run(resubmit())


def test_forget_of_an_unknown_decision_exits_3_as_inspect_does(ledger_url: str) -> None:
    inspected = flowdecision("inspect", "--ledger", ledger_url, "nope")
    forgot = flowdecision("forget", "--ledger", ledger_url, "nope", "--reason", "x")
    released = flowdecision("release", "--ledger", ledger_url, "nope", "--reason", "x")
    assert (inspected.returncode, forgot.returncode, released.returncode) == (3, 3, 3)
    assert "nope" in forgot.stderr and "Traceback" not in forgot.stderr


def test_bulk_forget_over_pending_claims_lists_each_as_refused(ledger_url: str) -> None:
    text = flowdecision(
        "forget", "--ledger", ledger_url, "--state", "pending_expired", "--reason", "x", "--yes"
    )
    assert text.returncode == 3, text.stderr
    assert text.stdout == ""
    assert text.stderr.count("not forgot") == 2 and "it is pending_expired" in text.stderr
    as_json = flowdecision(
        "forget", "--ledger", ledger_url, "--state", "pending_expired", "--reason", "x",
        "--yes", "--json",
    )  # fmt: skip
    assert as_json.returncode == 3
    body = json.loads(as_json.stdout)
    assert body["audit"] == []
    assert [item["decision_id"] for item in body["refused"]] == ["b-0", "b-1"]
    # A mixed bulk action acts on what it takes and lists the rest.
    mixed = flowdecision("forget", "--ledger", ledger_url, "--reason", "x", "--after", "0", "--yes")
    assert "forgot" in mixed.stdout, mixed.stderr
    assert mixed.returncode == 3
    assert mixed.stdout.count("forgot `a-") == 3 and mixed.stderr.count("not forgot") == 2


def test_a_tampered_cursor_is_a_usage_error_not_a_crash(ledger_url: str) -> None:
    for cursor in ("WzEsIlx1ZDgwMCJd", "Wzk5OTk5OTk5OTk5OTk5OTk5OTk5OTk5LCJhIl0"):  # \ud800; 2**76
        listed = flowdecision("list", "--ledger", ledger_url, "--cursor", cursor)
        assert listed.returncode == 2, listed.stderr
        assert "is not a cursor this query returned" in listed.stderr


def test_prune_keep_tombstones_then_the_horizon(ledger_url: str, tmp_path: Path) -> None:
    kept = flowdecision(
        "prune", "--ledger", ledger_url, "--older-than", "0s", "--keep-tombstones", "--json"
    )
    assert kept.returncode == 0, kept.stderr
    report = json.loads(kept.stdout)
    assert (report["pruned"], report["tombstones_kept"]) == (3, True)

    async def late_duplicate() -> DispatchOutcome:
        ledger = await SqliteLedger.open(tmp_path / "ledger.db")
        try:
            sink = RecordingSink()
            outcome = await Dispatcher("production", sink, ledger).dispatch(
                step_request("a-1", run_id="run-a")
            )
            assert sink.ids == []  # never reached the sink
            return outcome
        finally:
            await ledger.close()

    outcome = asyncio.run(late_duplicate())
    body = outcome.to_dict()
    assert (body["outcome"], body["receipt"]) == ("duplicate", None)
    assert body["receipt_digest"].startswith("sha256:")
    tombs = flowdecision("list", "--ledger", ledger_url, "--state", "tombstoned", "--json")
    assert len(json.loads(tombs.stdout)["decisions"]) == 3
    # `inspect` names it as `list` does, and keeps its completion time.
    inspected = json.loads(flowdecision("inspect", "--ledger", ledger_url, "a-1", "--json").stdout)
    assert inspected["state"] == "tombstoned" and inspected["completed_at_ms"] is not None
    table = flowdecision("inspect", "--ledger", ledger_url, "a-1").stdout
    assert "tombstoned" in table and "completed_at_ms" in table
    horizon = flowdecision("prune", "--ledger", ledger_url, "--tombstones-older-than", "0s")
    assert horizon.returncode == 0, horizon.stderr
    assert "removed 3 tombstone(s)" in horizon.stdout


def test_list_and_forget_by_completion_time(tmp_path: Path) -> None:
    """``--by completed``: --after/--before read the completion time, pages come in
    completion order (not claim order), and bulk actions take the same filters."""
    path = tmp_path / "ledger.db"

    async def seed() -> None:
        ledger = await SqliteLedger.open(path)
        try:
            for i, done_at in enumerate((9_000, 7_000, 8_000)):
                await ledger.claim(f"x-{i}", "h", "o", lease_ms=10**12, now_ms=1_000 * (i + 1))
                await ledger.complete(f"x-{i}", "h", "o", completed_at_ms=done_at)
            await ledger.claim("p-0", "h", "o", lease_ms=1, now_ms=500)  # pending: no such time
        finally:
            await ledger.close()

    asyncio.run(seed())
    url = f"sqlite:///{path}"

    def ids(*options: str) -> list[str]:
        listed = flowdecision("list", "--ledger", url, "--json", *options)
        assert listed.returncode == 0, listed.stderr
        return [row["decision_id"] for row in json.loads(listed.stdout)["decisions"]]

    assert ids() == ["p-0", "x-0", "x-1", "x-2"]  # first claimed first
    assert ids("--by", "completed") == ["x-1", "x-2", "x-0"]
    assert ids("--by", "completed", "--after", "7500", "--before", "9000") == ["x-2"]
    assert ids("--by", "claimed", "--after", "2000") == ["x-1", "x-2"]
    paged = flowdecision("list", "--ledger", url, "--by", "completed", "--limit", "2")
    assert paged.returncode == 0, paged.stderr
    assert [line.split()[0] for line in paged.stdout.splitlines()[2:4]] == ["x-1", "x-2"]
    cursor = paged.stdout.splitlines()[-1].removeprefix("next page: --cursor ")
    assert ids("--by", "completed", "--cursor", cursor) == ["x-0"]
    refused = flowdecision("list", "--ledger", url, "--by", "completed", "--cursor", cursor[:-2])
    assert refused.returncode == 2 and "cursor" in refused.stderr
    pending = flowdecision("list", "--ledger", url, "--by", "completed", "--state", "pending_live")
    assert pending.returncode == 2 and "`by` completed" in pending.stderr

    preview = flowdecision(
        "forget", "--ledger", url, "--by", "completed", "--before", "8500", "--reason", "replay"
    )
    assert preview.returncode == 2 and "2 decision(s) match" in preview.stdout
    done = flowdecision(
        "forget", "--ledger", url, "--by", "completed", "--before", "8500", "--reason",
        "replay", "--yes", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [e["decision_id"] for e in json.loads(done.stdout)["audit"]] == ["x-1", "x-2"]
    assert ids("--by", "completed") == ["x-0"]
