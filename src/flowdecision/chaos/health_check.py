"""``health_adds_up``: every health snapshot agrees with its worker's journal.

Every snapshot satisfies ``attempted = completed + duplicates + busy +
conflicts + rejected + failures + in_flight``; its counters equal the tally of
the outcome lines journaled before it, and ``claimed``/``takeovers`` equal the
journaled claims; summed over workers, journaled claims never exceed the
ledger's attempts, and the difference (claims committed but cut off by a
SIGKILL before their journal line, or committed while the connection died
around the commit, as in a failover) is at most kills x concurrency plus the
calls whose outcome their error left unknown.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ledger.machine import ClaimRecord
from .config import ChaosConfig
from .journal import in_doubt
from .report import fmt_problems

__all__ = ["HealthCheck", "check_health"]

Event = dict[str, Any]

#: dispatch outcome -> the health counter it increments
_OUTCOME_COUNTER = {
    "accepted": "completed",
    "duplicate": "duplicates",
    "busy": "busy",
    "conflict": "conflicts",
    "lease_lost": "lease_lost",
    "sink_error": "sink_failures",
    "ledger_error": "ledger_failures",
}
_FAILURE_OUTCOMES = ("lease_lost", "sink_error", "ledger_error", "other")


@dataclass(frozen=True, slots=True)
class HealthCheck:
    check: tuple[bool, str]
    reported_takeovers: int


def _check_snapshot(data: dict[str, Any], mine: list[Event]) -> list[str]:
    """What is wrong with one health report, given its owner's journal events."""
    problems: list[str] = []
    snap = data["snapshot"]
    name = f"worker {data['worker']} incarnation {data['incarnation']}"
    lhs = snap["attempted"]
    rhs = (
        snap["completed"] + snap["duplicates"] + snap["busy"] + snap["conflicts"]
        + snap["rejected"] + snap["failures"] + snap["in_flight"]
    )  # fmt: skip
    if lhs != rhs:
        problems.append(f"{name}: attempted {lhs} != outcomes + in_flight {rhs}")
    outs = [ev for ev in mine if ev["e"] == "out"]
    if len(outs) < data["outcomes_logged"]:
        problems.append(f"{name}: journal lost outcome lines")
    tally = Counter(ev["r"] for ev in outs[: data["outcomes_logged"]])
    tally["sink_error"] += tally["sink_conflict"]  # both count as sink failures
    for result, counter in _OUTCOME_COUNTER.items():
        if snap[counter] != tally[result]:
            problems.append(f"{name}: {counter}={snap[counter]} but journal says {tally[result]}")
    fails = sum(tally[r] for r in _FAILURE_OUTCOMES)
    if snap["failures"] != fails:
        problems.append(f"{name}: failures={snap['failures']} journal {fails}")
    if snap["attempted"] - snap["in_flight"] != data["outcomes_logged"]:
        problems.append(f"{name}: finished dispatches != journaled outcomes")
    if snap["claimed"] != data["claims_logged"] or snap["takeovers"] != data["takeovers_logged"]:
        problems.append(f"{name}: claimed/takeovers differ from journaled claims")
    journal_claims = sum(1 for ev in mine if ev["e"] == "claim" and ev.get("r") == "claimed")
    if journal_claims < data["claims_logged"]:
        problems.append(f"{name}: journal lost claim lines")
    if data["final"] and (snap["in_flight"] or len(outs) != data["outcomes_logged"]):
        problems.append(f"{name}: exited with work unaccounted for")
    return problems


def check_health(
    cfg: ChaosConfig,
    events_by_worker: Mapping[int, list[Event]],
    records: Mapping[str, ClaimRecord | None],
    claims: Mapping[str, list[Event]],
    stats: Counter[str],
) -> HealthCheck:
    """Check every ``health-*.json`` a run left against the journals and the ledger."""
    assert cfg.workdir is not None
    problems: list[str] = []
    reported_takeovers = 0
    health_files = sorted(Path(cfg.workdir).glob("health-*.json"))
    events_by_owner: dict[str, list[Event]] = defaultdict(list)
    for events in events_by_worker.values():
        for ev in events:
            events_by_owner[str(ev.get("o"))].append(ev)
    for path in health_files:
        data = json.loads(path.read_text())
        problems += _check_snapshot(data, events_by_owner.get(data["owner"], []))
        reported_takeovers += data["snapshot"]["takeovers"]
    ledger_claims = sum(r.attempts for r in records.values() if r is not None)
    journal_claims_total = sum(len(v) for v in claims.values())
    lost = ledger_claims - journal_claims_total
    doubtful = sum(in_doubt(ev) for events in events_by_worker.values() for ev in events)
    bound = (stats["kills"] + stats["crashes"]) * cfg.concurrency + doubtful
    if not 0 <= lost <= bound:
        problems.append(
            f"ledger attempts {ledger_claims} vs journaled claims {journal_claims_total}: "
            f"{lost} unjournaled, allowed 0..{bound}"
        )
    check = (
        not problems,
        fmt_problems(problems)
        or (
            f"{len(health_files)} snapshots match their journals; ledger attempts "
            f"{ledger_claims} = {journal_claims_total} journaled + {lost} cut off by kills "
            f"or in doubt ({doubtful} calls in doubt)"
        ),
    )
    return HealthCheck(check, reported_takeovers)
