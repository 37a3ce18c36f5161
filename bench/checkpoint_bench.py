"""WAL checkpoints on their own thread against inside the commits (issue 18).

    .venv/bin/python bench/checkpoint_bench.py                 # 8 pairs x 4 s, 50 callers
    .venv/bin/python bench/checkpoint_bench.py --pairs 3 --seconds 2

In one process, ``--callers`` tasks claim new decisions on one
``SqliteLedger`` (the default: ``synchronous=FULL``, group commit) in a fresh
file for ``--seconds``, with ``checkpoint_interval_ms`` at its default (the
checkpointer thread) and at 0 (SQLite checkpoints inside the commit that
takes the WAL past 1,000 pages), in interleaved pairs whose order alternates.
Per run: claims per second, and the callers' latency: median, p99 and how
many claims waited longer than ``--slow-ms`` (a batch that paid for a
checkpoint shows there, in every caller of the batch). Prints each pair, then
the medians of the pairs' ratios. Not a timed test; on a shared machine
compare the pairs, not single runs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from flowdecision.core.defaults import SQLITE_CHECKPOINT_INTERVAL_MS
from flowdecision.ledger.sqlite import SqliteLedger


async def run(interval_ms: float, seconds: float, callers: int, slow_ms: float) -> dict[str, float]:
    """One run in a fresh directory: rate and latency figures."""
    work = Path(tempfile.mkdtemp(prefix="flowdecision-checkpoint-bench-"))
    latencies: list[float] = []
    try:
        ledger = await SqliteLedger.open(work / "ledger.db", checkpoint_interval_ms=interval_ms)
        try:
            stop = time.monotonic() + seconds

            async def caller(c: int) -> None:
                n = 0
                while time.monotonic() < stop:
                    started = time.perf_counter()
                    await ledger.claim(f"c{c}-{n}", "h", "o", lease_ms=600_000)
                    latencies.append(time.perf_counter() - started)
                    n += 1

            began = time.monotonic()
            await asyncio.gather(*(caller(c) for c in range(callers)))
            elapsed = time.monotonic() - began
            commits = ledger.commits
        finally:
            await ledger.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ordered = sorted(latencies)
    return {
        "rate": len(ordered) / elapsed,
        "commits": commits,
        "p50_ms": ordered[len(ordered) // 2] * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
        "slow": sum(1 for x in ordered if x * 1000 > slow_ms),
        "claims": len(ordered),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--callers", type=int, default=50)
    parser.add_argument("--slow-ms", type=float, default=5.0)
    args = parser.parse_args()
    on, off = SQLITE_CHECKPOINT_INTERVAL_MS, 0.0
    rates: list[float] = []
    slows: list[float] = []
    p99s: list[float] = []
    for pair in range(1, args.pairs + 1):
        order = (on, off) if pair % 2 else (off, on)
        got: dict[float, dict[str, float]] = {}
        for interval in order:
            got[interval] = r = await run(interval, args.seconds, args.callers, args.slow_ms)
            name = "thread " if interval else "commits"
            print(
                f"pair {pair} checkpoints in {name}: {r['rate']:8,.0f} claims/s, "
                f"{r['commits']:5,.0f} commits, latency p50 {r['p50_ms']:5.2f} ms, "
                f"p99 {r['p99_ms']:5.2f} ms, {r['slow']:5,.0f} of {r['claims']:,.0f} "
                f"over {args.slow_ms:g} ms",
                flush=True,
            )
        rates.append(got[on]["rate"] / got[off]["rate"])
        p99s.append(got[on]["p99_ms"] / got[off]["p99_ms"])
        slows.append(got[on]["slow"] / max(1.0, got[off]["slow"]))
    print(
        f"medians of {args.pairs} pairs, thread / commits: rate {statistics.median(rates):.3f}x "
        f"(pairs {min(rates):.2f}-{max(rates):.2f}), p99 {statistics.median(p99s):.3f}x, "
        f"claims over {args.slow_ms:g} ms {statistics.median(slows):.3f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
