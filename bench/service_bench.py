"""Service benchmark: flowdecision's HTTP service against a bare app on the same server stack.

    .venv/bin/python bench/service_bench.py --quick        # ~1-2 min: 50 clients, 3 rounds
    .venv/bin/python bench/service_bench.py                # full (7-12 min): 1/10/50/200 clients
    .venv/bin/python bench/service_bench.py --write-docs   # full, then update docs/BENCHMARKS.md
    .venv/bin/python bench/service_bench.py --profile      # py-spy profiles under load instead
    .venv/bin/python bench/service_bench.py --from-json bench/results/service.json --write-docs
    .venv/bin/python bench/service_bench.py --quick --serve-args='--no-access-log'  # experiments

What runs, as subprocesses, each on a free port in a fresh temporary directory:

* ``bare uvicorn``: a bare Starlette app under ``uvicorn.run`` with uvicorn's
  defaults (``service_ceiling.py --plain-uvicorn``): a reference that does not
  move when ``serve`` changes, so a flaw in ``serve``'s stack, which the
  ``ceiling`` shares, still shows.
* ``ceiling``: a bare Starlette app answering ``GET /healthz`` with a constant,
  served by ``flowdecision serve`` itself with the app swapped out
  (``bench/service_ceiling.py``): same socket binding, same uvicorn settings,
  loop, HTTP implementation and worker model, so the ceiling follows any change
  to how ``serve`` runs uvicorn. Every other figure is also given as a ratio to
  this row at the same client count (rates: higher is better; latencies: lower).
* ``healthz``: ``GET /healthz`` on ``flowdecision serve``.
* ``post sqlite``: ``POST /v1/decisions`` on ``flowdecision serve`` with its
  embedded defaults (no flags: the ledger and outbox SQLite files it creates in
  its working directory, ``synchronous=FULL``, access log on).
* ``post postgres``: the same with ``--ledger`` and ``--sink`` both naming one
  fresh database on a PostgreSQL server with durable settings (fsync,
  synchronous_commit and full_page_writes on; a throwaway server started like
  ``tests/postgres_server.py`` unless ``--postgres-url`` names one).
* each again with ``--workers N`` (default: the CPU count) when ``flowdecision
  serve --help`` offers ``--workers``; otherwise those rows are skipped, with a
  note.

Every POST carries a new, unique decision id and a valid body with
``Content-Type: application/json``; any response other than 201 (200 for GETs),
any socket error or timeout is counted and flagged. Each server is started
fresh for each target in each round (new files, new database), then loaded
at each client count in turn: a warm-up, then a measured run.

Load generator: ``wrk`` (Debian package ``wrk``: ``apt-get install -y wrk``,
or ``make wrk``) with ``bench/wrk_service.lua``, one thread, N keep-alive
HTTP/1.1 connections, each sending its next request as soon as the previous
answer arrives (closed loop: "clients" = connections). A Python client would
be the bottleneck on a 2-vCPU machine: the ceiling is several thousand
requests/s, and a Python HTTP client costs about as much CPU per request as
the server it measures. wrk is C with LuaJIT, needs a few percent of one core
at these rates, and records every latency in an HDR histogram.

Method: ``--rounds`` (at least 3) interleaved rounds; in each round every
target runs once, the starting target rotating from round to round, so slow
phases of a shared machine hit all targets alike. Tables give the median over
rounds (requests/s also with its min-max), the server's CPU milliseconds per
answered request (user + system time of its processes and threads, from /proc:
much less sensitive than requests/s to other jobs on the machine), and the
1-minute load average (``os.getloadavg``) seen at the start of the measured
runs, because on a shared machine every rate depends on it.

Output: tables on stdout; every wrk run's raw output, server log tails on
failure and the load average before each run in ``bench/results/service*.log``;
medians and every sample in ``service*.json`` and ``service*.md``; the plot of
requests/s against clients in ``docs/service_scaling.png`` (full mode).

``--profile`` runs one pass instead: each target at ``--profile-clients``
under ``py-spy record --idle --threads`` (pip install py-spy, part of the
``bench`` extra), and writes the collapsed stacks and a per-thread summary of
where the wall-clock time goes (:data:`CATEGORIES`) under
``bench/results/profile/`` (rates measured while profiling are lower: py-spy
samples the process).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from flowdecision.core.model import DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402
from ledger_bench import machine_description  # noqa: E402
from service_ceiling import CEILING_BODY, READY_PREFIX  # noqa: E402

DOCS = ROOT / "docs" / "BENCHMARKS.md"
PLOT = ROOT / "docs" / "service_scaling.png"
LUA = HERE / "wrk_service.lua"
PROFILE_HZ = 200
BEGIN = "<!-- service-bench:begin -->"
END = "<!-- service-bench:end -->"


class BenchError(RuntimeError):
    """The benchmark cannot run or a server misbehaved; the message says what to do."""


# -- targets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One server configuration and the request it is loaded with."""

    name: str
    kind: str  # "ceiling", "uvicorn" (bare app, plain uvicorn.run) or "flowdecision"
    method: str  # "get" or "post"
    path: str
    expected: int
    backend: str | None = None  # "sqlite" or "postgres" for POST
    workers: int = 1

    @property
    def key(self) -> str:
        return self.name if self.workers == 1 else f"{self.name} ×{self.workers}w"


def make_targets(backends: Sequence[str], workers: int | None) -> list[Target]:
    """The targets for one round: 1 worker, then ``workers`` workers if given."""
    counts = [1] + ([workers] if workers and workers > 1 else [])
    targets = [Target("bare uvicorn", "uvicorn", "get", "/healthz", 200)]
    for n in counts:
        targets.append(Target("ceiling", "ceiling", "get", "/healthz", 200, workers=n))
        targets.append(Target("healthz", "flowdecision", "get", "/healthz", 200, workers=n))
        for backend in backends:
            name = f"post {backend}"
            post = Target(name, "flowdecision", "post", "/v1/decisions", 201, backend, n)
            targets.append(post)
    return targets


def serve_supports_workers() -> bool:
    """Whether this checkout's ``flowdecision serve`` has a ``--workers`` option."""
    out = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--help"],
        env=server_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    return "--workers" in out.stdout


# -- environment -----------------------------------------------------------------------


def server_env() -> dict[str, str]:
    """The environment for servers: no FLOWDECISION_* settings, this checkout first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    # bench/ for the ceiling app that uvicorn worker processes import by name.
    paths = [str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def require_wrk() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise BenchError(
            "the load generator `wrk` is not installed: `apt-get install -y wrk` "
            "(Debian/Ubuntu; `make wrk` does that), `brew install wrk` on macOS"
        )
    return found


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts; "" if unknown)."""
    best, kind = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    resolved = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def load_average() -> float:
    return os.getloadavg()[0]


_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants.

    Robust on a shared machine where requests/s are not: a request costs the
    same CPU whether or not other jobs compete for the cores. (Linux /proc only;
    0 elsewhere. PostgreSQL's own processes are not descendants: not counted.)
    """
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                pending += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return total


def git_revision() -> str:
    """The last commit that changed ``src/`` (what is measured), and HEAD."""

    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    src = git("log", "-1", "--format=%h", "--", "src") or "unknown"
    dirty = " + uncommitted changes in src/" if git("status", "--porcelain", "--", "src") else ""
    return f"src/ at {src}{dirty} (checkout {head})"


# -- raw log ---------------------------------------------------------------------------


class RawLog:
    """Everything wrk printed and what the machine was doing, in run order."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w", encoding="utf-8")

    def write(self, text: str) -> None:
        self.file.write(text.rstrip("\n") + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


# -- servers ---------------------------------------------------------------------------


class Server:
    """A ``flowdecision serve`` (or ceiling) subprocess; ``url`` once it is ready."""

    def __init__(
        self,
        argv: list[str],
        cwd: Path,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.cwd = cwd
        self.stdout_path = cwd / "server.stdout"
        self.stderr_path = cwd / "server.stderr"
        # Files, not pipes: the server never blocks on a full pipe, and this
        # process spends no CPU draining access-log lines during the runs.
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=env or server_env(), stdout=out, stderr=err
            )
        self.url = self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.stdout_path.read_text(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    return line[len(READY_PREFIX) :].strip()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise BenchError(f"server did not start ({' '.join(self.proc.args)}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for path in (self.stdout_path, self.stderr_path):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {path.name} (last {lines} lines)\n" + "\n".join(text))
        return "\n".join(out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def served(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A :class:`Server` run in ``cwd`` (a fresh directory), stopped and ``cwd`` removed after."""
    try:
        server = Server(argv, cwd, env=env)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


class Postgres:
    """Where POST postgres targets get a fresh database each: a throwaway or given server."""

    def __init__(self, url: str | None) -> None:
        self.server: Any = None
        if url is None:
            from tests.postgres_server import PostgresServer

            self.server = PostgresServer(fast=False).start()
            url = self.server.url("postgres")
        self.admin_url = url

    def describe(self) -> str:
        if self.server is not None:
            return (
                "throwaway server (tests/postgres_server.py, fast=False): fsync, "
                "synchronous_commit and full_page_writes on, unix socket"
            )
        return "the server --postgres-url names (its own durability settings)"

    def database_url(self, name: str) -> str:
        parts = urlsplit(self.admin_url)
        return urlunsplit(parts._replace(path=f"/{name}"))

    def _admin(self, sql: str) -> None:
        import asyncpg

        async def go() -> None:
            conn = await asyncpg.connect(self.admin_url)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(go())

    @contextmanager
    def fresh_database(self) -> Iterator[str]:
        name = f"fdbench_{uuid.uuid4().hex[:12]}"
        self._admin(f'CREATE DATABASE "{name}"')
        try:
            url = self.database_url(name)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "flowdecision.cli",
                    "migrate",
                    "--ledger",
                    url,
                    "--outbox",
                    url,
                ],
                env=server_env(),
                capture_output=True,
                check=True,
            )
            yield url
        finally:
            self._admin(f'DROP DATABASE IF EXISTS "{name}"')

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@contextmanager
def running(
    target: Target, work: Path, postgres: Postgres | None, serve_args: Sequence[str] = ()
) -> Iterator[Server]:
    """Start ``target``'s server in a fresh directory (and database); stop and clean up."""
    flags = ["--port", "0"]
    if target.workers > 1:
        flags += ["--workers", str(target.workers)]
    if target.kind == "ceiling":
        argv = [sys.executable, str(HERE / "service_ceiling.py"), *flags]
    elif target.kind == "uvicorn":
        argv = [sys.executable, str(HERE / "service_ceiling.py"), "--plain-uvicorn"]
    else:
        argv = [sys.executable, "-m", "flowdecision.cli", "serve", *flags]
    with contextlib_database(target, postgres) as url:
        if url is not None:
            argv += ["--ledger", url, "--sink", url]
        if target.kind == "flowdecision":
            argv += serve_args  # last, so they override the defaults above
        cwd = Path(tempfile.mkdtemp(prefix=f"{target.name.replace(' ', '-')}-", dir=work))
        with served(argv, cwd) as server:
            if target.kind in {"ceiling", "uvicorn"}:
                check_ceiling(server, target.workers)
            yield server


@contextmanager
def contextlib_database(target: Target, postgres: Postgres | None) -> Iterator[str | None]:
    if target.backend != "postgres":
        yield None
        return
    if postgres is None:
        raise BenchError("a postgres target without a PostgreSQL server")
    with postgres.fresh_database() as url:
        yield url


def check_ceiling(server: Server, workers: int) -> None:
    """Make sure the ceiling serves the bare app (in every worker we happen to reach)."""
    for _ in range(max(4, 4 * workers)):
        with urllib.request.urlopen(f"{server.url}/healthz", timeout=10) as response:
            body = response.read()
        if body != CEILING_BODY:
            raise BenchError(
                "the ceiling server answered with flowdecision's app, not the bare one: "
                "`serve` builds its uvicorn server in a way bench/service_ceiling.py "
                f"does not intercept (got {body[:80]!r})"
            )


# -- load ------------------------------------------------------------------------------


@dataclass
class Sample:
    """One measured wrk run."""

    target: str
    round: int
    clients: int
    seconds: float
    requests: int
    ok: int
    bad: int
    socket_errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    load: float
    cpu_ms: float = 0.0  # server CPU per answered request (all its processes/threads)
    first_bad_status: int = 0

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def failed(self) -> bool:
        return self.bad > 0 or self.socket_errors > 0


def body_template() -> Path:
    """A valid decision body with ``@ID@`` wherever the unique id goes (file for wrk)."""
    request = DecisionRequest(
        decision_id="@ID@",
        run_id="run-service-bench",
        authority_branch_id="production",
        causation_event_id="event-@ID@",
        decision=ScheduleStep(
            step=DecisionStep(step_id="@ID@-s", step_name="fetch", input={"n": 1})
        ),
    )
    fd, name = tempfile.mkstemp(prefix="flowdecision-body-", suffix=".json")
    with os.fdopen(fd, "wb") as f:
        f.write(request.to_json())
    return Path(name)


def wrk(
    target: Target, url: str, clients: int, seconds: int, template: Path
) -> tuple[dict[str, Any], str]:
    """One wrk run; its parsed WRK_JSON line and its whole output."""
    args = [target.method, target.path, str(target.expected)]
    if target.method == "post":
        args += [str(template), uuid.uuid4().hex[:12]]
    argv = [
        require_wrk(),
        "-t1",
        f"-c{clients}",
        f"-d{seconds}s",
        "--timeout",
        "30s",
        "-s",
        str(LUA),
        url,
        "--",
        *args,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120)
    output = proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            return json.loads(line[len("WRK_JSON ") :]), output
    raise BenchError(f"wrk failed (exit {proc.returncode}): {' '.join(argv)}\n{output}")


def measure(
    target: Target,
    server: Server,
    clients: int,
    args: argparse.Namespace,
    round_: int,
    template: Path,
    raw: RawLog,
    warmup: int,
) -> Sample:
    if warmup > 0:
        wrk(target, server.url, clients, warmup, template)
    load = load_average()
    cpu_before = process_tree_cpu_s(server.proc.pid)
    raw.write(
        f"\n### round {round_} | {target.key} | {clients} clients | {args.seconds} s | "
        f"loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())} | "
        f"{datetime.datetime.now(datetime.UTC):%H:%M:%S} UTC"
    )
    data, output = wrk(target, server.url, clients, args.seconds, template)
    cpu_s = process_tree_cpu_s(server.proc.pid) - cpu_before
    raw.write(output)
    sample = Sample(
        target=target.key,
        round=round_,
        clients=clients,
        seconds=data["duration_us"] / 1e6,
        requests=data["requests"],
        ok=data["ok"],
        bad=data["bad"],
        socket_errors=data["connect_errors"]
        + data["read_errors"]
        + data["write_errors"]
        + data["timeouts"],
        p50_ms=data["p50_us"] / 1000,
        p90_ms=data["p90_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        load=load,
        cpu_ms=1000 * cpu_s / data["ok"] if data["ok"] else 0.0,
        first_bad_status=data["first_bad_status"],
    )
    if sample.failed:
        raw.write(
            f"!!! {sample.bad} unexpected statuses (first {sample.first_bad_status}), "
            f"{sample.socket_errors} socket errors/timeouts\n{server.log_tail()}"
        )
    print(
        f"  round {round_} {target.key:<22} {clients:>3} clients  {sample.rate:>8,.0f}/s  "
        f"p50 {sample.p50_ms:6.1f}  p99 {sample.p99_ms:7.1f} ms  "
        f"cpu {sample.cpu_ms:.2f} ms/req  load {load:.1f}" + ("  FAILED" if sample.failed else ""),
        flush=True,
    )
    return sample


# -- summary ---------------------------------------------------------------------------


@dataclass
class Row:
    """Medians over rounds of one target at one client count, and ratios to the ceiling."""

    target: str
    clients: int
    rates: list[float]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    load: float
    bad: int
    cpu_ms: float = 0.0
    ratios: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


def summarize(samples: Sequence[Sample], ceiling_key: str = "ceiling") -> list[Row]:
    groups: dict[tuple[str, int], list[Sample]] = collections.defaultdict(list)
    for s in samples:
        groups[(s.target, s.clients)].append(s)
    rows: list[Row] = []
    for (target, clients), group in groups.items():
        rows.append(
            Row(
                target=target,
                clients=clients,
                rates=[s.rate for s in group],
                p50_ms=statistics.median(s.p50_ms for s in group),
                p90_ms=statistics.median(s.p90_ms for s in group),
                p99_ms=statistics.median(s.p99_ms for s in group),
                load=statistics.median(s.load for s in group),
                cpu_ms=statistics.median(s.cpu_ms for s in group),
                bad=sum(s.bad + s.socket_errors for s in group),
            )
        )
    ceilings = {r.clients: r for r in rows if r.target == ceiling_key}
    for row in rows:
        c = ceilings.get(row.clients)
        if c is None:
            continue
        # Ratio of medians, so a reader can check it against the table's own columns.
        row.ratios = {
            "rate": row.rate / c.rate if c.rate else 0.0,
            "p50": row.p50_ms / c.p50_ms if c.p50_ms else 0.0,
            "p90": row.p90_ms / c.p90_ms if c.p90_ms else 0.0,
            "p99": row.p99_ms / c.p99_ms if c.p99_ms else 0.0,
            "cpu": row.cpu_ms / c.cpu_ms if c.cpu_ms else 0.0,
        }
    return rows


def _x(ratios: dict[str, float], key: str) -> str:
    return f"{ratios[key]:.2f}" if key in ratios else "–"


def table(rows: Sequence[Row], order: Sequence[str]) -> str:
    lines = [
        "| target | clients | requests/s (min–max) | × ceiling | p50 ms | × | p90 ms | × "
        "| p99 ms | × | server CPU ms/req | × | load | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rank = {name: i for i, name in enumerate(order)}
    for r in sorted(rows, key=lambda r: (r.clients, rank.get(r.target, 99))):
        lines.append(
            f"| {r.target} | {r.clients} | {r.rate:,.0f} ({min(r.rates):,.0f}–{max(r.rates):,.0f})"
            f" | {_x(r.ratios, 'rate')} | {r.p50_ms:.1f} | {_x(r.ratios, 'p50')}"
            f" | {r.p90_ms:.1f} | {_x(r.ratios, 'p90')} | {r.p99_ms:.1f} | {_x(r.ratios, 'p99')}"
            f" | {r.cpu_ms:.2f} | {_x(r.ratios, 'cpu')}"
            f" | {r.load:.1f} | {r.bad or ''}{' ⚠' if r.bad else ''} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Row], order: Sequence[str], path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in order:
        mine = sorted((r for r in rows if r.target == name), key=lambda r: r.clients)
        if not mine:
            continue
        xs = [r.clients for r in mine]
        ys = [r.rate for r in mine]
        err = [[y - min(r.rates) for y, r in zip(ys, mine, strict=True)],
               [max(r.rates) - y for y, r in zip(ys, mine, strict=True)]]  # fmt: skip
        style = "--" if name.startswith(("ceiling", "bare uvicorn")) else "-"
        ax.errorbar(xs, ys, yerr=err, fmt=style + "o", capsize=3, label=name)
    ax.set_xscale("log")
    clients = sorted({r.clients for r in rows})
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent keep-alive clients (wrk connections)")
    ax.set_ylabel("requests/s (median of rounds, min–max bars)")
    ax.set_title("flowdecision serve vs a bare app on the same server stack")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, note, fontsize=7, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(report: str) -> None:
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    section = f"{BEGIN}\n{report}\n{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: section, text,
                      flags=re.S)  # fmt: skip
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOCS.write_text(text)


# -- profile ---------------------------------------------------------------------------


#: Where a sample's time goes. First the components, each owning everything it calls
#: (first matching rule wins; ``any``: a frame anywhere in the stack, ``leaf``: the
#: innermost frame); then, for the rest, the layer of the innermost frame that
#: belongs to one of :data:`LAYERS`. py-spy frames look like ``function (path:line)``.
CATEGORIES: list[tuple[str, str, str]] = [
    ("idle (waiting in epoll)", "leaf", r"\.select \(.*selectors\.py"),
    # The outbox first: its thread runs the shared store/ code too (store/sqlite_thread.py).
    ("outbox sink (SQL, commits, its thread)", "any", r"flowdecision/sinks/"),
    ("ledger (SQL, commits, its thread)", "any", r"flowdecision/(ledger/|store/)"),
    (
        "access log (logging, JSON lines, request id)",
        "any",
        r"logging/__init__\.py|JsonFormatter|uuid4 |_incoming_request_id",
    ),
    ("access log (logging, JSON lines, request id)", "leaf", r"AccessLogMiddleware"),
    ("metrics (prometheus_client)", "any", r"prometheus_client/|service/metrics\.py"),
    ("health snapshot (to_dict)", "any", r"flowdecision/health\.py"),
    ("response JSON encoding", "any", r"JSONResponse\.render|^_json \(.*service/app\.py"),
    (
        "dispatcher, identity, canonical JSON, request model",
        "any",
        r"flowdecision/(dispatcher|identity|model|jsonwire)\.py",
    ),
    ("socket writes (send syscall)", "any", r"_SelectorSocketTransport\.write|sock_send"),
]
LAYERS: list[tuple[str, str]] = [
    ("HTTP parsing and framing (h11/httptools)", r"[(/]h11/|httptools"),
    ("uvicorn protocol", r"[(/]uvicorn/"),
    ("starlette (middleware stack, routing, request/response)", r"[(/]starlette/"),
    ("flowdecision handlers and middleware", r"flowdecision/service/"),
    ("asyncio event loop (tasks, callbacks, timers, reads)", r"asyncio/|selectors\.py|uvloop"),
    ("threads: waiting for work", r"concurrent/futures/thread\.py|threading\.py|queue\.py"),
]
_COMPILED = [(name, where, re.compile(rx)) for name, where, rx in CATEGORIES]
_LAYERS = [(name, re.compile(rx)) for name, rx in LAYERS]


def categorize(frames: Sequence[str]) -> str:
    for name, where, rx in _COMPILED:
        if where == "leaf":
            if frames and rx.search(frames[-1]):
                return name
        elif any(rx.search(f) for f in frames):
            return name
    for frame in reversed(frames):
        for name, rx in _LAYERS:
            if rx.search(frame):
                return name
    return "other (incomplete stacks)"


def summarize_collapsed(path: Path, top: int = 6) -> str:
    """Per thread, where its wall-clock time goes, from a ``py-spy --idle --threads`` raw file.

    With ``--idle`` a thread is sampled whether it runs or waits, so shares are of
    wall-clock time. The event loop thread is split into :data:`CATEGORIES`
    ("idle" = nothing to do); other threads (ledger writer, outbox executor) by
    their innermost function, which tells a commit from a wait for work.
    """
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        name = next((f for f in frames if f.startswith("thread (")), "thread (?): ?")
        # "thread (123): flowdecision-outbox_0" -> "flowdecision-outbox"; pid for workers.
        pid = frames[0].split(":")[0] if frames[0].startswith("process ") else ""
        thread = re.sub(r"_\d+$", "", name.partition(": ")[2] or name)
        key = f"{thread} [{pid}]" if pid else thread
        code = [f for f in frames if not f.startswith(("process ", "thread ("))]
        threads[key][categorize(code)] += int(count_text)
        leaves[key][re.sub(r":\d+\)$", ")", code[-1]) if code else "?"] += int(count_text)
    if not threads:
        return "no samples"
    out = []
    ordered = sorted(threads, key=lambda k: (not k.startswith("MainThread"), k))
    for key in ordered:
        total = sum(threads[key].values())
        out.append(f"{key}: {total} samples")
        parts = threads[key] if key.startswith("MainThread") else leaves[key]
        for name, n in parts.most_common(None if key.startswith("MainThread") else top):
            out.append(f"  {100 * n / total:5.1f}%  {name}")
    return "\n".join(out)


def profile(
    targets: Sequence[Target],
    args: argparse.Namespace,
    work: Path,
    postgres: Postgres | None,
    template: Path,
    raw: RawLog,
) -> None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise BenchError("py-spy is not installed: `.venv/bin/pip install py-spy`")
    out_dir = Path(args.out) / "profile"
    out_dir.mkdir(parents=True, exist_ok=True)
    for target in targets:
        slug = target.key.replace(" ", "-").replace("×", "x")
        with running(target, work, postgres, args.serve_args) as server:
            wrk(target, server.url, args.profile_clients, args.warmup, template)
            out = out_dir / f"{slug}.txt"
            spy = subprocess.Popen(
                [py_spy, "record", "--pid", str(server.proc.pid), "--duration",
                 str(args.seconds), "--rate", str(PROFILE_HZ), "--format", "raw",
                 "--nonblocking", "--idle", "--threads", "--subprocesses", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            sample = measure(target, server, args.profile_clients, args, 0, template, raw, warmup=0)
            _, err = spy.communicate(timeout=args.seconds + 60)
            if not out.exists():
                raise BenchError(f"py-spy wrote nothing: {err.decode(errors='replace')}")
        summary = summarize_collapsed(out)
        header = (
            f"{target.key} at {args.profile_clients} clients: {sample.rate:,.0f} req/s "
            f"(while sampled), p50 {sample.p50_ms:.1f} ms, p99 {sample.p99_ms:.1f} ms, "
            f"loadavg {sample.load:.1f}"
        )
        (out_dir / f"{slug}-top.txt").write_text(header + "\n\n" + summary + "\n")
        print(f"\n{header}\n{summary}\n", flush=True)
    print(f"profiles in {out_dir}/ (*.txt: py-spy collapsed stacks, *-top.txt: summaries)")


# -- driver ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def ints(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part]

    parser.add_argument("--quick", action="store_true",
                        help="50 clients only, 3 rounds of 2 s (about 1-2 minutes)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--seconds", type=int, default=None,
                        help="measured seconds per run (default 5; --quick 2)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up seconds before each run (default 2; --quick 1)")  # fmt: skip
    parser.add_argument("--clients", type=ints, default=None,
                        help="client counts (default 1,10,50,200; --quick 50)")  # fmt: skip
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                        help="N for the N-worker rows (1: none)")  # fmt: skip
    parser.add_argument("--only", default="", help="comma-separated target names to run, "
                        "e.g. 'ceiling,post sqlite' (default: all)")  # fmt: skip
    parser.add_argument("--postgres-url", default=os.environ.get("FLOWDECISION_BENCH_POSTGRES_URL"),
                        help="an existing server to create throwaway databases on")  # fmt: skip
    parser.add_argument("--workdir", default=None, help="where servers' files go (a real disk)")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--plot", default=None, help=f"default {PLOT.relative_to(ROOT)} "
                        "(full mode, several client counts)")  # fmt: skip
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite the generated part of docs/BENCHMARKS.md")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="py-spy profiles under load instead of the benchmark")  # fmt: skip
    parser.add_argument("--profile-clients", type=int, default=50)
    parser.add_argument("--serve-args", type=shlex.split, default=[],
                        help="extra `flowdecision serve` flags for experiments, given with '=': "
                        "--serve-args='--no-access-log'; recorded in the report")  # fmt: skip
    parser.add_argument("--from-json", type=Path, default=None,
                        help="no measuring: tables, plot (and --write-docs) from a saved "
                        "service*.json")  # fmt: skip
    args = parser.parse_args()
    if args.from_json:
        samples, header, notes, order = from_json(args.from_json)
        finish(samples, header, notes, order, args, "")
        return
    args.seconds = args.seconds or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.clients = args.clients or ([50] if args.quick else [1, 10, 50, 200])
    if args.rounds < 3 and not args.profile:
        parser.error("--rounds must be at least 3 (medians of interleaved rounds)")
    require_wrk()

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    notes: list[str] = []
    workers = args.workers if args.workers > 1 else None
    if workers and not serve_supports_workers():
        notes.append(
            "N-worker rows skipped: this `flowdecision serve` has no `--workers` option "
            "(checked with `serve --help`)."
        )
        workers = None
    targets = make_targets(backends, workers)
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        targets = [t for t in targets if t.name in wanted or t.key in wanted]
    order = [t.key for t in targets]

    work = Path(tempfile.mkdtemp(prefix="flowdecision-service-bench-", dir=args.workdir))
    fs = filesystem_type(work)
    if fs in {"tmpfs", "ramfs"}:
        notes.append(f"WARNING: {work} is on {fs}: SQLite fsyncs cost nothing there; "
                     "use --workdir on a real disk.")  # fmt: skip
    suffix = "-profile" if args.profile else ("-quick" if args.quick else "")
    out = Path(args.out)
    raw = RawLog(out / f"service{suffix}.log")
    template = body_template()
    postgres: Postgres | None = None
    started = time.monotonic()
    header = [
        f"machine: {machine_description()}",
        f"flowdecision: {git_revision()}; wrk: one thread, keep-alive, closed loop",
        f"command: {shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])}; {args.rounds} rounds, "
        f"{args.warmup} s warm-up + {args.seconds} s measured per client count, "
        f"clients {','.join(map(str, args.clients))}",
        f"started {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"({os.cpu_count()} CPUs); workdir {work} ({fs or 'unknown fs'})",
    ]
    for line in header + notes:
        print(line, flush=True)
        raw.write(line)
    samples: list[Sample] = []
    try:
        if any(t.backend == "postgres" for t in targets):
            postgres = Postgres(args.postgres_url)
            header.append(f"PostgreSQL: {postgres.describe()}")
            print(header[-1], flush=True)
        if args.profile:
            profile(targets, args, work, postgres, template, raw)
            return
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(targets)
            for target in targets[shift:] + targets[:shift]:
                with running(target, work, postgres, args.serve_args) as server:
                    for i, clients in enumerate(args.clients):
                        # The first client count of a fresh server gets a longer warm-up.
                        warm = args.warmup if i == 0 else max(1, args.warmup // 2)
                        samples.append(
                            measure(target, server, clients, args, round_, template, raw, warm)
                        )
    finally:
        if postgres is not None:
            postgres.stop()
        shutil.rmtree(work, ignore_errors=True)
        template.unlink(missing_ok=True)
        raw.close()

    loads = [s.load for s in samples]
    header.append(
        f"finished after {time.monotonic() - started:.0f} s; 1-min load average during the "
        f"measured runs {min(loads):.1f}–{max(loads):.1f} (median {statistics.median(loads):.1f})"
    )
    failed = sum(1 for s in samples if s.failed)
    if failed:
        notes.append(f"WARNING: {failed} runs saw unexpected statuses or socket errors "
                     f"(⚠ in the table); see {raw.file.name}.")  # fmt: skip
    finish(samples, header, notes, order, args, suffix)


def finish(
    samples: Sequence[Sample],
    header: Sequence[str],
    notes: Sequence[str],
    order: Sequence[str],
    args: argparse.Namespace,
    suffix: str,
) -> None:
    """Tables on stdout and in ``--out``; the plot; the docs block if asked."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(samples)
    clients = sorted({s.clients for s in samples})
    report = "\n".join(
        [
            "```",
            *header,
            "```",
            "",
            "Medians of the rounds; `×` = ratio to the `ceiling` row at the same client "
            "count (1 worker); `server CPU ms/req` = CPU time (user + system) of the "
            "server's processes and threads per answered request (PostgreSQL's own "
            "processes not included), which depends much less than requests/s on what "
            "else runs on the machine; `load` = median 1-min load average at the start "
            "of the measured runs.",
            "",
            table(rows, order),
            *(["", *notes] if notes else []),
        ]
    )
    print("\n" + report)
    if not args.from_json:
        (out / f"service{suffix}.md").write_text(report + "\n")
        (out / f"service{suffix}.json").write_text(
            json.dumps(
                {
                    "header": list(header),
                    "notes": list(notes),
                    "order": list(order),
                    "rows": [{**asdict(r), "rate": r.rate} for r in rows],
                    "samples": [{**asdict(s), "rate": s.rate} for s in samples],
                },
                indent=1,
            )
        )
        shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
        print(f"\nraw log, tables and samples: {shown}/service{suffix}.*")
    plot_path = Path(args.plot) if args.plot else PLOT
    if len(clients) > 1:
        plot(rows, order, plot_path, header[-1])
        print(f"plot: {plot_path}")
    if args.write_docs:
        write_docs(report)
        print(f"wrote the generated block of {DOCS.relative_to(ROOT)}")


def from_json(path: Path) -> tuple[list[Sample], list[str], list[str], list[str]]:
    """Samples, header, notes and target order saved by an earlier run."""
    data = json.loads(path.read_text())
    samples = [Sample(**{k: v for k, v in d.items() if k != "rate"}) for d in data["samples"]]
    # Round 1 runs the targets in their canonical order.
    order = data.get("order") or list(dict.fromkeys(s.target for s in samples))
    return samples, data["header"], data["notes"], order


if __name__ == "__main__":
    try:
        main()
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
