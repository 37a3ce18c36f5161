"""``flowdecision chaos --sink temporal://…``: after the dispatchers' run, drain the
outbox into a real Temporal server through ``flowdecision relay`` processes that
deliver :data:`RELAY_CONCURRENCY` runs at once and are SIGKILLed and restarted, then
check what Temporal applied.

The harness runs its own worker (:mod:`.temporal_run`, in a process of its own)
for the workflow type :data:`~.temporal_run.CHAOS_WORKFLOW` on a task queue of
its own, so only a Temporal server is needed. The checks: the relay's cursor
reached the outbox's newest row; every decision in the outbox was applied by the
workflow exactly once (a relay killed after Temporal's accept and before its
cursor's advance redelivers: Temporal must absorb it); each run in ``seq`` order; and
no row was parked (Temporal refused none).
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from ..errors import InvalidArgumentError
from .config import ChaosConfig

__all__ = ["RELAY_NAME", "chaos_sink_url", "run_relay_phase"]

#: The relay cursor the harness drains with.
RELAY_NAME = "chaos"
#: Relays killed before the last one is left to finish.
MAX_RELAY_KILLS = 6
#: Runs each relay delivers at once: the kills land among concurrent deliveries.
RELAY_CONCURRENCY = 16


def chaos_sink_url(cfg: ChaosConfig) -> tuple[str, str, str, str]:
    """``(sink URL, address, namespace, task queue)`` for ``cfg.sink``: the harness's own
    task queue and workflow unless the URL names them (a workflow must be the harness's)."""
    from .temporal_run import CHAOS_WORKFLOW

    assert cfg.sink is not None
    parts = urlsplit(cfg.sink)
    if parts.scheme != "temporal" or not parts.netloc:
        raise InvalidArgumentError(
            f"--sink must be temporal://host:port[/namespace], got {cfg.sink!r}"
        )
    params = dict(parse_qsl(parts.query))
    params.setdefault("task_queue", f"flowdecision-chaos-{cfg.run_id}")
    params.setdefault("workflow", CHAOS_WORKFLOW)
    if params["workflow"] != CHAOS_WORKFLOW:
        raise InvalidArgumentError(
            f"--sink: chaos delivers to its own workflow `{CHAOS_WORKFLOW}`; leave `workflow` out"
        )
    namespace = parts.path.strip("/") or "default"
    url = f"temporal://{parts.netloc}/{namespace}?{urlencode(params)}"
    return url, parts.netloc, namespace, params["task_queue"]


def _python(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as err:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=err)


async def _cursor(outbox_url: str) -> tuple[int, int]:
    """``(cursor position, newest seq)`` of the harness's relay."""
    from ..sinks.outbox import OutboxSink

    async with OutboxSink(outbox_url) as outbox:
        states = await outbox.cursors(RELAY_NAME)
        if states:
            return states[0].position, states[0].head_seq
        rows = await outbox.fetch(after=0, limit=1)
        return 0, (1 if rows else 0)


async def _parked(outbox_url: str) -> list[str]:
    """The decisions the harness's relay parked or holds (none, when all went well)."""
    from ..sinks.outbox import OutboxSink

    async with OutboxSink(outbox_url) as outbox:
        return [row.decision_id for row in await outbox.parked(RELAY_NAME)]


async def _rows(outbox_url: str) -> list[tuple[str, str]]:
    """Every outbox row's ``(run_id, decision_id)``, in seq order."""
    from ..sinks.outbox import OutboxSink

    found: list[tuple[str, str]] = []
    async with OutboxSink(outbox_url) as outbox:
        after = 0
        while page := await outbox.fetch(after=after, limit=5000):
            found += [(entry.request.run_id, entry.decision_id) for entry in page]
            after = page[-1].seq
    return found


async def _effects(address: str, namespace: str, run_ids: set[str]) -> dict[str, list[str]]:
    from temporalio.client import Client

    from .temporal_run import EFFECTS_QUERY

    client = await Client.connect(address, namespace=namespace)
    return {
        run_id: list(await client.get_workflow_handle(run_id).query(EFFECTS_QUERY))
        for run_id in sorted(run_ids)
    }


def run_relay_phase(cfg: ChaosConfig, workdir: Path) -> tuple[dict[str, tuple[bool, str]], int]:
    """Drain the outbox through killed and restarted relays; the checks and the kill count."""
    assert cfg.outbox_url is not None
    sink_url, address, namespace, queue = chaos_sink_url(cfg)
    rng = random.Random(cfg.seed)
    log = workdir / "relay-phase.log"
    worker = _python("flowdecision.chaos.temporal_run", address, namespace, queue, log=log)
    relay: subprocess.Popen[bytes] | None = None
    kills = 0
    deadline = time.monotonic() + cfg.timeout_s
    try:
        assert worker.stdout is not None
        if b"ready" not in worker.stdout.readline():
            return {"relay_worker": (False, f"the chaos worker did not start (see {log})")}, 0
        argv = ("flowdecision.cli", "relay", "--from", cfg.outbox_url, "--to", sink_url,
                "--name", RELAY_NAME, "--batch", "25", "--lease-ms", "500",
                "--concurrency", str(RELAY_CONCURRENCY),
                "--retry-cap-s", "1", "--log-level", "warning")  # fmt: skip
        while time.monotonic() < deadline:
            relay = _python(*argv, log=log)
            if kills >= MAX_RELAY_KILLS:  # the last one runs until caught up
                while time.monotonic() < deadline:
                    position, head = asyncio.run(_cursor(cfg.outbox_url))
                    if position >= head:
                        break
                    time.sleep(0.1)
                break
            time.sleep(rng.uniform(0.3, max(0.6, 2 * cfg.kill_every_ms / 1000)))
            relay.send_signal(signal.SIGKILL)  # mid-batch, most likely
            relay.wait()
            kills += 1
        return _check(cfg, address, namespace), kills  # queries need the worker: before it stops
    finally:
        for proc in (relay, worker):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _check(cfg: ChaosConfig, address: str, namespace: str) -> dict[str, tuple[bool, str]]:
    assert cfg.outbox_url is not None
    position, head = asyncio.run(_cursor(cfg.outbox_url))
    rows = asyncio.run(_rows(cfg.outbox_url))
    parked = asyncio.run(_parked(cfg.outbox_url))
    checks: dict[str, tuple[bool, str]] = {
        "relay_delivered": (
            position >= head and not parked,
            f"relay cursor at seq {position} of {head} ({len(rows)} outbox rows); "
            f"{len(parked)} parked or held",
        )
    }
    effects = asyncio.run(_effects(address, namespace, {run for run, _ in rows}))
    applied: list[str] = [decision for run in sorted(effects) for decision in effects[run]]
    expected = [decision for _, decision in rows]
    counts: dict[str, int] = {}
    for decision in applied:
        counts[decision] = counts.get(decision, 0) + 1
    twice = sorted(d for d, n in counts.items() if n > 1)
    missing = sorted(set(expected) - set(counts))
    extra = sorted(set(counts) - set(expected))
    checks["engine_exactly_once"] = (
        not twice and not missing and not extra,
        f"{len(counts)} of {len(expected)} decisions applied by Temporal; "
        f"{len(twice)} twice, {len(missing)} missing, {len(extra)} unknown",
    )
    order: dict[str, list[str]] = {}
    for run, decision in rows:
        order.setdefault(run, []).append(decision)
    in_order = all(effects.get(run, []) == ids for run, ids in order.items())
    checks["engine_seq_order"] = (in_order, "each run applied its decisions in outbox seq order")
    return checks
