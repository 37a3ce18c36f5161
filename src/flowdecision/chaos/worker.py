"""One worker process: dispatch this worker's plan to the end, journaling everything.

Started by the controller as ``python -m flowdecision.chaos worker WORKDIR W I``
(worker ``W``, incarnation ``I``). A restarted incarnation skips the plan
entries its journal already shows finished, under a new owner id. Every
~100 ms it replaces ``health-<w>-<incarnation>.json`` with its health snapshot
and how many claim and outcome lines it had journaled at that instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import uuid
from pathlib import Path
from typing import Any

from ..connections.urls import parse_ledger_url
from ..core.dispatcher import Dispatcher
from ..core.model import DecisionRequest, request_hash
from ..errors import (
    DecisionBusyError,
    DecisionConflictError,
    DispatchLedgerError,
    LeaseLostError,
    SinkError,
)
from ..ledger.base import Ledger
from ..ledger.opening import open_ledger
from ..ledger.postgres import PostgresLedger
from ..sinks.base import HasStoreKey
from ..sinks.outbox import OutboxConflictError, OutboxSink
from ..store.joint import JointRow
from .config import BRANCH, ChaosConfig, wall_ms
from .journal import Journal, JournalingLedger, read_journal
from .workload import make_request

__all__ = ["TERMINAL", "ChaosSink", "open_run_ledger", "worker_main"]

#: Journaled outcomes after which a plan entry is done.
TERMINAL = frozenset({"accepted", "duplicate", "conflict"})


class ChaosSink:
    """The outbox, made slow at random (before and after the write) and sometimes
    raising *after* it wrote, so SIGSTOP and SIGKILL land mid-sink.

    On the shared layout it is a joint sink (``JointSink``): the dispatcher asks it for
    the row (:meth:`prepare`) and the ledger writes it in its own transaction.
    """

    def __init__(
        self, outbox: OutboxSink, journal: Journal, cfg: ChaosConfig, rng: random.Random
    ) -> None:
        self.outbox = outbox
        self.journal = journal
        self.cfg = cfg
        self.rng = rng

    async def _maybe_sleep(self) -> None:
        if self.rng.random() < self.cfg.slow_sink_rate:
            await asyncio.sleep(self.rng.uniform(0, 1.5 * self.cfg.lease_ms) / 1000)

    def joint_with(self, ledger: HasStoreKey) -> bool:
        """The shared layout (the outbox in the ledger's store) unless the run says
        ``separate``: then even a PostgreSQL outbox in the ledger's database is
        written on the claim, submit, complete path."""
        return self.cfg.layout != "separate" and self.outbox.joint_with(ledger)

    async def prepare(self, request: DecisionRequest) -> JointRow:
        """The outbox's row; slow at random before the transaction (the kills and
        pauses then land between the request and its one commit, or inside it)."""
        await self._maybe_sleep()
        return await self.outbox.prepare(request)

    def committed(self, row: JointRow) -> None:
        """The outbox's: wake this process's readers of the outbox."""
        self.outbox.committed(row)

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        await self._maybe_sleep()
        try:
            inserted = await self.outbox.deliver(request, attempt)
        except OutboxConflictError as error:
            self.journal.write(
                e="sink", d=request.decision_id, a=attempt, r="conflict", m=str(error)
            )
            raise
        self.journal.write(
            e="sink", d=request.decision_id, a=attempt, r="insert" if inserted else "replay"
        )
        await self._maybe_sleep()
        if self.rng.random() < self.cfg.sink_raise_rate:
            raise ConnectionResetError("chaos: the engine accepted it, then the connection reset")


async def open_run_ledger(cfg: ChaosConfig) -> Ledger:
    """The run's ledger, opened as a worker opens it (a pool sized for its lanes)."""
    kind, target = parse_ledger_url(cfg.ledger_url)
    if kind == "postgresql":
        return await PostgresLedger.connect(target, max_size=cfg.concurrency + 2)
    return await open_ledger(cfg.ledger_url)


def _write_atomic(path: Path, value: Any) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(value), encoding="utf-8")
    os.replace(temp, path)


async def _dispatch_once(dispatcher: Dispatcher, request: DecisionRequest) -> tuple[str, int]:
    """Dispatch; the journaled result and how long (ms) to wait before retrying.

    Any other exception is a harness bug: it ends the worker, and the
    controller counts a crash.
    """
    try:
        return ("accepted" if await dispatcher.dispatch(request) else "duplicate"), 0
    except DecisionBusyError as error:
        lease_ms = dispatcher.lease_ms
        return "busy", max(0, min(error.lease_expires_at_ms - wall_ms(), lease_ms))
    except DecisionConflictError:
        return "conflict", 0
    except LeaseLostError:
        return "lease_lost", 0
    except SinkError as error:
        if isinstance(error.__cause__, OutboxConflictError):
            return "sink_conflict", 0
        return "sink_error", 0
    except DispatchLedgerError:
        return "ledger_error", 0


async def worker_main(workdir: Path, worker: int, incarnation: int) -> int:
    """Run worker ``worker``'s plan (incarnation ``incarnation``) to the end."""
    cfg = ChaosConfig(**json.loads((workdir / "config.json").read_text()))
    plan = [tuple(entry) for entry in json.loads((workdir / f"plan-{worker}.json").read_text())]
    journal_path = workdir / f"journal-{worker}.jsonl"
    done: set[int] = set()
    for event in read_journal(journal_path)[0]:
        if event.get("e") == "out" and event.get("r") in TERMINAL:
            done.add(int(event["p"]))
    owner = f"chaos-w{worker}-i{incarnation}-{uuid.uuid4().hex[:8]}"
    journal = Journal(journal_path, {"i": incarnation, "o": owner})
    journal.write(e="start", pid=os.getpid())
    assert cfg.seed is not None and cfg.outbox_url is not None
    rng = random.Random(f"{cfg.seed}-{worker}-{incarnation}")
    ledger = JournalingLedger(await open_run_ledger(cfg), journal)
    outbox = await OutboxSink(cfg.outbox_url).open()
    dispatcher = Dispatcher(
        BRANCH, ChaosSink(outbox, journal, cfg, rng), ledger, lease_ms=cfg.lease_ms, owner_id=owner
    )
    health_path = workdir / f"health-{worker}-{incarnation}.json"

    def report(final: bool) -> None:
        _write_atomic(
            health_path,
            {
                "worker": worker,
                "incarnation": incarnation,
                "owner": owner,
                "final": final,
                "snapshot": dispatcher.health().to_dict(),
                "claims_logged": journal.claims,
                "takeovers_logged": journal.takeovers,
                "outcomes_logged": journal.outcomes,
                "done": len(done),
                "total": len(plan),
            },
        )

    pending = iter([p for p in range(len(plan)) if p not in done])

    async def run_one(position: int) -> None:
        index, variant = plan[position]
        request = make_request(cfg, index, variant)
        hash_ = request_hash(request)
        while True:
            result, wait_ms = await _dispatch_once(dispatcher, request)
            # No await between the dispatch finishing and this line: a health
            # snapshot either sees both or neither.
            journal.outcomes += 1
            journal.write(e="out", p=position, d=request.decision_id, v=variant, h=hash_, r=result)
            if result in TERMINAL:
                done.add(position)
                return
            await asyncio.sleep(wait_ms / 1000 + rng.uniform(0.002, 0.03))

    async def lane() -> None:
        for position in pending:
            await run_one(position)

    async def reporter() -> None:
        while True:
            report(False)
            await asyncio.sleep(0.1)

    reporting = asyncio.create_task(reporter())
    try:
        await asyncio.gather(*(lane() for _ in range(cfg.concurrency)))
    finally:
        reporting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporting
    report(True)
    journal.write(e="exit")
    journal.close()
    await outbox.close()
    await ledger.close()
    return 0
