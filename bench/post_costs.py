"""What one POST /v1/decisions costs, counted rather than timed (issue 18, "Half the Python").

    .venv/bin/python bench/post_costs.py                      # the service as it is
    .venv/bin/python bench/post_costs.py --otel               # tracing on (serve --otel)
    .venv/bin/python bench/post_costs.py --time --posts 20000 # CPU time instead of counts

In process (no sockets): ``create_app`` on the embedded defaults (ledger and
outbox in one SQLite file, in a fresh temporary directory), 50 concurrent
callers, each POSTing new decisions through the ASGI app. Prints, per POST:
Python function calls on the event loop's thread and on the others (the
ledger's), and SQL statements. Counts barely move with the machine's load,
unlike CPU time on a shared machine; ``bench/service_bench.py`` measures time.
``--time`` measures CPU time per POST here instead (the process's, and the event
loop's thread's), with nothing counted: the app and the ledger without the HTTP
server, for comparing two versions of the code on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from types import FrameType
from typing import Any

counts = {"loop": 0, "other": 0, "sql": 0}
_MAIN = threading.get_ident()
_measuring = False


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and _measuring:
        counts["loop" if threading.get_ident() == _MAIN else "other"] += 1


def _count_statements() -> None:
    connect = sqlite3.connect

    def counting_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)

        def trace(statement: str) -> None:
            if _measuring:
                counts["sql"] += 1

        conn.set_trace_callback(trace)
        return conn

    sqlite3.connect = counting_connect  # type: ignore[assignment]


def common_body(n: int) -> bytes:
    """The common request body (a schedule_step of plain strings), ``n`` in its input."""
    return json.dumps(
        {
            "decision_id": f"d-{n}-{uuid.uuid4().hex[:8]}",
            "run_id": "run-1",
            "authority_branch_id": "production",
            "causation_event_id": f"e-{n}",
            "decision": {
                "type": "schedule_step",
                "step": {"step_id": "s", "step_name": "fetch", "input": {"n": n}},
            },
        }
    ).encode()


def _start_tracing() -> None:
    """What ``serve --otel`` registers (the SDK's provider, every trace sampled), its
    batch processor holding every span so that no export runs while calls are
    counted."""
    os.environ.update(
        OTEL_TRACES_SAMPLER="always_on",
        OTEL_BSP_MAX_QUEUE_SIZE="1000000",
        OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1000000",
        OTEL_BSP_SCHEDULE_DELAY="3600000",
    )
    from flowdecision.observability import tracing

    tracing.start_sdk()


async def _run(posts: int, callers: int, timed: bool = False) -> None:
    global _measuring
    from flowdecision.service.app import create_app
    from flowdecision.service.config import Settings
    from flowdecision.service.runtime import Service

    os.chdir(tempfile.mkdtemp(prefix="post-costs-"))
    settings = Settings().validate()
    service = await Service.start(settings)
    app = create_app(settings, service=service)
    statuses: list[int] = []

    async def post(body: bytes) -> None:
        headers = [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/decisions",
            "raw_path": b"/v1/decisions", "root_path": "", "query_string": b"",
            "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080),
        }  # fmt: skip
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(scope, receive, send)

    await asyncio.gather(*(post(common_body(-n)) for n in range(1, 201)))  # warm up
    statuses.clear()
    bodies = iter([common_body(n) for n in range(posts)])

    async def caller() -> None:
        for body in bodies:
            await post(body)

    if timed:
        cpu, loop = time.process_time(), time.thread_time()
        await asyncio.gather(*(caller() for _ in range(callers)))
        cpu, loop = time.process_time() - cpu, time.thread_time() - loop
        await service.stop(1)
        assert statuses == [201] * posts, statuses[:5]
        print(
            f"per POST: {cpu / posts * 1e6:.1f} µs of CPU, "
            f"{loop / posts * 1e6:.1f} µs of it on the event loop's thread"
        )
        return
    sys.setprofile(_profile)
    _measuring = True
    await asyncio.gather(*(caller() for _ in range(callers)))
    _measuring = False
    sys.setprofile(None)
    await service.stop(1)
    assert statuses == [201] * posts, statuses[:5]
    print(
        f"per POST: {counts['loop'] / posts:.0f} Python calls on the event loop's thread, "
        f"{counts['other'] / posts:.0f} on the others, {counts['sql'] / posts:.2f} SQL statements"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--posts", type=int, default=3000)
    parser.add_argument("--callers", type=int, default=50)
    parser.add_argument("--otel", action="store_true",
                        help="tracing on, as serve --otel (needs the otel extra)")  # fmt: skip
    parser.add_argument("--time", action="store_true",
                        help="CPU time per POST instead of counts")  # fmt: skip
    args = parser.parse_args()
    if args.otel:
        _start_tracing()
    import uvloop

    if args.time:
        uvloop.run(_run(args.posts, args.callers, timed=True))
        return
    _count_statements()
    threading.setprofile(_profile)
    uvloop.run(_run(args.posts, args.callers))


if __name__ == "__main__":
    main()
