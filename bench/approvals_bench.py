"""Bulk approval (issue 40): 10,000 held decisions approved at once, and the POST rate meanwhile.

    flock /tmp/team/bench.lock .venv/bin/python bench/approvals_bench.py             # 3 rounds
    flock /tmp/team/bench.lock .venv/bin/python bench/approvals_bench.py --write-docs

Target: ``flowdecision serve`` on its default layout (ledger and outbox in one SQLite
file, ``synchronous=FULL``), holding every decision of the runs ``bulk-*``
(``--approve-runs``), with an admin token. Per round, on a fresh server and directory:

1. ``--decisions`` decisions are POSTed into run ``bulk-a`` and as many into ``bulk-b``
   (``DecisionClient``, 32 at a time): each answered 202 held;
2. **idle**: ``wrk`` POSTs new decisions (each in a run of its own, not held) for
   ``--seconds``: the POST rate with no approval running;
3. **alone**: ``POST /v1/actions/approve {"run_id": "bulk-a"}`` approves run
   ``bulk-a``'s decisions with nothing else running: decisions/s;
4. **under load**: the same for ``bulk-b`` while ``wrk`` POSTs for ``--seconds``,
   started together: the approval's decisions/s, and the POST rate while it ran
   (a round whose approval ended before ``wrk`` is flagged: its rate is not
   "during");
5. **cli**: ``flowdecision approve --run bulk-c --yes`` in a process of its own, on
   the same file while the service runs (a third set, seeded after step 4):
   decisions/s.

Each approved decision must be in the outbox exactly once and none may stay held
(checked after every round; a failure stops the bench). Samples go to
``bench/results/approvals-bench.json``; ``--write-docs`` replaces the block in
docs/BENCHMARKS.md.
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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

import requests  # noqa: E402

from flowdecision.client import DecisionClient  # noqa: E402
from flowdecision.core.model import DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402
from ledger_bench import machine_description  # noqa: E402
from service_bench import (  # noqa: E402
    BenchError,
    Server,
    Target,
    load_average,
    served,
    server_env,
    wrk,
)

RESULTS = HERE / "results" / "approvals-bench.json"
DOCS = ROOT / "docs" / "BENCHMARKS.md"
POST = Target("post sqlite", "flowdecision", "post", "/v1/decisions", 201, "sqlite")
ADMIN = "approvals-bench-admin-0123456789"
SEED_AT_ONCE = 32


def template() -> Path:
    """The wrk body: a step in a run of its own (``r-@ID@``), which no policy holds."""
    request = DecisionRequest(
        "@ID@", "r-@ID@", "production", "event-@ID@",
        ScheduleStep(DecisionStep("@ID@-s", "fetch", {"n": 1})),
    )  # fmt: skip
    fd, name = tempfile.mkstemp(prefix="approvals-bench-", suffix=".json")
    with open(fd, "wb") as out:
        out.write(request.to_json())
    return Path(name)


@contextmanager
def serving() -> Iterator[Server]:
    cwd = Path(tempfile.mkdtemp(prefix="approvals-bench-"))
    argv = [
        sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0",
        "--approve-runs", "bulk-a,bulk-b,bulk-c", "--no-access-log",
    ]  # fmt: skip
    # No submit token (wrk POSTs as service_bench does); the actions need the admin token.
    env = {**server_env(), "FLOWDECISION_ADMIN_TOKEN": ADMIN}
    with served(argv, cwd, env=env) as server:
        yield server


async def seed(url: str, run: str, count: int) -> None:
    """``count`` steps into ``run``, each answered 202 held."""
    queue = iter(range(count))
    async with DecisionClient(url) as client:

        async def worker() -> None:
            for n in queue:
                request = DecisionRequest(
                    f"{run}-{n}", run, "production", f"{run}-{n}-event",
                    ScheduleStep(DecisionStep(f"{run}-{n}-s", "payments.refund", {"n": n})),
                )  # fmt: skip
                result = await client.submit(request)
                if not result.held:
                    raise BenchError(f"{request.decision_id} was not held: {result}")

        await asyncio.gather(*(worker() for _ in range(SEED_AT_ONCE)))


def approve_run(url: str, run: str) -> tuple[float, dict[str, Any]]:
    """Approve every held decision of ``run`` over HTTP: (seconds, the answer)."""
    started = time.perf_counter()
    answer = requests.post(
        f"{url}/v1/actions/approve",
        json={"run_id": run, "actor": "bench", "reason": "bulk approval benchmark"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=3600,
    )
    elapsed = time.perf_counter() - started
    if answer.status_code != 200:
        raise BenchError(f"bulk approval answered {answer.status_code}: {answer.text[:500]}")
    return elapsed, answer.json()


def approve_cli(cwd: Path, run: str) -> float:
    """``flowdecision approve --run RUN --yes`` in a process of its own: seconds."""
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable, "-m", "flowdecision.cli", "approve", "--run", run, "--yes",
            "--reason", "bulk approval benchmark", "--actor", "bench", "--json",
            "--ledger", "sqlite:///.flowdecision/flowdecision.db",
        ],
        cwd=cwd, env=server_env(), capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise BenchError(f"flowdecision approve exited {proc.returncode}: {proc.stderr[-2000:]}")
    return elapsed


def check(url: str, runs: list[str], count: int) -> None:
    """Every decision of ``runs`` is in the outbox exactly once, and none is held."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    seen: dict[str, int] = {}
    after = 0
    while True:
        answer = requests.get(
            f"{url}/v1/outbox", params={"after": after, "limit": 1000}, timeout=60
        )
        if answer.status_code != 200:
            raise BenchError(f"GET /v1/outbox answered {answer.status_code}: {answer.text[:300]}")
        page = answer.json()
        for entry in page["entries"]:
            seen[entry["decision_id"]] = seen.get(entry["decision_id"], 0) + 1
        after = page["next_after"]
        if not page["has_more"]:
            break
    for run in runs:
        ids = [f"{run}-{n}" for n in range(count)]
        missing = [d for d in ids if d not in seen]
        twice = [d for d in ids if seen.get(d, 0) > 1]
        if missing or twice:
            raise BenchError(f"{run}: {len(missing)} missing from the outbox, {len(twice)} twice")
    held = requests.get(
        f"{url}/v1/decisions", params={"state": "held", "limit": 10}, headers=auth, timeout=60
    ).json()["decisions"]
    if held:
        raise BenchError(f"{len(held)} decision(s) still held after the approvals")


@dataclass
class Sample:
    round: int
    idle_rate: float
    alone_per_s: float
    loaded_per_s: float
    loaded_post_rate: float
    loaded_overlap: bool
    cli_per_s: float
    load: float


def measure(round_: int, args: argparse.Namespace, body: Path) -> Sample:
    count = args.decisions
    with serving() as server:
        asyncio.run(seed(server.url, "bulk-a", count))
        asyncio.run(seed(server.url, "bulk-b", count))
        wrk(POST, server.url, args.clients, args.warmup, body)
        load = load_average()
        idle, _ = wrk(POST, server.url, args.clients, args.seconds, body)
        alone_s, answer = approve_run(server.url, "bulk-a")
        if len(answer["outcomes"]) != count or answer["refused"]:
            raise BenchError(
                f"bulk-a: {len(answer['outcomes'])} approved, refused {answer['refused'][:3]}"
            )
        result: dict[str, Any] = {}

        def loaded_approval() -> None:
            result["elapsed"], result["answer"] = approve_run(server.url, "bulk-b")

        thread = threading.Thread(target=loaded_approval)
        thread.start()
        during, _ = wrk(POST, server.url, args.clients, args.seconds, body)
        thread.join()
        overlap = result["elapsed"] >= args.seconds  # the approval outlasted wrk's window
        asyncio.run(seed(server.url, "bulk-c", count))
        cli_s = approve_cli(server.cwd, "bulk-c")
        check(server.url, ["bulk-a", "bulk-b", "bulk-c"], count)
    sample = Sample(
        round_,
        idle["ok"] / (idle["duration_us"] / 1e6),
        count / alone_s,
        count / result["elapsed"],
        during["ok"] / (during["duration_us"] / 1e6),
        overlap,
        count / cli_s,
        load,
    )
    print(
        f"  round {round_}: POST idle {sample.idle_rate:,.0f}/s; approval alone "
        f"{sample.alone_per_s:,.0f}/s, under load {sample.loaded_per_s:,.0f}/s with POSTs at "
        f"{sample.loaded_post_rate:,.0f}/s{'' if overlap else ' (approval ended first)'}; "
        f"CLI {sample.cli_per_s:,.0f}/s; load {load:.1f}",
        flush=True,
    )
    return sample


def report(samples: list[Sample], args: argparse.Namespace) -> str:
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"

    paired = [s.loaded_post_rate / s.idle_rate for s in samples]
    during = (
        f"{cell([s.loaded_post_rate for s in samples])} requests/s, "
        f"**{statistics.median(paired):.2f}×** of idle (paired, "
        f"{min(paired):.2f}–{max(paired):.2f})"
    )
    if not all(s.loaded_overlap for s in samples):
        during += "; in some rounds the approval ended before wrk"
    rows = [
        ("bulk approval over HTTP, nothing else running",
         f"{cell([s.alone_per_s for s in samples])} decisions/s"),
        ("bulk approval over HTTP, with wrk POSTing",
         f"{cell([s.loaded_per_s for s in samples])} decisions/s"),
        ("`flowdecision approve --run … --yes` (its own process, the service running)",
         f"{cell([s.cli_per_s for s in samples])} decisions/s"),
        ("POST rate, no approval running", f"{cell([s.idle_rate for s in samples])} requests/s"),
        ("POST rate while the bulk approval runs", during),
    ]  # fmt: skip
    head = (
        f"`flock /tmp/team/bench.lock .venv/bin/python bench/approvals_bench.py --rounds "
        f"{args.rounds} --decisions {args.decisions} --seconds {args.seconds} --clients "
        f"{args.clients}` ({datetime.date.today()}, {machine_description()}; median 1-min "
        f"load average {statistics.median(s.load for s in samples):.1f}; medians over "
        f"rounds, min–max in brackets):"
    )
    table = [f"| {what} | {figure} |" for what, figure in rows]
    return "\n".join([head, "", "| what | figure |", "|---|---|", *table])


def write_docs(text: str) -> None:
    begin, end = "<!-- approvals-bench:begin -->", "<!-- approvals-bench:end -->"
    docs = DOCS.read_text(encoding="utf-8")
    block = f"{begin}\n{text}\n{end}"
    if begin in docs:
        docs = docs[: docs.index(begin)] + block + docs[docs.index(end) + len(end) :]
    else:
        docs = docs.rstrip("\n") + "\n\n## Bulk approval (issue 40)\n\n" + block + "\n"
    DOCS.write_text(docs, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decisions", type=int, default=10_000)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    body = template()
    samples = []
    try:
        for round_ in range(1, args.rounds + 1):
            samples.append(measure(round_, args, body))
    finally:
        body.unlink()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps([asdict(s) for s in samples], indent=1) + "\n")
    text = report(samples, args)
    print(text)
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
