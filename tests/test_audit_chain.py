"""The tamper-evident audit trails (issue 40): every audit row carries the hash of the
row before it in the same store, and ``flowdecision audit --verify`` / ``outbox audit
--verify`` recompute the chain and name the first row that does not match.

The ledger's trail on every backend (memory, JSON file, a real SQLite file, the
suite's real PostgreSQL), the outbox's on SQLite and PostgreSQL; rows edited and
deleted with raw SQL, as someone with write access to the database would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from flowdecision import open_ledger
from flowdecision.ledger import JsonFileLedger, Ledger, MemoryLedger, PostgresLedger, SqliteLedger
from flowdecision.ledger.jsonfile import AUDIT_FILE
from flowdecision.sinks.outbox import OutboxSink
from flowdecision.store.chain import GENESIS, link_hash, verify_chain

from .service_process import ROOT

CLI = [sys.executable, "-m", "flowdecision.cli"]


def flowdecision(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)


async def _act(ledger: Ledger, count: int) -> None:
    """``count`` audited actions: completed decisions forgotten, a pending one released."""
    for i in range(count):
        decision_id = f"d-{i}"
        await ledger.claim(decision_id, "h", "owner", lease_ms=60_000)
        if i % 3 == 2:
            await ledger.operator_release(decision_id, actor="ops", reason=f"stuck {i}")
            continue
        assert await ledger.complete(decision_id, "h", "owner")
        await ledger.forget(decision_id, actor="ops", reason=f"resend {i}")


def test_the_chain_detects_an_edit_a_deletion_and_an_insertion() -> None:
    contents = [(i, "forget", f"d-{i}", "ops", "why", "completed", 1) for i in range(4)]
    rows = []
    prev = GENESIS
    for seq, content in enumerate(contents, start=1):
        row_hash = link_hash(prev, content)
        rows.append((seq, prev, row_hash, content))
        prev = row_hash
    intact = verify_chain(rows)
    assert (intact.ok, intact.rows, intact.head, intact.head_seq) == (True, 4, prev, 4)
    edited = [*rows[:2], (3, rows[2][1], rows[2][2], (9, *contents[2][1:])), rows[3]]
    assert verify_chain(edited).first_break is not None
    assert verify_chain(edited).first_break.seq == 3  # type: ignore[union-attr]
    deleted = verify_chain([rows[0], rows[2], rows[3]])
    assert deleted.first_break is not None and deleted.first_break.seq == 3
    assert "prev_hash" in deleted.first_break.problem
    # Rows from before the chain are an unchained prefix, not a break ...
    legacy = verify_chain([(0, None, None, ("old",)), *rows])
    assert (legacy.ok, legacy.legacy, legacy.rows) == (True, 1, 5)
    # ... but a row without hashes after the chain began is.
    hole = verify_chain([rows[0], (2, None, None, contents[1])])
    assert hole.first_break is not None and hole.first_break.problem == "it has no hashes"
    assert verify_chain([]).to_dict() == {
        "ok": True, "rows": 0, "legacy": 0, "head": GENESIS, "head_seq": 0, "first_break": None,
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_the_scanning_ledgers_chain_their_trails(kind: str, tmp_path: Path) -> None:
    ledger: Ledger = MemoryLedger() if kind == "memory" else JsonFileLedger(tmp_path)
    await _act(ledger, 4)
    report = await ledger.verify_audit()
    assert (report.ok, report.rows, report.legacy) == (True, 4, 0)
    entries = (await ledger.audit(_all())).entries
    assert entries[0].prev_hash == GENESIS
    assert [e.prev_hash for e in entries[1:]] == [e.row_hash for e in entries[:-1]]
    assert report.head == entries[-1].row_hash
    # Edit the reason of the second entry where it is kept.
    if isinstance(ledger, MemoryLedger):
        trail = ledger._audit_trail
        trail[1] = dataclasses.replace(trail[1], reason="nothing to see")
    else:
        path = tmp_path / AUDIT_FILE
        lines = path.read_text().splitlines()
        second = json.loads(lines[1])
        second["reason"] = "nothing to see"
        lines[1] = json.dumps(second)
        path.write_text("\n".join(lines) + "\n")
    broken = await ledger.verify_audit()
    assert broken.first_break is not None and broken.first_break.seq == 2
    assert "edited" in broken.first_break.problem


def _all() -> object:
    from flowdecision.ledger.query import AuditQuery

    return AuditQuery(limit=1000)


async def test_sqlite_audit_verify_passes_intact_and_names_an_edited_row(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    async with await SqliteLedger.open(path) as ledger:
        await _act(ledger, 5)
    intact = flowdecision("audit", "--ledger", url, "--verify")
    assert intact.returncode == 0, intact.stderr
    assert intact.stdout.startswith("ledger audit trail: intact: 5 row(s); head sha256:")
    as_json = json.loads(flowdecision("audit", "--ledger", url, "--verify", "--json").stdout)
    assert (as_json["ok"], as_json["rows"], as_json["head_seq"]) == (True, 5, 5)

    # Someone with write access edits a row: the trigger is in the way, so it goes first.
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TRIGGER flowdecision_audit_no_update")
        conn.execute("UPDATE flowdecision_audit SET actor = 'someone else' WHERE seq = 3")
    edited = flowdecision("audit", "--ledger", url, "--verify")
    assert edited.returncode == 7, edited.stdout + edited.stderr
    assert edited.stdout.startswith("ledger audit trail: BROKEN at seq 3: its row_hash")
    # ... or deletes one (and fixes the edit): the next row names the hole.
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE flowdecision_audit SET actor = 'ops' WHERE seq = 3")
        conn.execute("DROP TRIGGER flowdecision_audit_no_delete")
        conn.execute("DELETE FROM flowdecision_audit WHERE seq = 2")
    deleted = json.loads(flowdecision("audit", "--ledger", url, "--verify", "--json").stdout)
    assert deleted["ok"] is False and deleted["first_break"]["seq"] == 3
    # Cutting the tail is not detected by the chain alone: the head moves back.
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM flowdecision_audit WHERE seq >= 2")
    cut = json.loads(flowdecision("audit", "--ledger", url, "--verify", "--json").stdout)
    assert (cut["ok"], cut["head_seq"]) == (True, 1)
    assert cut["head"] != as_json["head"]  # what a head kept elsewhere shows


async def test_a_sqlite_trail_from_before_the_chain_verifies_as_a_legacy_prefix(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    async with await SqliteLedger.open(path) as ledger:
        await ledger.claim("old", "h", "o", lease_ms=60_000)
    with sqlite3.connect(path) as conn:  # a row written by schema 6 (no hashes)
        conn.execute(
            "INSERT INTO flowdecision_audit (at_ms, action, decision_id, actor, reason, "
            "state_before, attempts) VALUES (1, 'release', 'old', 'ops', 'r', 'pending_live', 2)"
        )
    async with await SqliteLedger.open(path) as ledger:
        await _act(ledger, 2)
        report = await ledger.verify_audit()
    assert (report.ok, report.rows, report.legacy) == (True, 3, 1)


async def test_postgres_appends_chain_in_turn_and_an_edit_is_named(pg_empty_url: str) -> None:
    await PostgresLedger(pg_empty_url).migrate()
    first = await PostgresLedger.connect(pg_empty_url)
    second = await PostgresLedger.connect(pg_empty_url)
    try:
        for i in range(30):
            await first.claim(f"p-{i}", "h", "o", lease_ms=60_000)
        # Two ledger instances (as two hosts) act at once: the advisory lock orders them.
        await asyncio.gather(
            *(
                (first if i % 2 else second).operator_release(f"p-{i}", actor="ops", reason="r")
                for i in range(30)
            )
        )
        report = await first.verify_audit()
        assert (report.ok, report.rows) == (True, 30)
    finally:
        await first.close()
        await second.close()
    conn = await asyncpg.connect(pg_empty_url)
    try:
        await conn.execute("DROP RULE flowdecision_audit_no_update ON flowdecision_audit")
        await conn.execute("UPDATE flowdecision_audit SET reason = 'x' WHERE seq = 17")
    finally:
        await conn.close()
    edited = flowdecision("audit", "--ledger", pg_empty_url, "--verify")
    assert edited.returncode == 7, edited.stdout + edited.stderr
    assert "BROKEN at seq 17" in edited.stdout


async def _execute(url: str, statements: list[str], params: list[object] | None = None) -> None:
    """Raw SQL on the outbox's store (SQLite file or PostgreSQL), as an operator would."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            for statement in statements:
                if params is None:
                    conn.execute(statement)
                else:
                    conn.executemany(statement, params)
        return
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            if params is None:
                await conn.execute(statement)
            else:
                await conn.executemany(statement, params)
    finally:
        await conn.close()


async def _check_outbox_chain(url: str, drop_update_guard: str) -> None:
    outbox = OutboxSink(url)
    await outbox.migrate()
    # Rows relay "r" parked (as a relay leaves them), then skipped and retried.
    rows = [("r", i, f"o-{i}", f"run-{i}", "parked", "refused", 1, 5, 5) for i in range(1, 5)]
    marks = "$1, $2, $3, $4, $5, $6, $7, $8, $9" if url.startswith("postgres") else "?, " * 8 + "?"
    await _execute(
        url,
        [
            "INSERT INTO flow_decision_outbox_parked (relay, seq, decision_id, run_id, state, "
            f"error, attempts, parked_at_ms, updated_at_ms) VALUES ({marks})"
        ],
        list(rows),
    )
    try:
        for i in range(1, 5):
            action = "skip" if i % 2 else "retry"
            await outbox.act_on_parked("r", action, f"o-{i}", actor="ops", reason=f"why {i}")
        report = await outbox.verify_audit()
        assert (report.ok, report.rows) == (True, 4)
        trail = await outbox.audit()
        assert trail[0].prev_hash == GENESIS and trail[-1].row_hash == report.head
    finally:
        await outbox.close()
    intact = flowdecision("outbox", "audit", "--sink", url, "--verify")
    assert intact.returncode == 0, intact.stderr
    assert intact.stdout.startswith("outbox audit trail: intact: 4 row(s)")
    await _execute(
        url,
        [drop_update_guard, "UPDATE flow_decision_outbox_audit SET action = 'retry' WHERE seq = 3"],
    )
    broken = flowdecision("outbox", "audit", "--sink", url, "--verify")
    assert broken.returncode == 7, broken.stdout + broken.stderr
    assert broken.stdout.startswith("outbox audit trail: BROKEN at seq 3: its row_hash")


async def test_the_sqlite_outbox_audit_trail_is_chained_and_verified(tmp_path: Path) -> None:
    await _check_outbox_chain(
        f"sqlite:///{tmp_path / 'outbox.db'}", "DROP TRIGGER flow_decision_outbox_audit_no_update"
    )


async def test_the_postgres_outbox_audit_trail_is_chained_and_verified(pg_empty_url: str) -> None:
    await _check_outbox_chain(
        pg_empty_url, "DROP RULE flow_decision_outbox_audit_no_update ON flow_decision_outbox_audit"
    )


async def test_a_schema_6_ledger_gains_the_chain_on_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    async with await SqliteLedger.open(path) as ledger:
        await _act(ledger, 2)
    with sqlite3.connect(path) as conn:  # back to schema 6: no hash columns
        conn.execute("DROP TRIGGER flowdecision_audit_no_update")
        conn.execute("ALTER TABLE flowdecision_audit DROP COLUMN prev_hash")
        conn.execute("ALTER TABLE flowdecision_audit DROP COLUMN row_hash")
        conn.execute("DELETE FROM flowdecision_schema_version WHERE version > 6")
        conn.execute("PRAGMA user_version = 6")
    ledger = await open_ledger(f"sqlite:///{path}")
    try:
        report = await ledger.verify_audit()
        assert (report.ok, report.rows, report.legacy) == (True, 2, 2)
        await ledger.claim("new", "h", "o", lease_ms=60_000)
        await ledger.operator_release("new", actor="ops", reason="after the upgrade")
        report = await ledger.verify_audit()
        assert (report.ok, report.rows, report.legacy) == (True, 3, 2)
    finally:
        await ledger.close()
