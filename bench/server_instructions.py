"""Instructions per POST of the whole server, counted by callgrind: a figure that does not move.

    .venv/bin/python bench/server_instructions.py                      # the three tracing targets
    .venv/bin/python bench/server_instructions.py --target "installed, off" --short 15 --long 45

The rates of ``bench/tracing_bench.py`` swing by ±20% from one round to the
next on a shared 2-CPU machine, more than the few percent its targets are
about. This counts instead: each target of the tracing benchmark (the same
``flowdecision serve`` on the default layout, the same receiver, the same
``wrk`` load at 50 clients) runs under ``valgrind --tool=callgrind`` twice,
for ``--short`` and ``--long`` seconds of load, and the instructions the
server executed (every thread: uvicorn, the app, the ledger's thread, SQLite,
the exporter) are divided by the requests answered, as the difference of
the two runs, so start-up and shutdown cancel out. Under valgrind the
server runs ~50 times slower and one thread at a time, so group commit
forms other batches than at full speed; the count per request is what it
is for. Needs ``valgrind`` (Debian package ``valgrind``) and ``wrk``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import service_bench  # noqa: E402
import tracing_bench  # noqa: E402


def count(target: str, seconds: int) -> tuple[int, int]:
    """(instructions, requests answered) of one run of ``target`` under callgrind."""
    seen: dict[str, Any] = {}

    class Callgrind(service_bench.Server):
        def __init__(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
            wrapped = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={cwd}/cg.out"]
            super().__init__([*wrapped, *argv], cwd, timeout_s=600, env=env)

        def stop(self) -> None:
            super().stop()
            seen["stderr"] = self.stderr_path.read_text(errors="replace")

    tracing_bench.Server = Callgrind  # type: ignore[attr-defined,assignment]  # serving() starts it
    receiver = tracing_bench.Receiver()
    try:
        with tracing_bench.serving(target, receiver) as server:
            data, _ = service_bench.wrk(
                tracing_bench.POST, server.url, 50, seconds, service_bench.body_template()
            )
    finally:
        receiver.stop()
    collected = re.findall(r"Collected : (\d+)", seen.get("stderr", ""))
    if not collected or data["bad"]:
        raise SystemExit(f"{target}: no count ({data['bad']} failed requests)")
    return int(collected[-1]), data["ok"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", choices=tracing_bench.TARGETS)
    parser.add_argument("--short", type=int, default=15, help="seconds of load, first run")
    parser.add_argument("--long", type=int, default=45, help="seconds of load, second run")
    args = parser.parse_args()
    targets = args.target or list(tracing_bench.TARGETS)
    per_request: dict[str, float] = {}
    for target in targets:
        (short, n_short), (long, n_long) = count(target, args.short), count(target, args.long)
        per_request[target] = (long - short) / (n_long - n_short)
        print(f"{target:<16} {per_request[target]:>12,.0f} instructions per POST "
              f"({n_short} and {n_long} requests)", flush=True)  # fmt: skip
    off = per_request.get("installed, off")
    if off:
        for target, value in per_request.items():
            print(f"{target:<16} vs off: {off / value:.3f}x (the rate at equal instructions/s)")


if __name__ == "__main__":
    main()
