"""HTTP clients side by side: DecisionClient, the webhook and Restate sinks against plain aiohttp.

    flock /tmp/team/bench.lock .venv/bin/python bench/client_bench.py            # all three parts
    flock /tmp/team/bench.lock .venv/bin/python bench/client_bench.py --only client --rounds 3
    .venv/bin/python bench/client_bench.py --write-docs   # also replace the table in BENCHMARKS.md

Not a timed test (issue 41). Three parts, each in one run, interleaved rounds (the order of the
candidates rotates from round to round), medians over rounds:

* ``client``: ``POST /v1/decisions`` on one ``flowdecision serve`` with its default layout
  (SQLite ledger and outbox, no flags), at 1, 8 and 64 concurrent submitters, every body a
  new decision, every answer checked (201). Candidates: ``wrk`` (``bench/wrk_service.lua``,
  one thread, N connections), plain aiohttp (one ``ClientSession`` with
  ``TCPConnector(limit=64)``, N tasks), ``DecisionClient`` (N tasks on one client),
  ``SyncDecisionClient`` (N threads on one client; httpx's blocking pool) and, for the
  record, httpx's own ``AsyncClient(limits=Limits(max_connections=64))``, and, when their
  packages are installed (none is a dependency), httpx with httpx-aiohttp's transport,
  pyreqwest (Rust's reqwest) and aiosonic, each with a pool of 64.
* ``webhook``: ``WebhookSink.submit`` from 64 tasks into a local receiver (an aiohttp
  server in a subprocess that answers 200 to every POST), beside plain aiohttp posting the
  same bytes with the same headers to the same receiver, and httpx's ``AsyncClient`` doing
  the same (the sinks' transport before issue 41).
* ``restate``: ``RestateSink.deliver`` from 64 tasks into a Restate server's ingress
  (``/send`` of examples/restate_service.py's ``Decisions/handle``, each decision new),
  beside plain aiohttp posting the same bodies and headers. Needs ``make engines``.

The Python clients run in this process on asyncio's default event loop (what a host gets
without configuring one); a Python client costs about as much CPU per request as the server
it calls, and the machine has 2 cores, so a ratio is only meaningful within one run.
Output: a Markdown table on stdout and in ``bench/results/client-bench.md`` (samples in
``client-bench.json``; with ``--only``, ``client-bench-<parts>.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
from tests.service_process import ServiceProcess  # noqa: E402

from flowdecision.client import DecisionClient, SyncDecisionClient  # noqa: E402
from flowdecision.core.model import DecisionRequest, DecisionStep, ScheduleStep  # noqa: E402
from flowdecision.sinks.delivery import DecisionDelivery  # noqa: E402
from flowdecision.sinks.restate import RestateSink, parse_restate_url  # noqa: E402
from flowdecision.sinks.webhook import WebhookSink  # noqa: E402

LUA = HERE / "wrk_service.lua"
RESULTS = HERE / "results"
DOCS = ROOT / "docs" / "BENCHMARKS.md"
BEGIN, END = "<!-- client-bench:begin -->", "<!-- client-bench:end -->"

#: A submitter: send one request; True when its answer was the expected one.
Post = Callable[[bytes], Awaitable[bool]]
#: A candidate: opens its client for N submitters and yields its ``Post``.
Candidate = Callable[[str, int], AbstractAsyncContextManager[Post]]


class BenchError(RuntimeError):
    """The benchmark could not run (a missing tool, a server that did not start)."""


def request_bytes(decision_id: str) -> bytes:
    return DecisionRequest(
        decision_id=decision_id,
        run_id="run-client-bench",
        authority_branch_id="production",
        causation_event_id=f"event-{decision_id}",
        decision=ScheduleStep(
            step=DecisionStep(step_id=f"{decision_id}-s", step_name="fetch", input={"n": 1})
        ),
    ).to_json()


def fresh_bodies(count: int) -> list[bytes]:
    """``count`` decision bodies, each with a new id (made before the clock starts)."""
    token = uuid.uuid4().hex[:10]
    return [request_bytes(f"cb-{token}-{n}") for n in range(count)]


async def closed_loop(
    post: Callable[[Any], Awaitable[bool]], clients: int, seconds: float, bodies: list[Any]
) -> dict[str, Any]:
    """``clients`` tasks, each posting its next body as soon as its previous answer came."""
    stop = time.monotonic() + seconds
    counts = {"ok": 0, "bad": 0}
    feed = iter(bodies)

    async def one() -> None:
        while time.monotonic() < stop:
            body = next(feed, None)
            if body is None:  # made too few: the rate is still right, over less time
                break
            try:
                ok = await post(body)
            except Exception:
                ok = False
            counts["ok" if ok else "bad"] += 1

    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(clients)))
    elapsed = time.monotonic() - started
    return {"rate": counts["ok"] / elapsed, **counts}


def threaded_loop(
    post: Callable[[bytes], bool], clients: int, seconds: float, bodies: list[bytes]
) -> dict[str, Any]:
    """The blocking twin of :func:`closed_loop`: ``clients`` threads."""
    stop = time.monotonic() + seconds
    counts = {"ok": 0, "bad": 0}
    lock = threading.Lock()
    feed = iter(bodies)

    def one() -> None:
        while time.monotonic() < stop:
            with lock:
                body = next(feed)
            try:
                ok = post(body)
            except Exception:
                ok = False
            with lock:
                counts["ok" if ok else "bad"] += 1

    threads = [threading.Thread(target=one) for _ in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"rate": counts["ok"] / (time.monotonic() - started), **counts}


# -- the client part's candidates ------------------------------------------------------------


@asynccontextmanager
async def aiohttp_client(url: str, clients: int) -> AsyncIterator[Post]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:

        async def post(body: bytes) -> bool:
            async with session.post(f"{url}/v1/decisions", data=body, headers=headers) as answer:
                await answer.read()
                return answer.status == 201

        yield post


@asynccontextmanager
async def decision_client(url: str, clients: int) -> AsyncIterator[Post]:
    async with DecisionClient(url) as client:

        async def post(body: bytes) -> bool:
            return (await client.submit(body)).submitted

        yield post


def httpx_post(client: httpx.AsyncClient, url: str) -> Post:
    """What the other candidates send, through an ``httpx.AsyncClient``."""

    async def post(body: bytes) -> bool:
        headers = {"Content-Type": "application/json"}
        answer = await client.post(f"{url}/v1/decisions", content=body, headers=headers)
        return answer.status_code == 201

    return post


@asynccontextmanager
async def httpx_client(url: str, clients: int) -> AsyncIterator[Post]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        yield httpx_post(client, url)


@asynccontextmanager
async def httpx_aiohttp_client(url: str, clients: int) -> AsyncIterator[Post]:
    from httpx_aiohttp import AiohttpTransport

    transport = AiohttpTransport(limits=httpx.Limits(max_connections=64))
    async with httpx.AsyncClient(transport=transport) as client:
        yield httpx_post(client, url)


@asynccontextmanager
async def pyreqwest_client(url: str, clients: int) -> AsyncIterator[Post]:
    from pyreqwest.client import ClientBuilder

    async with ClientBuilder().max_connections(64).build() as client:

        async def post(body: bytes) -> bool:
            request = client.post(f"{url}/v1/decisions")
            request = request.header("Content-Type", "application/json").body_bytes(body)
            answer = await request.build().send()
            await answer.bytes()
            return answer.status == 201

        yield post


@asynccontextmanager
async def aiosonic_client(url: str, clients: int) -> AsyncIterator[Post]:
    import aiosonic
    from aiosonic.pools import PoolConfig

    pools = {":default": PoolConfig(size=64)}
    client = aiosonic.HTTPClient(connector=aiosonic.TCPConnector(pool_configs=pools))
    headers = {"Content-Type": "application/json"}
    try:

        async def post(body: bytes) -> bool:
            answer = await client.post(f"{url}/v1/decisions", data=body, headers=headers)
            await answer.content()
            return answer.status_code == 201

        yield post
    finally:
        await client.aclose()


def installed(module: str) -> bool:
    """Whether an optional candidate's package is there (the bench runs without them)."""
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def has_httpx_aiohttp() -> bool:
    try:
        import httpx_aiohttp  # noqa: F401
    except ImportError:
        return False
    return True


def wrk(url: str, clients: int, seconds: float) -> dict[str, Any]:
    """One wrk run against ``POST /v1/decisions`` (bench/wrk_service.lua's post mode)."""
    template = Path(tempfile.mkstemp(prefix="client-bench-", suffix=".json")[1])
    template.write_bytes(request_bytes("@ID@"))
    argv = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, round(seconds))}s", "--timeout", "30s",
            "-s", str(LUA), url, "--", "post", "/v1/decisions", "201", str(template),
            uuid.uuid4().hex[:12]]  # fmt: skip
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120)
    finally:
        template.unlink()
    for line in proc.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            data = json.loads(line[len("WRK_JSON ") :])
            return {"rate": data["ok"] / (data["duration_us"] / 1e6), "ok": data["ok"],
                    "bad": data["bad"]}  # fmt: skip
    raise BenchError(f"wrk failed (exit {proc.returncode}): {proc.stdout}{proc.stderr}")


def sync_client_run(url: str, clients: int, seconds: float) -> dict[str, Any]:
    bodies = fresh_bodies(int(seconds * 6000) + 1000)
    with SyncDecisionClient(url) as client:
        client.health()  # warm: one connection open
        return threaded_loop(lambda body: client.submit(body).submitted, clients, seconds, bodies)


async def async_run(
    candidate: Candidate, url: str, clients: int, seconds: float, warmup_s: float
) -> dict[str, Any]:
    async with candidate(url, clients) as post:
        await closed_loop(post, clients, warmup_s, fresh_bodies(int(warmup_s * 6000) + 1000))
        return await closed_loop(post, clients, seconds, fresh_bodies(int(seconds * 6000) + 1000))


CLIENT_CANDIDATES: dict[str, Candidate] = {
    "aiohttp (plain)": aiohttp_client,
    "DecisionClient": decision_client,
    "httpx.AsyncClient (plain)": httpx_client,
}


def client_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    candidates = dict(CLIENT_CANDIDATES)
    if has_httpx_aiohttp():
        candidates["httpx + httpx-aiohttp (plain)"] = httpx_aiohttp_client
    if installed("pyreqwest"):
        candidates["pyreqwest (plain)"] = pyreqwest_client
    if installed("aiosonic"):
        candidates["aiosonic (plain)"] = aiosonic_client
    names = ["wrk", *candidates, "SyncDecisionClient"]
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="client-bench-") as work:
        with ServiceProcess(Path(work)) as service:
            for round_ in range(args.rounds):
                for clients in args.clients:
                    shift = round_ % len(names)
                    for name in names[shift:] + names[:shift]:
                        if name == "wrk":
                            wrk(service.url, clients, args.warmup)
                            result = wrk(service.url, clients, args.seconds)
                        elif name == "SyncDecisionClient":
                            result = sync_client_run(service.url, clients, args.seconds)
                        else:
                            result = asyncio.run(
                                async_run(candidates[name], service.url, clients,
                                          args.seconds, args.warmup)
                            )  # fmt: skip
                        result.update(part="client", name=name, clients=clients, round=round_,
                                      load=os.getloadavg()[0])  # fmt: skip
                        print(json.dumps(result), flush=True)
                        samples.append(result)
    return samples


# -- the sinks' parts ------------------------------------------------------------------------

RECEIVER = """
import sys
from aiohttp import web

async def ok(request):
    await request.read()
    return web.Response(status=200, text="{}", content_type="application/json")

app = web.Application()
app.router.add_post("/hooks/decisions", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_receiver() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.post(f"http://127.0.0.1:{port}/hooks/decisions", content=b"{}")
            return proc, f"http://127.0.0.1:{port}/hooks/decisions"
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise BenchError("the webhook receiver did not start")


def sink_requests(count: int) -> list[DecisionRequest]:
    token = uuid.uuid4().hex[:10]
    return [DecisionRequest.parse(request_bytes(f"sb-{token}-{n}")) for n in range(count)]


async def sink_run(
    kind: str, target: str, name: str, clients: int, seconds: float, warmup_s: float
) -> dict[str, Any]:
    """``clients`` tasks submitting through the sink, or aiohttp posting what the sink posts."""

    restate = parse_restate_url(target) if kind == "restate" else None

    def wire(request: DecisionRequest) -> tuple[str, bytes, dict[str, str]]:
        # What the sink sends for ``request`` (its module docstring's contract).
        if kind == "webhook":
            headers = {"Content-Type": "application/json", "Idempotency-Key": request.decision_id,
                       "X-Flow-Attempt": "1"}  # fmt: skip
            return target, request.to_json(), headers
        delivery = DecisionDelivery.of(request, 1)
        body = json.dumps(delivery.to_dict(), ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json", "idempotency-key": request.decision_id,
                   "x-flow-attempt": "1"}  # fmt: skip
        assert restate is not None
        return restate.send_url(request.run_id), body, headers

    expected = {200, 202} if kind == "restate" else {200}
    if name == "aiohttp (plain)":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))

        async def aiohttp_post(request: DecisionRequest) -> None:
            url, body, headers = wire(request)
            async with session.post(url, data=body, headers=headers) as answer:
                await answer.read()
                if answer.status not in expected:
                    raise BenchError(f"HTTP {answer.status}")

        submit, close = aiohttp_post, session.close
    elif name == "httpx.AsyncClient (plain)":  # the sinks' transport before issue 41
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=10)

        async def httpx_post(request: DecisionRequest) -> None:
            url, body, headers = wire(request)
            answer = await client.post(url, content=body, headers=headers)
            if answer.status_code not in expected:
                raise BenchError(f"HTTP {answer.status_code}")

        submit, close = httpx_post, client.aclose
    else:
        sink = WebhookSink(target) if kind == "webhook" else RestateSink(target)
        await sink.open()
        submit, close = (lambda request: sink.submit(request, 1)), sink.close

    async def post(request: DecisionRequest) -> bool:
        await submit(request)
        return True

    try:
        await closed_loop(post, clients, warmup_s, sink_requests(int(warmup_s * 10_000) + 500))
        return await closed_loop(post, clients, seconds, sink_requests(int(seconds * 10_000)))
    finally:
        await close()


def sink_part(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    sink = "WebhookSink" if kind == "webhook" else "RestateSink"
    names = ["aiohttp (plain)", sink, "httpx.AsyncClient (plain)"]
    cleanup: list[Any] = []
    samples: list[dict[str, Any]] = []
    try:
        if kind == "webhook":
            receiver, target = start_receiver()
            cleanup.append(receiver.kill)
        else:
            from tests.engine_servers import RestateDeployment, RestateServer

            folder = Path(tempfile.mkdtemp(prefix="client-bench-restate-"))
            restate = RestateServer(folder / "restate").start()
            cleanup.append(restate.stop)
            deployment = RestateDeployment("examples.restate_service:app", folder).start()
            cleanup.append(deployment.stop)
            restate.register(deployment.uri)
            target = restate.url("Decisions", "handle")
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                result = asyncio.run(sink_run(kind, target, name, 64, args.seconds, args.warmup))
                result.update(part=kind, name=name, clients=64, round=round_,
                              load=os.getloadavg()[0])  # fmt: skip
                print(json.dumps(result), flush=True)
                samples.append(result)
    finally:
        for stop in reversed(cleanup):
            stop()
    return samples


# -- report ----------------------------------------------------------------------------------


def table(samples: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.rounds} interleaved rounds of {args.seconds:g} s (after {args.warmup:g} s of "
        "warm-up), medians (min-max) over rounds, the ratio to aiohttp taken per round; "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"aiohttp {aiohttp.__version__}, httpx {httpx.__version__}.",
        "",
        "| part | client | concurrent | requests/s | × aiohttp | failed |",
        "|---|---|---:|---:|---:|---:|",
    ]
    seen: list[tuple[str, str, int]] = []
    for s in samples:
        key = (s["part"], s["name"], s["clients"])
        if key not in seen:
            seen.append(key)
    seen.sort(key=lambda k: (["client", "webhook", "restate"].index(k[0]), k[2]))
    for part, name, clients in seen:

        def of(who: str, part: str = part, clients: int = clients) -> list[dict[str, Any]]:
            return [
                s for s in samples if (s["part"], s["name"], s["clients"]) == (part, who, clients)
            ]

        rates = [s["rate"] for s in of(name)]
        bad = sum(s["bad"] for s in of(name))
        # The ratio of each round's pair (measured minutes apart at most), then the median.
        base = {s["round"]: s["rate"] for s in of("aiohttp (plain)")}
        ratios = [s["rate"] / base[s["round"]] for s in of(name) if base.get(s["round"])]
        ratio = (
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            if ratios
            else "-"
        )
        lines.append(
            f"| {part} | {name} | {clients} | {statistics.median(rates):,.0f} "
            f"({min(rates):,.0f}-{max(rates):,.0f}) | {ratio} | {bad} |"
        )
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOCS.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["client", "webhook", "restate"], action="append")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--clients", type=lambda text: [int(n) for n in text.split(",")],
                        default=[1, 8, 64])  # fmt: skip
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    parts = args.only or ["client", "webhook", "restate"]
    samples: list[dict[str, Any]] = []
    if "client" in parts:
        samples += client_part(args)
    for kind in ("webhook", "restate"):
        if kind in parts:
            samples += sink_part(kind, args)
    text = table(samples, args)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    stem = "client-bench" + ("" if args.only is None else "-" + "-".join(parts))
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps(samples, indent=1) + "\n")
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
