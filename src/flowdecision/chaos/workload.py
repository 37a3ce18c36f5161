"""What the workers propose: decisions, their conflicting variants, and each worker's plan."""

from __future__ import annotations

import random
from typing import Any

from ..core.model import DecisionRequest, DecisionStep, ScheduleStep
from .config import BRANCH, ChaosConfig

__all__ = ["decision_id", "make_plans", "make_request"]


def decision_id(cfg: ChaosConfig, index: int) -> str:
    """The id of decision ``index`` in this run."""
    return f"chaos-{cfg.run_id}-{index:06d}"


def make_request(cfg: ChaosConfig, index: int, variant: int) -> DecisionRequest:
    """Variant 0 is the decision; variant 1 reuses its id with different content.

    Every decision is a ``schedule_step`` of the one run: a run takes any number
    of those, and at most one ``complete`` (the run invariants).
    """
    output: dict[str, Any] = {"index": index}
    if variant:
        output["reused"] = True
    return DecisionRequest(
        decision_id=decision_id(cfg, index),
        run_id=f"chaos-run-{cfg.run_id}",
        authority_branch_id=BRANCH,
        causation_event_id=f"chaos-event-{index}",
        decision=ScheduleStep(DecisionStep(f"step-{index}", "chaos", output)),
    )


def make_plans(cfg: ChaosConfig) -> list[list[tuple[int, int]]]:
    """Per worker, the ``(decision index, variant)`` entries it proposes, in order.

    Decision ``i`` goes to two distinct workers; some get a third, duplicate
    proposal and some a conflicting one. Plans are ordered by ``i`` (with
    jitter), so the proposers of a decision reach it at about the same time.
    """
    assert cfg.seed is not None
    rng = random.Random(cfg.seed)
    n = cfg.workers
    keyed: list[list[tuple[float, int, int]]] = [[] for _ in range(n)]
    for i in range(cfg.decisions):
        a = i % n
        b = (a + 1 + rng.randrange(n - 1)) % n
        keyed[a].append((i + rng.random(), i, 0))
        keyed[b].append((i + rng.random() * 3, i, 0))
        if rng.random() < cfg.duplicate_rate:
            keyed[rng.choice((a, b))].append((i + rng.random() * 2 * n, i, 0))
        if rng.random() < cfg.conflict_rate:
            keyed[rng.randrange(n)].append((i + rng.random() * 2, i, 1))
    return [[(i, v) for _, i, v in sorted(entries)] for entries in keyed]
