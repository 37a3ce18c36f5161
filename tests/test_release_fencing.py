"""Operator release is fenced, proven with real processes on SQLite and PostgreSQL.

An owner process claims a decision with a long lease and waits; the operator
releases it with ``flowdecision release`` (another process); a third process
claims it; then the old owner, still alive, tries to complete: refused. Its
renew is refused too, and the new owner completes normally.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "flowdecision.cli"]

#: The owner: claims, says so, waits for a line on stdin, then tries renew and complete.
_OWNER = r"""
import asyncio, json, sys
from flowdecision.ledger import open_ledger

async def main() -> None:
    ledger = await open_ledger(sys.argv[1])
    try:
        claimed = await ledger.claim("fenced", "h", "old-owner", lease_ms=3_600_000)
        print(json.dumps({"claimed": repr(claimed)}), flush=True)
        sys.stdin.readline()  # the operator releases meanwhile
        renewed = await ledger.renew("fenced", "h", "old-owner", lease_ms=3_600_000)
        try:
            ours = await ledger.complete("fenced", "h", "old-owner")
            completed = f"completed ours={ours}"
        except Exception as error:
            completed = f"refused: {error}"
        print(json.dumps({"renewed": renewed, "complete": completed}), flush=True)
    finally:
        await ledger.close()

asyncio.run(main())
"""

_TAKER = r"""
import asyncio, sys
from flowdecision.ledger import open_ledger

async def main() -> None:
    ledger = await open_ledger(sys.argv[1])
    try:
        claimed = await ledger.claim("fenced", "h", "new-owner", lease_ms=60_000)
        print(repr(claimed), await ledger.complete("fenced", "h", "new-owner"), flush=True)
    finally:
        await ledger.close()

asyncio.run(main())
"""


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue("pg_url")
    import asyncio

    import asyncpg

    async def clean() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("DELETE FROM flowdecision_claims WHERE decision_id = 'fenced'")
        finally:
            await conn.close()

    asyncio.run(clean())
    return url


def test_a_released_owner_can_never_complete(ledger_url: str) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, ledger_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        first = json.loads(owner.stdout.readline())
        assert first == {"claimed": "Claimed(attempt=1)"}
        released = subprocess.run(
            [*CLI, "release", "--ledger", ledger_url, "fenced", "--reason", "owner hung",
             "--actor", "oncall", "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert released.returncode == 0, released.stderr
        entry = json.loads(released.stdout)["audit"][0]
        assert (entry["state_before"], entry["attempts"]) == ("pending_live", 2)
        taker = subprocess.run(
            [sys.executable, "-c", _TAKER, ledger_url], capture_output=True, text=True, timeout=120
        )
        assert taker.returncode == 0, taker.stderr
        assert taker.stdout.split() == ["Claimed(attempt=3)", "True"]
        owner.stdin.write("go\n")
        owner.stdin.flush()
        last = json.loads(owner.stdout.readline())
        # The old owner is alive and tries: its lease is gone and the decision is the
        # new owner's, so its completion is not its own, and renew is refused.
        assert last["renewed"] is False
        assert last["complete"] == "completed ours=False"
        assert owner.wait(timeout=60) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_released_owner_cannot_complete_before_anyone_takes_over(ledger_url: str) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, ledger_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        assert json.loads(owner.stdout.readline()) == {"claimed": "Claimed(attempt=1)"}
        released = subprocess.run(
            [*CLI, "release", "--ledger", ledger_url, "fenced", "--reason", "owner hung"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert released.returncode == 0, released.stderr
        owner.stdin.write("go\n")
        owner.stdin.flush()
        last = json.loads(owner.stdout.readline())
        assert last["renewed"] is False
        assert last["complete"].startswith("refused: ")
        assert "owned by another dispatcher" in last["complete"]
        assert owner.wait(timeout=60) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
