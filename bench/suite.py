"""The benchmark suite behind ``make bench``: every figure side by side, in one run.

    .venv/bin/python bench/suite.py                 # everything (~20 min on 2 vCPUs)
    .venv/bin/python bench/suite.py --only ledger,group
    .venv/bin/python bench/suite.py --rounds 5 --seconds 1

Sections (each figure is the median of ``--rounds`` rounds, with the min-max
spread; compared figures are measured interleaved, round by round):

* ``ledger``   claim->complete cycles/s per backend, retained records, 1 and 8
               OS processes, against the raw limit of the same store (issue 3);
               the 1-process column doubles as the scaling plot's data.
* ``file``     the JSON file ledger at 1k / 10k / 50k retained records.
* ``group``    ledger cycles/s at 1, 8 and 64 concurrent dispatchers in one
               process, group commit on and off, against the raw
               one-commit-per-operation cycle of the same store (issue 6).
* ``sink``     1,000 distinct decisions through one Dispatcher whose sink takes
               20 ms, against a dispatcher serialized by one global lock.
* ``overhead`` per-dispatch time on MemoryLedger with a no-op sink, p50/p99.

PostgreSQL is a throwaway server with durable settings (fsync on,
synchronous_commit on) unless ``--postgres-url`` names one. Results go to
``bench/results/latest.json`` and ``latest.md``; the plot to
``docs/bench_scaling.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import ledger_bench as lb  # noqa: E402
from flowdecision.core.dispatcher import Dispatcher  # noqa: E402
from flowdecision.core.model import Complete, DecisionRequest  # noqa: E402
from flowdecision.ledger import Claimed, Ledger, MemoryLedger  # noqa: E402

OUT: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    OUT.append(line)


def stats(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt(values: Sequence[float], digits: int = 0) -> str:
    med, lo, hi = stats(values)
    return f"{med:,.{digits}f} ({lo:,.{digits}f}–{hi:,.{digits}f})"


def ratio(num: Sequence[float], den: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True) if b]


# -- ledger vs raw, per retained size (issue 3) --------------------------------------


def section_ledger(
    args: argparse.Namespace, work: Path, pg_url: str | None, results: dict[str, Any]
) -> None:
    emit("## Ledger vs raw store (claim→complete cycles/s, total over processes)")
    emit()
    emit("| backend | retained | procs | ledger | raw | ledger/raw |")
    emit("|---|---:|---:|---:|---:|---:|")
    rows = results.setdefault("ledger", [])
    for backend in args.backends:
        if backend == "sqlite":
            raw_kind, target_of = "raw-sqlite", None
        elif backend == "postgres" and pg_url:
            raw_kind, target_of = "raw-postgres", pg_url
        else:
            continue
        for size in args.sizes:
            if backend == "sqlite":
                path = work / f"sqlite-{size}.db"
                lb.preload_sqlite(path, size)
                target = str(path)
            else:
                assert target_of is not None
                asyncio.run(lb.preload_postgres(target_of, size))
                target = target_of
            rounds = args.rounds if size < 1_000_000 else args.rounds_1m
            for procs in args.processes:
                got = lb.run_rounds([raw_kind, backend], target, procs, args.seconds, rounds)
                led, raw = got[backend], got[raw_kind]
                rows.append(
                    {
                        "backend": backend,
                        "retained": size,
                        "procs": procs,
                        "ledger": led,
                        "raw": raw,
                    }
                )
                emit(
                    f"| {backend} | {size:,} | {procs} | {fmt(led)} | {fmt(raw)} "
                    f"| {fmt([100 * r for r in ratio(led, raw)])}% |"
                )
            if backend == "sqlite":
                for suffix in ("", "-wal", "-shm"):
                    Path(str(path) + suffix).unlink(missing_ok=True)
    emit()


def section_file(args: argparse.Namespace, work: Path, results: dict[str, Any]) -> None:
    emit("## JSON file ledger (1 process, cycles/s)")
    emit()
    emit("| retained | cycles/s |")
    emit("|---:|---:|")
    rows = results.setdefault("file", [])
    for size in args.file_sizes:
        root = work / f"file-{size}"
        lb.preload_file(root, size)
        seconds = args.seconds if size <= 1000 else max(args.seconds, 3.0)
        rounds = args.rounds if size <= 10_000 else 3
        values = []
        for round_ in range(rounds):
            started = time.perf_counter()
            cycles = asyncio.run(lb._ledger_loop("file", str(root), 0, seconds, f"r{round_}"))
            values.append(cycles / (time.perf_counter() - started))
        rows.append({"retained": size, "ledger": values})
        emit(f"| {size:,} | {fmt(values, 2)} |")
        shutil.rmtree(root)
    emit()


# -- group commit (issue 6) -----------------------------------------------------------------


async def _concurrent_cycles(ledger: Ledger, dispatchers: int, seconds: float, tag: str) -> int:
    ident = lb._identity("group")
    receipt = lb._receipt(ident)
    deadline = time.perf_counter() + seconds
    owner = f"bench-{os.getpid()}"

    async def one(index: int) -> int:
        cycles = 0
        while time.perf_counter() < deadline:
            decision_id = f"g{tag}-{index}-{cycles}"
            outcome = await ledger.claim(
                decision_id, "h" * 64, owner, lease_ms=lb.LEASE_MS, identity=ident
            )
            assert isinstance(outcome, Claimed), outcome
            await ledger.complete(decision_id, "h" * 64, owner, identity=ident, receipt=receipt)
            cycles += 1
        return cycles

    return sum(await asyncio.gather(*(one(i) for i in range(dispatchers))))


async def _open(backend: str, target: str, group: bool) -> Ledger:
    if backend == "sqlite":
        from flowdecision.ledger.sqlite import SqliteLedger

        return await SqliteLedger.open(target, group_commit=group)
    from flowdecision.ledger.postgres import PostgresLedger

    return await PostgresLedger.connect(target, group_commit=group, max_size=10)


def _group_slice(backend: str, target: str, mode: str, n: int, seconds: float, tag: str) -> float:
    if mode == "raw":
        if backend == "sqlite":
            return lb._raw_sqlite_loop(target, 0, seconds, "FULL", tag) / seconds
        return asyncio.run(lb._raw_postgres_loop(target, 0, seconds, tag)) / seconds

    async def run() -> float:
        ledger = await _open(backend, target, mode == "on")
        try:
            return await _concurrent_cycles(ledger, n, seconds, tag) / seconds
        finally:
            await ledger.close()

    return asyncio.run(run())


def section_group(
    args: argparse.Namespace, work: Path, pg_url: str | None, results: dict[str, Any]
) -> None:
    emit("## Group commit (one process, N concurrent dispatchers, cycles/s)")
    emit()
    emit(
        "| backend | dispatchers | group commit on | off | raw 1 commit/op | on/raw | off/raw "
        "| on/off |"
    )
    emit("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = results.setdefault("group", [])
    for backend in args.backends:
        if backend == "sqlite":
            target = str(work / "group.db")
            lb.preload_sqlite(Path(target), 10_000)
        elif backend == "postgres" and pg_url:
            target = pg_url
            asyncio.run(lb.preload_postgres(pg_url, 10_000))
        else:
            continue
        for n in args.dispatchers:
            got: dict[str, list[float]] = {"on": [], "off": [], "raw": []}
            for round_ in range(args.rounds):
                order = ["raw", "on", "off"] if round_ % 2 == 0 else ["off", "on", "raw"]
                for mode in order:
                    tag = f"{backend}{n}{mode}{round_}"
                    got[mode].append(_group_slice(backend, target, mode, n, args.seconds, tag))
            rows.append({"backend": backend, "dispatchers": n, **got})
            on_raw = [100 * r for r in ratio(got["on"], got["raw"])]
            off_raw = [100 * r for r in ratio(got["off"], got["raw"])]
            emit(
                f"| {backend} | {n} | {fmt(got['on'])} | {fmt(got['off'])} | {fmt(got['raw'])} "
                f"| {fmt([r / 100 for r in on_raw], 2)}× | {fmt([r / 100 for r in off_raw], 2)}× "
                f"| {fmt(ratio(got['on'], got['off']), 2)}× |"
            )
    emit()


# -- dispatcher: slow sink and overhead ------------------------------------------------------


class _SleepSink:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        await asyncio.sleep(self.seconds)


class _NoopSink:
    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        return None


def _requests(count: int, tag: str) -> list[DecisionRequest]:
    return [
        DecisionRequest(
            decision_id=f"{tag}-{n}",
            run_id="run-1",
            authority_branch_id="production",
            causation_event_id=f"event-{n}",
            decision=Complete(output={"n": n}),
        )
        for n in range(count)
    ]


class _Serialized:
    """The seed's shape: one global lock around every dispatch."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.lock = asyncio.Lock()

    async def dispatch(self, request: DecisionRequest) -> bool:
        async with self.lock:
            return await self.dispatcher.dispatch(request)


async def _slow_sink_round(round_: int, serialized_count: int) -> tuple[float, float]:
    fast = Dispatcher("production", _SleepSink(0.020), MemoryLedger())
    batch = _requests(1000, f"c{round_}")
    started = time.perf_counter()
    assert all(await asyncio.gather(*(fast.dispatch(r) for r in batch)))
    concurrent = len(batch) / (time.perf_counter() - started)
    slow = _Serialized(Dispatcher("production", _SleepSink(0.020), MemoryLedger()))
    batch = _requests(serialized_count, f"s{round_}")
    started = time.perf_counter()
    assert all(await asyncio.gather(*(slow.dispatch(r) for r in batch)))
    serial = len(batch) / (time.perf_counter() - started)
    return concurrent, serial


def section_sink(args: argparse.Namespace, results: dict[str, Any]) -> None:
    emit("## Dispatch throughput with a 20 ms sink (MemoryLedger, decisions/s)")
    emit()
    concurrent: list[float] = []
    serial: list[float] = []
    for round_ in range(args.rounds):
        c, s = asyncio.run(_slow_sink_round(round_, args.serialized_decisions))
        concurrent.append(c)
        serial.append(s)
    results["sink"] = {"concurrent": concurrent, "serialized": serial}
    emit("| dispatcher | decisions/s | ratio |")
    emit("|---|---:|---:|")
    speedup = fmt(ratio(concurrent, serial))
    emit(f"| flowdecision (1,000 concurrent) | {fmt(concurrent)} | {speedup}× |")
    emit(
        f"| serialized reference ({args.serialized_decisions} decisions, global lock) "
        f"| {fmt(serial, 1)} | 1× |"
    )
    emit()


async def _overhead_round(count: int, tag: str) -> list[float]:
    dispatcher = Dispatcher("production", _NoopSink(), MemoryLedger())
    batch = _requests(count, tag)
    for request in batch[:200]:  # warm up
        await dispatcher.dispatch(request)
    times: list[float] = []
    clock = time.perf_counter_ns
    for request in batch[200:]:
        started = clock()
        await dispatcher.dispatch(request)
        times.append((clock() - started) / 1000)
    return times


def section_overhead(args: argparse.Namespace, results: dict[str, Any]) -> None:
    emit("## Dispatcher overhead (MemoryLedger, no-op sink, µs per dispatch)")
    emit()
    p50: list[float] = []
    p99: list[float] = []
    for round_ in range(args.rounds):
        times = sorted(asyncio.run(_overhead_round(5200, f"o{round_}")))
        p50.append(times[len(times) // 2])
        p99.append(times[int(len(times) * 0.99)])
    results["overhead"] = {"p50": p50, "p99": p99}
    emit("| p50 µs | p99 µs | target p50 |")
    emit("|---:|---:|---:|")
    emit(f"| {fmt(p50, 1)} | {fmt(p99, 1)} | ≤ 50 |")
    emit()


# -- the plot ------------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        emit("(matplotlib not installed: no plot; `pip install -e '.[bench]'`)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series: dict[str, list[tuple[int, list[float]]]] = {}
    for row in results.get("ledger", []):
        if row["procs"] == 1:
            series.setdefault(row["backend"], []).append((row["retained"], row["ledger"]))
            series.setdefault(f"raw {row['backend']}", []).append((row["retained"], row["raw"]))
    for row in results.get("file", []):
        series.setdefault("json file", []).append((row["retained"], row["ledger"]))
    for name, points in series.items():
        points.sort()
        xs = [x for x, _ in points]
        meds = [statistics.median(v) for _, v in points]
        los = [m - min(v) for m, (_, v) in zip(meds, points, strict=True)]
        his = [max(v) - m for m, (_, v) in zip(meds, points, strict=True)]
        style = "--" if name.startswith("raw") else "-"
        ax.errorbar(xs, meds, yerr=[los, his], fmt=style + "o", capsize=3, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("retained records")
    ax.set_ylabel("claim→complete cycles/s (1 process)")
    ax.set_title("Per-operation cost vs retained records (median, min–max)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    emit(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )

    def ints(text: str) -> list[int]:
        return [int(part) for part in text.split(",")]

    parser.add_argument("--only", default="ledger,file,group,sink,overhead")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rounds-1m", type=int, default=5, help="rounds at 1M records")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per slice")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--sizes", type=ints, default=[1_000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--file-sizes", type=ints, default=[1_000, 10_000, 50_000])
    parser.add_argument("--processes", type=ints, default=[1, 8])
    parser.add_argument("--dispatchers", type=ints, default=[1, 8, 64])
    parser.add_argument("--serialized-decisions", type=int, default=50)
    parser.add_argument("--postgres-url", default=os.environ.get("FLOWDECISION_BENCH_POSTGRES_URL"))
    parser.add_argument("--workdir", default=None, help="where SQLite/JSON stores live (disk!)")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "bench_scaling.png"))
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    only = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="flowdecision-bench-", dir=args.workdir))
    started = time.monotonic()
    emit(f"machine: {lb.machine_description()}")
    emit(f"command: {' '.join(sys.argv)}; {args.rounds} rounds x {args.seconds:g} s per slice")
    emit()
    results: dict[str, Any] = {"machine": lb.machine_description(), "argv": sys.argv}
    server = None
    sections: list[tuple[str, Callable[[], None]]] = []
    try:
        pg_url = args.postgres_url
        if "postgres" in args.backends and not pg_url and only & {"ledger", "group"}:
            from tests.postgres_server import PostgresServer

            server = PostgresServer(fast=False).start()
            pg_url = server.url("postgres")
            emit("PostgreSQL: throwaway server, fsync=on, synchronous_commit=on, unix socket")
            emit()
        sections = [
            ("overhead", lambda: section_overhead(args, results)),
            ("sink", lambda: section_sink(args, results)),
            ("group", lambda: section_group(args, work, pg_url, results)),
            ("ledger", lambda: section_ledger(args, work, pg_url, results)),
            ("file", lambda: section_file(args, work, results)),
        ]
        for name, run in sections:
            if name in only:
                run()
        if only & {"ledger", "file"}:
            plot(results, Path(args.plot))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
        emit(f"total: {time.monotonic() - started:.0f} s")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "latest.json").write_text(json.dumps(results, indent=1))
        (out / "latest.md").write_text("\n".join(OUT) + "\n")


if __name__ == "__main__":
    main()
