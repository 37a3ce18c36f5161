"""Relay benchmark: does the outbox relay keep up with ``serve``'s POST rate?

    .venv/bin/python bench/relay_bench.py                 # 3 rounds, 10 s of load each (~3 min)
    .venv/bin/python bench/relay_bench.py --rounds 5 --seconds 15 --clients 50

``flowdecision serve`` on its default layout (ledger and outbox in one SQLite
file, ``synchronous=FULL``) in a fresh directory, loaded with ``POST
/v1/decisions`` by wrk (``bench/wrk_service.lua``, as ``bench/service_bench.py``
does: closed loop, N keep-alive connections, every id new). The relay delivers
into a no-op sink (``bench/noop_sink.py``), so what is measured is the relay itself:
reading the outbox, the sink call, the cursor's advance. Per round, in rotating
order:

* ``serve``: the POST rate alone, then an in-process ``OutboxRelay`` drains the
  rows the run left (``drain rows/s``: rows / wall time of ``drain()``);
* ``serve --relay-to``: the relay inside the service, during the load;
* ``serve + relay process``: ``flowdecision relay`` in its own process, during the load.

For the two live layouts: POST/s during the load, rows the relay delivered
during it (from the cursor table, via ``/metrics``) per second, their ratio, the
lag left when the load stopped, and how long it took to reach lag 0.

``relay_through()`` is the relay side reused by engine benchmarks (outbox +
relay -> engine): it drains an outbox into any sink and reports rows/s and
the end-to-end latency from each row's commit to the sink's accept.

Prints a Markdown table and writes it to ``bench/results/relay.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

from flowdecision.core.model import DecisionRequest  # noqa: E402
from flowdecision.sinks import OutboxRelay, OutboxSink, Sink  # noqa: E402
from flowdecision.sinks.cursor import CursorState  # noqa: E402
from ledger_bench import machine_description  # noqa: E402
from noop_sink import NoopSink  # noqa: E402
from service_bench import Server, Target, body_template, server_env, wrk  # noqa: E402

RESULTS = HERE / "results" / "relay.md"
_NO_CURSOR = CursorState("default", 0, None, 0, 0, 0, 0, 0, None, 0)
POST = Target("post sqlite", "flowdecision", "post", "/v1/decisions", 201, "sqlite")
NOOP_URL = "python:noop_sink:NoopSink"
SOCKET_ERRORS = ("connect_errors", "read_errors", "write_errors", "timeouts")


class TimingSink:
    """Wraps a sink; records when each decision was accepted (Unix ms)."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.accepted_ms: dict[str, float] = {}

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        await self.inner.submit(request, attempt)
        self.accepted_ms.setdefault(request.decision_id, time.time() * 1000)


@dataclass(frozen=True)
class RelayFigures:
    """What :func:`relay_through` measured."""

    rows: int
    seconds: float
    #: end to end: a row's commit in the outbox -> the sink's accept, in ms
    e2e_p50_ms: float
    e2e_p99_ms: float

    @property
    def per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


async def relay_through(
    outbox_url: str, sink: Sink, *, name: str = "bench", batch: int = 500
) -> RelayFigures:
    """Drain ``outbox_url`` into ``sink`` with an :class:`OutboxRelay` (the relay side of
    the engine benchmarks); rows/s and the commit-to-accept latency of every row."""
    timing = TimingSink(sink)
    async with OutboxSink(outbox_url) as outbox:
        relay = OutboxRelay(outbox, timing, name=name, batch=batch)
        started = time.perf_counter()
        rows = await relay.drain()
        seconds = time.perf_counter() - started
        accepted_at: dict[str, int] = {}
        after = 0
        while True:
            page = await outbox.fetch(after=after, limit=5000)
            if not page:
                break
            accepted_at.update((entry.decision_id, entry.accepted_at_ms) for entry in page)
            after = page[-1].seq
    latencies = sorted(
        timing.accepted_ms[d] - accepted_at[d] for d in timing.accepted_ms if d in accepted_at
    )
    return RelayFigures(rows, seconds, _percentile(latencies, 50), _percentile(latencies, 99))


def _percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    index = min(len(values) - 1, max(0, round(pct / 100 * len(values)) - 1))
    return values[index]


def _cursor(store: str) -> CursorState | None:
    """The ``default`` relay cursor, read from the outbox's store (exact, not cached)."""

    async def read() -> list[CursorState]:
        async with OutboxSink(store) as outbox:
            return await outbox.cursors("default")

    states = asyncio.run(read())
    return states[0] if states else None


def _store(cwd: Path) -> str:
    return f"sqlite:///{cwd / '.flowdecision' / 'flowdecision.db'}"


def _live(url: str, store: str, args: argparse.Namespace, template: Path) -> dict[str, float]:
    """Load ``url`` with POSTs; the relay's pace during the load and its catch-up after."""
    deadline = time.monotonic() + 60
    while (_cursor(store) or _NO_CURSOR).fence == 0:  # the relay holds its cursor
        if time.monotonic() > deadline:
            raise RuntimeError("the relay did not start within 60 s")
        time.sleep(0.1)
    before = (_cursor(store) or _NO_CURSOR).position
    result, _output = wrk(POST, url, args.clients, args.seconds, template)
    seconds = result["duration_us"] / 1e6
    at_end = _cursor(store) or _NO_CURSOR
    delivered = at_end.position - before
    lag_at_end = at_end.lag_rows
    stopped = time.monotonic()
    while (_cursor(store) or _NO_CURSOR).lag_rows > 0:
        if time.monotonic() - stopped > 120:
            raise RuntimeError("the relay did not catch up within 120 s")
        time.sleep(0.02)
    posts = result["ok"] / seconds
    return {
        "post_per_s": posts,
        "relay_per_s": delivered / seconds,
        "ratio": (delivered / seconds) / posts if posts else 0.0,
        "lag_at_end": lag_at_end,
        "catch_up_s": time.monotonic() - stopped,
        "bad": float(result["bad"] + sum(result[k] for k in SOCKET_ERRORS)),
    }


def _round(layout: str, args: argparse.Namespace, work: Path, template: Path) -> dict[str, float]:
    cwd = Path(tempfile.mkdtemp(prefix="relay-bench-", dir=work))
    serve = [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0"]
    relay_proc: subprocess.Popen[bytes] | None = None
    try:
        if layout == "serve --relay-to":
            serve += ["--relay-to", NOOP_URL]
        server = Server(serve, cwd)
        try:
            if layout == "serve":
                result, _ = wrk(POST, server.url, args.clients, args.seconds, template)
                seconds = result["duration_us"] / 1e6
                server.stop()
                drained = asyncio.run(relay_through(_store(cwd), NoopSink()))
                return {
                    "post_per_s": result["ok"] / seconds,
                    "relay_per_s": drained.per_s,
                    "ratio": drained.per_s / (result["ok"] / seconds),
                    "bad": float(result["bad"] + sum(result[k] for k in SOCKET_ERRORS)),
                }
            if layout == "serve + relay process":
                relay_proc = subprocess.Popen(
                    [sys.executable, "-m", "flowdecision.cli", "relay", "--from", _store(cwd),
                     "--to", NOOP_URL, "--log-level", "warning"],
                    cwd=cwd, env=server_env(), stdout=subprocess.DEVNULL,
                    stderr=(cwd / "relay.stderr").open("wb"),
                )  # fmt: skip
            return _live(server.url, _store(cwd), args, template)
        finally:
            server.stop()
    finally:
        if relay_proc is not None:
            relay_proc.terminate()
            relay_proc.wait(30)
        shutil.rmtree(cwd, ignore_errors=True)


LAYOUTS = ("serve", "serve --relay-to", "serve + relay process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=50)
    args = parser.parse_args()
    template = body_template()
    work = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    samples: dict[str, list[dict[str, float]]] = {layout: [] for layout in LAYOUTS}
    try:
        for round_no in range(args.rounds):
            order = LAYOUTS[round_no % 3 :] + LAYOUTS[: round_no % 3]
            for layout in order:
                sample = _round(layout, args, work, template)
                samples[layout].append(sample)
                print(f"round {round_no + 1} {layout}: {sample}", flush=True)
    finally:
        os.unlink(template)
        shutil.rmtree(work, ignore_errors=True)
    report = _table(samples, args)
    print(report)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(report + "\n", encoding="utf-8")


def _median(samples: list[dict[str, float]], key: str) -> float:
    values = [s[key] for s in samples if key in s]
    return statistics.median(values) if values else float("nan")


def _table(samples: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    lines = [
        f"Relay benchmark: {args.rounds} interleaved rounds, {args.seconds} s of wrk POST load "
        f"at {args.clients} clients per layout, medians. {machine_description()}.",
        "",
        "| layout | POST/s | relay rows/s | relay ÷ POST | lag at end (rows) | catch-up (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for layout, runs in samples.items():
        kind = "drain after the load" if layout == "serve" else "during the load"
        lag = "" if layout == "serve" else f"{_median(runs, 'lag_at_end'):.0f}"
        catch = "" if layout == "serve" else f"{_median(runs, 'catch_up_s'):.2f}"
        lines.append(
            f"| {layout} ({kind}) | {_median(runs, 'post_per_s'):.0f} | "
            f"{_median(runs, 'relay_per_s'):.0f} | {_median(runs, 'ratio'):.2f}× | {lag} | "
            f"{catch} |"
        )
    bad = sum(s.get("bad", 0) for runs in samples.values() for s in runs)
    lines.append("")
    lines.append(f"Non-201 answers or socket errors over all runs: {bad:.0f}.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
