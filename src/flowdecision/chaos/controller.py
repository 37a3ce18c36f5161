"""The controller: start the workers, kill and pause them at random, then verify.

It starts ``workers`` processes (``python -m flowdecision.chaos worker ...``).
While they run it SIGKILLs a random worker every ``kill_every_ms`` and restarts
it (a new incarnation with a new owner id), and SIGSTOPs one for ``pause_ms``
(longer than the lease) every ``pause_every_ms`` before SIGCONTing it. A
worker is faulted only once it has been dispatching for a while. When every
worker has finished its plan, :func:`~flowdecision.chaos.verify.verify` checks
the stores against the journals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..connections.urls import parse_ledger_url
from ..errors import HarnessError
from ..ledger.postgres import PostgresLedger
from ..sinks.outbox import OutboxSink
from .config import ChaosConfig, wall_ms
from .report import ChaosReport
from .verify import verify
from .workload import make_plans

__all__ = ["Progress", "run_chaos"]

#: ``progress(plan entries done, plan entries in all, fault counters)``.
Progress = Callable[[int, int, dict[str, int]], None]


@dataclass(slots=True)
class _Proc:
    worker: int
    incarnation: int
    popen: subprocess.Popen[bytes]
    paused_until: float | None = None
    ready_at: float | None = None


class _Fleet:
    """The worker processes: spawned, reaped, restarted and faulted."""

    def __init__(self, cfg: ChaosConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)
        self.stats: Counter[str] = Counter()
        self.incarnations = [0] * cfg.workers
        self.running: dict[int, _Proc] = {}
        #: seconds each failover command took
        self.failover_s: list[float] = []
        self.env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])
        python_path = self.env.get("PYTHONPATH")
        self.env["PYTHONPATH"] = src + (os.pathsep + python_path if python_path else "")

    def spawn(self, worker: int) -> None:
        self.incarnations[worker] += 1
        self.stats["incarnations"] += 1
        log = open(self.workdir / f"worker-{worker}.log", "ab")
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "flowdecision.chaos", "worker", str(self.workdir),
                 str(worker), str(self.incarnations[worker])],
                stdout=log, stderr=log, env=self.env,
            )  # fmt: skip
        finally:
            log.close()
        self.running[worker] = _Proc(worker, self.incarnations[worker], popen)

    def reap(self, now: float) -> None:
        """Resume workers whose pause is over; restart killed or crashed ones."""
        for worker, proc in list(self.running.items()):
            code = proc.popen.poll()
            if code is None:
                if proc.paused_until is not None and now >= proc.paused_until:
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.paused_until = None
                continue
            del self.running[worker]
            if code == 0:
                continue
            if code != -signal.SIGKILL:
                self.stats["crashes"] += 1
                if self.stats["crashes"] > 3 * self.cfg.workers:
                    raise HarnessError(
                        f"chaos worker {worker} keeps failing (exit {code}); "
                        f"see {self.workdir / f'worker-{worker}.log'}"
                    )
            self.spawn(worker)

    def faultable(self, now: float) -> list[_Proc]:
        """Running, unpaused workers that have been dispatching for a while.

        Killing one that is still starting would livelock it without testing anything.
        """
        min_age = max(2 * self.cfg.lease_ms, 200) / 1000
        for proc in self.running.values():
            health = self.workdir / f"health-{proc.worker}-{proc.incarnation}.json"
            if proc.ready_at is None and health.exists():
                proc.ready_at = now
        return [
            p
            for p in self.running.values()
            if p.paused_until is None and p.ready_at is not None and now - p.ready_at >= min_age
        ]

    def kill_one(self, live: list[_Proc]) -> _Proc | None:
        if not live:
            return None
        victim = self.rng.choice(live)
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait()
        self.stats["kills"] += 1
        del self.running[victim.worker]
        self.spawn(victim.worker)
        return victim

    def pause_one(self, live: list[_Proc], now: float) -> None:
        if not live:
            return
        victim = self.rng.choice(live)
        victim.popen.send_signal(signal.SIGSTOP)
        assert self.cfg.pause_ms is not None
        victim.paused_until = now + self.cfg.pause_ms / 1000
        self.stats["pauses"] += 1

    def stop_all(self) -> None:
        for proc in self.running.values():
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.kill()
            proc.popen.wait()

    def plan_entries_done(self) -> int:
        done = 0
        for worker in range(self.cfg.workers):
            with contextlib.suppress(OSError, ValueError):
                path = self.workdir / f"health-{worker}-{self.incarnations[worker]}.json"
                done += int(json.loads(path.read_text())["done"])
        return done


async def _prepare_stores(cfg: ChaosConfig) -> None:
    """Create or upgrade both schemas before any worker starts."""
    kind, target = parse_ledger_url(cfg.ledger_url)
    if kind == "postgresql":
        ledger = PostgresLedger(target)
        try:
            await ledger.migrate()
        finally:
            await ledger.close()
    assert cfg.outbox_url is not None
    outbox = OutboxSink(cfg.outbox_url)
    try:
        await outbox.migrate()
    finally:
        await outbox.close()


def _every(period_ms: int, start: float) -> float:
    return start + period_ms / 1000 if period_ms > 0 else float("inf")


def _failover(fleet: _Fleet) -> None:
    """Run the failover command once (the workers keep dispatching meanwhile)."""
    cfg = fleet.cfg
    assert cfg.failover_command is not None
    started = time.monotonic()
    try:
        proc = subprocess.run(
            shlex.split(cfg.failover_command),
            capture_output=True,
            text=True,
            timeout=300,
            env=fleet.env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise HarnessError(f"the failover command failed: {error}") from error
    if proc.returncode != 0:
        raise HarnessError(
            f"the failover command exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        )
    fleet.stats["failovers"] += 1
    fleet.failover_s.append(round(time.monotonic() - started, 3))
    with open(fleet.workdir / "failovers.jsonl", "a", encoding="utf-8") as out:
        out.write(json.dumps({"t": wall_ms(), "s": fleet.failover_s[-1], "out": proc.stdout}))
        out.write("\n")


def _drive(fleet: _Fleet, progress: Progress | None, total_entries: int) -> bool:
    """Run the fleet until every worker finished (True) or the timeout passed (False)."""
    cfg = fleet.cfg
    started = time.monotonic()
    deadline = started + cfg.timeout_s
    next_kill = _every(cfg.kill_every_ms, started)
    next_pause = _every(cfg.pause_every_ms, started)
    next_failover = _every(cfg.failover_every_ms, started)
    next_progress = started
    while fleet.running:
        now = time.monotonic()
        fleet.reap(now)
        live = fleet.faultable(now)
        if now >= next_kill:
            next_kill = now + cfg.kill_every_ms / 1000
            victim = fleet.kill_one(live)
            live = [p for p in live if p is not victim]
        if now >= next_pause:
            next_pause = now + cfg.pause_every_ms / 1000
            fleet.pause_one(live, now)
        if now >= next_failover and live:
            _failover(fleet)
            done = fleet.stats["failovers"]
            limit = cfg.max_failovers
            next_failover = (
                float("inf")
                if limit and done >= limit
                else time.monotonic() + cfg.failover_every_ms / 1000
            )
        if now >= deadline:
            return False
        if progress is not None and now >= next_progress:
            next_progress = now + 0.5
            progress(fleet.plan_entries_done(), total_entries, dict(fleet.stats))
        time.sleep(0.01)
    return True


def run_chaos(config: ChaosConfig, progress: Progress | None = None) -> ChaosReport:
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

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(f"chaos controller stopped by signal {signum}")

    # SIGTERM must reach the `finally` below, which kills the workers it started.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if in_main else None
    fleet = _Fleet(cfg, workdir)
    try:
        for worker in range(cfg.workers):
            fleet.spawn(worker)
        started = time.monotonic()
        drained = _drive(fleet, progress, total_entries)
    finally:
        fleet.stop_all()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - started
    if progress is not None:
        progress(fleet.plan_entries_done(), total_entries, dict(fleet.stats))
    report = asyncio.run(verify(cfg, fleet.stats, elapsed))
    if cfg.approvals:  # before the relay phase, which then delivers these rows too
        from .approval_phase import run_approval_phase

        checks, figures = run_approval_phase(cfg, workdir)
        report.checks.update(checks)
        report.figures.update(figures)
    if cfg.sink is not None:
        from .relay_phase import run_relay_phase

        checks, kills = run_relay_phase(cfg, workdir)
        report.checks.update(checks)
        report.figures["relay_kills"] = kills
    if cfg.failover_command:
        report.figures["failovers"] = fleet.stats["failovers"]
        report.figures["failover_s"] = fleet.failover_s
    if drained:
        report.checks["drained"] = (True, f"all {cfg.workers} workers finished their plans")
    else:
        report.checks["drained"] = (False, f"workers still running after {cfg.timeout_s:.0f} s")
    return report
