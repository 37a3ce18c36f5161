"""A dispatcher process that dies (SIGKILL) right after the engine accepted a decision.

``python -m tests.engine_crash LEDGER_PATH SINK_URL REQUEST_JSON`` opens the
SQLite ledger and the sink URL, dispatches the request with a 300 ms lease, and
SIGKILLs itself as soon as the sink's ``submit`` returned: the engine has the
decision, the ledger still holds only the claim. The test then dispatches the
same decision from another owner once the lease has lapsed (a takeover with
attempt 2), and the engine must absorb it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from flowdecision import DecisionRequest, Dispatcher
from flowdecision.ledger.sqlite import SqliteLedger
from flowdecision.sinks.loader import open_sink

LEASE_MS = 300


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
