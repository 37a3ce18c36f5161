"""One JSON shape per object: the API, the CLI's ``--json`` and the client agree.

A real ``flowdecision serve`` in a fresh directory (the default one-file
layout: ledger and outbox in one SQLite file); the same decisions are then read
through ``GET`` on the service, the ``flowdecision`` commands with ``--json``
(on the same store file) and the typed client's ``to_dict()``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx

from flowdecision.client import SyncDecisionClient
from flowdecision.core.defaults import DEFAULT_STORE_URL
from flowdecision.ledger import open_ledger
from flowdecision.sinks import OutboxSink
from tests.service_process import ROOT, ServiceProcess, decision

CLI = [sys.executable, "-m", "flowdecision.cli"]


def _cli(cwd: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run(
        [*CLI, *args], cwd=cwd, input=stdin, capture_output=True, timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    return result


def test_cli_json_client_and_api_print_the_same_shapes(tmp_path: Path) -> None:
    store = tmp_path / DEFAULT_STORE_URL.removeprefix("sqlite:///")
    with ServiceProcess(tmp_path) as service, SyncDecisionClient(service.url) as client:
        done = decision("shape-done")
        assert client.submit(done).submitted

        async def pending() -> None:  # a claim nobody completed (a live lease)
            ledger = await open_ledger(f"sqlite:///{store}")
            try:
                await ledger.claim("shape-pending", "h" * 64, "someone", lease_ms=600_000)
            finally:
                await ledger.close()

        asyncio.run(pending())

        # A decision's claim record: GET, `inspect --json`, DecisionState.to_dict().
        for decision_id in ("shape-done", "shape-pending"):
            api = httpx.get(f"{service.url}/v1/decisions/{decision_id}").json()
            cli = json.loads(
                _cli(
                    tmp_path, "inspect", "--ledger", f"sqlite:///{store}", decision_id, "--json"
                ).stdout
            )
            state = client.get(decision_id)
            assert state is not None
            assert cli == api == state.to_dict(), decision_id
            assert "receipt" in api and "result_receipt" not in cli
        assert api["state"] == "pending" and "lease_expires_at_ms" in api

        # An outbox entry: GET /v1/outbox, `outbox tail --json`, the library and the client.
        api_page = httpx.get(f"{service.url}/v1/outbox").json()
        tail = _cli(tmp_path, "outbox", "tail", "--sink", f"sqlite:///{store}", "--json")
        lines = [json.loads(line) for line in tail.stdout.decode().splitlines()]
        page = client.outbox()

        async def library() -> list[object]:
            outbox = await OutboxSink(f"sqlite:///{store}").open()
            try:
                return [entry.to_dict() for entry in await outbox.fetch()]
            finally:
                await outbox.close()

        assert len(lines) == 1 and lines[0]["decision_id"] == "shape-done"
        assert lines == api_page["entries"] == asyncio.run(library())
        assert page.to_dict() == api_page

        # A submission's answer: POST's body, `submit --json` (plus line and request id)
        # and SubmitResult.to_dict().
        raw = httpx.post(
            f"{service.url}/v1/decisions",
            content=done.to_json(),
            headers={"Content-Type": "application/json"},
        )
        line = json.loads(
            _cli(
                tmp_path, "submit", "--url", service.url, "--json", "-", stdin=done.to_json()
            ).stdout
        )
        assert line.pop("line") == 1 and line.pop("request_id")
        assert line == raw.json() == client.submit(done).to_dict()
        assert raw.json()["outcome"] == "duplicate"
