"""The outbox relay against the engine alone, side by side, into real Temporal and Restate.

    .venv/bin/python bench/relay_throughput_bench.py                   # 3 rounds
    .venv/bin/python bench/relay_throughput_bench.py --rounds 5 --only restate,poison

Real engines, started once (tests/engine_servers.py): a Temporal dev server with a
worker process (tests/temporal_workflows.py: ``PlainFlowRun`` for run mode,
``HandleDecision`` for start mode) and a Restate server with
examples/restate_service.py registered (the ``DecisionRun`` virtual object keyed
by run). Per target and round, the same decisions shape (``--runs`` runs of
``--per-run`` decisions each, new ids every time):

* **engine alone**: ``--clients`` (64) concurrent clients of the engine's own SDK or
  ingress -- the flowdecision sink object, i.e. temporalio's client or an HTTP POST
  to Restate's ingress -- each submitting whole runs, a run's decisions in order;
* **relay**: the same decisions written to a fresh SQLite outbox first (not
  timed), then ``OutboxRelay(...).drain()`` timed, at ``--concurrency`` runs at once.

Before each side the engines' processes must be idle (under 15% of a core): Temporal
runs started workflows after it answered, and that backlog must not slow the next
side. The sides alternate which goes first.

Rates are decisions per second; the ratio is relay / engine alone, per round.

Two more parts:

* **poison**: a local webhook receiver (2 ms per request), 100 runs of 10; the
  relay drains it whole, and again with run 50's third decision refused with HTTP
  400 (parked, its run held): the other 99 runs' delivered/s against the clean run.
* **sigkill**: ``flowdecision relay`` processes into Temporal (run mode, the
  ``FlowRun`` workflow that records its effects) SIGKILLed every 2 s until the
  cursor reaches the last row; then every run's effects are read back: decisions
  lost, and decisions applied twice (both must be 0).

Results: stdout, ``bench/results/relay-throughput.md`` and ``.json`` (``--out`` names
another file). Besides the rates, each engine round records the CPU time per decision
of this process (the clients, or the relay with its reader thread) and of the engines'
processes, over the timed part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tests.engine_servers import (  # noqa: E402
    RestateDeployment,
    RestateServer,
    TemporalServer,
    TemporalWorkerProcess,
)
from tests.webhook_receiver import WebhookReceiver  # noqa: E402

from flowdecision.core.model import DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402
from flowdecision.sinks import OutboxSink  # noqa: E402
from flowdecision.sinks.loader import close_sink, open_sink  # noqa: E402
from flowdecision.sinks.relay import OutboxRelay  # noqa: E402

QUEUE = "bench-relay-throughput"
RESULTS = HERE / "results"


def decisions(runs: int, per_run: int) -> list[list[DecisionRequest]]:
    """``runs`` runs of ``per_run`` new decisions each."""
    tag = uuid.uuid4().hex[:8]
    return [
        [
            DecisionRequest(
                decision_id=f"{tag}-r{run}-d{index}",
                run_id=f"{tag}-r{run}",
                authority_branch_id="production",
                causation_event_id=f"{tag}-r{run}-e{index}",
                decision=ScheduleStep(
                    step=DecisionStep(step_id=f"s{index}", step_name="fetch", input={"n": index})
                ),
            )
            for index in range(per_run)
        ]
        for run in range(runs)
    ]


async def engine_alone(url: str, runs: list[list[DecisionRequest]], clients: int) -> float:
    """Decisions/s of ``clients`` concurrent clients, each submitting whole runs in order."""
    sink = await open_sink(url)
    try:
        queue: asyncio.Queue[list[DecisionRequest]] = asyncio.Queue()
        for run in runs:
            queue.put_nowait(run)

        async def client() -> None:
            while not queue.empty():
                for request in queue.get_nowait():
                    await sink.submit(request, 1)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return sum(map(len, runs)) / (time.perf_counter() - started)
    finally:
        await close_sink(sink)


async def fill(folder: Path, runs: list[list[DecisionRequest]]) -> str:
    """A fresh SQLite outbox holding the runs' decisions, each run's one after the other
    (as an agent proposes them): the relay needs many runs in its window to fill its
    lanes, the harder case for it."""
    url = f"sqlite:///{folder / f'outbox-{uuid.uuid4().hex[:6]}.db'}"
    async with OutboxSink(url) as outbox:
        for run in runs:
            for request in run:
                await outbox.submit(request, 1)
    return url


async def relay_drain(url: str, outbox_url: str, concurrency: int) -> tuple[float, Any]:
    """Decisions/s of one relay draining the outbox into ``url``; and its status."""
    async with OutboxSink(outbox_url) as outbox:
        relay = OutboxRelay(outbox, url, concurrency=concurrency, name="bench")
        try:
            rows = await outbox.count()
            started = time.perf_counter()
            delivered = await relay.drain()
            seconds = time.perf_counter() - started
            status = await relay.refresh()
        finally:
            await relay.close()
    assert delivered <= rows
    return delivered / seconds, status


def load() -> float:
    return os.getloadavg()[0]


#: The engines' processes (servers, worker, Restate service): :func:`quiesce` watches them.
ENGINE_PIDS: list[int] = []


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def quiesce(limit_s: float = 90.0) -> float:
    """Wait until the engines are idle (under 15% of a core over 0.5 s): a side must not
    pay for the work the previous one left queued (Temporal runs the started workflows
    after answering). Returns the seconds waited."""
    started = time.monotonic()
    hz = os.sysconf("SC_CLK_TCK")
    while time.monotonic() - started < limit_s:
        before = _cpu_ticks(ENGINE_PIDS)
        time.sleep(0.5)
        if (_cpu_ticks(ENGINE_PIDS) - before) / hz / 0.5 < 0.15:
            break
    return time.monotonic() - started


async def engines_part(args: argparse.Namespace, urls: dict[str, str], folder: Path) -> dict:
    results: dict[str, dict[str, list[float]]] = {}
    targets = [t for t in ("temporal-run", "temporal-start", "restate") if t in args.only]
    for round_ in range(1, args.rounds + 1):
        for target in targets:
            runs_n = args.runs if target == "restate" else args.temporal_runs
            per_run = args.per_run
            order = ("alone", "relay") if round_ % 2 else ("relay", "alone")
            row = results.setdefault(
                target,
                {key: [] for key in ("alone", "relay", "ratio", "cpu_alone", "cpu_relay",
                                     "engines_alone", "engines_relay")},
            )  # fmt: skip
            got: dict[str, float] = {}
            for side in order:
                runs = decisions(runs_n, per_run)
                outbox = await fill(folder, runs) if side == "relay" else ""
                quiesce()
                own, engines = time.process_time(), _cpu_ticks(ENGINE_PIDS)
                if side == "alone":
                    got[side] = await engine_alone(urls[target], runs, args.clients)
                else:
                    got[side], status = await relay_drain(urls[target], outbox, args.concurrency)
                    assert status.parked_rows == 0, status
                rows = runs_n * per_run
                # CPU per decision (µs): this process (the clients or the relay, every
                # thread) and the engines' processes, over the timed part.
                row[f"cpu_{side}"].append((time.process_time() - own) / rows * 1e6)
                engine_s = (_cpu_ticks(ENGINE_PIDS) - engines) / os.sysconf("SC_CLK_TCK")
                row[f"engines_{side}"].append(engine_s / rows * 1e6)
                row[side].append(got[side])
            row["ratio"].append(got["relay"] / got["alone"])
            print(
                f"round {round_} {target:15} alone {got['alone']:8.1f}/s  relay "
                f"{got['relay']:8.1f}/s  ratio {got['relay'] / got['alone']:.2f}  "
                f"CPU/decision own {row['cpu_alone'][-1]:.0f} vs {row['cpu_relay'][-1]:.0f} µs, "
                f"engines {row['engines_alone'][-1]:.0f} vs {row['engines_relay'][-1]:.0f} µs  "
                f"load {load():.1f}",
                flush=True,
            )
    return results


async def poison_part(args: argparse.Namespace, folder: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"clean": [], "poisoned": [], "ratio": []}
    with WebhookReceiver() as receiver:
        receiver.delay_s = 0.002
        for round_ in range(1, args.rounds + 1):
            got: dict[str, float] = {}
            for side in ("clean", "poisoned") if round_ % 2 else ("poisoned", "clean"):
                runs = decisions(100, 10)
                receiver.refuse = {runs[50][2].decision_id} if side == "poisoned" else set()
                outbox = await fill(folder, runs)
                got[side], status = await relay_drain(receiver.url, outbox, args.concurrency)
                expected = (1, 7) if side == "poisoned" else (0, 0)
                assert (status.parked_rows, status.held_rows) == expected, status
                out[side].append(got[side])
            out["ratio"].append(got["poisoned"] / got["clean"])
            print(
                f"round {round_} poison          clean {got['clean']:8.1f}/s  poisoned "
                f"{got['poisoned']:8.1f}/s  ratio {got['poisoned'] / got['clean']:.2f}",
                flush=True,
            )
    return out


def sigkill_part(args: argparse.Namespace, server: TemporalServer, folder: Path) -> dict:
    """Relay processes SIGKILLed every 2 s into Temporal; lost and twice-applied decisions."""
    runs = decisions(args.temporal_runs, args.per_run)
    outbox = asyncio.run(fill(folder, runs))
    url = server.url(QUEUE, "FlowRun")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    argv = [sys.executable, "-m", "flowdecision.cli", "relay", "--from", outbox, "--to", url,
            "--name", "bench-kill", "--lease-ms", "1000", "--log-level", "warning"]  # fmt: skip
    kills = 0
    started = time.perf_counter()
    with (folder / "sigkill.log").open("ab") as log:
        while True:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
            time.sleep(2.0)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            position, head = asyncio.run(_cursor(outbox))
            if position >= head:
                break
            kills += 1
    seconds = time.perf_counter() - started
    expected = {run[0].run_id: [d.decision_id for d in run] for run in runs}
    # An update Temporal accepted is durable, but its handler runs when the worker gets
    # to it: read the effects until every decision shows (or two minutes pass).
    settle = time.monotonic() + 120
    while True:
        effects = asyncio.run(_effects(server.address, list(expected)))
        shown = sum(len(applied) for applied in effects.values())
        if shown >= sum(map(len, expected.values())) or time.monotonic() > settle:
            break
        time.sleep(1.0)
    counts = Counter(d for applied in effects.values() for d in applied)
    lost = sum(1 for run in expected.values() for d in run if counts[d] == 0)
    twice = sum(1 for n in counts.values() if n > 1)
    in_order = all(effects[run_id] == ids for run_id, ids in expected.items())
    parked = asyncio.run(_parked(outbox))
    result = {
        "parked": parked,
        "decisions": sum(map(len, runs)),
        "kills": kills,
        "seconds": round(seconds, 1),
        "lost": lost,
        "twice": twice,
        "in_order": in_order,
    }
    print(f"sigkill: {result}", flush=True)
    return result


async def _parked(outbox_url: str) -> int:
    async with OutboxSink(outbox_url) as outbox:
        return len(await outbox.parked("bench-kill"))


async def _cursor(outbox_url: str) -> tuple[int, int]:
    async with OutboxSink(outbox_url) as outbox:
        states = await outbox.cursors("bench-kill")
        if states:
            return states[0].position, states[0].head_seq
        return 0, await outbox.count()


async def _effects(address: str, run_ids: list[str]) -> dict[str, list[str]]:
    from temporalio.client import Client

    client = await Client.connect(address)
    found: dict[str, list[str]] = {}
    for run_id in run_ids:
        effects = await client.get_workflow_handle(run_id).query("effects")
        found[run_id] = [effect[1] for effect in effects]
    return found


def cell(values: list[float], digits: int = 0) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--runs", type=int, default=256, help="runs per Restate round")
    parser.add_argument("--temporal-runs", type=int, default=128, help="runs per Temporal round")
    parser.add_argument("--per-run", type=int, default=5)
    parser.add_argument(
        "--only", default="temporal-run,temporal-start,restate,poison,sigkill", type=str
    )
    parser.add_argument(
        "--out", default="relay-throughput", help="results file name in bench/results/, no suffix"
    )
    args = parser.parse_args()
    args.only = set(args.only.split(","))
    folder = Path(tempfile.mkdtemp(prefix="fd-bench-relay-"))
    processes: list[Any] = []
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "only"}}
    try:
        urls: dict[str, str] = {}
        temporal = None
        if args.only & {"temporal-run", "temporal-start", "sigkill"}:
            temporal = TemporalServer(folder / "temporal").start()
            processes.append(TemporalWorkerProcess(temporal, QUEUE).start())
            processes.append(temporal)
            urls["temporal-run"] = temporal.url(QUEUE, "PlainFlowRun")
            urls["temporal-start"] = temporal.url(QUEUE, "HandleDecision", mode="start")
        if "restate" in args.only:
            restate = RestateServer(folder / "restate").start()
            processes.append(restate)
            deployment = RestateDeployment(
                "examples.restate_service:app", folder / "restate"
            ).start()
            processes.insert(0, deployment)
            restate.register(deployment.uri)
            urls["restate"] = restate.url("DecisionRun", "apply", keyed_by_run=True)
        ENGINE_PIDS.extend(p.proc.pid for p in processes if p.proc is not None)
        report["engines"] = asyncio.run(engines_part(args, urls, folder))
        if "poison" in args.only:
            report["poison"] = asyncio.run(poison_part(args, folder))
        if "sigkill" in args.only and temporal is not None:
            report["sigkill"] = sigkill_part(args, temporal, folder)
    finally:
        for process in processes:
            process.stop()
    lines = [
        f"{args.clients} clients alone vs a relay at --concurrency {args.concurrency}; runs "
        f"of {args.per_run} decisions ({args.temporal_runs} runs per Temporal round, "
        f"{args.runs} per Restate round); {args.rounds} alternating rounds; medians "
        "(min-max) of decisions/s, and of the per-round ratio.",
        "",
        "| target | engine alone | relay | relay / alone | CPU µs/decision, this process: "
        "alone / relay | engines' CPU µs/decision: alone / relay |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for target, row in report["engines"].items():
        lines.append(
            f"| {target} | {cell(row['alone'])} | {cell(row['relay'])} | {cell(row['ratio'], 2)} "
            f"| {cell(row['cpu_alone'])} / {cell(row['cpu_relay'])} "
            f"| {cell(row['engines_alone'])} / {cell(row['engines_relay'])} |"
        )
    if "poison" in report:
        row = report["poison"]
        lines.append(
            f"| webhook, 1 of 100 runs poisoned | {cell(row['clean'])} (clean) "
            f"| {cell(row['poisoned'])} | {cell(row['ratio'], 2)} | | |"
        )
    if "sigkill" in report:
        s = report["sigkill"]
        lines += [
            "",
            f"SIGKILL every 2 s into Temporal (run mode): {s['decisions']} decisions, "
            f"{s['kills']} kills, {s['seconds']} s; lost {s['lost']}, applied twice "
            f"{s['twice']}, parked {s['parked']}, every run in seq order: {s['in_order']}.",
        ]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
