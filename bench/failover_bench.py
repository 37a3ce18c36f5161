"""Failover benchmark: ``flowdecision chaos`` with its failover fault, synchronous
and asynchronous standby, and the throughput cost of synchronous commit.

    .venv/bin/python bench/failover_bench.py                 # full (~15-25 min)
    .venv/bin/python bench/failover_bench.py --quick         # 1 run per mode, 1000 decisions
    .venv/bin/python bench/failover_bench.py --write-docs    # full, then docs/RELIABILITY.md
    .venv/bin/python bench/failover_bench.py --from-json bench/results/failover.json --write-docs

What runs, each on a fresh pair (tests/postgres_server.py ``ReplicatedPostgres``:
a primary and a streaming standby made with ``pg_basebackup -R`` on a physical
replication slot, unix sockets only, run as the ``postgres`` account, ``fsync``
off because the OS never crashes here, ``synchronous_commit=on``):

* ``sync``: ``synchronous_standby_names='*'``. ``--runs`` chaos runs of
  ``--decisions`` decisions, 8 workers (no worker kills or pauses: the fault
  under test is the database's), and ``--failovers`` failovers (one every
  ``--every-ms``): SIGKILL the primary's
  postmaster and every backend, ``pg_ctl promote`` the standby, rebuild the
  old primary as the new standby.
* ``async``: the same with ``synchronous_standby_names=''``.
* ``async-held``: asynchronous, and the primary's WAL sender is SIGSTOPped
  for ``--hold-ms`` before each kill (replication lagging as under load or a
  slow network): what an asynchronous standby can lose when it is behind.
* ``throughput``: no faults; the cost of synchronous commit. One synchronous
  pair, ``fsync`` on this time; ``PostgresLedger`` claim → complete cycles (two commits each, the
  ledger benchmark's loop, ``bench/ledger_bench.py``) from ``--tp-processes``
  processes for ``--tp-seconds`` each, through the multi-host URL as is
  (every commit waits for the standby's flush) and with
  ``synchronous_commit=local`` added to it (a session setting: commits return
  once flushed on the primary, as with an asynchronous standby; the standby
  still streams). Same servers, same processes' code, interleaved over
  ``--tp-rounds`` rounds, the order alternating: cycles/s (median) and their
  ratio. (Chaos runs are not a throughput measure: their sink sleeps.)

Every run's ledger is the co-located ledger and outbox in one database reached
through ``?host=A,B&target_session_attrs=read-write``. Figures per run: lost
(acknowledged as submitted, missing or not completed on the survivor) and
repeated (acknowledged, then completed by another owner: run twice), the
harness's checks, ledger failures seen by the workers, each failover's length.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from tests.postgres_server import ReplicatedPostgres, migrate_postgres  # noqa: E402

from ledger_bench import run_cell  # noqa: E402

RESULTS = HERE / "results" / "failover.json"
DOCS = ROOT / "docs" / "RELIABILITY.md"
BEGIN = "<!-- failover-bench:begin -->"
END = "<!-- failover-bench:end -->"


async def _create_database(url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute('CREATE DATABASE "chaos"')
    finally:
        await conn.close()


def chaos_run(*, synchronous: bool, args: argparse.Namespace, faults: bool, hold_ms: int) -> dict:
    """One chaos run on a fresh pair; the report's figures and checks."""
    pair = ReplicatedPostgres(synchronous=synchronous).start()
    try:
        asyncio.run(_create_database(pair.url()))
        command = f"{sys.executable} {ROOT / 'tests' / 'postgres_server.py'} failover {pair.state}"
        if hold_ms:
            command += f" --hold-standby-ms {hold_ms}"
        decisions = args.decisions
        cli = [
            sys.executable, "-m", "flowdecision.cli", "chaos", "--ledger", pair.url("chaos"),
            "--decisions", str(decisions), "--workers", "8", "--lease-ms", "300",
            "--timeout", "1200", "--json", "--kill-every-ms", "0", "--pause-every-ms", "0",
        ]  # fmt: skip
        if faults:
            cli += [
                "--failover-command", command, "--failover-every-ms", str(args.every_ms),
                "--failovers", str(args.failovers),
            ]  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="flowdecision-failover-") as workdir:
            proc = subprocess.run(
                [*cli, "--workdir", workdir],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={
                    **{k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")},
                    "PYTHONPATH": str(ROOT / "src"),
                },
                check=False,
            )
        if not proc.stdout.strip():
            return {"error": proc.stderr[-3000:]}
        report = json.loads(proc.stdout)
        return {
            "ok": report["ok"],
            "figures": report["figures"],
            "failed": {n: c["detail"] for n, c in report["checks"].items() if not c["passed"]},
        }
    finally:
        pair.stop()


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Claim → complete cycles/s with and without waiting for the standby, side by side."""
    processes = [int(p) for p in str(args.tp_processes).split(",")]
    pair = ReplicatedPostgres(synchronous=True, durable=True).start()
    try:
        asyncio.run(_create_database(pair.url()))
        urls = {
            "sync": pair.url("chaos"),
            "async": pair.url("chaos") + "&synchronous_commit=local",
        }
        asyncio.run(migrate_postgres(urls["sync"]))
        out: dict[str, Any] = {str(p): {"sync": [], "async": [], "load1": []} for p in processes}
        for round_ in range(args.tp_rounds):
            for count in processes:
                order = ["sync", "async"] if round_ % 2 == 0 else ["async", "sync"]
                for mode in order:
                    rate = run_cell("postgres", urls[mode], count, args.tp_seconds)
                    out[str(count)][mode].append(rate)
                    out[str(count)]["load1"].append(_load1())
                    print(f"throughput {mode} x{count}: {rate:,.0f} cycles/s", flush=True)
        return out
    finally:
        pair.stop()


def _load1() -> float:
    return round(os.getloadavg()[0], 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            k: getattr(args, k)
            for k in (
                "runs",
                "async_runs",
                "decisions",
                "failovers",
                "every_ms",
                "hold_ms",
                "tp_processes",
                "tp_seconds",
                "tp_rounds",
            )
        },
        "modes": {"sync": [], "async": [], "async-held": []},
        "throughput": {},
    }
    modes = args.modes.split(",")
    plan = [("sync", True, 0)] * args.runs * ("sync" in modes)
    plan += [("async", False, 0)] * args.async_runs * ("async" in modes)
    plan += [("async-held", False, args.hold_ms)] * args.async_runs * ("async-held" in modes)
    for mode, synchronous, hold in plan:
        load = _load1()
        result = chaos_run(synchronous=synchronous, args=args, faults=True, hold_ms=hold)
        result["load1"] = load
        out["modes"][mode].append(result)
        figures = result.get("figures", {})
        print(
            f"{mode}: ok={result.get('ok')} lost={figures.get('lost_after_ack')} "
            f"repeated={figures.get('repeated_after_ack')} failovers={figures.get('failovers')} "
            f"{result.get('failed') or result.get('error', '')}",
            flush=True,
        )
    if args.tp_rounds:
        out["throughput"] = throughput(args)
    return out


def _sum(runs: list[dict], key: str) -> list[int]:
    return [int(r["figures"][key]) for r in runs if "figures" in r]


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    loads = [r["load1"] for runs in result["modes"].values() for r in runs if "load1" in r]
    loads += [x for cell in (result.get("throughput") or {}).values() for x in cell["load1"]]
    load = f"{min(loads):g}–{max(loads):g}" if loads else "not recorded"
    lines = [
        BEGIN,
        f"Run {result['started']}: `python bench/failover_bench.py --write-docs` "
        f"({cfg['decisions']:,} decisions and {cfg['failovers']} failovers per run, one every "
        f"{cfg['every_ms'] / 1000:g} s, 8 workers, no worker kills; 1-minute load average "
        f"{load} at the start of each run on this 2-vCPU machine).",
        "",
        "| standby | runs | failovers | acknowledged | lost | repeated | runs with a loss "
        "or a repeat | ledger failures seen | failover (kill → standby rebuilt), median | "
        "every check |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    names = {
        "sync": "synchronous",
        "async": "asynchronous",
        "async-held": f"asynchronous, WAL sender held {cfg['hold_ms']} ms before each kill",
    }
    for mode, runs in result["modes"].items():
        done = [r for r in runs if "figures" in r]
        if not runs:
            continue
        lost, repeated = _sum(done, "lost_after_ack"), _sum(done, "repeated_after_ack")
        bad = sum(1 for a, b in zip(lost, repeated, strict=True) if a or b)
        secs = [s for r in done for s in r["figures"].get("failover_s", [])]
        lines.append(
            f"| {names[mode]} | {len(runs)} | {sum(_sum(done, 'failovers'))} | "
            f"{sum(_sum(done, 'acknowledged')):,} | {sum(lost)} (per run: "
            f"{', '.join(map(str, lost))}) | {sum(repeated)} (per run: "
            f"{', '.join(map(str, repeated))}) | {bad} of {len(runs)} | "
            f"{sum(_sum(done, 'ledger_failures')):,} | "
            f"{statistics.median(secs) if secs else float('nan'):.1f} s | "
            f"{sum(1 for r in runs if r.get('ok'))} of {len(runs)} PASS |"
        )
    lines += throughput_lines(result)
    lines.append(END)
    return "\n".join(lines)


def throughput_lines(result: dict[str, Any]) -> list[str]:
    tp, cfg = result.get("throughput") or {}, result["config"]
    if not tp or "tp_seconds" not in cfg:
        return []
    lines = [
        "",
        f"Synchronous commit's cost, no faults: `PostgresLedger` claim → complete cycles "
        f"(two commits each) for {cfg['tp_seconds']:g} s per cell, one synchronous pair with "
        "`fsync` on, each "
        "cell with the URL as is (waits for the standby) and with "
        f"`synchronous_commit=local`, {cfg['tp_rounds']} interleaved rounds, median (runs):",
        "",
        "| processes | synchronous standby, cycles/s | local commit only, cycles/s | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for count, cell in tp.items():
        s, a = statistics.median(cell["sync"]), statistics.median(cell["async"])
        runs = ", ".join(f"{x:,.0f}" for x in cell["sync"])
        aruns = ", ".join(f"{x:,.0f}" for x in cell["async"])
        lines.append(f"| {count} | {s:,.0f} ({runs}) | {a:,.0f} ({aruns}) | **{s / a:.2f}×** |")
    return lines


def write_docs(result: dict[str, Any]) -> None:
    text = DOCS.read_text()
    block = markdown(result)
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOCS.write_text(head + block + tail if BEGIN in text else text.rstrip("\n") + "\n\n" + block)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=2, help="synchronous runs")
    parser.add_argument("--async-runs", type=int, default=3, help="asynchronous runs, per kind")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--failovers", type=int, default=4)
    parser.add_argument("--every-ms", type=int, default=3000)
    parser.add_argument("--hold-ms", type=int, default=500)
    parser.add_argument("--tp-processes", default="1,8", help="throughput: processes per cell")
    parser.add_argument("--tp-seconds", type=float, default=5.0, help="throughput: per cell")
    parser.add_argument("--tp-rounds", type=int, default=5, help="throughput: 0 skips it")
    parser.add_argument("--modes", default="sync,async,async-held")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--from-json", type=Path)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.async_runs, args.decisions, args.failovers = 1, 1, 1000, 2
        args.tp_seconds, args.tp_rounds = 2.0, 1
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = run(args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.write_docs:
        write_docs(result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
