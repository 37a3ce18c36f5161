"""What the run invariants cost a POST (issue 40): ``serve`` with them on and off, side by side.

    flock /tmp/team/bench.lock .venv/bin/python bench/runs_bench.py                 # 5 rounds x 8 s
    flock /tmp/team/bench.lock .venv/bin/python bench/runs_bench.py --write-docs

Targets: ``flowdecision serve`` on its default layout (ledger and outbox in one SQLite
file, ``synchronous=FULL``, access log on: claim, outbox row and completion in one
commit), once with the run invariants (the default) and once with
``--no-run-invariants``, each loaded by ``wrk`` with ``POST /v1/decisions`` (a new
decision id per request, as in ``bench/service_bench.py``), for two bodies:

* ``step``: a ``schedule_step`` in a run of its own (``r-<id>``): every claim reads
  its run's record and finds none (the common case: the cost is the read);
* ``complete``: a ``complete`` in a run of its own: every POST also writes the run's
  record (reserved and closed in the same commit: the most a POST pays).

Method: ``--rounds`` rounds; in each, for each body, both configurations run back
to back, each on a fresh server and directory (warm-up ``--warmup`` s, measured
``--seconds`` s), the order flipping every round. The figure to hold against the
target (on at least 0.9x of off) is the paired ratio: the median over rounds of
on's rate over the same round's off (a shared, noisy 2-core machine drifts between
rounds; back to back it mostly does not). Server CPU per request (user + system,
from /proc) is given too. Samples go to ``bench/results/runs-bench.json``;
``--write-docs`` replaces the block in docs/BENCHMARKS.md.

``--in-process``: no server, no HTTP: a ``Dispatcher`` on the same layout
(``SqliteLedger`` and ``OutboxSink`` in one file) dispatches ``--decisions``
steps, each in a run of its own, one at a time and 32 at a time, with the
invariants on and off alternating; it prints rates and this process's CPU per
decision (the invariants' own cost, without the service around it). With
``--postgres`` the ledger is PostgreSQL (a throwaway durable server, or
``--postgres-url``), 32 at a time, joint with an outbox in the same database and
on the claim, submit, complete path (a sink that takes everything): there
run-bound operations take the locking batch transactions (docs/PROTOCOL.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

from flowdecision import Dispatcher, PostgresLedger, open_ledger  # noqa: E402
from flowdecision.core.model import Complete, DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402
from flowdecision.sinks.outbox import OutboxSink  # noqa: E402
from ledger_bench import machine_description  # noqa: E402
from service_bench import (  # noqa: E402
    Postgres,
    Server,
    Target,
    load_average,
    process_tree_cpu_s,
    served,
    wrk,
)

RESULTS = HERE / "results" / "runs-bench.json"
DOCS = ROOT / "docs" / "BENCHMARKS.md"
POST = Target("post sqlite", "flowdecision", "post", "/v1/decisions", 201, "sqlite")
CONFIGS = {"on": [], "off": ["--no-run-invariants"]}
BODIES = ("step", "complete")


def template(body: str) -> Path:
    """The wrk body template: ``@ID@`` is each request's own id (its run's too)."""
    decision = (
        ScheduleStep(DecisionStep("@ID@-s", "fetch", {"n": 1}))
        if body == "step"
        else Complete(output={"n": 1})
    )
    request = DecisionRequest("@ID@", "r-@ID@", "production", "event-@ID@", decision)
    fd, name = tempfile.mkstemp(prefix=f"runs-bench-{body}-", suffix=".json")
    with open(fd, "wb") as out:
        out.write(request.to_json())
    return Path(name)


@contextmanager
def serving(config: str) -> Iterator[Server]:
    cwd = Path(tempfile.mkdtemp(prefix="runs-bench-"))
    argv = [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0", *CONFIGS[config]]
    with served(argv, cwd) as server:
        yield server


@dataclass
class Sample:
    body: str
    config: str
    round: int
    rate: float
    cpu_ms: float
    p99_ms: float
    bad: int
    load: float


def measure(body: str, config: str, round_: int, args: argparse.Namespace, path: Path) -> Sample:
    with serving(config) as server:
        wrk(POST, server.url, args.clients, args.warmup, path)
        load = load_average()
        cpu_before = process_tree_cpu_s(server.proc.pid)
        data, _ = wrk(POST, server.url, args.clients, args.seconds, path)
        cpu_s = process_tree_cpu_s(server.proc.pid) - cpu_before
    ok = data["ok"]
    sample = Sample(
        body, config, round_, ok / (data["duration_us"] / 1e6),
        1000 * cpu_s / ok if ok else 0.0, data["p99_us"] / 1000,
        data["bad"] + data["timeouts"] + data["connect_errors"] + data["read_errors"], load,
    )  # fmt: skip
    print(
        f"  round {round_} {body:<8} {config:<3} {sample.rate:8,.0f}/s  "
        f"cpu {sample.cpu_ms:.3f} ms/req  p99 {sample.p99_ms:.1f} ms  load {load:.1f}"
        f"{f'  FAILED {sample.bad}' if sample.bad else ''}",
        flush=True,
    )
    return sample


def report(samples: list[Sample], args: argparse.Namespace) -> str:
    lines = [
        f"`flock /tmp/team/bench.lock .venv/bin/python bench/runs_bench.py --rounds {args.rounds} "
        f"--seconds {args.seconds} --warmup {args.warmup} --clients {args.clients}` "
        f"({datetime.date.today()}, {machine_description()}; median 1-min load average "
        f"{statistics.median(s.load for s in samples):.1f}):",
        "",
        "| body | invariants | requests/s (median, min–max) | on/off paired (min–max) "
        "| CPU ms/request | p99 ms | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for body in BODIES:
        off = {s.round: s.rate for s in samples if s.body == body and s.config == "off"}
        for config in CONFIGS:
            group = [s for s in samples if s.body == body and s.config == config]
            rates = [s.rate for s in group]
            paired = [s.rate / off[s.round] for s in group]
            ratio = (
                f"**{statistics.median(paired):.3f}×** ({min(paired):.2f}–{max(paired):.2f})"
                if config == "on"
                else "1"
            )
            lines.append(
                f"| {body} | {config} | {statistics.median(rates):,.0f} "
                f"({min(rates):,.0f}–{max(rates):,.0f}) | {ratio} "
                f"| {statistics.median(s.cpu_ms for s in group):.3f} "
                f"| {statistics.median(s.p99_ms for s in group):.1f} "
                f"| {sum(s.bad for s in group)} |"
            )
    return "\n".join(lines)


def write_docs(text: str) -> None:
    begin, end = "<!-- runs-bench:begin -->", "<!-- runs-bench:end -->"
    docs = DOCS.read_text(encoding="utf-8")
    block = f"{begin}\n{text}\n{end}"
    if begin in docs:
        docs = docs[: docs.index(begin)] + block + docs[docs.index(end) + len(end) :]
    else:
        docs = docs.rstrip("\n") + "\n\n## Run invariants: POST on vs off (issue 40)\n\n" + block
        docs += "\n"
    DOCS.write_text(docs, encoding="utf-8")


class NullSink:
    """A sink that takes every decision at once (the claim, submit, complete path)."""

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        return None


async def dispatch(
    on: bool, decisions: int, at_once: int, ledger_url: str, outbox_url: str | None, tag: str
) -> tuple[float, float]:
    """``decisions`` steps, each in a run of its own, ``at_once`` at a time, into an outbox
    (joint with the ledger when in its store) or :class:`NullSink`: (this process's CPU
    µs per decision, decisions/s)."""
    ledger = await open_ledger(ledger_url)
    ledger.run_invariants = on
    outbox = None if outbox_url is None else await OutboxSink(outbox_url).open()
    dispatcher = Dispatcher("production", outbox or NullSink(), ledger)
    requests = [
        DecisionRequest(
            f"{tag}-{i}", f"r-{tag}-{i}", "production", f"e{i}",
            ScheduleStep(DecisionStep(f"{tag}-{i}-s", "fetch", {"n": 1})),
        )
        for i in range(decisions)
    ]  # fmt: skip
    lanes = asyncio.Semaphore(at_once)

    async def one(request: DecisionRequest) -> None:
        async with lanes:
            await dispatcher.dispatch(request)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(request) for request in requests))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if outbox is not None:
        await outbox.close()
    await ledger.close()
    return 1e6 * cpu / decisions, decisions / wall


def in_process(args: argparse.Namespace) -> None:
    if not args.postgres:
        directory = Path(tempfile.mkdtemp(prefix="runs-bench-"))
        url = f"sqlite:///{directory / 'one.db'}"
        try:
            compare(args, [("sqlite, joint", url, url, 1), ("sqlite, joint", url, url, 32)])
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    server = Postgres(args.postgres_url)
    try:
        url = server.admin_url
        asyncio.run(PostgresLedger(url).migrate())
        asyncio.run(OutboxSink(url).migrate())
        split = ("postgres, claim/submit/complete", url, None, 32)
        compare(args, [("postgres, joint", url, url, 32), split])
    finally:
        server.stop()


def compare(args: argparse.Namespace, layouts: list[tuple[str, str, str | None, int]]) -> None:
    """Each layout with the invariants on and off, alternating; prints the medians."""
    for name, ledger_url, outbox_url, at_once in layouts:
        cpu: dict[bool, list[float]] = {True: [], False: []}
        rate: dict[bool, list[float]] = {True: [], False: []}
        for round_ in range(args.rounds):
            for on in (True, False) if round_ % 2 else (False, True):
                tag = f"{name[:2]}{at_once}-{round_}-{on}"
                used, done = asyncio.run(
                    dispatch(on, args.decisions, at_once, ledger_url, outbox_url, tag)
                )
                cpu[on].append(used)
                rate[on].append(done)
        on_cpu, off_cpu = statistics.median(cpu[True]), statistics.median(cpu[False])
        on_rate, off_rate = statistics.median(rate[True]), statistics.median(rate[False])
        print(
            f"{name}, {at_once} at a time: {on_rate:,.0f} vs {off_rate:,.0f} decisions/s "
            f"(on/off {on_rate / off_rate:.3f}); this process's CPU {on_cpu:.0f} vs "
            f"{off_cpu:.0f} µs/decision (on/off {on_cpu / off_cpu:.3f}); medians of "
            f"{args.rounds} alternating rounds",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--in-process", action="store_true", help="the Dispatcher alone")
    parser.add_argument("--decisions", type=int, default=4000, help="with --in-process")
    parser.add_argument(
        "--postgres", action="store_true", help="with --in-process: a PostgreSQL ledger instead"
    )
    parser.add_argument("--postgres-url", default=None, help="else a throwaway server")
    args = parser.parse_args()
    if args.in_process:
        in_process(args)
        return
    paths = {body: template(body) for body in BODIES}
    samples: list[Sample] = []
    try:
        for round_ in range(1, args.rounds + 1):
            order = list(CONFIGS) if round_ % 2 else list(reversed(CONFIGS))
            for body in BODIES:
                for config in order:
                    samples.append(measure(body, config, round_, args, paths[body]))
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps([asdict(s) for s in samples], indent=1) + "\n")
    text = report(samples, args)
    print()
    print(text)
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
