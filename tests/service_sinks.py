"""Custom sinks the service tests load with ``--sink python:tests.service_sinks:...``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from flowdecision.model import DecisionRequest


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
