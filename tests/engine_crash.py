"""A dispatcher process that dies (SIGKILL) right after the engine accepted a decision.

``python -m tests.engine_crash LEDGER_PATH SINK_URL REQUEST_JSON`` opens the
SQLite ledger and the sink URL, dispatches the request with a 2 s lease (long
enough that a loaded machine still renews it in time), and SIGKILLs itself as
soon as the sink's ``submit`` returned: the engine has the decision, the
ledger still holds only the claim. :func:`crash_then_take_over` then
dispatches the same decision from another owner once the lease has lapsed (a
takeover with attempt 2), and the engine must absorb it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from flowdecision import DecisionRequest, Dispatcher
from flowdecision.ledger.sqlite import SqliteLedger
from flowdecision.sinks.loader import close_sink, open_sink

ROOT = Path(__file__).resolve().parent.parent

LEASE_MS = 2000


class _DieAfterAccept:
    def __init__(self, sink: object) -> None:
        self.sink = sink

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        await self.sink.submit(request, attempt)  # type: ignore[attr-defined]
        print(f"accepted {request.decision_id} attempt {attempt}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


async def _main(ledger_path: str, sink_url: str, request_json: str) -> None:
    sink = await open_sink(sink_url)
    ledger = SqliteLedger(ledger_path)
    dispatcher = Dispatcher(
        "production", _DieAfterAccept(sink), ledger, lease_ms=LEASE_MS, owner_id="crashing-owner"
    )
    await dispatcher.dispatch(DecisionRequest.parse(request_json))


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2], sys.argv[3]))


async def crash_then_take_over(ledger_path: Path, sink_url: str, request: DecisionRequest) -> str:
    """Run this module as a process that dies after the engine's accept, then let
    another owner dispatch the same decision once the lease lapsed.

    Checks the ledger's side (the takeover submits with attempt 2, a third
    dispatch is a duplicate the ledger answers) and returns the crashed
    process's stdout; the caller checks the engine's side (one effect).
    """
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.engine_crash",
        str(ledger_path),
        sink_url,
        request.to_json().decode(),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(child.communicate(), timeout=120)
    assert child.returncode == -signal.SIGKILL, err.decode()
    assert f"accepted {request.decision_id} attempt 1" in out.decode()
    await asyncio.sleep(LEASE_MS / 1000 + 0.1)  # the crashed owner's lease lapses
    sink = await open_sink(sink_url)
    ledger = SqliteLedger(ledger_path)
    try:
        owner = Dispatcher("production", sink, ledger, owner_id="taking-over-owner")
        outcome = await owner.dispatch(request)
        assert (outcome.submitted, outcome.attempt) == (True, 2)
        assert owner.health().takeovers == 1
        assert (await owner.dispatch(request)).submitted is False  # the ledger answers now
    finally:
        await ledger.close()
        await close_sink(sink)
    return out.decode()


async def post_twice_through_serve(tmp_path: Path, sink_url: str, request: DecisionRequest) -> None:
    """``flowdecision serve --sink sink_url``: POST ``request`` twice (201, then the
    ledger's 200), check ``/healthz`` (which probes the sink) and a clean exit."""
    import httpx

    from tests.service_process import ServiceProcess

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    with ServiceProcess(tmp_path, "--ledger", ledger, "--sink", sink_url) as service:
        async with httpx.AsyncClient(base_url=service.url, headers=service.headers) as http:
            first = await http.post("/v1/decisions", content=request.to_json())
            again = await http.post("/v1/decisions", content=request.to_json())
            health = await http.get("/healthz")
    assert (first.status_code, again.status_code) == (201, 200), first.text
    assert health.status_code == 200, health.text
    assert service.proc.returncode == 0, service.log_text()[-2000:]
