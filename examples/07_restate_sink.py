"""A sink into Restate: each decision one invocation of a virtual object keyed by its run.

    make engines        # restate-server from npm into .engines/ (or set RESTATE_SERVER)
    pip install 'flowdecision[restate]' restate-sdk hypercorn
    python examples/07_restate_sink.py

It starts a throwaway Restate server and the service of
``examples/restate_service.py`` (Python ``restate-sdk``, served by hypercorn),
registers the service, then:

1. dispatches a run's three decisions through a Dispatcher with a SQLite
   ledger and a ``RestateSink`` on ``DecisionRun/{run_id}/apply``: Restate
   enqueues one invocation per decision (idempotency key = decision id) and
   runs them one at a time for the run;
2. submits the first straight to the sink with attempt 2, as the next owner
   would after a crash between Restate's accept and the ledger's completion:
   Restate answers ``PreviouslyAccepted``, nothing runs again;
3. reads the run object's state: each decision applied once, in order.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def restate_server_binary() -> str:
    """``$RESTATE_SERVER``, or the binary ``make engines`` installed under .engines/."""
    explicit = os.environ.get("RESTATE_SERVER")
    pattern = str(ROOT / ".engines/node_modules/@restatedev/restate-server-*/bin/restate-server")
    found = [explicit] if explicit else sorted(glob.glob(pattern))
    if not found:
        raise SystemExit(f"no restate-server: run `make engines` (looked for {pattern})")
    return found[0]


def until(what: str, ready: Callable[[], object], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} did not come up in {timeout:.0f}s")


def http(method: str, url: str, body: object = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        call.add_header("content-type", "application/json")
    with urllib.request.urlopen(call, timeout=30) as answer:
        return json.loads(answer.read() or b"null")


def start_restate(folder: Path) -> tuple[list[subprocess.Popen[bytes]], int]:
    """restate-server and the example service, registered; the processes and the ingress port."""
    ingress, admin, node, service = (free_port() for _ in range(4))
    env = {
        **os.environ,
        "RESTATE_INGRESS__BIND_ADDRESS": f"127.0.0.1:{ingress}",
        "RESTATE_ADMIN__BIND_ADDRESS": f"127.0.0.1:{admin}",
        "RESTATE_BIND_ADDRESS": f"127.0.0.1:{node}",
        "RESTATE_LISTEN_MODE": "tcp",
        "RESTATE_LOG_FILTER": "error",
    }
    quiet = subprocess.DEVNULL
    server = subprocess.Popen(
        [restate_server_binary(), "--no-logo", "--base-dir", str(folder / "restate")],
        env=env,
        stdout=quiet,
        stderr=quiet,
    )
    hypercorn = Path(sys.executable).parent / "hypercorn"
    endpoint = subprocess.Popen(
        [str(hypercorn), "--bind", f"127.0.0.1:{service}", "examples.restate_service:app"],
        cwd=ROOT,
        stdout=quiet,
        stderr=quiet,
    )
    processes = [endpoint, server]
    try:
        until("restate-server", lambda: http("GET", f"http://127.0.0.1:{admin}/health") or True)
        until("the service", lambda: socket.create_connection(("127.0.0.1", service)).close() or 1)
        http(
            "POST", f"http://127.0.0.1:{admin}/deployments", {"uri": f"http://127.0.0.1:{service}"}
        )
    except BaseException:
        stop(processes)
        raise
    print("registered DecisionRun and Decisions with Restate")
    return processes, ingress


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
        process.wait()


async def main(folder: Path, ingress: int) -> None:
    from flowdecision import DecisionRequest, Dispatcher, SqliteLedger
    from flowdecision.sinks.restate import RestateSink

    sink = RestateSink(f"restate+http://127.0.0.1:{ingress}/DecisionRun/{{run_id}}/apply")
    ledger = SqliteLedger(folder / "ledger.db")
    dispatcher = Dispatcher("production", sink, ledger)
    step = {"step_id": "fetch-1", "step_name": "fetch", "input": {"url": "a"}}
    decisions = [
        DecisionRequest.from_dict(
            {
                "decision_id": decision_id,
                "run_id": "example-run-1",
                "authority_branch_id": "production",
                "causation_event_id": f"evt-{decision_id}",
                "decision": decision,
            }
        )
        for decision_id, decision in [
            ("d-1", {"type": "schedule_step", "step": step}),
            ("d-2", {"type": "schedule_step", "step": {**step, "step_id": "fetch-2"}}),
            ("d-3", {"type": "complete", "output": {"pages": 2}}),
        ]
    ]
    for decision in decisions:
        outcome = await dispatcher.dispatch(decision)
        print(f"dispatched {decision.decision_id}: submitted {outcome.submitted}")
    answer = await sink.deliver(decisions[0], 2)
    print(f"d-1 resubmitted with attempt 2: absorbed by Restate {answer.absorbed}")
    await sink.close()
    await ledger.close()

    state_url = f"http://127.0.0.1:{ingress}/DecisionRun/example-run-1/applied"

    def all_three() -> bool:
        return len(http("POST", state_url)) == 3  # type: ignore[arg-type]

    await asyncio.to_thread(until, "the three invocations", all_three)
    state = http("POST", state_url)
    assert isinstance(state, dict)
    for decision_id, applied in sorted(state.items(), key=lambda item: item[1]["order"]):
        print(f"  applied {decision_id}: {applied['kind']}, attempt {applied['attempt']}")
    print(f"each decision applied once: {sorted(state) == ['d-1', 'd-2', 'd-3']}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        processes, ingress_port = start_restate(Path(folder))
        try:
            asyncio.run(main(Path(folder), ingress_port))
        finally:
            stop(processes)
