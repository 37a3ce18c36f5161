"""Custom sinks the service tests load with ``--sink python:tests.service_sinks:...``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from flowdecision.core.model import DecisionRequest


class GateSink:
    """Blocks each submission until the file ``$FLOWDECISION_TEST_GATE`` exists.

    Writes ``<gate>.entered`` when a submission starts waiting, so a test knows a
    dispatch is in flight, and appends accepted ids to ``<gate>.accepted``.
    """

    def __init__(self) -> None:
        self.gate = Path(os.environ["FLOWDECISION_TEST_GATE"])

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        Path(f"{self.gate}.entered").write_text(request.decision_id)
        while not self.gate.exists():  # noqa: ASYNC110 - the gate is a file another process creates
            await asyncio.sleep(0.02)
        with open(f"{self.gate}.accepted", "a") as handle:
            handle.write(f"{request.decision_id} {attempt}\n")


def make_gate_sink() -> GateSink:
    """A factory, to exercise the ``python:module:factory`` form."""
    return GateSink()


class NotASink:
    def submit(self, request: DecisionRequest, attempt: int) -> None:  # not async
        return None


class SecretFailingSink:
    """Always fails with an exception whose text holds a secret (it must stay in the log)."""

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        raise RuntimeError(
            "engine refused: token=sk-live-SECRET-42 at /srv/engine/private.sock db.internal:5432"
        )


class SlowSink:
    """Takes 0.2-1.5 s per decision: ``dec-slow-N`` (N in 0..19) takes 0.2 + 1.3 * N / 19 s.

    Appends the decision id to ``$FLOWDECISION_TEST_DIR/entered`` when a
    submission starts, so a test knows how many are in flight.
    """

    def __init__(self) -> None:
        self.entered = Path(os.environ["FLOWDECISION_TEST_DIR"]) / "entered"

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        with open(self.entered, "a") as handle:
            handle.write(request.decision_id + "\n")
        index = int(request.decision_id.rsplit("-", 1)[-1]) % 20
        await asyncio.sleep(0.2 + 1.3 * index / 19)


class ProbedSink:
    """Accepts every decision; its ``probe()`` is what ``/healthz`` calls.

    The probe raises while ``$FLOWDECISION_TEST_DIR/probe-fails`` exists and
    hangs (far past the probe timeout) while ``probe-hangs`` exists; each call
    appends a line to ``probes``, so a test sees that it was called.
    """

    def __init__(self) -> None:
        self.dir = Path(os.environ["FLOWDECISION_TEST_DIR"])

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        return None

    async def probe(self) -> None:
        with open(self.dir / "probes", "a") as handle:
            handle.write("probe\n")
        if (self.dir / "probe-hangs").exists():
            await asyncio.sleep(3600)
        if (self.dir / "probe-fails").exists():
            raise ConnectionRefusedError("engine at /srv/engine/private.sock refused the probe")
