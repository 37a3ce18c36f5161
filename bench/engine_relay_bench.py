"""Inline engine sink vs outbox + relay, into Temporal and into Restate, side by side.

    .venv/bin/python bench/engine_relay_bench.py                 # 3 rounds, 10 s each
    .venv/bin/python bench/engine_relay_bench.py --rounds 5 --seconds 15 --clients 16
    .venv/bin/python bench/engine_relay_bench.py --write-docs    # then update docs/BENCHMARKS.md

Real engines, started once (tests/engine_servers.py): a Temporal dev server with
a worker process (``PlainFlowRun`` of tests/temporal_workflows.py: run mode, no-op
hooks) and a Restate server with examples/restate_service.py registered (the
``DecisionRun`` virtual object keyed by run id). For each engine, two targets,
each a fresh ``flowdecision serve`` in a fresh directory:

* **inline**: ``serve --ledger sqlite:///… --sink <engine URL>``: the POST waits
  for the engine (Temporal: ``wait=accepted``; Restate: ``/send`` accepted);
* **relay**: ``serve`` with its default layout (ledger and outbox in one SQLite
  file, one transaction per decision) and, beside it, ``flowdecision relay
  --from <that file> --to <engine URL>`` (or ``serve --relay-to`` with
  ``--relay-in-serve``): the POST commits locally, the relay delivers.

Load: ``wrk`` (bench/wrk_service.lua), ``--clients`` keep-alive connections for
``--seconds``, each POST a new decision; ``--run-size`` consecutive decisions
of a connection share a run id (one Temporal workflow, one Restate object key).

Measured per target and round:

* **accepted/s**: POSTs answered 201 per second of load;
* **POST p99**: wrk's 99th percentile POST latency;
* **delivered/s**: decisions the engine accepted, per second from the start of
  the load until the last one was delivered. Inline, that is the POST answer
  itself. Relay: the relay's cursor (``flow_decision_outbox_cursor``, advanced
  only after the engine accepted) is sampled every 20 ms until it reaches the
  last row;
* **delivery p99**: accepted (the outbox row's ``accepted_at_ms``) to delivered
  (the first cursor sample at or past the row), 99th percentile; inline it is
  the POST p99.

Method: ``--rounds`` interleaved rounds, the starting target rotating, medians
over rounds; the 1-minute load average is printed with each sample because
this is a shared 2-vCPU machine. Results: stdout, ``bench/results/engine-relay.md``
and ``.json``; ``--write-docs`` replaces the table in docs/BENCHMARKS.md between
``<!-- engine-relay:begin -->`` and ``<!-- engine-relay:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
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
from tests.service_process import ServiceProcess  # noqa: E402

from flowdecision.core.model import DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402

LUA = HERE / "wrk_service.lua"
RESULTS = HERE / "results"
DOCS = ROOT / "docs" / "BENCHMARKS.md"
QUEUE = "bench-engine-relay"
RELAY_NAME = "bench"


class BenchError(Exception):
    """The benchmark could not run (a missing tool, a server that did not start)."""


@dataclass
class Sample:
    engine: str
    layout: str
    round: int
    seconds: float
    accepted: int
    bad: int
    post_p99_ms: float
    delivered_s: float
    delivery_p99_ms: float
    load: float
    delivered: int = -1  # -1: all accepted ones
    notes: list[str] = field(default_factory=list)

    @property
    def accepted_rate(self) -> float:
        return self.accepted / self.seconds if self.seconds else 0.0

    @property
    def delivered_rate(self) -> float:
        delivered = self.accepted if self.delivered < 0 else self.delivered
        return delivered / self.delivered_s if self.delivered_s else 0.0


def template(path: Path) -> Path:
    request = DecisionRequest(
        decision_id="@ID@",
        run_id="@RUN@",
        authority_branch_id="production",
        causation_event_id="event-@ID@",
        decision=ScheduleStep(
            step=DecisionStep(step_id="@ID@-s", step_name="fetch", input={"n": 1})
        ),
    )
    path.write_bytes(request.to_json())
    return path


def wrk(url: str, args: argparse.Namespace, body: Path) -> dict[str, Any]:
    binary = shutil.which("wrk")
    if binary is None:
        raise BenchError("wrk is not installed: `make wrk` (apt-get install -y wrk)")
    argv = [
        binary, "-t1", f"-c{args.clients}", f"-d{args.seconds}s", "--timeout", "60s",
        "-s", str(LUA), url, "--", "post", "/v1/decisions", "201", str(body),
        uuid.uuid4().hex[:10], str(args.run_size),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.seconds + 300)
    for line in done.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            data: dict[str, Any] = json.loads(line[len("WRK_JSON ") :])
            return data
    raise BenchError(f"wrk failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


class CursorSampler:
    """Samples (time, relay cursor position) every 20 ms from the outbox's SQLite file."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CursorSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _read(self) -> int:
        try:
            with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=1) as conn:
                row = conn.execute(
                    "SELECT position FROM flow_decision_outbox_cursor WHERE name = ?",
                    (RELAY_NAME,),
                ).fetchone()
        except sqlite3.Error:
            return 0
        return int(row[0]) if row else 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._read()))
            self._stop.wait(0.02)

    def position(self) -> int:
        return self.samples[-1][1] if self.samples else 0


def outbox_rows(db: Path) -> list[tuple[int, int]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return [
            (int(seq), int(at))
            for seq, at in conn.execute(
                "SELECT seq, accepted_at_ms FROM flow_decision_outbox ORDER BY seq"
            )
        ]


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_inline(engine: str, url: str, args: argparse.Namespace, body: Path, round_: int) -> Sample:
    folder = Path(tempfile.mkdtemp(prefix="fd-bench-inline-"))
    try:
        ledger = f"sqlite:///{folder / 'ledger.db'}"
        with ServiceProcess(folder, "--ledger", ledger, "--sink", url, "--no-access-log") as serve:
            load = os.getloadavg()[0]
            data = wrk(serve.url, args, body)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seconds = data["duration_us"] / 1e6
    p99_ms = data["p99_us"] / 1000
    return Sample(engine, "inline", round_, seconds, data["ok"], data["bad"], p99_ms,
                  seconds, p99_ms, load)  # fmt: skip


def run_relay(engine: str, url: str, args: argparse.Namespace, body: Path, round_: int) -> Sample:
    folder = Path(tempfile.mkdtemp(prefix="fd-bench-relay-"))
    db = folder / ".flowdecision" / "flowdecision.db"
    relay: subprocess.Popen[bytes] | None = None
    extra = ["--relay-to", url] if args.relay_in_serve else []
    try:
        with ServiceProcess(folder, "--no-access-log", *extra) as serve:
            if not args.relay_in_serve:
                env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
                relay = subprocess.Popen(
                    [sys.executable, "-m", "flowdecision.cli", "relay", "--from",
                     f"sqlite:///{db}", "--to", url, "--name", RELAY_NAME],
                    cwd=folder, env=env, stdout=subprocess.DEVNULL,
                    stderr=(folder / "relay.log").open("wb"),
                )  # fmt: skip
            with CursorSampler(db) as sampler:
                load = os.getloadavg()[0]
                started = time.time()
                data = wrk(serve.url, args, body)
                rows = outbox_rows(db)
                last = rows[-1][0] if rows else 0
                deadline = time.time() + args.drain_timeout
                while sampler.position() < last and time.time() < deadline:
                    if relay is not None and relay.poll() is not None:
                        log = (folder / "relay.log").read_text(errors="replace")[-3000:]
                        raise BenchError(f"the relay exited ({relay.returncode}):\n{log}")
                    time.sleep(0.05)
    finally:
        if relay is not None:
            relay.terminate()
            relay.wait(30)
        shutil.rmtree(folder, ignore_errors=True)
    samples = sampler.samples
    caught_up = sampler.position() >= last
    delivered_at: list[float] = []
    index = 0
    for seq, accepted_ms in rows:
        while index < len(samples) and samples[index][1] < seq:
            index += 1
        if index == len(samples):
            break
        delivered_at.append(samples[index][0] - accepted_ms / 1000)
    end = samples[min(index, len(samples) - 1)][0] if caught_up else samples[-1][0]
    sample = Sample(
        engine, "relay", round_, data["duration_us"] / 1e6, data["ok"], data["bad"],
        data["p99_us"] / 1000, end - started, p99([d * 1000 for d in delivered_at]), load,
    )  # fmt: skip
    if not caught_up:
        sample.delivered = len(delivered_at)
        sample.notes.append(
            f"the relay had delivered {len(delivered_at)} of {len(rows)} rows "
            f"{args.drain_timeout:.0f} s after the load ended"
        )
    return sample


def start_engines(folder: Path) -> tuple[list[Any], dict[str, str]]:
    temporal = TemporalServer(folder / "temporal").start()
    worker = TemporalWorkerProcess(temporal, QUEUE).start()
    restate = RestateServer(folder / "restate").start()
    deployment = RestateDeployment("examples.restate_service:app", folder / "restate").start()
    restate.register(deployment.uri)
    urls = {
        "Temporal": temporal.url(QUEUE, "PlainFlowRun"),
        "Restate": restate.url("DecisionRun", "apply", keyed_by_run=True),
    }
    return [worker, deployment, temporal, restate], urls


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def table(samples: list[Sample], args: argparse.Namespace) -> str:
    lines = [
        f"{args.clients} wrk connections, {args.seconds} s per run, runs of {args.run_size} "
        f"decisions, {args.rounds} interleaved rounds; medians (min-max) over rounds.",
        "",
        "| engine | layout | accepted/s | POST p99 ms | delivered/s | delivery p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for engine in ("Temporal", "Restate"):
        for layout in ("inline", "relay"):
            rows = [s for s in samples if s.engine == engine and s.layout == layout]
            if not rows:
                continue
            acc = [s.accepted_rate for s in rows]
            dlv = [s.delivered_rate for s in rows]
            lines.append(
                f"| {engine} | {'inline sink' if layout == 'inline' else 'outbox + relay'} "
                f"| {median(acc):.0f} ({min(acc):.0f}-{max(acc):.0f}) "
                f"| {median([s.post_p99_ms for s in rows]):.0f} "
                f"| {median(dlv):.0f} ({min(dlv):.0f}-{max(dlv):.0f}) "
                f"| {median([s.delivery_p99_ms for s in rows]):.0f} |"
            )
    loads = [s.load for s in samples]
    lines += ["", f"1-minute load average during the runs: {min(loads):.1f}-{max(loads):.1f}."]
    notes = [f"{s.engine} {s.layout} round {s.round}: {n}" for s in samples for n in s.notes]
    bad = [f"{s.engine} {s.layout} round {s.round}: {s.bad} non-201" for s in samples if s.bad]
    if notes or bad:
        lines += ["", *[f"- {n}" for n in notes + bad]]
    return "\n".join(lines)


def write_docs(text: str) -> None:
    begin, end = "<!-- engine-relay:begin -->", "<!-- engine-relay:end -->"
    docs = DOCS.read_text()
    if begin not in docs:
        raise BenchError(f"{DOCS} has no {begin} … {end} markers")
    head, _, rest = docs.partition(begin)
    _, _, tail = rest.partition(end)
    DOCS.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--run-size", type=int, default=10)
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    parser.add_argument("--engines", default="Temporal,Restate")
    parser.add_argument(
        "--relay-in-serve",
        action="store_true",
        help="serve --relay-to URL instead of a separate relay process",
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fd-bench-engines-"))
    body = template(folder / "body.json")
    processes, urls = start_engines(folder)
    samples: list[Sample] = []
    try:
        targets = [
            (engine, layout) for engine in args.engines.split(",") for layout in ("inline", "relay")
        ]
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(targets)
            for engine, layout in targets[shift:] + targets[:shift]:
                runner = run_inline if layout == "inline" else run_relay
                sample = runner(engine, urls[engine], args, body, round_)
                samples.append(sample)
                print(
                    f"round {round_} {engine:8} {layout:6} accepted/s {sample.accepted_rate:7.1f} "
                    f"POST p99 {sample.post_p99_ms:7.0f} ms  delivered/s "
                    f"{sample.delivered_rate:7.1f}  delivery p99 {sample.delivery_p99_ms:7.0f} ms "
                    f" load {sample.load:.1f} {' '.join(sample.notes)}",
                    flush=True,
                )
    finally:
        for process in processes:
            process.stop()
        shutil.rmtree(folder, ignore_errors=True)
    text = table(samples, args)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine-relay.md").write_text(text + "\n")
    (RESULTS / "engine-relay.json").write_text(
        json.dumps([asdict(s) for s in samples], indent=2) + "\n"
    )
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
