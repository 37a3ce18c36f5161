"""CPU per POST of each thread of ``flowdecision serve`` under wrk (50 clients).

Starts ``flowdecision serve`` (default layout, arguments passed through) in a
fresh temporary directory, warms it up for 2 s with ``bench/service_bench.py``'s
wrk script, then reads every thread's user and system CPU from
``/proc/PID/task/*/stat`` before and after an 8-second measured run. Linux only.

    .venv/bin/python bench/results/experiments/threads_cpu.py [serve args...]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import service_bench as sb

TICK = os.sysconf("SC_CLK_TCK")
SECONDS = 8


def thread_cpu(pid: int) -> dict[str, tuple[str, float, float]]:
    """Thread id -> (name, user s, system s)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # the thread ended between listing and reading
        fields = stat.rsplit(")", 1)[1].split()
        out[tid] = (name, int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="flowdecision-threads-"))
    flowdecision = str(Path(sys.executable).parent / "flowdecision")
    server = sb.Server([flowdecision, "serve", "--port", "0", *sys.argv[1:]], workdir)
    try:
        template = sb.body_template()
        target = next(t for t in sb.make_targets(["sqlite"], None) if t.key == "post sqlite")
        sb.wrk(target, server.url, 50, 2, template)
        before = thread_cpu(server.proc.pid)
        data, _ = sb.wrk(target, server.url, 50, SECONDS, template)
        after = thread_cpu(server.proc.pid)
    finally:
        server.stop()
    n = data["requests"]
    print(f"rate {n / data['duration_us'] * 1e6:.0f}/s p99 {data['p99_us'] / 1000:.1f} ms")
    for tid, (name, user, system) in after.items():
        if tid not in before:
            continue
        du, ds = user - before[tid][1], system - before[tid][2]
        if du + ds > 0.05:
            print(
                f"{name:20s} user {du * 1e6 / n:7.1f} us/POST  sys {ds * 1e6 / n:6.1f} us/POST"
                f"  busy {(du + ds) / SECONDS * 100:5.1f}%"
            )


if __name__ == "__main__":
    main()
