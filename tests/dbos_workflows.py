"""DBOS workflows for the DBOS sink tests (imported by the ``dbos+…?workflow=`` URL too)."""

from __future__ import annotations

from dbos import DBOS

from flowdecision import DecisionRequest

#: (decision id, request_json, attempt) of every workflow execution, in order.
RUNS: list[tuple[str, str, int]] = []


@DBOS.workflow()
async def record_decision(request_json: str, attempt: int) -> str:
    """Record one execution; returns the decision id."""
    decision_id = DecisionRequest.parse(request_json).decision_id
    RUNS.append((decision_id, request_json, attempt))
    return decision_id


def not_async(request_json: str, attempt: int) -> None:
    """A plain function: the sink must refuse it."""
