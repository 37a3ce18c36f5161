"""Start the decision service and talk to it with the typed client.

    python examples/03_service_and_client.py [DIRECTORY]

Runs ``flowdecision serve`` on a free port with a bearer token (SQLite ledger
and outbox in DIRECTORY), then, with :class:`flowdecision.client.DecisionClient`:
submits a decision (``submitted``), submits it again (``duplicate``), reads its
claim, pulls the outbox, shows that a reused id with other content raises
``DecisionConflictError`` (the library's own exception), reads health, and
stops the service with SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from flowdecision import DecisionConflictError, DecisionRequest
from flowdecision.client import DecisionClient


def start_service(directory: Path, token: str) -> tuple[subprocess.Popen[str], str]:
    """``flowdecision serve --port 0``; returns the process and the URL it printed."""
    env = {**os.environ, "FLOWDECISION_TOKEN": token}  # a token is never a flag
    service = subprocess.Popen(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0",
         "--ledger", f"sqlite:///{directory / 'ledger.db'}",
         "--sink", f"sqlite:///{directory / 'outbox.db'}", "--no-access-log"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert service.stdout is not None
    for line in service.stdout:  # "flowdecision serving on http://127.0.0.1:PORT"
        if line.startswith("flowdecision serving on "):
            return service, line.split()[-1]
    raise SystemExit(f"the service did not start (exit code {service.wait()})")


def decision(decision_id: str, output: object) -> DecisionRequest:
    return DecisionRequest.parse(
        {
            "decision_id": decision_id,
            "run_id": "run-1",
            "authority_branch_id": "production",
            "causation_event_id": f"evt-{decision_id}",
            "decision": {"type": "complete", "output": output},
        }
    )


async def use_the_client(url: str, token: str) -> None:
    async with DecisionClient(url, token=token, timeout=10) as client:
        request = decision("dec-1", {"ok": True})
        first = await client.submit(request)
        print(first.outcome, first.decision_id, "attempt", first.attempt)  # submitted ... 1
        again = await client.submit(request)
        print(again.outcome, "same receipt:", again.receipt == first.receipt)  # duplicate True

        state = await client.get("dec-1")
        assert state is not None
        print("claim:", state.state, "attempts", state.attempts)  # completed, 1

        page = await client.outbox(after=0)
        print("outbox:", [(item.seq, item.decision_id) for item in page.entries])

        try:
            await client.submit(decision("dec-1", {"ok": False}))  # same id, other content
        except DecisionConflictError as error:
            print("conflict:", type(error).__name__, error.decision_id)

        health = await client.health()
        print("health:", health.status, "completed", health.snapshot["completed"])


def main(directory: Path) -> int:
    token = secrets.token_hex(16)
    service, url = start_service(directory, token)
    try:
        print("service on", url)
        asyncio.run(use_the_client(url, token))
    finally:
        service.send_signal(signal.SIGTERM)  # graceful: in-flight work finishes first
        code = service.wait(timeout=60)
    print("service stopped with exit code", code)
    return code


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    sys.exit(main(target))
