"""The run invariants (issue 40): a closed run takes no new decision, a run has at
most one terminal decision, and a duplicate stays a duplicate -- on the memory,
SQLite and PostgreSQL ledgers, through the library, two racing processes, the
service, both clients and the CLI; and an existing store upgrades to them.

Real SQLite files, the suite's real PostgreSQL server, real processes and HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import requests

from flowdecision import (
    Dispatcher,
    DispatchOutcome,
    MemoryLedger,
    PostgresLedger,
    RunClosedError,
    SqliteLedger,
    open_ledger,
    request_hash,
)
from flowdecision.core.model import Complete, DecisionRequest, DecisionStep, Fail, ScheduleStep
from flowdecision.errors import LedgerError, LedgerSchemaError
from flowdecision.ledger import JsonFileLedger, Ledger, RunClosed, RunState, RunStatus
from flowdecision.ledger.machine import DecisionOrigin
from flowdecision.ledger.query import DecisionQuery
from flowdecision.ledger.rows import LEDGER
from flowdecision.ledger.states import AlreadyCompleted, Claimed, DecisionState
from flowdecision.sinks.outbox import OutboxSink

from .helpers import RecordingSink
from .run_race import done as race_done
from .run_race import step as race_step
from .service_process import ROOT, ServiceProcess

TOKEN = "runs-token-0123456789abcdef"
SQLITE_VERSION = LEDGER.newest("sqlite")
PG_VERSION = LEDGER.newest("postgres")


def _step(decision_id: str, run_id: str) -> DecisionRequest:
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id=f"{decision_id}-cause",
        decision=ScheduleStep(DecisionStep(f"{decision_id}-s", "work", {"id": decision_id})),
    )


def _end(decision_id: str, run_id: str, *, fail: bool = False) -> DecisionRequest:
    decision: Complete | Fail = Fail(error="gave up") if fail else Complete(output={"ok": True})
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id=f"{decision_id}-cause",
        decision=decision,
    )


async def _pg_ledger(pg_url: str) -> PostgresLedger:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("TRUNCATE flowdecision_claims, flowdecision_runs")
    finally:
        await conn.close()
    return await PostgresLedger.connect(pg_url)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Ledger]:
    """A ledger keeping the run invariants (memory: turned on; SQL: the default)."""
    opened: Ledger
    if request.param == "memory":
        opened = MemoryLedger(run_invariants=True)
    elif request.param == "sqlite":
        opened = await SqliteLedger.open(tmp_path / "ledger.db")
    else:
        opened = await _pg_ledger(request.getfixturevalue("pg_url"))
    assert opened.run_invariants
    try:
        yield opened
    finally:
        await opened.close()


async def _refused(dispatcher: Dispatcher, request: DecisionRequest) -> RunClosedError:
    with pytest.raises(RunClosedError) as caught:
        await dispatcher.dispatch(request)
    return caught.value


async def _check_close_rules(ledger: Ledger, dispatcher: Dispatcher, run: str) -> None:
    """The rules a dispatcher sees, on any path (joint or claim, submit, complete)."""
    assert (await dispatcher.dispatch(_step(f"{run}-a", run))).submitted
    assert (await ledger.run_state(run)).status is RunStatus.OPEN
    assert (await dispatcher.dispatch(_end(f"{run}-end", run))).submitted
    state = await ledger.run_state(run)
    assert (state.status, state.closed_by, state.terminal_kind) == (
        RunStatus.CLOSED,
        f"{run}-end",
        "complete",
    )
    record = await ledger.read_record(f"{run}-end")
    assert record is not None and state.closed_at_ms == record.completed_at_ms

    # A new decision of the closed run is refused, naming the decision that closed it.
    late = await _refused(dispatcher, _step(f"{run}-late", run))
    assert (late.run_id, late.run_state, late.closed_by, late.closed_at_ms) == (
        run,
        "closed",
        f"{run}-end",
        state.closed_at_ms,
    )
    assert late.code == "run_closed" and f"{run}-end" in str(late)
    # A second terminal decision under another id: refused the same way (a fail too).
    assert (await _refused(dispatcher, _end(f"{run}-end2", run, fail=True))).closed_by == (
        f"{run}-end"
    )
    # Nothing was stored for the refused ones; duplicates stay duplicates.
    assert await ledger.read_record(f"{run}-late") is None
    assert await ledger.read_record(f"{run}-end2") is None
    for again in (_step(f"{run}-a", run), _end(f"{run}-end", run)):
        outcome = await dispatcher.dispatch(again)
        assert (outcome.outcome, outcome.attempt) == ("duplicate", 1)
    # Another run is untouched.
    assert (await dispatcher.dispatch(_step(f"{run}-other", f"{run}-x"))).submitted
    assert dispatcher.health().rejected == 2


async def test_a_closed_run_refuses_new_decisions_and_answers_duplicates(ledger: Ledger) -> None:
    sink = RecordingSink()
    dispatcher = Dispatcher("production", sink, ledger)
    assert not dispatcher.joint
    run = f"run-{uuid.uuid4().hex[:8]}"
    await _check_close_rules(ledger, dispatcher, run)
    assert sink.ids == [f"{run}-a", f"{run}-end", f"{run}-other"]  # nothing refused reached it


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_the_joint_path_keeps_the_rules_and_writes_no_row_for_a_refusal(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'one.db'}"
        opened: Ledger = await open_ledger(url)
    else:
        url = request.getfixturevalue("pg_url")
        opened = await _pg_ledger(url)
    outbox = await OutboxSink(url).open()
    try:
        dispatcher = Dispatcher("production", outbox, opened)
        assert dispatcher.joint
        run = f"run-{uuid.uuid4().hex[:8]}"
        await _check_close_rules(opened, dispatcher, run)
        assert await outbox.get(f"{run}-end") is not None
        assert await outbox.get(f"{run}-late") is None
        assert await outbox.get(f"{run}-end2") is None
    finally:
        await outbox.close()
        await opened.close()


async def test_claimed_before_the_close_completes_after_it_but_never_starts_again(
    ledger: Ledger,
) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    origin = DecisionOrigin(run, "cause")
    terminal = DecisionOrigin(run, "cause", "complete")
    step_hash, end_hash = request_hash(_step("s", run)), request_hash(_end("end", run))
    # A step claimed while the run is open; then the terminal decision is claimed.
    assert await ledger.claim(f"{run}-s", step_hash, "A", lease_ms=60_000, origin=origin) == (
        Claimed(1)
    )
    assert await ledger.claim(f"{run}-e", end_hash, "B", lease_ms=60_000, origin=terminal) == (
        Claimed(1)
    )
    closing = await ledger.run_state(run)
    assert (closing.status, closing.terminal_decision_id, closing.closed_by) == (
        RunStatus.CLOSING,
        f"{run}-e",
        None,
    )
    # While closing: another terminal is refused, a step is still taken.
    refused = await ledger.claim(f"{run}-e2", end_hash, "C", lease_ms=60_000, origin=terminal)
    assert isinstance(refused, RunClosed) and refused.run.status is RunStatus.CLOSING
    assert await ledger.claim(f"{run}-t", step_hash, "C", lease_ms=1, origin=origin) == Claimed(1)
    # The terminal decision completes: the run closes.
    assert await ledger.complete(f"{run}-e", end_hash, "B", origin=terminal)
    closed = await ledger.run_state(run)
    assert closed.status is RunStatus.CLOSED and closed.closed_by == f"{run}-e"
    # The step claimed before the close completes after it (its owner's lease is live) ...
    assert await ledger.complete(f"{run}-s", step_hash, "A", origin=origin)
    # ... but no attempt starts after the close: not a takeover of the expired step,
    await asyncio.sleep(0.01)
    late = await ledger.claim(f"{run}-t", step_hash, "D", lease_ms=60_000, origin=origin)
    assert isinstance(late, RunClosed) and late.run.closed_by == f"{run}-e"
    record = await ledger.read_record(f"{run}-t")
    assert record is not None and record.attempts == 1  # unchanged by the refusal
    # ... nor a new decision; a completed one is still a duplicate.
    assert isinstance(
        await ledger.claim(f"{run}-n", step_hash, "D", lease_ms=10, origin=origin), RunClosed
    )
    assert isinstance(
        await ledger.claim(f"{run}-s", step_hash, "D", lease_ms=10, origin=origin),
        AlreadyCompleted,
    )
    # A run the ledger knows nothing of is open.
    assert (await ledger.run_state(f"{run}-none")).status is RunStatus.OPEN


async def test_the_reserved_terminal_decision_survives_a_failed_submission(
    ledger: Ledger,
) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"

    class FailOnce:
        failed = False

        async def submit(self, request: DecisionRequest, attempt: int) -> None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("engine down")

    dispatcher = Dispatcher("production", FailOnce(), ledger)
    with pytest.raises(Exception, match="sink"):
        await dispatcher.dispatch(_end(f"{run}-end", run))
    assert (await ledger.run_state(run)).status is RunStatus.CLOSING
    # Another terminal decision cannot take its place; the released one is retried.
    assert (await _refused(dispatcher, _end(f"{run}-other", run))).run_state == "closing"
    outcome = await dispatcher.dispatch(_end(f"{run}-end", run))
    assert (outcome.submitted, outcome.attempt) == (True, 2)
    assert (await ledger.run_state(run)).closed_by == f"{run}-end"


async def test_the_json_file_ledger_never_keeps_them(tmp_path: Path) -> None:
    ledger = JsonFileLedger(tmp_path)
    assert not ledger.runs_supported and not ledger.run_invariants
    with pytest.raises(LedgerError, match="Rust hosts"):
        ledger.run_invariants = True
    ledger.run_invariants = False  # what serve does with run_invariants = false: fine
    dispatcher = Dispatcher("production", RecordingSink(), ledger)
    for name in ("one", "two"):  # the seed's behaviour: both completes taken
        assert (await dispatcher.dispatch(_end(name, "run-file"))).submitted


async def test_without_the_invariants_a_ledger_keeps_the_seed_behaviour(tmp_path: Path) -> None:
    seedlike = await SqliteLedger.open(tmp_path / "l.db", run_invariants=False)
    for opened in (MemoryLedger(), seedlike):
        dispatcher = Dispatcher("production", RecordingSink(), opened)
        for name in ("one", "two"):  # two completes of one run, then a step: all taken
            assert (await dispatcher.dispatch(_end(name, "run-seed"))).submitted
        assert (await dispatcher.dispatch(_step("three", "run-seed"))).submitted
        assert (await opened.run_state("run-seed")).status is RunStatus.OPEN
        await opened.close()


# -- two real processes race on 1,000 runs ------------------------------------------------

RACE_RUNS = 1000


def _racers(ledger_url: str, outbox_url: str) -> list[dict[str, int]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    start_at = time.time() + 2.0  # both have opened their stores by then
    args = [ledger_url, outbox_url, str(RACE_RUNS)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.run_race", *args, name, str(start_at), str(seed)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for seed, name in enumerate(("a", "b"))
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out))
    return results


async def _check_race(ledger: Ledger, outbox: OutboxSink, results: list[dict[str, int]]) -> None:
    # Every decision in the ledger, with its run, first-claim and completion times.
    rows = []
    query = DecisionQuery(limit=1000)
    while True:
        page = await ledger.list_decisions(query)
        rows.extend(page.decisions)
        if page.next_cursor is None:
            break
        query = DecisionQuery(limit=1000, cursor=page.next_cursor)
    by_run: dict[str, list[Any]] = {}
    for row in rows:
        assert row.state is DecisionState.COMPLETED, row  # nothing left half-done
        assert row.attempts == 1, row  # never claimed twice
        by_run.setdefault(row.run_id or "", []).append(row)
    assert len(by_run) == RACE_RUNS
    for run in range(RACE_RUNS):
        state = await ledger.run_state(f"run-{run}")
        assert state.status is RunStatus.CLOSED, state
        assert state.closed_at_ms is not None
        terminals = [row for row in by_run[f"run-{run}"] if "-done-" in row.decision_id]
        assert [row.decision_id for row in terminals] == [state.closed_by]  # exactly one
        for row in by_run[f"run-{run}"]:
            # No decision claimed after its run closed.
            assert row.created_at_ms <= state.closed_at_ms, (row, state)
    # The outbox got each recorded decision once, and the one terminal decision per run.
    delivered = await outbox.fetch(after=0, limit=10 * RACE_RUNS)
    assert sorted(entry.decision_id for entry in delivered) == sorted(r.decision_id for r in rows)
    # The processes' answers add up: each decision recorded once, each refusal stored nothing.
    total = {key: sum(result[key] for result in results) for key in results[0]}
    assert total["submitted"] == len(rows)
    assert total["submitted"] + total["duplicate"] + total["run_closed"] == 2 * RACE_RUNS * 4
    assert total["run_closed"] >= RACE_RUNS  # at least the losing complete of each run
    # After the race: a recorded decision is a duplicate, a refused one is refused.
    dispatcher = Dispatcher("production", outbox, ledger)
    for run in (0, RACE_RUNS // 2, RACE_RUNS - 1):
        requests = [race_step(run, k, n) for k in range(3) for n in "ab"]
        for request in requests + [race_done(run, n) for n in "ab"]:
            if await ledger.read_record(request.decision_id) is None:
                await _refused(dispatcher, request)
            else:
                assert (await dispatcher.dispatch(request)).outcome == "duplicate"


async def _race_and_check(ledger_url: str, outbox_url: str) -> None:
    # Create and migrate both stores before the racers open them.
    ledger = await open_ledger(ledger_url)
    outbox = OutboxSink(outbox_url)
    await outbox.migrate()
    await outbox.open()
    try:
        results = await asyncio.to_thread(_racers, ledger_url, outbox_url)
        await _check_race(ledger, outbox, results)
    finally:
        await outbox.close()
        await ledger.close()


@pytest.mark.parametrize("layout", ["joint", "split"])
async def test_two_processes_race_on_a_thousand_sqlite_runs(tmp_path: Path, layout: str) -> None:
    """joint: ledger and outbox in one file (claim, row, completion in one commit);
    split: the outbox in another file (claim, submit, complete)."""
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    outbox_url = ledger_url if layout == "joint" else f"sqlite:///{tmp_path / 'outbox.db'}"
    await _race_and_check(ledger_url, outbox_url)


@pytest.mark.parametrize("layout", ["joint", "split"])
async def test_two_processes_race_on_a_thousand_postgres_runs(
    pg_empty_url: str, tmp_path: Path, layout: str
) -> None:
    """joint: ledger and outbox in one database; split: the outbox in a SQLite file
    (claim, submit, complete: each a locking transaction with the run's lock)."""
    await PostgresLedger(pg_empty_url).migrate()
    outbox_url = pg_empty_url if layout == "joint" else f"sqlite:///{tmp_path / 'outbox.db'}"
    await _race_and_check(pg_empty_url, outbox_url)


# -- upgrading an existing store ---------------------------------------------------------


def _back_to_schema_5(path: Path) -> None:
    """Make a current SQLite ledger what schema 5 left: no runs table, no audit
    chain columns (schema 7), version 5."""
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE flowdecision_runs")
        conn.execute("ALTER TABLE flowdecision_audit DROP COLUMN prev_hash")
        conn.execute("ALTER TABLE flowdecision_audit DROP COLUMN row_hash")
        conn.execute("DELETE FROM flowdecision_schema_version WHERE version > 5")
        conn.execute("PRAGMA user_version = 5")


async def test_a_schema_5_sqlite_ledger_upgrades_on_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    old = await SqliteLedger.open(path, run_invariants=False)
    dispatcher = Dispatcher("production", RecordingSink(), old)
    await dispatcher.dispatch(_step("old-step", "run-old"))
    await dispatcher.dispatch(_end("old-end", "run-old"))  # completed before the upgrade
    await old.close()
    _back_to_schema_5(path)
    with pytest.raises(LedgerSchemaError, match="older than version"):
        await open_ledger(f"sqlite:///{path}", create=False)  # read-only: never migrates
    upgraded = await SqliteLedger.open(path)
    try:
        assert await upgraded.migrate() == (5, SQLITE_VERSION)
        # What was there is still answered; the run (closed before the rules) is open.
        dispatcher = Dispatcher("production", RecordingSink(), upgraded)
        assert (await dispatcher.dispatch(_end("old-end", "run-old"))).outcome == "duplicate"
        assert (await upgraded.run_state("run-old")).status is RunStatus.OPEN
        # New terminal decisions close runs from now on.
        assert (await dispatcher.dispatch(_end("new-end", "run-new"))).submitted
        await _refused(dispatcher, _step("new-late", "run-new"))
    finally:
        await upgraded.close()


async def test_a_schema_5_postgres_ledger_upgrades_with_migrate(pg_empty_url: str) -> None:
    await PostgresLedger(pg_empty_url).migrate()
    conn = await asyncpg.connect(pg_empty_url)
    try:
        await conn.execute("DROP TABLE flowdecision_runs")
        await conn.execute(
            "ALTER TABLE flowdecision_audit DROP COLUMN prev_hash, DROP COLUMN row_hash"
        )
        await conn.execute("DELETE FROM flowdecision_schema_version WHERE version > 5")
        await conn.execute(
            "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record, "
            "created_at_ms, run_id) VALUES ('old-1', 'completed', 500, $1, 500, 'run-old')",
            json.dumps({"request_hash": "h1", "status": "completed", "owner_id": "o",
                        "lease_expires_at_ms": 0, "attempts": 1, "completed_at_ms": 500}),
        )  # fmt: skip
    finally:
        await conn.close()
    with pytest.raises(LedgerSchemaError):
        await PostgresLedger.connect(pg_empty_url)  # PostgreSQL migrates only when asked
    assert await PostgresLedger(pg_empty_url).migrate() == (5, PG_VERSION)
    ledger = await PostgresLedger.connect(pg_empty_url)
    try:
        assert isinstance(await ledger.claim("old-1", "h1", "x", lease_ms=5), AlreadyCompleted)
        dispatcher = Dispatcher("production", RecordingSink(), ledger)
        assert (await dispatcher.dispatch(_end("pg-end", "run-pg"))).submitted
        assert (await ledger.run_state("run-pg")).closed_by == "pg-end"
    finally:
        await ledger.close()


# -- the service, both clients and the CLI ------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with ServiceProcess(tmp_path_factory.mktemp("runs"), token=TOKEN) as proc:
        yield proc


def _post(service: ServiceProcess, request: DecisionRequest) -> requests.Response:
    return requests.post(
        f"{service.url}/v1/decisions", data=request.to_json(), headers=service.headers, timeout=30
    )


def test_the_service_answers_409_run_closed_and_shows_the_run(service: ServiceProcess) -> None:
    assert _post(service, _step("h-a", "run-h")).status_code == 201
    assert _post(service, _end("h-end", "run-h")).status_code == 201
    late = _post(service, _step("h-late", "run-h"))
    assert late.status_code == 409, late.text
    error = late.json()["error"]
    assert (error["code"], error["decision_id"], error["run_id"], error["run_state"]) == (
        "run_closed",
        "h-late",
        "run-h",
        "closed",
    )
    assert error["closed_by"] == "h-end" and isinstance(error["closed_at_ms"], int)
    assert "Retry-After" not in late.headers
    again = _post(service, _end("h-end", "run-h"))  # a duplicate stays a duplicate
    assert (again.status_code, again.json()["outcome"]) == (200, "duplicate")

    run = requests.get(
        f"{service.url}/v1/runs/run-h", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    ).json()
    assert run["run"] == {
        "run_id": "run-h",
        "state": "closed",
        "terminal_decision_id": "h-end",
        "terminal_kind": "complete",
        "closed_by": "h-end",
        "closed_at_ms": error["closed_at_ms"],
    }
    assert [row["decision_id"] for row in run["decisions"]] == ["h-a", "h-end"]


def test_both_clients_raise_a_typed_run_closed_error(service: ServiceProcess) -> None:
    from flowdecision.client import DecisionClient, ServiceRunClosedError, SyncDecisionClient

    with SyncDecisionClient(service.url, token=TOKEN) as client:
        assert client.submit(_end("c-end", "run-c")).outcome == "submitted"
        with pytest.raises(ServiceRunClosedError) as caught:
            client.submit(_step("c-late", "run-c"))
        page = client.run("run-c")
    error = caught.value
    assert isinstance(error, RunClosedError)  # the library's exception, as for a Dispatcher
    assert (error.status, error.run_id, error.run_state, error.closed_by, error.tries) == (
        409,
        "run-c",
        "closed",
        "c-end",
        1,  # never retried
    )
    assert page.run == RunState("run-c", "c-end", "complete", None, error.closed_at_ms)

    async def go() -> None:
        async with DecisionClient(service.url, token=TOKEN) as client:
            with pytest.raises(ServiceRunClosedError, match="c-end"):
                await client.submit(_end("c-end-2", "run-c"))
            assert (await client.run("run-open")).run == RunState.opened("run-open")

    asyncio.run(go())


def test_submit_exits_6_for_a_closed_run(service: ServiceProcess, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    assert _post(service, _end("x-end", "run-x")).status_code == 201
    body = tmp_path / "late.json"
    body.write_bytes(_step("x-late", "run-x").to_json())
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "submit", "--url", service.url,
         "--token-file", str(token), str(body)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert done.returncode == 6, done.stderr
    assert "run `run-x` is closed" in done.stderr or "run_closed" in done.stderr


def test_list_run_shows_the_run_state(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"

    async def seed() -> None:
        async with await SqliteLedger.open(path) as opened:
            dispatcher = Dispatcher("production", RecordingSink(), opened)
            outcome: DispatchOutcome = await dispatcher.dispatch(_step("l-a", "run-l"))
            assert outcome.submitted
            await dispatcher.dispatch(_end("l-end", "run-l", fail=True))

    asyncio.run(seed())
    cli = [sys.executable, "-m", "flowdecision.cli", "list", "--ledger", f"sqlite:///{path}"]
    table = subprocess.run([*cli, "--run", "run-l"], capture_output=True, text=True, check=True)
    first = table.stdout.splitlines()[0]
    assert first.startswith("run run-l: closed by l-end (fail) at "), table.stdout
    as_json = subprocess.run(
        [*cli, "--run", "run-l", "--json"], capture_output=True, text=True, check=True
    )
    body = json.loads(as_json.stdout)
    assert (body["run"]["state"], body["run"]["closed_by"]) == ("closed", "l-end")
    assert [row["decision_id"] for row in body["decisions"]] == ["l-a", "l-end"]
    other = subprocess.run([*cli, "--run", "run-new"], capture_output=True, text=True, check=True)
    assert other.stdout.splitlines()[0] == "run run-new: open"
