"""``flowdecision chaos --approvals N``: operators approve held decisions in bulk while
they are SIGKILLed, and each held decision must be delivered once and approved once.

After the dispatchers' run, the harness proposes ``N`` new decisions in
:data:`APPROVAL_RUNS` runs of their own that an :class:`ApprovalPolicy` holds
(each answered ``held``: nothing reaches the outbox). Then, round after round,
:data:`OPERATORS` operator processes per run with held decisions approve that
run in bulk at once (``flowdecision approve --run R --yes``, racing each
other), and up to :data:`KILLS_PER_ROUND` of them are SIGKILLed at random
moments (at most :data:`MAX_APPROVAL_KILLS` in all). A decision an approval claimed but a
kill left pending (the claim, sink, complete path of a ``separate`` layout) is
approved again by id, which takes it over once its lease expires. Rounds go on
until no decision is held or pending.

The checks: every held decision is completed in the ledger and has its one
row in the outbox (nothing lost); each has exactly one ``approve`` audit entry
made from the ``held`` state (two racing operators never both approve; a
killed approval left no half: the approval, the claim and the outbox row are
one transaction on the shared layout); the audit trail's hash chain verifies.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..core.approvals import ApprovalPolicy
from ..core.dispatcher import Dispatcher
from ..core.model import DecisionRequest, DecisionStep, ScheduleStep
from ..ledger.machine import ClaimStatus
from ..ledger.opening import open_ledger
from ..ledger.query import AuditQuery
from ..sinks.outbox import OutboxSink
from .config import BRANCH, ChaosConfig

__all__ = ["APPROVAL_RUNS", "approval_ids", "run_approval_phase"]

#: Runs the held decisions are spread over (each approved in bulk by its own operators).
APPROVAL_RUNS = 4
#: Operator processes approving one run at once, in each round.
OPERATORS = 2
#: Operators SIGKILLed in all before the rounds are left to finish.
MAX_APPROVAL_KILLS = 8
#: Operators SIGKILLed at most in one round.
KILLS_PER_ROUND = 4
#: Held decisions proposed at once.
_HOLD_AT_ONCE = 32


def _run_of(cfg: ChaosConfig, index: int) -> str:
    return f"chaos-approve-{cfg.run_id}-{index % APPROVAL_RUNS}"


def approval_ids(cfg: ChaosConfig) -> list[str]:
    """The ids of the decisions the approval phase holds."""
    return [f"chaos-{cfg.run_id}-held-{index:06d}" for index in range(cfg.approvals)]


def _held_request(cfg: ChaosConfig, index: int, decision_id: str) -> DecisionRequest:
    return DecisionRequest(
        decision_id=decision_id,
        run_id=_run_of(cfg, index),
        authority_branch_id=BRANCH,
        causation_event_id=f"chaos-held-event-{index}",
        decision=ScheduleStep(DecisionStep(f"held-step-{index}", "chaos.risky", {"i": index})),
    )


async def _hold_all(cfg: ChaosConfig) -> int:
    """Propose the phase's decisions under a policy that holds their runs; how many
    were answered held."""
    assert cfg.outbox_url is not None
    runs = tuple(sorted({_run_of(cfg, index) for index in range(cfg.approvals)}))
    ledger = await open_ledger(cfg.ledger_url)
    held = 0
    try:
        async with OutboxSink(cfg.outbox_url) as outbox:
            dispatcher = Dispatcher(
                BRANCH, outbox, ledger, lease_ms=cfg.lease_ms, approvals=ApprovalPolicy(runs=runs)
            )
            ids = approval_ids(cfg)
            for start in range(0, len(ids), _HOLD_AT_ONCE):
                outcomes = await asyncio.gather(
                    *(
                        dispatcher.dispatch(_held_request(cfg, index, ids[index]))
                        for index in range(start, min(start + _HOLD_AT_ONCE, len(ids)))
                    )
                )
                held += sum(1 for outcome in outcomes if outcome.held)
    finally:
        await ledger.close()
    return held


async def _unfinished(cfg: ChaosConfig) -> tuple[set[str], list[str]]:
    """``(runs with held decisions, decisions claimed but not completed)``."""
    ledger = await open_ledger(cfg.ledger_url)
    runs: set[str] = set()
    pending: list[str] = []
    try:
        for index, decision_id in enumerate(approval_ids(cfg)):
            record = await ledger.read_record(decision_id)
            if record is None:  # never held (approvals_held says so): nothing to approve
                continue
            if record.status is ClaimStatus.HELD:
                runs.add(_run_of(cfg, index))
            elif record.status is ClaimStatus.PENDING:
                pending.append(decision_id)
    finally:
        await ledger.close()
    return runs, pending


def _operator(cfg: ChaosConfig, log: Path, name: str, *target: str) -> subprocess.Popen[bytes]:
    """``flowdecision approve`` (a run with ``--run R --yes``, or ids) as operator ``name``."""
    assert cfg.outbox_url is not None
    argv = [
        sys.executable, "-m", "flowdecision.cli", "approve", *target,
        "--ledger", cfg.ledger_url, "--sink", cfg.outbox_url,
        "--lease-ms", str(cfg.lease_ms),
        "--actor", name, "--reason", "chaos approval phase", "--json",
    ]  # fmt: skip
    with log.open("ab") as err:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)


def run_approval_phase(
    cfg: ChaosConfig, workdir: Path
) -> tuple[dict[str, tuple[bool, str]], dict[str, int]]:
    """Hold, approve in bulk through killed operators, check; the checks and figures."""
    held = asyncio.run(_hold_all(cfg))
    checks: dict[str, tuple[bool, str]] = {
        "approvals_held": (
            held == cfg.approvals,
            f"{held} of {cfg.approvals} decisions answered held (nothing sent)",
        )
    }
    rng = random.Random(cfg.seed)
    log = workdir / "approval-phase.log"
    kills = rounds = 0
    deadline = time.monotonic() + cfg.timeout_s
    while time.monotonic() < deadline:
        runs, pending = asyncio.run(_unfinished(cfg))
        if not runs and not pending:
            break
        rounds += 1
        procs = [
            _operator(cfg, log, f"chaos-op-{n}", "--run", run, "--yes")
            for run in sorted(runs)
            for n in range(OPERATORS)
        ]
        if pending:  # left claimed by a killed approval: taken over once the lease expires
            procs.append(_operator(cfg, log, "chaos-op-takeover", *pending))
        # Up to KILLS_PER_ROUND kills, each after a random wait: an operator's Python
        # starts in ~0.3 s and then approves a decision every few ms, so most land
        # mid-approval (between a claim and its commit, or between two decisions).
        for _ in range(KILLS_PER_ROUND):
            if kills >= MAX_APPROVAL_KILLS:
                break
            time.sleep(rng.uniform(0.2, 0.2 + max(0.4, cfg.kill_every_ms / 1000)))
            live = [proc for proc in procs if proc.poll() is None]
            if not live:
                break
            rng.choice(live).send_signal(signal.SIGKILL)
            kills += 1
        for proc in procs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    found, takeovers = asyncio.run(_check(cfg))
    checks.update(found)
    figures = {
        "approvals": held,
        "approval_kills": kills,
        "approval_rounds": rounds,
        "approval_takeovers": takeovers,
    }
    return checks, figures


async def _check(cfg: ChaosConfig) -> tuple[dict[str, tuple[bool, str]], int]:
    """The checks, and how many approvals took over a claim a killed one left."""
    assert cfg.outbox_url is not None
    ids = approval_ids(cfg)
    ledger = await open_ledger(cfg.ledger_url)
    try:
        completed = [
            decision_id
            for decision_id in ids
            if (record := await ledger.read_record(decision_id)) is not None
            and record.status is ClaimStatus.COMPLETED
        ]
        approvals: dict[str, int] = {}
        takeovers = 0  # approvals of a claim a killed approval left (not on the shared layout)
        query = AuditQuery(limit=1000)
        while True:
            page = await ledger.audit(query)
            for entry in page.entries:
                if entry.action != "approve":
                    continue
                if entry.state_before == "held":
                    approvals[entry.decision_id] = approvals.get(entry.decision_id, 0) + 1
                else:
                    takeovers += 1
            if page.next_cursor is None:
                break
            query = AuditQuery(cursor=page.next_cursor, limit=1000)
        chain = await ledger.verify_audit()
    finally:
        await ledger.close()
    async with OutboxSink(cfg.outbox_url) as outbox:
        in_outbox = [decision_id for decision_id in ids if await outbox.get(decision_id)]
    once = [decision_id for decision_id in ids if approvals.get(decision_id) == 1]
    twice = [decision_id for decision_id in ids if approvals.get(decision_id, 0) > 1]
    checks = {
        "approvals_delivered": (
            len(completed) == len(ids) and len(in_outbox) == len(ids),
            f"{len(completed)} of {len(ids)} approved decisions completed, "
            f"{len(in_outbox)} in the outbox",
        ),
        "approvals_audited_once": (
            len(once) == len(ids),
            f"{len(once)} of {len(ids)} approved exactly once; {len(twice)} twice",
        ),
        "audit_chain": (
            chain.ok,
            f"{chain.rows} audit rows chained"
            + ("" if chain.first_break is None else f"; broken at {chain.first_break}"),
        ),
    }
    return checks, takeovers
