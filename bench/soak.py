"""Soak: ``flowdecision serve`` on its default layout at a fixed rate, for a long time.

    .venv/bin/python bench/soak.py                                  # 500/s for 30 min
    .venv/bin/python bench/soak.py --rate 200 --minutes 2 --warmup-s 20   # a short one
    .venv/bin/python bench/soak.py --minutes 30 --write-docs        # then docs/BENCHMARKS.md
    .venv/bin/python bench/soak.py --from-json bench/results/soak.json --write-docs

What runs: ``flowdecision serve --port 0`` with no other flag, in a fresh
temporary directory (so the default layout: ledger and outbox in
``.flowdecision/flowdecision.db``, ``synchronous=FULL``, access log on), and an
open-loop load generator in this process: request ``i`` is due at
``start + i / rate`` whether or not earlier ones were answered, and its latency
is measured from when it was due (a stall shows as latency, not as a lower
rate: no coordinated omission). Each ``POST /v1/decisions`` carries a new
decision id; anything but 201 is counted as an error. The client is a minimal
asyncio HTTP/1.1 client on ``--connections`` keep-alive connections.

Every ``--sample-s`` seconds it samples the server: RSS and open descriptors
(``/proc``, the process and its children), the SQLite file and its WAL,
the ledger and outbox row counts (a read-only connection, closed at once),
and ``/metrics`` cardinality (sample lines). Per minute: requests sent,
errors, p50/p99/max latency.

Targets (issue 19), judged after ``--warmup-s``: RSS and descriptors flat
(the last minute's median within 10% of the first post-warm-up minute's), the
WAL checkpointed and bounded (its size never above ``--wal-bound-mib``; the
default is 4 times SQLite's 1000-page autocheckpoint), p99 without upward trend
(the slope of a least-squares line through the per-minute p99s is under 10%
of their median per 10 minutes, or the last third's median is within 25% of
the first third's; the machine is shared, so one noisy minute is not a trend).

Writes ``bench/results/soak.json`` (every sample and minute) and, with
``--plot``/``--write-docs``, ``docs/soak.png``; ``--write-docs`` also replaces
the soak section of docs/BENCHMARKS.md. Exit status 1 if a request failed
or a target was missed (``--no-judge`` reports only).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
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

from flowdecision.core.model import DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402

DOCS = ROOT / "docs" / "BENCHMARKS.md"
PLOT = ROOT / "docs" / "soak.png"
RESULTS = HERE / "results" / "soak.json"
BEGIN = "<!-- soak:begin -->"
END = "<!-- soak:end -->"
READY = "flowdecision serving on "


#: the load generator's queue, for the sampler
BACKLOG: dict[str, asyncio.Queue[Any]] = {}


class SoakError(RuntimeError):
    """The soak cannot run (the server did not start); the message says why."""


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    fds: int
    db_mib: float
    wal_mib: float
    ledger_rows: int
    outbox_rows: int
    metrics_series: int
    load1: float
    #: requests due but not yet sent (the server or this client fell behind the rate)
    backlog: int = 0


@dataclass
class Minute:
    minute: int
    sent: int = 0
    ok: int = 0
    errors: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)


# -- the server --------------------------------------------------------------------


class Server:
    """``flowdecision serve --port 0`` in ``workdir``, stderr to ``serve.log``."""

    def __init__(self, workdir: Path, extra: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
        env["PYTHONPATH"] = str(ROOT / "src")
        env["PYTHONUNBUFFERED"] = "1"
        self.log_path = workdir / "serve.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0", *extra],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self.db = workdir / ".flowdecision" / "flowdecision.db"
        self.host, self.port = self._wait_ready()

    def _wait_ready(self) -> tuple[str, int]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode("utf-8", "replace")
            if not line:
                break
            if line.startswith(READY):
                url = line.split()[-1].rstrip("/")
                host, _, port = url.removeprefix("http://").partition(":")
                # Keep draining stdout so the server never blocks on a full pipe.
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return host, int(port)
        self.stop()
        raise SoakError(f"serve did not start: {self.log_path.read_text(errors='replace')[-3000:]}")

    def pids(self) -> list[int]:
        """The server and its child processes (``--workers``)."""
        found = [self.proc.pid]
        for pid in found:
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                try:
                    found += [int(c) for c in task.read_text().split()]
                except OSError:
                    pass
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _rss_and_fds(pids: list[int]) -> tuple[float, int]:
    rss_kib, fds = 0, 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kib += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, ValueError):
            pass  # a worker that just exited
    return rss_kib / 1024, fds


def _rows(db: Path) -> tuple[int, int]:
    # Read-only and closed at once: a reader left open would hold back checkpoints.
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        ledger = conn.execute("SELECT count(*) FROM flowdecision_claims").fetchone()[0]
        outbox = conn.execute("SELECT count(*) FROM flow_decision_outbox").fetchone()[0]
        return int(ledger), int(outbox)
    finally:
        conn.close()


def _mib(path: Path) -> float:
    try:
        return path.stat().st_size / 2**20
    except FileNotFoundError:
        return 0.0


# -- the client --------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection; :meth:`request` returns (status, body)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None and self.writer is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode("ascii") + body)
        try:
            status_line = await self.reader.readuntil(b"\r\n")
            headers = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.writer = None
            raise
        length, close = 0, False
        for line in headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"connection" and b"close" in value.lower():
                close = True
        payload = await self.reader.readexactly(length)
        if close:
            self.writer.close()
            self.writer = None
        return int(status_line.split()[1]), payload


def _body(n: int, run: str) -> bytes:
    decision_id = f"soak-{run}-{n}"
    return DecisionRequest(
        decision_id=decision_id,
        run_id=f"run-{n % 1000}",
        authority_branch_id="production",
        causation_event_id=f"event-{decision_id}",
        decision=ScheduleStep(
            step=DecisionStep(step_id=f"{decision_id}-s", step_name="fetch", input={"n": n})
        ),
    ).to_json()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _load(
    server: Server,
    args: argparse.Namespace,
    minutes: dict[int, Minute],
    start: float,
    stop_at: float,
) -> None:
    queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
    BACKLOG["queue"] = queue
    run = uuid.uuid4().hex[:8]

    async def lane() -> None:
        conn = Connection(server.host, server.port)
        while (item := await queue.get()) is not None:
            n, due = item
            minute = minutes.setdefault(int((due - start) // 60), Minute(int((due - start) // 60)))
            minute.sent += 1
            try:
                status, _ = await conn.request("POST", "/v1/decisions", _body(n, run))
            except (OSError, asyncio.IncompleteReadError):
                status = 0
            if status == 201:
                minute.ok += 1
                minute.latencies.append((time.monotonic() - due) * 1000)
            else:
                minute.errors += 1

    lanes = [asyncio.create_task(lane()) for _ in range(args.connections)]
    n = 0
    while True:
        due = start + n / args.rate
        if due >= stop_at:
            break
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait((n, due))
        n += 1
    for _ in lanes:
        queue.put_nowait(None)
    await asyncio.gather(*lanes)


async def _sample_once(server: Server, metrics: Connection, t_s: float) -> Sample:
    rss, fds = _rss_and_fds(server.pids())
    series = -1
    for _ in range(2):  # the server closes a keep-alive connection idle past 5 s: reconnect
        try:
            _, text = await metrics.request("GET", "/metrics")
        except (OSError, asyncio.IncompleteReadError):
            metrics.writer = None
            continue
        series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
        break
    ledger, outbox = await asyncio.to_thread(_rows, server.db)
    return Sample(
        t_s=round(t_s, 1),
        rss_mib=round(rss, 1),
        fds=fds,
        db_mib=round(_mib(server.db), 2),
        wal_mib=round(_mib(server.db.with_name(server.db.name + "-wal")), 2),
        ledger_rows=ledger,
        outbox_rows=outbox,
        metrics_series=series,
        load1=round(os.getloadavg()[0], 2),
        backlog=BACKLOG["queue"].qsize() if "queue" in BACKLOG else 0,
    )


async def _sampler(
    server: Server, args: argparse.Namespace, samples: list[Sample], start: float, stop_at: float
) -> None:
    metrics = Connection(server.host, server.port)
    while time.monotonic() < stop_at:
        samples.append(await _sample_once(server, metrics, time.monotonic() - start))
        await asyncio.sleep(max(0.0, args.sample_s - (time.monotonic() - start) % args.sample_s))


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="flowdecision-soak-"))
    server = Server(workdir, args.serve_arg)
    minutes: dict[int, Minute] = {}
    samples: list[Sample] = []
    started = datetime.datetime.now(datetime.UTC)
    try:
        start = time.monotonic()
        stop_at = start + args.minutes * 60
        await asyncio.gather(
            _load(server, args, minutes, start, stop_at),
            _sampler(server, args, samples, start, stop_at),
        )
        # The final sample, once every answer is in (the row counts are judged on it;
        # idle connections may have closed by then, so it is not a point of the series).
        metrics = Connection(server.host, server.port)
        final = await _sample_once(server, metrics, time.monotonic() - start)
    finally:
        server.stop()
        log_tail = server.log_path.read_text(errors="replace")[-2000:]
        shutil.rmtree(workdir, ignore_errors=True)
    for minute in minutes.values():
        minute.p50_ms = round(_percentile(minute.latencies, 0.50), 2)
        minute.p99_ms = round(_percentile(minute.latencies, 0.99), 2)
        minute.max_ms = round(max(minute.latencies, default=0.0), 2)
    rows = [
        {k: v for k, v in asdict(m).items() if k != "latencies"}
        for m in sorted(minutes.values(), key=lambda m: m.minute)
    ]
    result = {
        "started": started.isoformat(timespec="seconds"),
        "config": {
            "rate": args.rate,
            "minutes": args.minutes,
            "warmup_s": args.warmup_s,
            "connections": args.connections,
            "sample_s": args.sample_s,
            "serve_args": args.serve_arg,
            "wal_bound_mib": args.wal_bound_mib,
        },
        "machine": _machine(),
        "samples": [asdict(s) for s in samples],
        "final_sample": asdict(final),
        "minutes": rows,
        "server_log_tail": log_tail if any(r["errors"] for r in rows) else "",
    }
    result["verdict"] = judge(result)
    return result


# -- judging and reporting ------------------------------------------------------------


def _median_between(samples: list[dict[str, Any]], key: str, lo: float, hi: float) -> float:
    values = [s[key] for s in samples if lo <= s["t_s"] < hi]
    return float(statistics.median(values)) if values else float("nan")


def _slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """Each target: the figures it is judged on, and whether it is met."""
    cfg, samples, minutes = result["config"], result["samples"], result["minutes"]
    warm = cfg["warmup_s"]
    end = samples[-1]["t_s"] if samples else 0.0
    window = min(60.0, max(1.0, (end - warm) / 3))
    verdict: dict[str, Any] = {}
    for key, name in (("rss_mib", "rss"), ("fds", "fds")):
        first = _median_between(samples, key, warm, warm + window)
        last = _median_between(samples, key, end - window, end + 1)
        change = (last - first) / first if first else float("nan")
        verdict[name] = {
            "after_warmup": first,
            "at_end": last,
            "max": max((s[key] for s in samples if s["t_s"] >= warm), default=0),
            "change": round(change, 4),
            "met": abs(change) <= 0.10,
        }
    wal_max = max((s["wal_mib"] for s in samples), default=0.0)
    verdict["wal"] = {
        "max_mib": wal_max,
        "at_end_mib": samples[-1]["wal_mib"] if samples else 0.0,
        "bound_mib": cfg["wal_bound_mib"],
        "met": wal_max <= cfg["wal_bound_mib"],
    }
    steady = [m for m in minutes if m["minute"] * 60 >= warm and m["ok"]]
    # The last minute is partial when the run ends; it is kept (its p99 is real).
    p99s = [m["p99_ms"] for m in steady]
    median = statistics.median(p99s) if p99s else 0.0
    slope = _slope([(m["minute"], m["p99_ms"]) for m in steady])
    third = max(1, len(p99s) // 3)
    first_third = statistics.median(p99s[:third]) if p99s else 0.0
    last_third = statistics.median(p99s[-third:]) if p99s else 0.0
    verdict["p99"] = {
        "median_ms": median,
        "slope_ms_per_10min": round(slope * 10, 3),
        "first_third_ms": first_third,
        "last_third_ms": last_third,
        "met": (slope * 10 <= 0.10 * median) or (last_third <= 1.25 * first_third),
    }
    sent = sum(m["sent"] for m in minutes)
    errors = sum(m["errors"] for m in minutes)
    last_sample = result.get("final_sample") or (samples[-1] if samples else {})
    verdict["requests"] = {
        "sent": sent,
        "errors": errors,
        "ledger_rows": last_sample.get("ledger_rows", 0),
        "outbox_rows": last_sample.get("outbox_rows", 0),
        "met": errors == 0
        and last_sample.get("ledger_rows") == sent
        and last_sample.get("outbox_rows") == sent,
    }
    verdict["met"] = all(v["met"] for v in verdict.values() if isinstance(v, dict))
    return verdict


def _machine() -> str:
    try:
        sys.path.insert(0, str(HERE))
        from ledger_bench import machine_description

        return machine_description()
    except Exception as error:
        return f"unknown machine ({error})"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, minutes = result["samples"], result["minutes"]
    t = [s["t_s"] / 60 for s in samples]
    series = [
        ("RSS (MiB)", [s["rss_mib"] for s in samples]),
        ("open descriptors", [s["fds"] for s in samples]),
        ("WAL (MiB)", [s["wal_mib"] for s in samples]),
        ("database file (MiB)", [s["db_mib"] for s in samples]),
        ("ledger / outbox rows", [s["ledger_rows"] for s in samples]),
        ("/metrics sample lines", [s["metrics_series"] for s in samples]),
    ]
    fig, axes = plt.subplots(4, 2, figsize=(11, 11), sharex=True)
    flat = axes.flatten()
    for ax, (title, values) in zip(flat, series, strict=False):
        ax.plot(t, values, lw=1.2)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    flat[4].plot(t, [s["outbox_rows"] for s in samples], lw=1, ls="--", label="outbox")
    flat[4].legend(["ledger", "outbox"], fontsize=8)
    mins = [m["minute"] + 0.5 for m in minutes]
    flat[6].plot(mins, [m["p99_ms"] for m in minutes], marker="o", ms=3, label="p99")
    flat[6].plot(mins, [m["p50_ms"] for m in minutes], marker="o", ms=3, label="p50")
    flat[6].set_title("latency per minute (ms, from when due)", fontsize=10)
    flat[6].legend(fontsize=8)
    flat[6].grid(alpha=0.3)
    flat[6].set_ylim(bottom=0)
    flat[7].plot(t, [s["load1"] for s in samples], lw=1.2, color="grey", label="load average")
    flat[7].plot(
        t, [s.get("backlog", 0) / 100 for s in samples], lw=1, color="red", label="backlog / 100"
    )
    flat[7].set_title("machine load (1 min) and requests behind schedule", fontsize=10)
    flat[7].legend(fontsize=8)
    flat[7].grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    warm = result["config"]["warmup_s"] / 60
    for ax in flat:
        ax.axvline(warm, color="red", lw=0.8, ls=":")
    cfg = result["config"]
    fig.suptitle(
        f"flowdecision serve, default layout, {cfg['rate']} decisions/s for "
        f"{cfg['minutes']} min (red: end of warm-up)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    cfg, v = result["config"], result["verdict"]
    ok = "met" if v["met"] else "MISSED"

    def mark(item: dict[str, Any]) -> str:
        return "met" if item["met"] else "**missed**"

    reqs = v["requests"]
    lines = [
        BEGIN,
        f"Run {result['started']}: `python bench/soak.py --rate {cfg['rate']} "
        f"--minutes {cfg['minutes']} --warmup-s {cfg['warmup_s']} --write-docs` on "
        f"{result['machine']}. The machine is shared with other jobs (load average in "
        "the last panel), so latency moves with them. Targets overall: "
        f"**{ok}**.",
        "",
        "| target | figures | |",
        "|---|---|---|",
        f"| every request answered 201, every decision in the ledger and outbox | "
        f"{reqs['sent']:,} sent, {reqs['errors']} errors, {reqs['ledger_rows']:,} ledger "
        f"rows, {reqs['outbox_rows']:,} outbox rows | {mark(reqs)} |",
        f"| RSS flat after warm-up (within 10%) | {v['rss']['after_warmup']:.1f} MiB → "
        f"{v['rss']['at_end']:.1f} MiB ({v['rss']['change']:+.1%}), max "
        f"{v['rss']['max']:.1f} | {mark(v['rss'])} |",
        f"| descriptors flat after warm-up (within 10%) | {v['fds']['after_warmup']:.0f} → "
        f"{v['fds']['at_end']:.0f} ({v['fds']['change']:+.1%}), max {v['fds']['max']} | "
        f"{mark(v['fds'])} |",
        f"| WAL checkpointed and bounded (≤ {v['wal']['bound_mib']} MiB) | max "
        f"{v['wal']['max_mib']:.2f} MiB, {v['wal']['at_end_mib']:.2f} MiB at the end | "
        f"{mark(v['wal'])} |",
        f"| p99 without upward trend | median {v['p99']['median_ms']:.1f} ms; slope "
        f"{v['p99']['slope_ms_per_10min']:+.2f} ms per 10 min; first third "
        f"{v['p99']['first_third_ms']:.1f} ms, last third {v['p99']['last_third_ms']:.1f} ms"
        f" | {mark(v['p99'])} |",
        "",
        "![soak](soak.png)",
        "",
        "| minute | sent | errors | p50 ms | p99 ms | max ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {m['minute']} | {m['sent']:,} | {m['errors']} | {m['p50_ms']:.1f} | "
        f"{m['p99_ms']:.1f} | {m['max_ms']:.1f} |"
        for m in result["minutes"]
    ]
    lines.append(END)
    return "\n".join(lines)


def write_docs(result: dict[str, Any]) -> None:
    text = DOCS.read_text()
    block = markdown(result)
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = head + block + tail
    else:
        text = (
            text.rstrip("\n")
            + "\n\n## Soak (issue 19)\n\n"
            + "`bench/soak.py` (see its docstring for the method and the targets).\n\n"
            + block
            + "\n"
        )
    DOCS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=500.0, help="decisions per second")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--wal-bound-mib", type=float, default=16.0)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write results")
    parser.add_argument("--from-json", type=Path, help="report a previous run")
    parser.add_argument("--plot", action="store_true", help="write docs/soak.png")
    parser.add_argument("--write-docs", action="store_true", help="plot + docs/BENCHMARKS.md")
    parser.add_argument("--no-judge", action="store_true", help="exit 0 even if missed")
    args = parser.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        result["verdict"] = judge(result)
    else:
        result = asyncio.run(soak(args))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot or args.write_docs:
        plot(result, PLOT)
    if args.write_docs:
        write_docs(result)
    print(markdown(result))
    return 0 if result["verdict"]["met"] or args.no_judge else 1


if __name__ == "__main__":
    sys.exit(main())
