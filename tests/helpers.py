"""Shared test doubles: requests, sinks and ledgers that behave on demand."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from flowdecision.core.identity import ExecutionIdentity, ResultOutcome, ResultReceipt, digest_bytes
from flowdecision.core.model import Complete, DecisionRequest, DecisionStep, ScheduleStep


def request(
    branch: str = "production", decision_id: str = "decision-1", **kw: Any
) -> DecisionRequest:
    """The seed tests' request: ``complete`` with a null output."""
    return DecisionRequest(
        decision_id=decision_id,
        run_id=kw.get("run_id", "run-1"),
        authority_branch_id=branch,
        causation_event_id=kw.get("causation_event_id", "event-1"),
        decision=kw.get("decision", Complete(output=None)),
    )


def step_request(
    decision_id: str, payload: Any = None, *, run_id: str = "run-1"
) -> DecisionRequest:
    """A ``schedule_step`` of run ``run_id``: a run takes any number of these (a run
    takes at most one ``complete``, the seed's :func:`request`: run invariants)."""
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id="event-1",
        decision=ScheduleStep(DecisionStep(f"{decision_id}-step", "work", payload)),
    )


def identity(tag: str) -> ExecutionIdentity:
    return ExecutionIdentity.derive("a3s.test.flow-decision", {"tag": tag})


def receipt(ident: ExecutionIdentity) -> ResultReceipt:
    return ResultReceipt.new(
        ident,
        digest_bytes("a3s.test.flow-evidence", b"event"),
        ResultOutcome.SUCCEEDED,
        digest_bytes("a3s.test.flow-result", b"result"),
        6,
    )


class RecordingSink:
    """Accepts everything and records (decision_id, attempt) in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.calls.append((request.decision_id, attempt))

    @property
    def ids(self) -> list[str]:
        return [decision_id for decision_id, _ in self.calls]


class FailingOnceSink:
    def __init__(self) -> None:
        self.calls = 0

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.calls += 1
        if self.calls == 1:
            raise OSError("transient")


class SlowCountingSink:
    def __init__(self, seconds: float = 0.05) -> None:
        self.calls = 0
        self.seconds = seconds

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.calls += 1
        await asyncio.sleep(self.seconds)


class ControlledSink:
    """Blocks until ``finish`` is set; counts calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.finish = asyncio.Event()

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.calls += 1
        self.started.set()
        await self.finish.wait()


class CancellableSink:
    def __init__(self, seconds: float = 0.05) -> None:
        self.started = 0
        self.completed = 0
        self.seconds = seconds

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.started += 1
        await asyncio.sleep(self.seconds)
        self.completed += 1


class Ticker:
    """A task that counts its turns on the event loop (``period_s`` apart): a loop
    that blocks stops the count."""

    def __init__(self, period_s: float) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._run(period_s))

    async def _run(self, period_s: float) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(period_s)

    def stop(self) -> None:
        self._task.cancel()


def acknowledged_before_kill(code: str, *args: str, seconds: float = 1.0) -> list[str]:
    """Run ``python -c code *args`` with this checkout's ``src``, ``kill -9`` it after
    ``seconds``; the non-empty lines it printed after its first, ``ready``.

    The child prints one line per operation once the call returned
    (acknowledged), so every line names something that must have survived.
    """
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    child = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    acked: list[str] = []

    def read() -> None:
        assert child.stdout is not None
        acked.extend(line.strip() for line in child.stdout)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(seconds)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)
    reader.join(30)
    return [line for line in acked if line]
