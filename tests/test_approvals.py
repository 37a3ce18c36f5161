"""Approval holds (issue 40): a policy names the decisions an operator must approve; a
held decision is recorded with its request, nothing reaches the sink or the outbox,
and an approval dispatches it exactly once -- on the memory, SQLite and PostgreSQL
ledgers, on the joint path (the outbox in the ledger's store) and into a webhook, from
two racing processes and across a SIGKILL; rejection is terminal; holds expire.

Real SQLite files, the suite's real PostgreSQL server, a real local HTTP receiver, real
``flowdecision`` processes and a real ``flowdecision serve``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import requests

from flowdecision import Dispatcher, MemoryLedger, PostgresLedger, SqliteLedger
from flowdecision.core.approvals import ApprovalPolicy
from flowdecision.core.model import (
    Complete,
    DecisionRequest,
    DecisionStep,
    ScheduleStep,
    ScheduleSteps,
)
from flowdecision.errors import (
    ActionRefusedError,
    DecisionConflictError,
    DecisionRejectedError,
    InvalidArgumentError,
    LedgerSchemaError,
    RunClosedError,
    SinkConflictError,
    UnknownDecisionError,
)
from flowdecision.ledger import JsonFileLedger, Ledger
from flowdecision.ledger.query import DecisionQuery
from flowdecision.ledger.states import DecisionState, Held, Rejected, RunStatus
from flowdecision.service.config import ConfigError, load_settings
from flowdecision.sinks.outbox import OutboxSink

from .helpers import RecordingSink
from .service_process import ROOT, ServiceProcess, wait_for
from .webhook_receiver import WebhookReceiver

TOKEN = "approvals-token-0123456789abcdef"
ADMIN = "approvals-admin-0123456789abcdef"


def _step(
    decision_id: str, run_id: str, name: str = "payments.charge", n: int = 1
) -> DecisionRequest:
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id=f"{decision_id}-cause",
        decision=ScheduleStep(DecisionStep(f"{decision_id}-s", name, {"n": n})),
    )


def _end(decision_id: str, run_id: str) -> DecisionRequest:
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id=f"{decision_id}-cause",
        decision=Complete(output={"ok": True}),
    )


def _uid() -> str:
    return uuid.uuid4().hex[:10]


def _held_body(decision_id: str) -> dict[str, Any]:
    """The one JSON shape of a held answer (a hold that never expires)."""
    return {
        "outcome": "held",
        "decision_id": decision_id,
        "attempt": None,
        "receipt": None,
        "state": "held",
        "hold_expires_at_ms": None,
    }


# -- the policy ----------------------------------------------------------------------


def test_the_policy_forms_each_hold_what_they_name() -> None:
    by_kind = ApprovalPolicy(kinds=["complete"])
    assert by_kind.needs_approval(_end("k", "r")) and not by_kind.needs_approval(_step("k", "r"))
    by_step = ApprovalPolicy(steps=("payments.*", "deploy"))
    assert by_step.needs_approval(_step("s", "r", "payments.refund"))
    assert by_step.needs_approval(_step("s", "r", "deploy"))
    assert not by_step.needs_approval(_step("s", "r", "deploy.preview"))
    assert not by_step.needs_approval(_end("s", "r"))
    several = DecisionRequest(
        decision_id="m",
        run_id="r",
        authority_branch_id="production",
        causation_event_id="c",
        decision=ScheduleSteps((DecisionStep("a", "fetch", 1), DecisionStep("b", "deploy", 2))),
    )
    assert by_step.needs_approval(several)  # any step of a schedule_steps
    by_run = ApprovalPolicy(runs="run-risky")
    assert by_run.needs_approval(_step("x", "run-risky", "fetch"))
    assert not by_run.needs_approval(_step("x", "run-other", "fetch"))

    def large(request: DecisionRequest) -> bool:
        decision = request.decision
        return isinstance(decision, ScheduleStep) and decision.step.input["n"] > 100

    by_predicate = ApprovalPolicy(predicate=large)
    assert by_predicate.needs_approval(_step("p", "r", "fetch", n=500))
    assert not by_predicate.needs_approval(_step("p", "r", "fetch", n=5))
    assert not ApprovalPolicy().enabled and ApprovalPolicy().hold_of(_end("n", "r")) is None
    held = ApprovalPolicy(kinds=("complete",), expire_ms=5000, reject_closes_run=True)
    terms = held.hold_of(_end("t", "r"))
    assert terms is not None and (terms.expire_ms, terms.reject_closes_run) == (5000, True)
    assert DecisionRequest.parse(terms.request.encode()) == _end("t", "r")
    assert by_predicate.to_dict() == {
        "kinds": [],
        "steps": [],
        "runs": [],
        "predicate": large.__qualname__,
        "expire_ms": None,
        "reject_closes_run": False,
    }
    assert held.to_dict()["kinds"] == ["complete"] and held.to_dict()["expire_ms"] == 5000


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"kinds": ["complete", "finish"]}, "unknown decision kind `finish`"),
        ({"steps": [""]}, "empty"),
        ({"expire_ms": 0}, "expire_ms"),
        ({"expire_ms": -5}, "expire_ms"),
    ],
)
def test_a_malformed_policy_is_refused_naming_the_problem(
    options: dict[str, Any], problem: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=problem):
        ApprovalPolicy(**options)


def test_the_service_settings_describe_the_policy(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        'approve_kinds = ["complete"]\napprove_steps = ["payments.*"]\nhold_expire_ms = 60000\n'
    )
    settings = load_settings(
        {"approve_runs": "run-a,run-b"},
        env={"FLOWDECISION_REJECT_CLOSES_RUN": "true"},
        config_file=str(config),
    )
    policy = settings.approval_policy()
    assert policy is not None
    assert (policy.kinds, policy.steps, policy.runs) == (
        ("complete",),
        ("payments.*",),
        ("run-a", "run-b"),
    )
    assert (policy.expire_ms, policy.reject_closes_run) == (60000, True)
    assert load_settings({}, env={}).approval_policy() is None
    with pytest.raises(ConfigError, match="unknown decision kind `nope`"):
        load_settings({}, env={"FLOWDECISION_APPROVE_KINDS": "nope"})


async def test_the_json_file_ledger_refuses_holds_with_a_clear_error(tmp_path: Path) -> None:
    ledger = JsonFileLedger(tmp_path)
    with pytest.raises(InvalidArgumentError, match="JSON file ledger is shared with Rust hosts"):
        Dispatcher("production", RecordingSink(), ledger, approvals=ApprovalPolicy(kinds=["fail"]))
    # A policy that holds nothing needs nothing of the ledger.
    Dispatcher("production", RecordingSink(), ledger, approvals=ApprovalPolicy())


# -- the library on every ledger that holds ------------------------------------------


class _Layout:
    """A ledger and a sink: the joint path (the outbox in the ledger's store) or not."""

    def __init__(self, ledger: Ledger, sink: Any, outbox: OutboxSink | None) -> None:
        self.ledger = ledger
        self.sink = sink
        self.outbox = outbox

    def dispatcher(self, policy: ApprovalPolicy | None, **options: Any) -> Dispatcher:
        return Dispatcher("production", self.sink, self.ledger, approvals=policy, **options)

    async def delivered(self, decision_id: str) -> int:
        """How many times the sink received ``decision_id`` (outbox rows, or calls)."""
        if self.outbox is not None:
            rows = await self.outbox.fetch(after=0, limit=1000)
            return sum(1 for row in rows if row.decision_id == decision_id)
        return sum(1 for called in self.sink.calls if called[0] == decision_id)


async def _pg_ledger(pg_url: str) -> PostgresLedger:
    return await PostgresLedger.connect(pg_url)


@pytest.fixture(
    params=["memory", "sqlite-outbox", "sqlite-sink", "postgres-outbox", "postgres-sink"]
)
async def layout(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[_Layout]:
    kind: str = request.param
    outbox: OutboxSink | None = None
    ledger: Ledger
    if kind == "memory":
        ledger = MemoryLedger(run_invariants=True)
    elif kind.startswith("sqlite"):
        ledger = await SqliteLedger.open(tmp_path / "store.db")
        if kind.endswith("outbox"):
            outbox = await OutboxSink(f"sqlite:///{tmp_path / 'store.db'}").open()
    else:
        pg_url = request.getfixturevalue("pg_url")
        ledger = await _pg_ledger(pg_url)
        if kind.endswith("outbox"):
            outbox = await OutboxSink(pg_url).open()
    sink = outbox if outbox is not None else RecordingSink()
    try:
        yield _Layout(ledger, sink, outbox)
    finally:
        if outbox is not None:
            await outbox.close()
        await ledger.close()


async def test_a_held_decision_reaches_nothing_until_approved_then_exactly_once(
    layout: _Layout,
) -> None:
    run = f"run-{_uid()}"
    held_id, free_id = f"held-{_uid()}", f"free-{_uid()}"
    dispatcher = layout.dispatcher(ApprovalPolicy(steps=["payments.*"]))
    assert dispatcher.joint == (layout.outbox is not None)
    first = await dispatcher.dispatch(_step(held_id, run))
    assert (first.outcome, first.held, first.submitted, first.attempt) == (
        "held",
        True,
        False,
        None,
    )
    assert first.to_dict() == _held_body(held_id)
    again = await dispatcher.dispatch(_step(held_id, run))  # the same decision again: held
    assert again.held
    with pytest.raises(DecisionConflictError):  # other content under the id: a conflict
        await dispatcher.dispatch(_step(held_id, run, n=2))
    assert (await dispatcher.dispatch(_step(free_id, run, "fetch"))).submitted  # not named
    assert await layout.delivered(held_id) == 0
    entry = await layout.ledger.lookup(held_id)
    assert entry is not None and entry.state == Held(None) and entry.attempts == 0
    assert entry.to_dict()["state"] == "held"
    record = await layout.ledger.read_record(held_id)
    assert record is not None and record.request is not None
    assert DecisionRequest.parse(record.request.encode()) == _step(held_id, run)
    page = await layout.ledger.list_decisions(DecisionQuery(run_id=run, state=DecisionState.HELD))
    assert [row.decision_id for row in page.decisions] == [held_id]
    assert page.decisions[0].to_dict()["hold_expires_at_ms"] is None

    approved = await dispatcher.approve(held_id, actor="ops@host", reason="looks right")
    assert approved.dispatch.submitted and approved.dispatch.attempt == 1
    assert approved.audit is not None
    assert (approved.audit.action, approved.audit.state_before, approved.audit.actor) == (
        "approve",
        "held",
        "ops@host",
    )
    assert approved.to_dict()["audit"] == approved.audit.to_dict()
    assert await layout.delivered(held_id) == 1
    # Approving again, or the agent's retry, delivers nothing more.
    twice = await dispatcher.approve(held_id, actor="other", reason="me too")
    assert (twice.dispatch.outcome, twice.audit) == ("duplicate", None)
    assert (await dispatcher.dispatch(_step(held_id, run))).outcome == "duplicate"
    assert await layout.delivered(held_id) == 1
    done = await layout.ledger.lookup(held_id)
    assert done is not None and done.state.kind == "completed" and done.attempts == 1
    report = await layout.ledger.verify_audit()
    assert report.ok
    approvals = [e for e in (await layout.ledger.audit(_audit_query(held_id))).entries]
    assert [e.action for e in approvals] == ["approve"]


def _audit_query(decision_id: str) -> Any:
    from flowdecision.ledger.query import AuditQuery

    return AuditQuery(decision_id=decision_id)


async def test_rejection_is_terminal_and_can_close_the_run(layout: _Layout) -> None:
    run = f"run-{_uid()}"
    held_id = f"rej-{_uid()}"
    policy = ApprovalPolicy(kinds=["complete"], reject_closes_run=True)
    dispatcher = layout.dispatcher(policy)
    assert (await dispatcher.dispatch(_end(held_id, run))).held
    entry = await layout.ledger.reject(held_id, actor="ops", reason="not yet")
    assert (entry.action, entry.state_before) == ("reject", "held")
    with pytest.raises(DecisionRejectedError) as caught:
        await dispatcher.dispatch(_end(held_id, run))
    assert caught.value.code == "decision_rejected" and caught.value.rejected_at_ms is not None
    looked = await layout.ledger.lookup(held_id)
    assert looked is not None and isinstance(looked.state, Rejected)
    assert looked.to_dict()["rejected_at_ms"] == caught.value.rejected_at_ms
    with pytest.raises(ActionRefusedError, match="only a held decision can be approved"):
        await dispatcher.approve(held_id, actor="ops", reason="changed my mind")
    with pytest.raises(ActionRefusedError, match="only a held decision can be rejected"):
        await layout.ledger.reject(held_id, actor="ops", reason="again")
    assert await layout.delivered(held_id) == 0
    # The policy said a rejection closes the run: nothing new of it is taken.
    state = await layout.ledger.run_state(run)
    assert (state.status, state.closed_by, state.terminal_kind) == (
        RunStatus.CLOSED,
        held_id,
        "rejected",
    )
    with pytest.raises(RunClosedError):
        await dispatcher.dispatch(_step(f"late-{_uid()}", run, "fetch"))
    # Forgetting a rejected decision frees its id (audited), as for a completed one.
    await layout.ledger.forget(held_id, actor="ops", reason="reuse the id")
    assert await layout.ledger.lookup(held_id) is None


async def test_a_rejection_closes_no_run_unless_the_policy_says_so(layout: _Layout) -> None:
    run = f"run-{_uid()}"
    dispatcher = layout.dispatcher(ApprovalPolicy(kinds=["complete"]))
    held_id = f"rej-{_uid()}"
    assert (await dispatcher.dispatch(_end(held_id, run))).held
    await layout.ledger.reject(held_id, actor="ops", reason="no")
    assert (await layout.ledger.run_state(run)).status is RunStatus.OPEN
    assert (await dispatcher.dispatch(_end(f"other-{_uid()}", run))).held  # another complete


async def test_holds_expire_into_rejections_audited(layout: _Layout) -> None:
    run = f"run-{_uid()}"
    policy = ApprovalPolicy(kinds=["complete"], steps=["payments.*"], expire_ms=150)
    dispatcher = layout.dispatcher(policy)
    late, swept, kept = f"late-{_uid()}", f"swept-{_uid()}", f"kept-{_uid()}"
    first = await dispatcher.dispatch(_step(late, run))
    assert first.held and first.hold_expires_at_ms is not None
    assert (await dispatcher.dispatch(_step(swept, run))).held
    await asyncio.sleep(0.3)
    # An approval that comes too late rejects the decision instead (audited: expire).
    with pytest.raises(ActionRefusedError, match="hold expired"):
        await dispatcher.approve(late, actor="ops", reason="too late")
    assert (await layout.ledger.audit(_audit_query(late))).entries[-1].action == "expire"
    forever = layout.dispatcher(ApprovalPolicy(kinds=["complete"]))  # no expiry
    assert (await forever.dispatch(_end(kept, run))).held
    expired = await layout.ledger.expire_holds()
    assert [entry.decision_id for entry in expired] == [swept]
    assert (expired[0].action, expired[0].actor) == ("expire", "flowdecision")
    for gone in (late, swept):
        with pytest.raises(DecisionRejectedError):
            await dispatcher.dispatch(_step(gone, run))
        assert await layout.delivered(gone) == 0
    looked = await layout.ledger.lookup(kept)
    assert looked is not None and isinstance(looked.state, Held)
    assert (await layout.ledger.expire_holds()) == []
    assert (await layout.ledger.verify_audit()).ok


async def test_holds_keep_the_run_invariants(layout: _Layout) -> None:
    run = f"run-{_uid()}"
    dispatcher = layout.dispatcher(ApprovalPolicy(steps=["payments.*"]))
    step_id = f"step-{_uid()}"
    assert (await dispatcher.dispatch(_step(step_id, run))).held
    assert (await dispatcher.dispatch(_end(f"end-{_uid()}", run))).submitted  # closes the run
    with pytest.raises(RunClosedError):  # a new hold of a closed run is refused, not held
        await dispatcher.dispatch(_step(f"new-{_uid()}", run))
    with pytest.raises(RunClosedError):  # and an approval of a hold made before the close
        await dispatcher.approve(step_id, actor="ops", reason="after the close")
    looked = await layout.ledger.lookup(step_id)
    assert looked is not None and isinstance(looked.state, Held)  # still held: reject it
    await layout.ledger.reject(step_id, actor="ops", reason="the run is over")
    assert await layout.delivered(step_id) == 0


async def test_an_approval_and_a_rejection_racing_one_wins(layout: _Layout) -> None:
    dispatcher = layout.dispatcher(ApprovalPolicy(steps=["payments.*"]))
    ids = [f"duel-{index}-{_uid()}" for index in range(6)]
    for decision_id in ids:
        assert (await dispatcher.dispatch(_step(decision_id, f"run-{_uid()}"))).held
    for decision_id in ids:
        approved, rejected = await asyncio.gather(
            dispatcher.approve(decision_id, actor="a", reason="yes"),
            layout.ledger.reject(decision_id, actor="b", reason="no"),
            return_exceptions=True,
        )
        # Exactly one acts; the other is refused for the state the first left.
        assert isinstance(approved, ActionRefusedError) != isinstance(rejected, ActionRefusedError)
        state = await layout.ledger.lookup(decision_id)
        assert state is not None
        if isinstance(approved, ActionRefusedError):
            assert isinstance(state.state, Rejected) and await layout.delivered(decision_id) == 0
        else:
            assert state.state.kind == "completed" and await layout.delivered(decision_id) == 1
    assert (await layout.ledger.verify_audit()).ok


async def test_unknown_and_never_held_decisions_are_refused(layout: _Layout) -> None:
    dispatcher = layout.dispatcher(ApprovalPolicy(steps=["payments.*"]))
    with pytest.raises(UnknownDecisionError):
        await dispatcher.approve(f"nobody-{_uid()}", actor="ops", reason="r")
    with pytest.raises(UnknownDecisionError):
        await layout.ledger.reject(f"nobody-{_uid()}", actor="ops", reason="r")
    free = f"free-{_uid()}"
    assert (await dispatcher.dispatch(_step(free, f"run-{_uid()}", "fetch"))).submitted
    with pytest.raises(ActionRefusedError):
        await layout.ledger.reject(free, actor="ops", reason="not held")
    held = f"held-{_uid()}"
    assert (await dispatcher.dispatch(_step(held, f"run-{_uid()}"))).held
    with pytest.raises(ActionRefusedError, match="held"):  # forget refuses a held decision
        await layout.ledger.forget(held, actor="ops", reason="r")
    with pytest.raises(Exception, match="actor"):
        await layout.ledger.reject(held, actor=" ", reason="r")


async def test_a_dispatcher_without_the_policy_still_answers_held(layout: _Layout) -> None:
    """A held decision is held for every dispatcher: one without the policy (another
    replica, an older config) answers ``held`` too and sends nothing."""
    held = f"held-{_uid()}"
    run = f"run-{_uid()}"
    assert (
        await layout.dispatcher(ApprovalPolicy(steps=["payments.*"])).dispatch(_step(held, run))
    ).held
    plain = layout.dispatcher(None)
    assert (await plain.dispatch(_step(held, run))).held
    assert await layout.delivered(held) == 0


# -- a SQLite ledger from before the holds upgrades ------------------------------------


MIGRATION_8 = ROOT / "src" / "flowdecision" / "ledger" / "sql" / "sqlite" / "0008_holds.sql"


def _back_to_schema_7(path: Path) -> None:
    """Make a current SQLite ledger what schema 7 left: the claims table's CHECK
    without the hold states (rebuilt as migration 8 does, without them), version 7."""
    script = MIGRATION_8.read_text().replace(", 'held', 'rejected'", "")
    with sqlite3.connect(path) as conn:
        conn.executescript(script)
        conn.execute("DELETE FROM flowdecision_schema_version WHERE version > 7")
        conn.execute("PRAGMA user_version = 7")
        sql = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'flowdecision_claims'"
        ).fetchone()[0]
        assert "'held'" not in sql


async def test_a_schema_7_sqlite_ledger_upgrades_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    async with await SqliteLedger.open(path) as ledger:
        assert (
            await Dispatcher("production", RecordingSink(), ledger).dispatch(_step("o", "r"))
        ).submitted
    _back_to_schema_7(path)
    async with await SqliteLedger.open(path) as ledger:
        assert ledger.version_at_open == 7 and await ledger.schema_version() == 8
        looked = await ledger.lookup("o")
        assert looked is not None and looked.state.kind == "completed"
        dispatcher = Dispatcher(
            "production", RecordingSink(), ledger, approvals=ApprovalPolicy(steps=["payments.*"])
        )
        assert (await dispatcher.dispatch(_step("n", "r"))).held
    conn = sqlite3.connect(path)
    try:
        names = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        }
        assert {
            "flowdecision_claims_state",
            "flowdecision_claims_lease",
            "flowdecision_claims_run",
        } <= names
    finally:
        conn.close()


# -- racing processes, SIGKILL -----------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> list[str]:
    return [sys.executable, "-m", "flowdecision.cli", *args]


def _env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    return {**base, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


async def _hold_many(ledger: Ledger, sink: Any, run: str, count: int) -> list[str]:
    dispatcher = Dispatcher(
        "production", sink, ledger, approvals=ApprovalPolicy(steps=["payments.*"])
    )
    ids = [f"{run}-d{index:03d}" for index in range(count)]
    for decision_id in ids:
        assert (await dispatcher.dispatch(_step(decision_id, run))).held
    return ids


def _hold_in_default_layout(store: Path, run: str, count: int) -> list[str]:
    """``count`` held decisions of ``run`` in a SQLite file holding ledger and outbox."""

    async def seed() -> list[str]:
        async with await SqliteLedger.open(store) as ledger:
            outbox = await OutboxSink(f"sqlite:///{store}").open()
            try:
                return await _hold_many(ledger, outbox, run, count)
            finally:
                await outbox.close()

    return asyncio.run(seed())


async def _outbox_rows(url: str) -> list[Any]:
    """Every row of the outbox at ``url``, page after page."""
    outbox = await OutboxSink(url).open()
    rows: list[Any] = []
    try:
        while True:
            page = await outbox.fetch(after=rows[-1].seq if rows else 0, limit=1000)
            rows += page
            if len(page) < 1000:
                return rows
    finally:
        await outbox.close()


def _race(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    procs = [
        subprocess.Popen(
            cmd, env=_env(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd in commands
    ]
    done = []
    for proc, cmd in zip(procs, commands, strict=True):
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


def test_two_processes_approving_at_once_deliver_each_decision_once_into_the_outbox(
    tmp_path: Path,
) -> None:
    """The default layout (ledger and outbox in one SQLite file): two operators approve a
    run's 40 held decisions in bulk at the same moment, and the same one by id."""
    store = tmp_path / "flowdecision.db"
    url = f"sqlite:///{store}"

    ids = _hold_in_default_layout(store, "run-race", 40)
    bulk = ["approve", "--ledger", url, "--run", "run-race", "--yes", "--reason", "race", "--json"]
    one = ["approve", "--ledger", url, ids[7], "--reason", "race", "--json"]
    results = _race(
        [_cli(*bulk, "--actor", "ops-a"), _cli(*bulk, "--actor", "ops-b"), _cli(*one)], tmp_path
    )
    for result in results:
        assert result.returncode in (0, 3), result.stderr  # 3: a decision the other took
    approved = [entry for result in results for entry in json.loads(result.stdout)["audit"]]
    assert sorted(entry["decision_id"] for entry in approved) == sorted(ids)  # once each

    async def check() -> None:
        rows = await _outbox_rows(url)
        assert sorted(row.decision_id for row in rows) == sorted(ids)
        assert all(row.first_attempt == row.highest_attempt == 1 for row in rows)
        async with await SqliteLedger.open(store) as ledger:
            page = await ledger.list_decisions(DecisionQuery(run_id="run-race", limit=1000))
            assert {row.state for row in page.decisions} == {DecisionState.COMPLETED}
            assert (await ledger.verify_audit()).ok

    asyncio.run(check())


async def _truncate_pg(pg_url: str, run: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("DELETE FROM flowdecision_claims WHERE run_id = $1", run)
    finally:
        await conn.close()


def test_two_processes_approving_into_a_webhook_deliver_once(pg_url: str, tmp_path: Path) -> None:
    """PostgreSQL ledger, a webhook sink (a real local receiver): the approval claims
    under the lease, the sink runs, completion follows; two racing operators and the
    same decision approved by both deliver each decision once."""
    run = f"run-hook-{_uid()}"

    async def seed() -> list[str]:
        async with await PostgresLedger.connect(pg_url) as ledger:
            return await _hold_many(ledger, RecordingSink(), run, 12)

    ids = asyncio.run(seed())
    with WebhookReceiver() as receiver:
        receiver.delay_s = 0.05
        args = ["approve", "--ledger", pg_url, "--sink", receiver.url, "--run", run, "--yes",
                "--reason", "race", "--json"]  # fmt: skip
        results = _race([_cli(*args), _cli(*args)], tmp_path)
        for result in results:
            assert result.returncode in (0, 3), result.stderr
        keys = [headers.get("Idempotency-Key") for _path, headers, _body in receiver.requests]
    assert sorted(keys) == sorted(ids)  # every decision exactly once
    approved = [entry for result in results for entry in json.loads(result.stdout)["audit"]]
    assert sorted(entry["decision_id"] for entry in approved) == sorted(ids)


def test_an_approval_racing_sigkill_delivers_once_into_the_outbox(tmp_path: Path) -> None:
    """A bulk approval is SIGKILLed mid-way, then run again: every decision lands in the
    outbox exactly once (each approval is one transaction: claim, row and audit)."""
    store = tmp_path / "flowdecision.db"
    url = f"sqlite:///{store}"

    ids = _hold_in_default_layout(store, "run-kill", 150)
    args = ["approve", "--ledger", url, "--run", "run-kill", "--yes", "--reason", "kill"]
    victim = subprocess.Popen(
        _cli(*args), env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )

    def some_approved() -> bool:
        conn = sqlite3.connect(store, timeout=30)
        try:
            return bool(
                conn.execute(
                    "SELECT count(*) FROM flowdecision_audit WHERE action = 'approve'"
                ).fetchone()[0]
            )
        finally:
            conn.close()

    wait_for(some_approved, timeout=120, interval=0.005)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    assert victim.returncode == -signal.SIGKILL
    again = subprocess.run(
        _cli(*args, "--json"), env=_env(), cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert again.returncode in (0, 3), again.stderr

    async def check() -> None:
        rows = await _outbox_rows(url)
        assert sorted(row.decision_id for row in rows) == sorted(ids)  # once each
        async with await SqliteLedger.open(store) as ledger:
            entries = []
            for decision_id in ids:
                entries += [
                    e
                    for e in (await ledger.audit(_audit_query(decision_id))).entries
                    if e.action == "approve"
                ]
            assert sorted(e.decision_id for e in entries) == sorted(ids)  # one approval each

    asyncio.run(check())


_KILLED_APPROVER = """
import asyncio, sys
from flowdecision import Dispatcher, PostgresLedger
from flowdecision.sinks.webhook import WebhookSink

async def main():
    ledger = await PostgresLedger.connect(sys.argv[1])
    dispatcher = Dispatcher("production", WebhookSink(sys.argv[2]), ledger, lease_ms=1500)
    await dispatcher.approve(sys.argv[3], actor="victim", reason="killed mid-way")

asyncio.run(main())
"""


def test_an_approval_killed_mid_delivery_is_taken_over_by_the_next(pg_url: str) -> None:
    """A webhook approval SIGKILLed while the receiver holds its request: approving again
    waits out the dead approver's lease, takes over (attempt 2) and completes; both
    deliveries carry the same Idempotency-Key, so the receiver applies it once."""
    run = f"run-kill-{_uid()}"
    decision_id = f"{run}-d"

    async def seed() -> None:
        async with await PostgresLedger.connect(pg_url) as ledger:
            dispatcher = Dispatcher(
                "production", RecordingSink(), ledger, approvals=ApprovalPolicy(runs=[run])
            )
            assert (await dispatcher.dispatch(_step(decision_id, run))).held

    asyncio.run(seed())
    with WebhookReceiver() as receiver:
        receiver.delay_s = 5.0
        victim = subprocess.Popen(
            [sys.executable, "-c", _KILLED_APPROVER, pg_url, receiver.url, decision_id],
            env=_env(),
        )
        wait_for(lambda: receiver.in_flight == 1, timeout=60)
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        receiver.delay_s = 0.0

        async def approve_again() -> Any:
            from flowdecision.sinks.webhook import WebhookSink

            async with await PostgresLedger.connect(pg_url) as ledger:
                sink = WebhookSink(receiver.url)
                try:
                    dispatcher = Dispatcher("production", sink, ledger, lease_ms=1500)
                    outcome = await dispatcher.approve(decision_id, actor="ops", reason="again")
                    entry = await ledger.lookup(decision_id)
                    return outcome, entry
                finally:
                    await sink.close()

        outcome, entry = asyncio.run(approve_again())
        wait_for(lambda: len(receiver.requests) == 2, timeout=30)
        keys = {headers.get("Idempotency-Key") for _path, headers, _body in receiver.requests}
    assert outcome.dispatch.submitted and outcome.dispatch.attempt == 2
    assert outcome.audit is not None and outcome.audit.state_before in (
        "pending_expired",
        "pending_live",
    )
    assert entry is not None and entry.state.kind == "completed" and entry.attempts == 2
    assert keys == {decision_id}


# -- the service, both clients and the CLI ---------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(
        tmp_path_factory.mktemp("approvals"),
        "--approve-steps",
        "payments.*",
        "--approve-kinds",
        "fail",
        token=TOKEN,
        env={"FLOWDECISION_ADMIN_TOKEN": ADMIN, "FLOWDECISION_REJECT_CLOSES_RUN": "true"},
    ) as proc:
        yield proc


def _post(service: ServiceProcess, request: DecisionRequest) -> requests.Response:
    return requests.post(
        f"{service.url}/v1/decisions", data=request.to_json(), headers=service.headers, timeout=30
    )


def _admin(service: ServiceProcess, action: str, body: dict[str, str]) -> requests.Response:
    return requests.post(
        f"{service.url}/v1/actions/{action}",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    )


def test_the_service_answers_202_held_and_approves_over_http(service: ServiceProcess) -> None:
    run = f"run-{_uid()}"
    held_id = f"h-{_uid()}"
    first = _post(service, _step(held_id, run))
    assert first.status_code == 202, first.text
    assert first.json() == _held_body(held_id)
    again = _post(service, _step(held_id, run))
    assert (again.status_code, again.json()["outcome"]) == (202, "held")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    state = requests.get(f"{service.url}/v1/decisions/{held_id}", headers=auth, timeout=30)
    assert state.json()["state"] == "held" and state.json()["hold_expires_at_ms"] is None
    outbox = requests.get(f"{service.url}/v1/outbox", headers=auth, timeout=30).json()
    assert held_id not in [entry["decision_id"] for entry in outbox["entries"]]
    # The submit token is no admin token.
    refused = requests.post(
        f"{service.url}/v1/actions/approve",
        json={"decision_id": held_id, "actor": "a", "reason": "r"},
        headers=auth,
        timeout=30,
    )
    assert refused.status_code == 403
    approved = _admin(service, "approve", {"decision_id": held_id, "actor": "ops", "reason": "ok"})
    assert approved.status_code == 200, approved.text
    body = approved.json()
    assert (body["outcome"], body["attempt"], body["audit"]["action"]) == (
        "submitted",
        1,
        "approve",
    )
    outbox = requests.get(f"{service.url}/v1/outbox", headers=auth, timeout=30).json()
    assert [e["decision_id"] for e in outbox["entries"]].count(held_id) == 1
    twice = _admin(service, "approve", {"decision_id": held_id, "actor": "ops", "reason": "ok"})
    assert (twice.json()["outcome"], twice.json()["audit"]) == ("duplicate", None)
    duplicate = _post(service, _step(held_id, run))
    assert (duplicate.status_code, duplicate.json()["outcome"]) == (200, "duplicate")
    missing = _admin(service, "approve", {"decision_id": "nobody", "actor": "o", "reason": "r"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    both = _admin(
        service, "approve", {"decision_id": "x", "run_id": "y", "actor": "o", "reason": "r"}
    )
    assert (both.status_code, both.json()["error"]["code"]) == (422, "invalid_action")


def test_the_service_rejects_in_bulk_and_answers_409_rejected(service: ServiceProcess) -> None:
    run = f"run-{_uid()}"
    ids = [f"b-{index}-{_uid()}" for index in range(3)]
    for decision_id in ids:
        assert _post(service, _step(decision_id, run)).status_code == 202
    free = f"free-{_uid()}"
    assert _post(service, _step(free, run, "fetch")).status_code == 201
    answer = _admin(service, "reject", {"run_id": run, "actor": "ops", "reason": "bulk"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["action"] == "reject" and body["refused"] == []
    assert sorted(entry["decision_id"] for entry in body["audit"]) == sorted(ids)
    late = _post(service, _step(ids[0], run))
    assert late.status_code == 409
    error = late.json()["error"]
    assert (error["code"], error["decision_id"]) == ("decision_rejected", ids[0])
    assert isinstance(error["rejected_at_ms"], int)
    # REJECT_CLOSES_RUN: the run closed with its first rejection.
    closed = _post(service, _step(f"after-{_uid()}", run, "fetch"))
    assert (closed.status_code, closed.json()["error"]["code"]) == (409, "run_closed")


def test_both_clients_approve_reject_and_wait(service: ServiceProcess) -> None:
    from flowdecision.client import DecisionClient, SyncDecisionClient
    from flowdecision.client.errors import ServiceDecisionRejectedError
    from flowdecision.client.results import Outcome

    run = f"run-{_uid()}"
    waited_id, rejected_id = f"w-{_uid()}", f"r-{_uid()}"
    with SyncDecisionClient(service.url, token=TOKEN) as client:
        submitted = client.submit(_step(waited_id, run))
        assert (submitted.outcome, submitted.held, submitted.attempt) == (Outcome.HELD, True, None)
        assert submitted.to_dict()["state"] == "held"
        started = time.monotonic()
        still = client.wait(waited_id, timeout=0.5)  # nobody acts: back at the timeout
        assert still is not None and still.held and time.monotonic() - started >= 0.4
        assert client.wait("nobody-at-all", timeout=1) is None

    async def approve_later() -> None:
        await asyncio.sleep(0.5)
        async with DecisionClient(service.url, token=TOKEN) as admin:
            result = await admin.approve(waited_id, actor="ops", reason="ok", admin_token=ADMIN)
            assert result.decision.submitted and result.audit is not None
            assert result.to_dict()["audit"] == result.audit.to_dict()

    async def wait_for_approval() -> Any:
        async with DecisionClient(service.url, token=TOKEN) as client:
            waiting = asyncio.ensure_future(client.wait(waited_id, timeout=20))
            await approve_later()
            return await waiting

    state = asyncio.run(wait_for_approval())
    assert state is not None and state.completed and state.attempts == 1

    with SyncDecisionClient(service.url, token=TOKEN) as client:
        assert client.submit(_end(rejected_id, f"run-{_uid()}")).held is False  # not named
        failing = DecisionRequest(
            decision_id=rejected_id + "-f",
            run_id=f"run-{_uid()}",
            authority_branch_id="production",
            causation_event_id="c",
            decision=__import__("flowdecision.core.model", fromlist=["Fail"]).Fail(error="x"),
        )
        assert client.submit(failing).held  # approve_kinds = fail
        entry = client.reject(failing.decision_id, actor="ops", reason="no", admin_token=ADMIN)
        assert (entry.action, entry.decision_id) == ("reject", failing.decision_id)
        after = client.wait(failing.decision_id, timeout=5)
        assert after is not None and after.state == "rejected" and after.rejected_at_ms
        with pytest.raises(ServiceDecisionRejectedError) as caught:
            client.submit(failing)
    assert isinstance(caught.value, DecisionRejectedError) and caught.value.tries == 1


def test_the_cli_approves_and_rejects_by_id_and_by_run(tmp_path: Path) -> None:
    """In a directory of the default layout, with no --ledger and no --sink: the
    approval lands in the outbox `serve` would deliver to (the same file)."""
    store = tmp_path / ".flowdecision" / "flowdecision.db"
    ids = _hold_in_default_layout(store, "run-cli", 4)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _cli(*args, "--reason", "cli"), env=_env(), cwd=tmp_path, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip

    one = cli("approve", ids[0], "--actor", "me")
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith(f"approved `{ids[0]}` (was held, attempts 1); audit #1")
    rows = asyncio.run(_outbox_rows(f"sqlite:///{store}"))
    assert [row.decision_id for row in rows] == [ids[0]]
    preview = cli("reject", "--run", "run-cli")  # the held ones only
    assert preview.returncode == 2 and "3 decision(s) match; nothing was done" in preview.stdout
    rejected = cli("reject", "--run", "run-cli", "--yes", "--json")
    assert rejected.returncode == 0, rejected.stderr  # the approved one is no match
    body = json.loads(rejected.stdout)
    assert sorted(e["decision_id"] for e in body["audit"]) == sorted(ids[1:])
    assert body["refused"] == []
    told = cli("reject", "--run", "run-cli", "--state", "completed", "--yes", "--json")
    assert told.returncode == 3  # asked for the completed one: refused, listed
    assert [item["decision_id"] for item in json.loads(told.stdout)["refused"]] == [ids[0]]
    again = cli("approve", ids[1])
    assert again.returncode == 3 and "rejected" in again.stderr


def test_the_service_expires_holds_by_itself(tmp_path: Path) -> None:
    from flowdecision.client import SyncDecisionClient

    with (
        ServiceProcess(
            tmp_path, "--approve-kinds", "complete", "--hold-expire-ms", "300", token=TOKEN
        ) as proc,
        SyncDecisionClient(proc.url, token=TOKEN) as client,
    ):
        held = client.submit(_end("exp-1", "run-exp"))
        assert held.held and held.hold_expires_at_ms is not None
        state = client.wait("exp-1", timeout=20)
        assert state is not None and state.state == "rejected", state
        page = client.audit(decision_id="exp-1")
        assert [(e.action, e.actor) for e in page.entries] == [("expire", "flowdecision")]
        health = client.health().snapshot
        assert health["duplicates"] == 0  # a held answer is no duplicate


def test_a_json_file_ledger_with_an_approval_setting_is_refused_at_start(tmp_path: Path) -> None:
    done = subprocess.run(
        _cli("serve", "--port", "0", "--ledger", str(tmp_path / "files"),
             "--sink", f"sqlite:///{tmp_path / 'outbox.db'}",
             "--approve-kinds", "fail"),
        env=_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    assert "JSON file ledger" in done.stderr and "approve_kinds" in done.stderr, done.stderr


def test_the_service_approves_a_run_in_bulk_into_a_webhook(tmp_path: Path) -> None:
    """``serve`` with a webhook sink: held decisions reach the receiver only when approved
    (the approval claims under the lease, the sink runs, completion follows), once each."""
    run = f"run-{_uid()}"
    with (
        WebhookReceiver() as receiver,
        ServiceProcess(
            tmp_path,
            "--ledger",
            f"sqlite:///{tmp_path / 'ledger.db'}",
            "--sink",
            receiver.url,
            "--approve-runs",
            run,
            token=TOKEN,
            env={"FLOWDECISION_ADMIN_TOKEN": ADMIN},
        ) as proc,
    ):
        ids = [f"{run}-{index}" for index in range(5)]
        for decision_id in ids:
            assert _post(proc, _step(decision_id, run, "fetch")).status_code == 202
        other = _post(proc, _step(f"other-{_uid()}", f"run-{_uid()}", "fetch"))
        assert other.status_code == 201  # not in the policy's runs
        assert len(receiver.requests) == 1
        answer = _admin(proc, "approve", {"run_id": run, "actor": "ops", "reason": "bulk"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["refused"] == [] and body["action"] == "approve"
        assert sorted(item["decision_id"] for item in body["outcomes"]) == sorted(ids)
        assert {item["outcome"] for item in body["outcomes"]} == {"submitted"}
        assert sorted(entry["decision_id"] for entry in body["audit"]) == sorted(ids)
        again = _admin(proc, "approve", {"run_id": run, "actor": "ops", "reason": "again"})
        assert again.json()["outcomes"] == []  # nothing is held any more
        keys = [headers.get("Idempotency-Key") for _p, headers, _b in receiver.requests[1:]]
    assert sorted(keys) == sorted(ids)


def test_both_clients_act_on_a_run_in_bulk(service: ServiceProcess) -> None:
    from flowdecision.client import BulkActionResult, DecisionClient, SyncDecisionClient

    approved_run, rejected_run = f"run-{_uid()}", f"run-{_uid()}"
    with SyncDecisionClient(service.url, token=TOKEN) as client:
        for index in range(3):
            assert client.submit(_step(f"{approved_run}-{index}", approved_run)).held
            assert client.submit(_step(f"{rejected_run}-{index}", rejected_run)).held
        done = client.approve_run(approved_run, actor="ops", reason="ok", admin_token=ADMIN)
    assert isinstance(done, BulkActionResult) and done.action == "approve"
    assert sorted(o.decision.decision_id for o in done.outcomes) == [
        f"{approved_run}-{index}" for index in range(3)
    ]
    assert all(o.decision.submitted and o.audit is not None for o in done.outcomes)
    assert done.refused == () and len(done.audit) == 3
    assert done.to_dict()["outcomes"][0]["audit"] == done.outcomes[0].audit.to_dict()  # type: ignore[union-attr]

    async def reject() -> BulkActionResult:
        async with DecisionClient(service.url, token=TOKEN) as client:
            return await client.reject_run(
                rejected_run, actor="ops", reason="no", admin_token=ADMIN
            )

    rejected = asyncio.run(reject())
    assert (rejected.action, rejected.outcomes, len(rejected.audit)) == ("reject", (), 3)
    assert {entry.action for entry in rejected.audit} == {"reject"}
    assert "outcomes" not in rejected.to_dict()


def test_two_processes_approving_at_once_on_postgres_deliver_once_into_its_outbox(
    pg_url: str, tmp_path: Path
) -> None:
    """The joint path on PostgreSQL (the outbox in the ledger's database): two bulk
    approvals of one run racing, each decision in the outbox once."""
    run = f"run-pgo-{_uid()}"

    async def seed() -> list[str]:
        async with await PostgresLedger.connect(pg_url) as ledger:
            outbox = await OutboxSink(pg_url).open()
            try:
                return await _hold_many(ledger, outbox, run, 30)
            finally:
                await outbox.close()

    ids = asyncio.run(seed())
    args = ["approve", "--ledger", pg_url, "--run", run, "--yes", "--reason", "race", "--json"]
    results = _race([_cli(*args, "--actor", "ops-a"), _cli(*args, "--actor", "ops-b")], tmp_path)
    for result in results:
        assert result.returncode in (0, 3), result.stderr
    approved = [entry for result in results for entry in json.loads(result.stdout)["audit"]]
    assert sorted(entry["decision_id"] for entry in approved) == sorted(ids)
    rows = [row for row in asyncio.run(_outbox_rows(pg_url)) if row.decision_id in set(ids)]
    assert sorted(row.decision_id for row in rows) == sorted(ids)
    assert all(row.first_attempt == row.highest_attempt == 1 for row in rows)


def test_the_service_acts_in_bulk_by_query(service: ServiceProcess) -> None:
    run = f"run-{_uid()}"
    ids = [f"q-{index}-{_uid()}" for index in range(2)]
    for decision_id in ids:
        assert _post(service, _step(decision_id, run)).status_code == 202
    none = _admin(service, "approve", {"run_id": run, "before": 1, "actor": "o", "reason": "r"})
    assert (none.status_code, none.json()["outcomes"]) == (200, [])  # held long after 1 ms
    since = _admin(service, "approve", {"run_id": run, "after": 0, "actor": "o", "reason": "r"})
    assert since.status_code == 200, since.text
    assert sorted(item["decision_id"] for item in since.json()["outcomes"]) == sorted(ids)
    bad = _admin(service, "approve", {"after": "yesterday", "actor": "o", "reason": "r"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (422, "invalid_action")
    both = _admin(
        service, "reject", {"decision_id": ids[0], "after": 0, "actor": "o", "reason": "r"}
    )
    assert (both.status_code, both.json()["error"]["code"]) == (422, "invalid_action")


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_an_outbox_row_of_other_content_refuses_the_approval_and_keeps_the_hold(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The outbox already holds other content under the decision's id (written by a
    dispatcher on another ledger): the approval's transaction rolls back whole -- no
    claim, no audit entry -- and the decision stays held."""
    url = (
        f"sqlite:///{tmp_path / 'store.db'}"
        if kind == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    ledger: Ledger = (
        await SqliteLedger.open(tmp_path / "store.db")
        if kind == "sqlite"
        else await PostgresLedger.connect(url)
    )
    outbox = await OutboxSink(url).open()
    try:
        decision_id, run = f"clash-{_uid()}", f"run-{_uid()}"
        held = Dispatcher("production", outbox, ledger, approvals=ApprovalPolicy(runs=[run]))
        assert (await held.dispatch(_step(decision_id, run))).held
        elsewhere = Dispatcher("production", outbox, MemoryLedger())  # not joint: a plain submit
        assert (await elsewhere.dispatch(_step(decision_id, run, n=2))).submitted
        with pytest.raises(SinkConflictError):
            await held.approve(decision_id, actor="ops", reason="r")
        looked = await ledger.lookup(decision_id)
        assert looked is not None and isinstance(looked.state, Held)
        assert (await ledger.audit(_audit_query(decision_id))).entries == ()
    finally:
        await outbox.close()
        await ledger.close()


async def test_a_schema_7_postgres_ledger_takes_holds_after_migrate(pg_empty_url: str) -> None:
    await PostgresLedger(pg_empty_url).migrate()
    conn = await asyncpg.connect(pg_empty_url)
    try:  # back to schema 7: the status constraint without the hold states
        await conn.execute(
            "ALTER TABLE flowdecision_claims DROP CONSTRAINT flowdecision_claims_status_check"
        )
        await conn.execute(
            "ALTER TABLE flowdecision_claims ADD CONSTRAINT flowdecision_claims_status_check "
            "CHECK (status IN ('pending', 'completed', 'tombstone'))"
        )
        await conn.execute("DELETE FROM flowdecision_schema_version WHERE version > 7")
    finally:
        await conn.close()
    with pytest.raises(LedgerSchemaError):
        await PostgresLedger.connect(pg_empty_url)  # PostgreSQL migrates only when asked
    before, after = await PostgresLedger(pg_empty_url).migrate()
    assert (before, after) == (7, 8)
    async with await PostgresLedger.connect(pg_empty_url) as ledger:
        dispatcher = Dispatcher(
            "production", RecordingSink(), ledger, approvals=ApprovalPolicy(kinds=["complete"])
        )
        assert (await dispatcher.dispatch(_end("pg7", "run-pg7"))).held
        await ledger.reject("pg7", actor="ops", reason="upgraded")
        looked = await ledger.lookup("pg7")
        assert looked is not None and isinstance(looked.state, Rejected)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
async def test_holds_without_the_run_invariants(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The seed-compatible setting (no run records): the claim rules alone hold, approve
    and reject; a rejection closes nothing."""
    ledger: Ledger
    if kind == "memory":
        ledger = MemoryLedger()
    elif kind == "sqlite":
        ledger = await SqliteLedger.open(tmp_path / "ledger.db", run_invariants=False)
    else:
        ledger = await PostgresLedger.connect(
            request.getfixturevalue("pg_url"), run_invariants=False
        )
    sink = RecordingSink()
    try:
        assert not ledger.run_invariants
        policy = ApprovalPolicy(kinds=["complete"], reject_closes_run=True)
        dispatcher = Dispatcher("production", sink, ledger, approvals=policy)
        run = f"run-{_uid()}"
        kept, dropped = f"k-{_uid()}", f"d-{_uid()}"
        assert (await dispatcher.dispatch(_end(kept, run))).held
        assert (await dispatcher.dispatch(_end(dropped, run))).held  # no terminal slot
        page = await ledger.list_decisions(DecisionQuery(run_id=run, state=DecisionState.HELD))
        assert sorted(row.decision_id for row in page.decisions) == sorted([kept, dropped])
        assert (await dispatcher.approve(kept, actor="ops", reason="ok")).dispatch.submitted
        await ledger.reject(dropped, actor="ops", reason="no")
        assert sink.ids == [kept]
        assert (await ledger.run_state(run)).status is RunStatus.OPEN
    finally:
        await ledger.close()
