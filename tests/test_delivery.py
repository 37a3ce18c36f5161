"""DecisionDelivery: the envelope the engine sinks send, built from a request."""

from __future__ import annotations

import pytest

from flowdecision.core.model import (
    Complete,
    Decision,
    DecisionRequest,
    DecisionStep,
    Fail,
    ScheduleStep,
    ScheduleSteps,
    request_hash,
)
from flowdecision.sinks.delivery import DecisionDelivery

STEP = DecisionStep(step_id="s1", step_name="fetch", input={"n": 1})


@pytest.mark.parametrize(
    ("decision", "kind"),
    [
        (ScheduleStep(step=STEP), "schedule_step"),
        (ScheduleSteps(steps=(STEP, STEP)), "schedule_steps"),
        (ScheduleSteps(steps=()), "schedule_steps"),
        (Complete(output={"ok": True}), "complete"),
        (Fail(error="boom"), "fail"),
    ],
)
def test_the_delivery_names_the_decisions_wire_type(decision: Decision, kind: str) -> None:
    request = DecisionRequest(
        decision_id="d1",
        run_id="r1",
        authority_branch_id="production",
        causation_event_id="e1",
        decision=decision,
    )
    # Twice: the second delivery of a class reads the type the first one learnt.
    for attempt in (1, 2):
        delivery = DecisionDelivery.of(request, attempt)
        assert delivery.kind == kind == request.decision.to_dict()["type"]
        assert delivery.to_dict() == {
            "decision_id": "d1",
            "run_id": "r1",
            "kind": kind,
            "attempt": attempt,
            "request_hash": request_hash(request),
            "request_json": request.to_json().decode(),
        }
        assert delivery.request() == request
