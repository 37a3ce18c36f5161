"""What a harness run found: :class:`ChaosReport` and its printed summary."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChaosReport", "summary_rows"]


@dataclass(slots=True)
class ChaosReport:
    """Figures and verdicts of one run; ``ok`` is True when every check passed."""

    config: dict[str, Any]
    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(passed for passed, _ in self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "config": self.config,
            "figures": self.figures,
            "checks": {
                name: {"passed": passed, "detail": detail}
                for name, (passed, detail) in self.checks.items()
            },
        }


def summary_rows(report: ChaosReport) -> Iterator[tuple[str, str]]:
    """``(name, value)`` rows for the printed summary."""
    f = report.figures
    yield "ledger", f"{f['ledger']} (outbox layout: {f.get('layout', 'separate')})"
    yield (
        "decisions",
        f"{f['decisions']} ({f['proposals']} proposals, {f['dispatches']} dispatches)",
    )
    yield "workers", f"{f['workers']} ({f['incarnations']} incarnations)"
    yield "kills", str(f["kills"])
    yield "pauses", str(f["pauses"])
    yield "takeovers", f"{f['takeovers_ledger']} in the ledger, {f['takeovers_reported']} reported"
    yield "lost leases", str(f["lost_leases"])
    yield (
        "duplicates suppressed",
        f"{f['duplicates_suppressed_dispatcher']} by the ledger, "
        f"{f['duplicates_suppressed_outbox']} absorbed by the outbox "
        f"({f['outbox_rows_replayed']} rows replayed)",
    )
    yield "conflicts refused", str(f["conflicts_refused"])
    yield "busy retries", str(f["busy_retries"])
    yield "sink / ledger failures", f"{f['sink_failures']} / {f['ledger_failures']}"
    yield "stale completions refused by the ledger", str(f["stale_completions_refused"])
    yield "late acks (stale owner, already completed)", str(f["late_acks"])
    yield (
        "acknowledged: lost / repeated",
        f"{f['acknowledged']}: {f['lost_after_ack']} / {f['repeated_after_ack']}",
    )
    yield "completed by a call whose answer was lost", str(f["completed_unanswered"])
    if "failovers" in f:
        times = ", ".join(f"{s:.1f}" for s in f["failover_s"])
        yield "failovers", f"{f['failovers']} (seconds each: {times})"
    yield "elapsed", f"{f['elapsed_s']} s ({f['decisions_per_s']} decisions/s)"
    for name, (passed, detail) in report.checks.items():
        yield f"check {name}", ("PASS" if passed else "FAIL") + f": {detail}"


def fmt_problems(items: list[str], limit: int = 3) -> str:
    """The first ``limit`` problems, and how many there were in all."""
    head = "; ".join(items[:limit])
    return head + (f"; ... ({len(items)} in all)" if len(items) > limit else "")
