"""An agent's risky step held for a person's approval, approved from the CLI, delivered once.

    python examples/08_approval_hold.py [DIRECTORY]

Runs ``flowdecision serve`` on a free port (ledger and outbox in one SQLite file in
DIRECTORY, the default layout) with an approval policy: every step named
``payments.*`` is held (``--approve-steps``). Then:

* the agent (``DecisionClient``) proposes a harmless step, which goes straight to
  the outbox (``submitted``), and a refund, which is answered ``held``: recorded,
  nothing delivered;
* the agent waits for the outcome (``client.wait``, a long-poll) while an operator
  approves the refund from the command line (``flowdecision approve ID --reason
  ...``): the approval, the claim and the outbox row are one transaction;
* the agent's wait returns ``completed``; the agent retries the refund (as agents
  do after a timeout) and gets ``duplicate``; the outbox holds the refund once,
  and the audit trail says who approved it and why.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from flowdecision import DecisionRequest
from flowdecision.client import DecisionClient


def start_service(ledger: str, token: str, admin: str) -> tuple[subprocess.Popen[str], str]:
    """``flowdecision serve --port 0`` holding ``payments.*`` steps; the process and its URL."""
    env = {**os.environ, "FLOWDECISION_TOKEN": token, "FLOWDECISION_ADMIN_TOKEN": admin}
    service = subprocess.Popen(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0",
         "--ledger", ledger, "--approve-steps", "payments.*", "--no-access-log"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert service.stdout is not None
    for line in service.stdout:  # "flowdecision serving on http://127.0.0.1:PORT"
        if line.startswith("flowdecision serving on "):
            return service, line.split()[-1]
    raise SystemExit(f"the service did not start (exit code {service.wait()})")


def step(decision_id: str, name: str, args: dict[str, object]) -> DecisionRequest:
    """What the agent's flow graph proposes: schedule one step of run ``order-7``."""
    return DecisionRequest.parse(
        {
            "decision_id": decision_id,
            "run_id": "order-7",
            "authority_branch_id": "production",
            "causation_event_id": f"evt-{decision_id}",
            "decision": {
                "type": "schedule_step",
                "step": {"step_id": f"{decision_id}-step", "step_name": name, "input": args},
            },
        }
    )


def cli(*args: str) -> str:
    """One ``flowdecision`` command (the operator's terminal); its output."""
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", *args],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout


async def agent_and_operator(url: str, token: str, ledger: str) -> None:
    async with DecisionClient(url, token=token, timeout=10) as client:
        lookup = await client.submit(step("lookup-order", "orders.lookup", {"order": 7}))
        print("agent: lookup-order", lookup.outcome)  # submitted

        refund = step("refund-order-7", "payments.refund", {"order": 7, "amount_eur": 1200})
        held = await client.submit(refund)
        print("agent: refund-order-7", held.outcome)  # held: nothing delivered yet

        # The agent waits for a person; meanwhile an operator approves from the CLI.
        waiting = asyncio.create_task(client.wait("refund-order-7", timeout=60))
        approved = await asyncio.to_thread(
            cli, "approve", "refund-order-7", "--ledger", ledger,
            "--actor", "alice", "--reason", "customer verified by phone",
        )  # fmt: skip
        print("operator:", approved.strip().splitlines()[-1])
        state = await waiting
        assert state is not None
        print("agent: refund-order-7 is now", state.state)  # completed

        again = await client.submit(refund)  # a retry after a timeout, say
        print("agent retries: refund-order-7", again.outcome)  # duplicate: not delivered again

        page = await client.outbox(after=0)
        print("outbox:", [entry.decision_id for entry in page.entries])

    for entry in json.loads(cli("audit", "--ledger", ledger, "--json"))["entries"]:
        print(f"audit: {entry['action']} {entry['decision_id']} by {entry['actor']}: "
              f"{entry['reason']} (was {entry['state_before']})")  # fmt: skip


def main(directory: Path) -> int:
    token, admin = secrets.token_hex(16), secrets.token_hex(16)
    ledger = f"sqlite:///{directory / 'flowdecision.db'}"  # the outbox shares the file
    service, url = start_service(ledger, token, admin)
    try:
        asyncio.run(agent_and_operator(url, token, ledger))
    finally:
        service.send_signal(signal.SIGTERM)
        code = service.wait(timeout=60)
    print("service stopped with exit code", code)
    return code


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    sys.exit(main(target))
