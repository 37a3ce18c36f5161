"""The sink protocol."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..model import DecisionRequest

__all__ = ["Sink"]


@runtime_checkable
class Sink(Protocol):
    """Where the dispatcher delivers a claimed decision.

    ``attempt`` is the claim's attempt number, a fencing token that grows on
    every takeover. A sink **must deduplicate on** ``request.decision_id``: if a
    process crashes after the sink accepted a decision but before the ledger
    recorded completion, the lease expires and another owner delivers the same
    decision again (with a higher ``attempt``). Raising means "not accepted";
    the claim is released so a retry can deliver it.
    """

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Deliver ``request``; return only once the engine has accepted it."""
        ...
