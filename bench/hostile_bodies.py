"""Hostile bodies against honest POSTs (issue 38, item 4), on a real ``flowdecision serve``.

Not a timed test: results in docs/BENCHMARKS.md, "Hostile bodies". Run alone::

    flock /tmp/team/bench.lock .venv/bin/python bench/hostile_bodies.py --rounds 3

Each round runs two phases of ``--seconds`` each, in alternating order, on one
fresh ``flowdecision serve`` (default layout, SQLite ledger and outbox in one
file, access log off):

* **quiet**: one honest client posts small, distinct decisions back to back
  (one connection, keep-alive), and a prober asks ``GET /healthz`` every 20 ms
  (a new connection each time, as a load balancer does);
* **attack**: the same, while ``--attackers`` clients (4) post hostile bodies
  back to back, each on its own connection: a decision whose ``output`` is
  arrays nested 100 deep, repeated up to ``--attack-kib`` (976 KiB: under the
  1 MiB decision limit, as in the issue).

Every client is its own process (the machine has two cores; the clients'
own CPU is part of what the server competes with, as in the issue). Printed per
phase: the honest POSTs per second, ``/healthz`` p50/p99/max in ms, and the
attackers' requests and their statuses; then the medians over the rounds and
the target's two ratios: honest rate under attack / quiet (target >= 0.5) and
``/healthz`` p99 under attack (target <= 100 ms).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _decision(decision_id: str, output: str) -> bytes:
    head = {
        "decision_id": decision_id,
        "run_id": "run-1",
        "authority_branch_id": "production",
        "causation_event_id": f"evt-{decision_id}",
    }
    return (
        json.dumps(head)[:-1] + ',"decision":{"type":"complete","output":' + output + "}}"
    ).encode()


def hostile_body(kib: int, tag: str) -> bytes:
    """A decision whose output is arrays nested 100 deep, repeated to about ``kib`` KiB."""
    chain = "[" * 100 + "]" * 100
    count = max(1, (kib * 1024 - 200) // (len(chain) + 1))
    return _decision(f"attack-{tag}", "[" + ",".join([chain] * count) + "]")


def _serve(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0", "--no-access-log"],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(directory / "serve.log", "wb"),
    )
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode()
        if line.startswith("flowdecision serving on "):
            url = line.split()[-1]
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the rest
            return proc, url
    raise SystemExit(f"serve did not start: see {directory / 'serve.log'}")


def _connection(url: str) -> http.client.HTTPConnection:
    host, port = url.split("//")[1].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def honest(url: str, seconds: float, tag: str, out: Any) -> None:
    conn = _connection(url)
    done, n = 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        n += 1
        conn.request("POST", "/v1/decisions", _decision(f"h-{tag}-{n}", '{"ok":true}'),
                     {"Content-Type": "application/json"})  # fmt: skip
        answer = conn.getresponse()
        answer.read()
        if answer.status in (200, 201):
            done += 1
    out.put(("honest", done / seconds))


def prober(url: str, seconds: float, out: Any) -> None:
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        conn = _connection(url)
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        conn.close()
        latencies.append((time.perf_counter() - started) * 1000)
        time.sleep(0.02)
    out.put(("healthz", latencies))


def attacker(url: str, seconds: float, kib: int, tag: str, out: Any) -> None:
    statuses: dict[int, int] = {}
    n = 0
    deadline = time.monotonic() + seconds
    conn = _connection(url)
    while time.monotonic() < deadline:
        n += 1
        body = hostile_body(kib, f"{tag}-{n}")
        try:
            conn.request("POST", "/v1/decisions", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            status = answer.status
            if answer.getheader("connection", "").lower() == "close":
                conn.close()
                conn = _connection(url)
        except (OSError, http.client.HTTPException):
            status = 0
            conn.close()
            conn = _connection(url)
        statuses[status] = statuses.get(status, 0) + 1
    out.put(("attack", statuses))


def phase(url: str, seconds: float, attackers: int, kib: int, tag: str) -> dict[str, Any]:
    out: Any = mp.Queue()
    procs = [
        mp.Process(target=honest, args=(url, seconds, tag, out)),
        mp.Process(target=prober, args=(url, seconds, out)),
        *(
            mp.Process(target=attacker, args=(url, seconds, kib, f"{tag}-{i}", out))
            for i in range(attackers)
        ),
    ]
    for proc in procs:
        proc.start()
    result: dict[str, Any] = {"attack": {}}
    for _ in procs:
        kind, value = out.get(timeout=seconds + 120)
        if kind == "attack":
            for status, count in value.items():
                result["attack"][status] = result["attack"].get(status, 0) + count
        else:
            result[kind] = value
    for proc in procs:
        proc.join()
    latencies = sorted(result.pop("healthz"))
    result["healthz_p50"] = statistics.median(latencies)
    result["healthz_p99"] = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    result["healthz_max"] = latencies[-1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--attack-kib", type=int, default=976)
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _serve(Path(tmp))
        try:
            for round_no in range(args.rounds):
                order = ["quiet", "attack"] if round_no % 2 == 0 else ["attack", "quiet"]
                for name in order:
                    attackers = args.attackers if name == "attack" else 0
                    result = phase(
                        url, args.seconds, attackers, args.attack_kib, f"r{round_no}{name}"
                    )
                    result.update(round=round_no, phase=name)
                    rows.append(result)
                    print(
                        f"round {round_no} {name:6s}: honest {result['honest']:7.1f} POST/s, "
                        f"/healthz p50 {result['healthz_p50']:6.1f} p99 "
                        f"{result['healthz_p99']:7.1f} max {result['healthz_max']:7.1f} ms, "
                        f"attack {dict(sorted(result['attack'].items()))}",
                        flush=True,
                    )
        finally:
            proc.terminate()
            proc.wait(30)
    quiet = [r["honest"] for r in rows if r["phase"] == "quiet"]
    attacked = [r for r in rows if r["phase"] == "attack"]
    ratio = statistics.median(
        a["honest"] / q["honest"]
        for a, q in zip(attacked, [r for r in rows if r["phase"] == "quiet"], strict=True)
    )
    p99 = statistics.median(r["healthz_p99"] for r in attacked)
    print(
        f"median honest POST/s quiet {statistics.median(quiet):.1f}, under attack "
        f"{statistics.median(r['honest'] for r in attacked):.1f}: ratio {ratio:.2f} "
        f"(target >= 0.5); /healthz p99 under attack {p99:.1f} ms (target <= 100)"
    )
    if args.json:
        summary = {"args": vars(args), "rows": rows, "ratio": ratio, "healthz_p99_attack_ms": p99}
        args.json.write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
