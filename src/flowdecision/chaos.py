"""The crash harness behind ``flowdecision chaos``: real processes, killed for real.

A controller starts ``workers`` processes (``python -m flowdecision.chaos
worker ...``). Each dispatches its share of ``decisions`` through one ledger
into one :class:`~flowdecision.sinks.OutboxSink`; every decision is proposed by
at least two workers, some are proposed again (duplicates) and some are
re-proposed with different content under the same id (conflicting reuse).
Leases are short. While they run, the controller SIGKILLs a random worker every
``kill_every_ms`` and restarts it (a new incarnation with a new owner id), and
SIGSTOPs a worker for ``pause_ms`` (longer than the lease) every
``pause_every_ms`` before SIGCONTing it. The sink sleeps at random, before and
after it writes, and sometimes raises after writing, so faults land mid-sink.

Evidence. Each worker appends one JSON line per event to its own journal
(``journal-<w>.jsonl``; a plain ``write(2)`` to an ``O_APPEND`` file, which a
SIGKILL cannot tear): every ledger call with its start/end wall-clock times
(claims and renewals are also logged *before* the call, so a call cut short is
visible), every outbox delivery and every dispatch outcome. Every ~100 ms it
replaces ``health-<w>-<incarnation>.json`` with its health snapshot and how many
claim and outcome lines it had journaled at that instant. A kill loses at most
what happened after the last line; nothing in a journal is ever wrong.

After every worker has finished its plan, :func:`verify` checks (see
``docs/RELIABILITY.md`` for the reasoning):

``ledger_exactly_once``
    every decision's record is completed; its completer (the record's owner) is
    a journaled claimant whose attempt equals the record's final ``attempts``;
    no two claims of one decision share an attempt number.
``outbox_one_row``
    exactly one outbox row per decision, and ``first_attempt <=
    highest_attempt <= ledger attempts``.
``no_conflicting_content``
    each row's bytes hash to its ``request_hash``, which is the hash the ledger
    bound; no worker was told "accepted"/"duplicate" for other content or
    "conflict" for the bound content; the outbox never raised a conflict.
``no_stale_completion``
    for the completer's last lease grant before completion (claim or renewal,
    journaled with start ``t0`` and end ``t1``), ``completed_at < t0 + lease``
    proves the lease was live (``t1 + lease <= completed_at`` would prove it had
    expired -- a failure; in between is counted as ambiguous). File and SQLite
    ledgers use this host's clock; the PostgreSQL ledger uses the server's,
    which in this harness runs on the same host.
``health_adds_up``
    every snapshot satisfies ``attempted = completed + duplicates + busy +
    conflicts + rejected + failures + in_flight``; its counters equal the tally
    of the outcome lines journaled before it, and ``claimed``/``takeovers``
    equal the journaled claims; summed over workers, journaled claims never
    exceed the ledger's attempts, and the difference (claims committed but cut
    off by a SIGKILL before their journal line) is at most kills x concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .dispatcher import Dispatcher
from .errors import (
    DecisionBusyError,
    DecisionConflictError,
    DispatchLedgerError,
    LeaseLostError,
    LedgerError,
    SinkError,
)
from .identity import ExecutionIdentity, ResultReceipt
from .ledger.base import Ledger, Operation
from .ledger.machine import ClaimRecord, ClaimStatus
from .ledger.states import AlreadyCompleted, Busy, Claimed, ClaimOutcome, Conflict
from .ledger.url import parse_ledger_url
from .model import Complete, DecisionRequest, request_hash
from .sinks.outbox import OutboxConflictError, OutboxSink

__all__ = ["ChaosConfig", "ChaosReport", "run_chaos", "verify"]

T = TypeVar("T")

BRANCH = "production"
_TERMINAL = frozenset({"accepted", "duplicate", "conflict"})
#: dispatch outcome -> the health counter it increments
_OUTCOME_COUNTER = {
    "accepted": "completed",
    "duplicate": "duplicates",
    "busy": "busy",
    "conflict": "conflicts",
    "lease_lost": "lease_lost",
    "sink_error": "sink_failures",
    "ledger_error": "ledger_failures",
}
_FAILURE_OUTCOMES = ("lease_lost", "sink_error", "ledger_error", "other")


def _ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class ChaosConfig:
    """One harness run. ``outbox_url`` defaults to ``sqlite:///<workdir>/outbox.db``
    for file and SQLite ledgers and to the ledger's own database for PostgreSQL."""

    ledger_url: str
    outbox_url: str | None = None
    workers: int = 8
    decisions: int = 5000
    lease_ms: int = 200
    concurrency: int = 4
    kill_every_ms: int = 1000
    pause_every_ms: int = 1500
    pause_ms: int | None = None
    duplicate_rate: float = 0.2
    conflict_rate: float = 0.05
    slow_sink_rate: float = 0.1
    sink_raise_rate: float = 0.02
    seed: int | None = None
    workdir: str | None = None
    timeout_s: float = 900.0
    run_id: str = ""

    def resolved(self) -> ChaosConfig:
        """A copy with defaults filled in and values checked."""
        if self.workers < 2:
            raise ValueError("chaos needs at least 2 workers (every decision has 2 proposers)")
        if self.decisions < 1 or self.lease_ms < 10 or self.concurrency < 1:
            raise ValueError("decisions >= 1, lease_ms >= 10 and concurrency >= 1 are required")
        kind, _ = parse_ledger_url(self.ledger_url)
        if kind == "memory":
            raise ValueError("a memory ledger cannot be shared between processes")
        out = ChaosConfig(**asdict(self))
        out.seed = self.seed if self.seed is not None else random.randrange(1 << 30)
        out.run_id = self.run_id or uuid.uuid4().hex[:8]
        out.pause_ms = self.pause_ms if self.pause_ms is not None else 3 * self.lease_ms
        if out.workdir is None:
            out.workdir = tempfile.mkdtemp(prefix="flowdecision-chaos-")
        if out.outbox_url is None:
            out.outbox_url = (
                self.ledger_url
                if kind == "postgresql"
                else f"sqlite:///{Path(out.workdir).resolve() / 'outbox.db'}"
            )
        return out


# ------------------------------------------------------------------------ the workload


def decision_id(cfg: ChaosConfig, index: int) -> str:
    return f"chaos-{cfg.run_id}-{index:06d}"


def make_request(cfg: ChaosConfig, index: int, variant: int) -> DecisionRequest:
    """Variant 0 is the decision; variant 1 reuses its id with different content."""
    output: dict[str, Any] = {"index": index}
    if variant:
        output["reused"] = True
    return DecisionRequest(
        decision_id=decision_id(cfg, index),
        run_id=f"chaos-run-{cfg.run_id}",
        authority_branch_id=BRANCH,
        causation_event_id=f"chaos-event-{index}",
        decision=Complete(output=output),
    )


def make_plans(cfg: ChaosConfig) -> list[list[tuple[int, int]]]:
    """Per worker, the ``(decision index, variant)`` entries it proposes, in order.

    Decision ``i`` goes to two distinct workers; some get a third, duplicate
    proposal and some a conflicting one. Plans are ordered by ``i`` (with
    jitter), so the proposers of a decision reach it at about the same time.
    """
    assert cfg.seed is not None
    rng = random.Random(cfg.seed)
    n = cfg.workers
    keyed: list[list[tuple[float, int, int]]] = [[] for _ in range(n)]
    for i in range(cfg.decisions):
        a = i % n
        b = (a + 1 + rng.randrange(n - 1)) % n
        keyed[a].append((i + rng.random(), i, 0))
        keyed[b].append((i + rng.random() * 3, i, 0))
        if rng.random() < cfg.duplicate_rate:
            keyed[rng.choice((a, b))].append((i + rng.random() * 2 * n, i, 0))
        if rng.random() < cfg.conflict_rate:
            keyed[rng.randrange(n)].append((i + rng.random() * 2, i, 1))
    return [[(i, v) for _, i, v in sorted(entries)] for entries in keyed]


# ---------------------------------------------------------------------------- journal


class Journal:
    """Append-only JSON lines; each line is one ``write(2)`` on an ``O_APPEND`` fd."""

    def __init__(self, path: Path, base: dict[str, Any]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._base = base
        self.claims = 0
        self.takeovers = 0
        self.outcomes = 0

    def write(self, **event: Any) -> None:
        line = json.dumps({**self._base, **event}, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)


def read_journal(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Events of one journal, and how many lines could not be parsed (a torn tail)."""
    events: list[dict[str, Any]] = []
    torn = 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return events, 0
    for line in data.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            torn += 1
    return events, torn


class JournalingLedger(Ledger):
    """Delegates to a real ledger and journals every call with its timing."""

    def __init__(self, inner: Ledger, journal: Journal) -> None:
        self.inner = inner
        self.journal = journal

    async def _apply(self, decision_id: str, op: Operation[T]) -> T:  # pragma: no cover
        raise AssertionError("JournalingLedger delegates every public call")

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        return await self.inner._read(decision_id)

    async def _prune(self, before_ms: int, progress: object) -> int:  # pragma: no cover
        raise AssertionError("JournalingLedger delegates every public call")

    def now_ms(self) -> int:
        return self.inner.now_ms()

    async def close(self) -> None:
        await self.inner.close()

    async def claim(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
    ) -> ClaimOutcome:
        t0 = _ms()
        try:
            outcome = await self.inner.claim(
                decision_id, request_hash, owner_id, lease_ms=lease_ms, now_ms=now_ms,
                identity=identity,
            )  # fmt: skip
        except LedgerError as error:
            self.journal.write(e="claim", d=decision_id, t0=t0, t1=_ms(), r="error", m=str(error))
            raise
        t1 = _ms()
        if isinstance(outcome, Claimed):
            self.journal.claims += 1
            if outcome.attempt > 1:
                self.journal.takeovers += 1
            self.journal.write(
                e="claim", d=decision_id, t0=t0, t1=t1, r="claimed", a=outcome.attempt
            )
        elif isinstance(outcome, Busy):
            self.journal.write(e="claim", d=decision_id, t0=t0, t1=t1, r="busy")
        elif isinstance(outcome, Conflict):
            self.journal.write(e="claim", d=decision_id, t0=t0, t1=t1, r="conflict")
        elif isinstance(outcome, AlreadyCompleted):
            self.journal.write(e="claim", d=decision_id, t0=t0, t1=t1, r="completed")
        return outcome

    async def renew(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        lease_ms: int,
        now_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
    ) -> bool:
        t0 = _ms()
        self.journal.write(e="renew0", d=decision_id, t0=t0)
        try:
            renewed = await self.inner.renew(
                decision_id, request_hash, owner_id, lease_ms=lease_ms, now_ms=now_ms,
                identity=identity,
            )  # fmt: skip
        except LedgerError as error:
            self.journal.write(e="renew", d=decision_id, t0=t0, t1=_ms(), ok=False, m=str(error))
            raise
        self.journal.write(e="renew", d=decision_id, t0=t0, t1=_ms(), ok=renewed)
        return renewed

    async def complete(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        completed_at_ms: int | None = None,
        identity: ExecutionIdentity | None = None,
        receipt: ResultReceipt | None = None,
    ) -> bool:
        t0 = _ms()
        self.journal.write(e="complete0", d=decision_id, t0=t0)
        try:
            ours = await self.inner.complete(
                decision_id, request_hash, owner_id, completed_at_ms=completed_at_ms,
                identity=identity, receipt=receipt,
            )  # fmt: skip
        except LedgerError as error:
            self.journal.write(e="complete", d=decision_id, t0=t0, t1=_ms(), ok=False, m=str(error))
            raise
        self.journal.write(e="complete", d=decision_id, t0=t0, t1=_ms(), ok=True, ours=ours)
        return ours

    async def release(
        self,
        decision_id: str,
        request_hash: str,
        owner_id: str,
        *,
        identity: ExecutionIdentity | None = None,
    ) -> None:
        await self.inner.release(decision_id, request_hash, owner_id, identity=identity)
        self.journal.write(e="release", d=decision_id, t1=_ms())


class ChaosSink:
    """The outbox, made slow at random (before and after the write) and sometimes
    raising *after* it wrote, so SIGSTOP and SIGKILL land mid-sink."""

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


# ----------------------------------------------------------------------------- worker


async def _open_worker_ledger(cfg: ChaosConfig) -> Ledger:
    kind, target = parse_ledger_url(cfg.ledger_url)
    if kind == "postgresql":
        from .ledger.postgres import PostgresLedger

        return await PostgresLedger.connect(target, max_size=cfg.concurrency + 2)
    from .ledger.url import open_ledger

    return await open_ledger(cfg.ledger_url)


def _write_atomic(path: Path, value: Any) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(value), encoding="utf-8")
    os.replace(temp, path)


async def worker_main(workdir: Path, worker: int, incarnation: int) -> int:
    """One worker process: run this worker's plan to the end, journaling everything."""
    cfg = ChaosConfig(**json.loads((workdir / "config.json").read_text()))
    plan = [tuple(entry) for entry in json.loads((workdir / f"plan-{worker}.json").read_text())]
    journal_path = workdir / f"journal-{worker}.jsonl"
    done: set[int] = set()
    for event in read_journal(journal_path)[0]:
        if event.get("e") == "out" and event.get("r") in _TERMINAL:
            done.add(int(event["p"]))
    owner = f"chaos-w{worker}-i{incarnation}-{uuid.uuid4().hex[:8]}"
    journal = Journal(journal_path, {"i": incarnation, "o": owner})
    journal.write(e="start", pid=os.getpid())
    assert cfg.seed is not None
    rng = random.Random(f"{cfg.seed}-{worker}-{incarnation}")
    ledger = JournalingLedger(await _open_worker_ledger(cfg), journal)
    assert cfg.outbox_url is not None
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
            result = "other"
            wait_s = 0.0
            try:
                accepted = await dispatcher.dispatch(request)
                result = "accepted" if accepted else "duplicate"
            except DecisionBusyError as error:
                result = "busy"
                wait_s = max(0, min(error.lease_expires_at_ms - _ms(), cfg.lease_ms)) / 1000
            except DecisionConflictError:
                result = "conflict"
            except LeaseLostError:
                result = "lease_lost"
            except SinkError as error:
                result = "sink_error"
                if isinstance(error.__cause__, OutboxConflictError):
                    result = "sink_conflict"
            except DispatchLedgerError:
                result = "ledger_error"
            # No await between the dispatch finishing and this line: a health
            # snapshot either sees both or neither.
            journal.outcomes += 1
            journal.write(e="out", p=position, d=request.decision_id, v=variant, h=hash_, r=result)
            if result in _TERMINAL:
                done.add(position)
                return
            await asyncio.sleep(wait_s + rng.uniform(0.002, 0.03))

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


# ------------------------------------------------------------------------- controller


@dataclass(slots=True)
class _Proc:
    worker: int
    incarnation: int
    popen: subprocess.Popen[bytes]
    paused_until: float | None = None
    ready_at: float | None = None


@dataclass(slots=True)
class ChaosReport:
    """Figures and verdicts of one run; ``ok`` is True when every check passed."""

    config: dict[str, Any]
    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(passed for passed, _ in self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "config": self.config,
            "figures": self.figures,
            "checks": {
                name: {"passed": passed, "detail": detail}
                for name, (passed, detail) in self.checks.items()
            },
        }


async def _prepare_stores(cfg: ChaosConfig) -> None:
    kind, target = parse_ledger_url(cfg.ledger_url)
    if kind == "postgresql":
        from .ledger.postgres import PostgresLedger

        ledger = PostgresLedger(target)
        try:
            await ledger.migrate()
        finally:
            await ledger.close()
    assert cfg.outbox_url is not None
    await (await OutboxSink(cfg.outbox_url).open()).close()


def run_chaos(
    config: ChaosConfig, progress: Callable[[int, int, dict[str, int]], None] | None = None
) -> ChaosReport:
    """Run the harness (blocking); returns the verified report."""
    cfg = config.resolved()
    assert cfg.workdir is not None and cfg.pause_ms is not None
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(asdict(cfg)))
    plans = make_plans(cfg)
    for worker, plan in enumerate(plans):
        (workdir / f"plan-{worker}.json").write_text(json.dumps(plan))
    total_entries = sum(len(plan) for plan in plans)
    asyncio.run(_prepare_stores(cfg))

    rng = random.Random(cfg.seed)
    stats: Counter[str] = Counter()
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    incarnations = [0] * cfg.workers

    def spawn(worker: int) -> _Proc:
        incarnations[worker] += 1
        stats["incarnations"] += 1
        log = open(workdir / f"worker-{worker}.log", "ab")
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "flowdecision.chaos", "worker", str(workdir),
                 str(worker), str(incarnations[worker])],
                stdout=log, stderr=log, env=env,
            )  # fmt: skip
        finally:
            log.close()
        return _Proc(worker, incarnations[worker], popen)

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(f"chaos controller stopped by signal {signum}")

    # SIGTERM must reach the `finally` below, which kills the workers it started.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if in_main else None
    running: dict[int, _Proc] = {w: spawn(w) for w in range(cfg.workers)}
    finished: set[int] = set()
    started = time.monotonic()
    deadline = started + cfg.timeout_s
    next_kill = started + cfg.kill_every_ms / 1000 if cfg.kill_every_ms > 0 else float("inf")
    next_pause = started + cfg.pause_every_ms / 1000 if cfg.pause_every_ms > 0 else float("inf")
    next_progress = started
    timed_out = False
    try:
        while running:
            now = time.monotonic()
            for worker, proc in list(running.items()):
                code = proc.popen.poll()
                if code is None:
                    if proc.paused_until is not None and now >= proc.paused_until:
                        proc.popen.send_signal(signal.SIGCONT)
                        proc.paused_until = None
                    continue
                del running[worker]
                if code == 0:
                    finished.add(worker)
                elif code == -signal.SIGKILL:
                    running[worker] = spawn(worker)
                else:
                    stats["crashes"] += 1
                    if stats["crashes"] > 3 * cfg.workers:
                        raise RuntimeError(
                            f"chaos worker {worker} keeps failing (exit {code}); "
                            f"see {workdir / f'worker-{worker}.log'}"
                        )
                    running[worker] = spawn(worker)
            # Only fault a worker that has been dispatching for a while: killing
            # one that is still starting would livelock it without testing anything.
            min_age = max(2 * cfg.lease_ms, 200) / 1000
            for proc in running.values():
                if (
                    proc.ready_at is None
                    and (workdir / f"health-{proc.worker}-{proc.incarnation}.json").exists()
                ):
                    proc.ready_at = now
            live = [
                p
                for p in running.values()
                if p.paused_until is None and p.ready_at is not None and now - p.ready_at >= min_age
            ]
            if now >= next_kill:
                next_kill = now + cfg.kill_every_ms / 1000
                if live:
                    victim = rng.choice(live)
                    victim.popen.send_signal(signal.SIGKILL)
                    victim.popen.wait()
                    stats["kills"] += 1
                    del running[victim.worker]
                    running[victim.worker] = spawn(victim.worker)
                    live = [p for p in live if p is not victim]
            if now >= next_pause:
                next_pause = now + cfg.pause_every_ms / 1000
                if live:
                    victim = rng.choice(live)
                    victim.popen.send_signal(signal.SIGSTOP)
                    victim.paused_until = now + cfg.pause_ms / 1000
                    stats["pauses"] += 1
            if now >= deadline:
                timed_out = True
                break
            if progress is not None and now >= next_progress:
                next_progress = now + 0.5
                progress(_progress(workdir, cfg.workers, incarnations), total_entries, dict(stats))
            time.sleep(0.01)
    finally:
        for proc in running.values():
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.kill()
            proc.popen.wait()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - started
    if progress is not None:
        progress(_progress(workdir, cfg.workers, incarnations), total_entries, dict(stats))
    report = asyncio.run(verify(cfg, stats, elapsed))
    if timed_out:
        report.checks["drained"] = (False, f"workers still running after {cfg.timeout_s:.0f} s")
    else:
        report.checks["drained"] = (True, f"all {cfg.workers} workers finished their plans")
    return report


def _progress(workdir: Path, workers: int, incarnations: list[int]) -> int:
    done = 0
    for worker in range(workers):
        with contextlib.suppress(OSError, ValueError):
            path = workdir / f"health-{worker}-{incarnations[worker]}.json"
            done += int(json.loads(path.read_text())["done"])
    return done


# ------------------------------------------------------------------------------ verify


def _records_file(cfg: ChaosConfig, ids: list[str]) -> dict[str, ClaimRecord | None]:
    from .ledger.jsonfile import JsonFileLedger

    _, target = parse_ledger_url(cfg.ledger_url)
    records = JsonFileLedger(target)._read_records()
    return {key: records.get(key) for key in ids}


async def _load_records(cfg: ChaosConfig, ids: list[str]) -> dict[str, ClaimRecord | None]:
    kind, _ = parse_ledger_url(cfg.ledger_url)
    if kind == "file":
        return await asyncio.to_thread(_records_file, cfg, ids)
    ledger = await _open_worker_ledger(cfg)
    try:
        out: dict[str, ClaimRecord | None] = {}
        for key in ids:
            out[key] = await ledger._read(key)
        return out
    finally:
        await ledger.close()


def _fmt(items: list[str], limit: int = 3) -> str:
    head = "; ".join(items[:limit])
    return head + (f"; ... ({len(items)} in all)" if len(items) > limit else "")


async def verify(
    cfg: ChaosConfig, stats: Counter[str] | None = None, elapsed_s: float = 0.0
) -> ChaosReport:
    """Check the stores against the journals (see the module docs)."""
    stats = stats if stats is not None else Counter()
    assert cfg.workdir is not None and cfg.outbox_url is not None
    workdir = Path(cfg.workdir)
    plans = [
        [tuple(e) for e in json.loads((workdir / f"plan-{w}.json").read_text())]
        for w in range(cfg.workers)
    ]
    ids = [decision_id(cfg, i) for i in range(cfg.decisions)]
    variants_hash = {
        (i, v): request_hash(make_request(cfg, i, v)) for plan in plans for i, v in plan
    }
    hash_variant = {h: (i, v) for (i, v), h in variants_hash.items()}
    report = ChaosReport(config=asdict(cfg))
    records = await _load_records(cfg, ids)

    # Journals.
    events_by_worker: dict[int, list[dict[str, Any]]] = {}
    torn = 0
    for w in range(cfg.workers):
        events, bad = read_journal(workdir / f"journal-{w}.jsonl")
        events_by_worker[w] = events
        torn += bad
    claims: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_owner: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    outcomes: Counter[str] = Counter()
    bad_outcomes: list[str] = []
    sink_conflicts = 0
    sink_events: Counter[str] = Counter()
    late_acks = 0
    refused = 0
    for events in events_by_worker.values():
        for ev in events:
            kind = ev.get("e")
            key = str(ev.get("d"))
            if kind == "complete" and not ev.get("ok"):
                message = str(ev.get("m", ""))
                refused += "expired" in message or "another dispatcher" in message
            if kind in ("claim", "renew0", "renew", "complete0", "complete", "release"):
                by_owner[(ev["o"], key)].append(ev)
            if kind == "claim" and ev.get("r") == "claimed":
                claims[key].append(ev)
            elif kind == "sink":
                sink_events[ev["r"]] += 1
                if ev["r"] == "conflict":
                    sink_conflicts += 1
            elif kind == "out":
                outcomes[ev["r"]] += 1
                record = records.get(key)
                if record is not None and ev["r"] in ("accepted", "duplicate", "conflict"):
                    bound = record.request_hash == ev["h"]
                    if ev["r"] == "conflict" and bound:
                        bad_outcomes.append(f"{key}: told `conflict` for the bound content")
                    if ev["r"] != "conflict" and not bound:
                        bad_outcomes.append(f"{key}: told `{ev['r']}` for unbound content")
                if ev["r"] == "accepted" and record is not None and record.owner_id != ev["o"]:
                    late_acks += 1

    # 1. Ledger: completed exactly once, by the last claimant.
    problems: list[str] = []
    for key in ids:
        record = records[key]
        if record is None:
            problems.append(f"{key}: no ledger record")
            continue
        if record.status is not ClaimStatus.COMPLETED or record.completed_at_ms is None:
            problems.append(f"{key}: {record.status.value}, not completed")
            continue
        attempts = Counter(int(c["a"]) for c in claims[key])
        dup = [a for a, n in attempts.items() if n > 1]
        if dup:
            problems.append(f"{key}: attempt(s) {dup} claimed by two owners")
        mine = [c for c in claims[key] if c["o"] == record.owner_id]
        if not any(int(c["a"]) == record.attempts for c in mine):
            problems.append(
                f"{key}: completer {record.owner_id} has no journaled claim of attempt "
                f"{record.attempts}"
            )
        if attempts and max(attempts) > record.attempts:
            problems.append(f"{key}: a claim of attempt {max(attempts)} > {record.attempts}")
    report.checks["ledger_exactly_once"] = (
        not problems,
        _fmt(problems) or f"{len(ids)} decisions completed once, each by its last claimant",
    )

    # 2 + 3. Outbox rows and content.
    outbox_rows: dict[str, list[Any]] = defaultdict(list)
    async with OutboxSink(cfg.outbox_url) as outbox:
        after = 0
        prefix = f"chaos-{cfg.run_id}-"
        while page := await outbox.fetch(after=after, limit=5000):
            for entry in page:
                if entry.decision_id.startswith(prefix):
                    outbox_rows[entry.decision_id].append(entry)
            after = page[-1].seq
    row_problems: list[str] = []
    content_problems = list(bad_outcomes)
    replays = 0
    for key in ids:
        rows = outbox_rows.get(key, [])
        if len(rows) != 1:
            row_problems.append(f"{key}: {len(rows)} outbox rows")
            continue
        entry = rows[0]
        replays += entry.highest_attempt > entry.first_attempt
        record = records[key]
        if record is not None and not (
            1 <= entry.first_attempt <= entry.highest_attempt <= record.attempts
        ):
            row_problems.append(
                f"{key}: attempts first={entry.first_attempt} highest={entry.highest_attempt} "
                f"ledger={record.attempts}"
            )
        actual = hashlib.sha256(entry.request_json).hexdigest()
        if actual != entry.request_hash:
            content_problems.append(f"{key}: stored bytes do not hash to request_hash")
        if record is not None and entry.request_hash != record.request_hash:
            content_problems.append(f"{key}: outbox content differs from the ledger's binding")
        if entry.request_hash not in hash_variant:
            content_problems.append(f"{key}: outbox holds content no worker proposed")
    extra = set(outbox_rows) - set(ids)
    row_problems += [f"{key}: unexpected outbox row" for key in sorted(extra)]
    if sink_conflicts:
        content_problems.append(f"the outbox refused conflicting content {sink_conflicts} times")
    report.checks["outbox_one_row"] = (
        not row_problems,
        _fmt(row_problems) or f"{len(ids)} rows, one per decision, attempts within the ledger's",
    )
    report.checks["no_conflicting_content"] = (
        not content_problems,
        _fmt(content_problems)
        or (
            f"every row is the bound content; {outcomes['conflict']} conflicting proposals refused"
        ),
    )

    # 4. No completion by an owner whose lease had expired.
    stale: list[str] = []
    proven = ambiguous = 0
    for key in ids:
        record = records[key]
        if record is None or record.completed_at_ms is None:
            continue
        history = by_owner.get((record.owner_id, key), [])
        grant: dict[str, Any] | None = None
        unresolved = False
        complete_start: int | None = None
        for ev in history:
            if ev["e"] == "claim" and ev.get("r") == "claimed" and ev["a"] == record.attempts:
                grant, unresolved = ev, False
            elif grant is not None and ev["e"] == "renew0":
                unresolved = True
            elif grant is not None and ev["e"] == "renew":
                unresolved = False
                if ev.get("ok"):
                    grant = ev
            elif grant is not None and ev["e"] == "complete0":
                complete_start = int(ev["t0"])
                break
        if grant is None:
            stale.append(f"{key}: no lease grant journaled for the completer")
            continue
        done_at = record.completed_at_ms
        lower = int(grant["t0"]) + cfg.lease_ms
        upper_base = complete_start if unresolved and complete_start is not None else grant["t1"]
        upper = int(upper_base) + cfg.lease_ms
        if done_at < lower:
            proven += 1
        elif done_at >= upper:
            stale.append(
                f"{key}: completed at {done_at}, lease granted at {grant['t0']}..{grant['t1']} "
                f"ended by {upper}"
            )
        else:
            ambiguous += 1
    report.checks["no_stale_completion"] = (
        not stale,
        _fmt(stale)
        or f"{proven} completions proven inside a live lease, {ambiguous} within clock slack",
    )

    # 5. Health counters.
    health_problems: list[str] = []
    reported: Counter[str] = Counter()
    reported_takeovers = 0
    health_files = sorted(workdir.glob("health-*.json"))  # noqa: ASYNC240 - offline check
    events_by_owner: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for events in events_by_worker.values():
        for ev in events:
            events_by_owner[str(ev.get("o"))].append(ev)
    for path in health_files:
        data = json.loads(path.read_text())
        snap = data["snapshot"]
        w, inc, owner = data["worker"], data["incarnation"], data["owner"]
        name = f"worker {w} incarnation {inc}"
        lhs = snap["attempted"]
        rhs = (
            snap["completed"] + snap["duplicates"] + snap["busy"] + snap["conflicts"]
            + snap["rejected"] + snap["failures"] + snap["in_flight"]
        )  # fmt: skip
        if lhs != rhs:
            health_problems.append(f"{name}: attempted {lhs} != outcomes + in_flight {rhs}")
        mine = events_by_owner.get(owner, [])
        outs = [ev for ev in mine if ev["e"] == "out"]
        if len(outs) < data["outcomes_logged"]:
            health_problems.append(f"{name}: journal lost outcome lines")
        tally = Counter(ev["r"] for ev in outs[: data["outcomes_logged"]])
        tally["sink_error"] += tally["sink_conflict"]  # both count as sink failures
        for result, counter in _OUTCOME_COUNTER.items():
            if snap[counter] != tally[result]:
                health_problems.append(
                    f"{name}: {counter}={snap[counter]} but journal says {tally[result]}"
                )
        fails = sum(tally[r] for r in _FAILURE_OUTCOMES)
        if snap["failures"] != fails:
            health_problems.append(f"{name}: failures={snap['failures']} journal {fails}")
        if snap["attempted"] - snap["in_flight"] != data["outcomes_logged"]:
            health_problems.append(f"{name}: finished dispatches != journaled outcomes")
        if (
            snap["claimed"] != data["claims_logged"]
            or snap["takeovers"] != data["takeovers_logged"]
        ):
            health_problems.append(f"{name}: claimed/takeovers differ from journaled claims")
        journal_claims = sum(1 for ev in mine if ev["e"] == "claim" and ev.get("r") == "claimed")
        if journal_claims < data["claims_logged"]:
            health_problems.append(f"{name}: journal lost claim lines")
        if data["final"] and (snap["in_flight"] or len(outs) != data["outcomes_logged"]):
            health_problems.append(f"{name}: exited with work unaccounted for")
        for counter in (*_OUTCOME_COUNTER.values(), "failures", "claimed", "attempted"):
            reported[counter] += snap[counter]
        reported_takeovers += snap["takeovers"]
    ledger_claims = sum(r.attempts for r in records.values() if r is not None)
    ledger_takeovers = sum(r.attempts - 1 for r in records.values() if r is not None)
    journal_claims_total = sum(len(v) for v in claims.values())
    lost = ledger_claims - journal_claims_total
    bound = (stats["kills"] + stats["crashes"]) * cfg.concurrency
    if not 0 <= lost <= bound:
        health_problems.append(
            f"ledger attempts {ledger_claims} vs journaled claims {journal_claims_total}: "
            f"{lost} unjournaled, allowed 0..{bound}"
        )
    report.checks["health_adds_up"] = (
        not health_problems,
        _fmt(health_problems)
        or (
            f"{len(health_files)} snapshots match their journals; ledger attempts "
            f"{ledger_claims} = {journal_claims_total} journaled + {lost} cut off by kills"
        ),
    )

    report.figures = {
        "ledger": parse_ledger_url(cfg.ledger_url)[0],
        "decisions": cfg.decisions,
        "proposals": sum(len(p) for p in plans),
        "workers": cfg.workers,
        "incarnations": stats["incarnations"],
        "kills": stats["kills"],
        "pauses": stats["pauses"],
        "crashes": stats["crashes"],
        "dispatches": sum(outcomes.values()),
        "takeovers_ledger": ledger_takeovers,
        "takeovers_reported": reported_takeovers,
        "lost_leases": outcomes["lease_lost"],
        "duplicates_suppressed_dispatcher": outcomes["duplicate"],
        "duplicates_suppressed_outbox": sink_events["replay"],
        "outbox_rows_replayed": replays,
        "conflicts_refused": outcomes["conflict"],
        "busy_retries": outcomes["busy"],
        "sink_failures": outcomes["sink_error"],
        "ledger_failures": outcomes["ledger_error"],
        "stale_completions_refused": refused,
        "late_acks": late_acks,
        "stale_check_ambiguous": ambiguous,
        "torn_journal_lines": torn,
        "elapsed_s": round(elapsed_s, 1),
        "decisions_per_s": round(cfg.decisions / elapsed_s, 1) if elapsed_s else None,
    }
    return report


def summary_rows(report: ChaosReport) -> Iterator[tuple[str, str]]:
    """``(name, value)`` rows for the printed summary."""
    f = report.figures
    yield "ledger", str(f["ledger"])
    yield (
        "decisions",
        f"{f['decisions']} ({f['proposals']} proposals, {f['dispatches']} dispatches)",
    )
    yield "workers", f"{f['workers']} ({f['incarnations']} incarnations)"
    yield "kills", str(f["kills"])
    yield "pauses", str(f["pauses"])
    yield "takeovers", f"{f['takeovers_ledger']} in the ledger, {f['takeovers_reported']} reported"
    yield "lost leases", str(f["lost_leases"])
    yield (
        "duplicates suppressed",
        f"{f['duplicates_suppressed_dispatcher']} by the ledger, "
        f"{f['duplicates_suppressed_outbox']} by the outbox",
    )
    yield "conflicts refused", str(f["conflicts_refused"])
    yield "busy retries", str(f["busy_retries"])
    yield "sink / ledger failures", f"{f['sink_failures']} / {f['ledger_failures']}"
    yield "stale completions refused by the ledger", str(f["stale_completions_refused"])
    yield "late acks (stale owner, already completed)", str(f["late_acks"])
    yield "elapsed", f"{f['elapsed_s']} s ({f['decisions_per_s']} decisions/s)"
    for name, (passed, detail) in report.checks.items():
        yield f"check {name}", ("PASS" if passed else "FAIL") + f": {detail}"


def cleanup(cfg: ChaosConfig) -> None:
    if cfg.workdir is not None:
        shutil.rmtree(cfg.workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        sys.exit(asyncio.run(worker_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
    print("usage: python -m flowdecision.chaos worker WORKDIR WORKER INCARNATION", file=sys.stderr)
    sys.exit(2)
