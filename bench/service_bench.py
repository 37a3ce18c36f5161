"""Service benchmark: POST /v1/decisions throughput and latency with 50 concurrent clients.

Not a timed test. For each backend it starts ``flowdecision serve`` in a
separate process (ledger and outbox sink on the same store, access log off),
then runs ``--clients`` concurrent HTTP/1.1 keep-alive clients (asyncio +
httpx, in this process) that each POST new, unique decisions in a loop. After
a warm-up it measures for ``--seconds`` and reports requests/s and the p50,
p90 and p99 latency seen by the clients. Every response must be 201.

    .venv/bin/python bench/service_bench.py                  # sqlite + postgres
    .venv/bin/python bench/service_bench.py --backends sqlite --seconds 5
    .venv/bin/python bench/service_bench.py --postgres-url postgresql://...
    .venv/bin/python bench/service_bench.py --write-docs     # update docs/BENCHMARKS.md

Without ``--postgres-url`` a throwaway PostgreSQL server is started the way the
test suite does (``tests/postgres_server.py``) but with durable settings (fsync
and synchronous_commit on), and removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from flowdecision.model import DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402

DOCS = ROOT / "docs" / "BENCHMARKS.md"
BEGIN = "<!-- service-bench:begin -->"
END = "<!-- service-bench:end -->"


@dataclass
class Result:
    backend: str
    clients: int
    requests: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


class Service:
    """``flowdecision serve --port 0`` in a subprocess; ``url`` once it is ready."""

    def __init__(self, cwd: Path, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flowdecision.cli",
                "serve",
                "--port",
                "0",
                "--no-access-log",
                "--log-level",
                "warning",
                *args,
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode()
            if line.startswith("flowdecision serving on "):
                self.url = line.split()[-1]
                break
        else:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise RuntimeError(f"service did not start:\n{err}")
        # Keep draining the pipes so the service never blocks on a full pipe.
        for pipe in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=pipe.read, daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one response (Content-Length framed, as uvicorn sends it); return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


def _body(prefix: str, index: int) -> bytes:
    decision_id = f"{prefix}-{index}"
    return DecisionRequest(
        decision_id=decision_id,
        run_id=f"run-{prefix}",
        authority_branch_id="production",
        causation_event_id=f"event-{decision_id}",
        decision=ScheduleStep(
            step=DecisionStep(step_id=f"{decision_id}-s", step_name="fetch", input={"i": index})
        ),
    ).to_json()


async def load(url: str, clients: int, warmup: float, seconds: float) -> Result:
    prefix = uuid.uuid4().hex[:10]
    counter = iter(range(10**12))
    latencies: list[float] = []
    errors = 0
    measuring = False
    stop = False

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    async def client() -> None:
        # A minimal HTTP/1.1 keep-alive client: httpx itself would be the bottleneck here.
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while not stop:
                body = _body(prefix, next(counter))
                head = (
                    f"POST /v1/decisions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode()
                started = time.perf_counter()
                writer.write(head + body)
                status = await _read_response(reader)
                elapsed = time.perf_counter() - started
                if status != 201:
                    errors += 1
                elif measuring:
                    latencies.append(elapsed)
        finally:
            writer.close()

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await asyncio.sleep(warmup)
    measuring = True
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    measuring = False
    elapsed = time.perf_counter() - started
    stop = True
    await asyncio.gather(*tasks)
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return Result("", clients, len(latencies), elapsed, pct(0.50), pct(0.90), pct(0.99), errors)


def run_backend(name: str, work: Path, args: argparse.Namespace, url: str | None) -> Result:
    cwd = work / name
    cwd.mkdir()
    extra: list[str] = []
    if url is not None:
        subprocess.run(
            [sys.executable, "-m", "flowdecision.cli", "migrate", "--ledger", url, "--outbox", url],
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
        )
        extra = ["--ledger", url, "--sink", url]
    service = Service(cwd, *extra)
    try:
        result = asyncio.run(load(service.url, args.clients, args.warmup, args.seconds))
    finally:
        service.stop()
    result.backend = name
    return result


def table(results: list[Result]) -> str:
    lines = [
        "| backend | clients | requests/s | p50 ms | p90 ms | p99 ms | non-201 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.backend} | {r.clients} | {r.rate:,.0f} | {r.p50_ms:.1f} | {r.p90_ms:.1f} "
            f"| {r.p99_ms:.1f} | {r.errors} |"
        )
    return "\n".join(lines)


def write_docs(results: list[Result], args: argparse.Namespace) -> None:
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
    section = f"""{BEGIN}
## Service

`bench/service_bench.py`: `POST /v1/decisions` through `flowdecision serve` (uvicorn, one
process, access log off) with {args.clients} concurrent keep-alive HTTP/1.1 clients (plain
asyncio streams in one client process on the same machine), every request a new decision,
ledger and outbox sink on the same store. {args.seconds:g} s measured after a
{args.warmup:g} s warm-up; latency is what the clients saw. SQLite: WAL,
`synchronous=FULL`, ledger and outbox in two files. PostgreSQL: a local server with durable
settings (fsync and synchronous_commit on), over a unix socket. Each accepted decision
costs a ledger claim, an outbox insert and a ledger completion, each its own committed
transaction.

{table(results)}

Measured on {machine}, Python {platform.python_version()}; the client, the service (and
PostgreSQL) share the CPUs, so these are lower bounds for a dedicated service host.
Reproduce with `.venv/bin/python bench/service_bench.py --write-docs`.
{END}"""
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: section, text,
                      flags=re.S)  # fmt: skip
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOCS.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--postgres-url")
    parser.add_argument("--write-docs", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    work = Path(tempfile.mkdtemp(prefix="flowdecision-service-bench-"))
    server = None
    results: list[Result] = []
    try:
        if "sqlite" in backends:
            results.append(run_backend("sqlite", work, args, None))
            print(table(results[-1:]), flush=True)
        if "postgres" in backends:
            url = args.postgres_url
            if not url:
                from tests.postgres_server import PostgresServer

                server = PostgresServer(fast=False).start()
                url = server.url("postgres")
            results.append(run_backend("postgres", work, args, url))
            print(table(results[-1:]), flush=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))
    if args.write_docs:
        write_docs(results, args)
        print(f"\nwrote the Service section of {DOCS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
