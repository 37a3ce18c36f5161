"""A sink that accepts every decision at once (``python:noop_sink:NoopSink``).

Kept in a module of its own, importing nothing heavy, so a relay process loads
it in milliseconds (bench/relay_bench.py measures the relay, not the sink).
"""

from __future__ import annotations

from flowdecision.core.model import DecisionRequest


class NoopSink:
    """Accepts every decision at once: the relay's own cost, nothing else."""

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        return None
