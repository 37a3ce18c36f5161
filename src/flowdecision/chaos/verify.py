"""Check the stores against the journals after a run (see ``docs/RELIABILITY.md``).

``ledger_exactly_once``
    every decision's record is completed; its completer (the record's owner) is
    a journaled claimant whose attempt equals the record's final ``attempts``
    (or made a claim-and-complete call whose answer it never learned: cut off by
    a kill, or its connection died around the commit);
    no two claims of one decision share an attempt number.
``outbox_one_row``
    exactly one outbox row per decision, and ``first_attempt <=
    highest_attempt <= ledger attempts``.
``no_conflicting_content``
    each row's bytes hash to its ``request_hash``, which is the hash the ledger
    bound; no worker was told "accepted"/"duplicate" for other content or
    "conflict" for the bound content; the outbox never raised a conflict.
``no_stale_completion``
    for the completer's last lease grant before completion (claim or renewal,
    journaled with start ``t0`` and end ``t1``), ``completed_at < t0 + lease``
    proves the lease was live (``t1 + lease <= completed_at`` would prove it had
    expired -- a failure; in between is counted as ambiguous). File and SQLite
    ledgers use this host's clock; the PostgreSQL ledger uses the server's,
    which in this harness runs on the same host.
``acknowledged_by_owner``
    every decision a worker was told was submitted (``accepted``) is, on the
    store that survived (after failovers: the promoted standby), completed by
    that worker's owner: none lost (no record, or not completed) and none
    repeated (completed by another owner, which ran it again).
``health_adds_up``: see :mod:`.health_check`.

Stores are read only through the public API: :meth:`Ledger.read_record
<flowdecision.ledger.Ledger.read_record>` (or :meth:`JsonFileLedger.records`,
one file read for all) and :meth:`OutboxSink.fetch`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..connections.urls import parse_ledger_url
from ..core.model import request_hash
from ..ledger.jsonfile import JsonFileLedger
from ..ledger.machine import ClaimRecord, ClaimStatus
from ..sinks.outbox import OutboxEntry, OutboxSink
from .config import ChaosConfig
from .health_check import check_health
from .journal import in_doubt, read_journal
from .report import ChaosReport, fmt_problems
from .worker import open_run_ledger
from .workload import decision_id, make_request

__all__ = ["Evidence", "verify"]

Check = tuple[bool, str]
Event = dict[str, Any]
_LEASE_EVENTS = ("claim", "renew0", "renew", "complete0", "complete", "release", "joint0")


def _joint_unanswered(history: list[Event]) -> bool:
    """The owner made a claim-and-complete call on the decision whose answer it never
    learned, so claim and completion may have committed together, in one transaction,
    with no ``claimed`` line: cut off by a kill (``joint0`` is its last line), or its
    connection died around the commit (e.g. in a failover; see
    :func:`.journal.in_doubt`)."""
    return any(
        ev["e"] == "joint0" and (after is None or in_doubt(after))
        for ev, after in zip(history, [*history[1:], None], strict=True)
    )


@dataclass
class Evidence:
    """The stores' contents and what the journals say about them."""

    cfg: ChaosConfig
    ids: list[str]
    proposals: int
    proposed_hashes: set[str]
    records: dict[str, ClaimRecord | None]
    events_by_worker: dict[int, list[Event]] = field(default_factory=dict)
    torn: int = 0
    #: per decision, its journaled granted claims
    claims: defaultdict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))
    #: per (owner, decision), its lease events in journal order
    by_owner: defaultdict[tuple[str, str], list[Event]] = field(
        default_factory=lambda: defaultdict(list)
    )
    outcomes: Counter[str] = field(default_factory=Counter)
    bad_outcomes: list[str] = field(default_factory=list)
    sink_events: Counter[str] = field(default_factory=Counter)
    late_acks: int = 0
    refused: int = 0
    #: per decision, the owners told `accepted` (submitted) for it
    acked: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def scan(self, ev: Event) -> None:
        """Take one journal event into account."""
        kind = ev.get("e")
        key = str(ev.get("d"))
        if kind == "complete" and not ev.get("ok"):
            message = str(ev.get("m", ""))
            self.refused += "expired" in message or "another dispatcher" in message
        if kind in _LEASE_EVENTS:
            self.by_owner[(ev["o"], key)].append(ev)
        if kind == "claim" and ev.get("r") == "claimed":
            self.claims[key].append(ev)
        elif kind == "sink":
            self.sink_events[ev["r"]] += 1
        elif kind == "out":
            self._scan_outcome(ev, key)

    def _scan_outcome(self, ev: Event, key: str) -> None:
        result = ev["r"]
        self.outcomes[result] += 1
        if result == "accepted":
            self.acked[key].append(ev["o"])
        record = self.records.get(key)
        if record is None:
            return
        if result in ("accepted", "duplicate", "conflict"):
            bound = record.request_hash == ev["h"]
            if result == "conflict" and bound:
                self.bad_outcomes.append(f"{key}: told `conflict` for the bound content")
            if result != "conflict" and not bound:
                self.bad_outcomes.append(f"{key}: told `{result}` for unbound content")
        if result == "accepted" and record.owner_id != ev["o"]:
            self.late_acks += 1


async def _load_records(cfg: ChaosConfig, ids: list[str]) -> dict[str, ClaimRecord | None]:
    kind, target = parse_ledger_url(cfg.ledger_url)
    if kind == "file":
        every = await JsonFileLedger(target).records()
        return {key: every.get(key) for key in ids}
    ledger = await open_run_ledger(cfg)
    try:
        return {key: await ledger.read_record(key) for key in ids}
    finally:
        await ledger.close()


async def gather_evidence(cfg: ChaosConfig) -> Evidence:
    """Read the plans, the ledger records and every journal of a finished run."""
    assert cfg.workdir is not None
    workdir = Path(cfg.workdir)
    plans = [
        [tuple(e) for e in json.loads((workdir / f"plan-{w}.json").read_text())]
        for w in range(cfg.workers)
    ]
    ids = [decision_id(cfg, i) for i in range(cfg.decisions)]
    variants = {(i, v) for plan in plans for i, v in plan}
    evidence = Evidence(
        cfg=cfg,
        ids=ids,
        proposals=sum(len(p) for p in plans),
        proposed_hashes={request_hash(make_request(cfg, i, v)) for i, v in variants},
        records=await _load_records(cfg, ids),
    )
    for w in range(cfg.workers):
        events, bad = read_journal(workdir / f"journal-{w}.jsonl")
        evidence.events_by_worker[w] = events
        evidence.torn += bad
        for ev in events:
            evidence.scan(ev)
    return evidence


def check_ledger(ev: Evidence) -> tuple[Check, int]:
    """``ledger_exactly_once``: completed once, by the last claimant; and how many
    decisions were completed by a call whose caller never learned the answer (its
    retry, if any, was told ``duplicate``)."""
    problems: list[str] = []
    unanswered = 0
    for key in ev.ids:
        record = ev.records[key]
        if record is None:
            problems.append(f"{key}: no ledger record")
            continue
        if record.status is not ClaimStatus.COMPLETED or record.completed_at_ms is None:
            problems.append(f"{key}: {record.status.value}, not completed")
            continue
        attempts = Counter(int(c["a"]) for c in ev.claims[key])
        dup = [a for a, n in attempts.items() if n > 1]
        if dup:
            problems.append(f"{key}: attempt(s) {dup} claimed by two owners")
        mine = [c for c in ev.claims[key] if c["o"] == record.owner_id]
        cut_off = _joint_unanswered(ev.by_owner.get((record.owner_id, key), []))
        journaled = any(int(c["a"]) == record.attempts for c in mine)
        unanswered += cut_off and not journaled
        if not cut_off and not journaled:
            problems.append(
                f"{key}: completer {record.owner_id} has no journaled claim of attempt "
                f"{record.attempts}"
            )
        if attempts and max(attempts) > record.attempts:
            problems.append(f"{key}: a claim of attempt {max(attempts)} > {record.attempts}")
    check = (
        not problems,
        fmt_problems(problems)
        or f"{len(ev.ids)} decisions completed once, each by its last claimant",
    )
    return check, unanswered


async def _load_outbox(cfg: ChaosConfig) -> dict[str, list[OutboxEntry]]:
    assert cfg.outbox_url is not None
    rows: dict[str, list[OutboxEntry]] = defaultdict(list)
    prefix = f"chaos-{cfg.run_id}-"
    async with OutboxSink(cfg.outbox_url) as outbox:
        after = 0
        while page := await outbox.fetch(after=after, limit=5000):
            for entry in page:
                if entry.decision_id.startswith(prefix):
                    rows[entry.decision_id].append(entry)
            after = page[-1].seq
    return rows


def check_outbox(
    ev: Evidence, outbox_rows: dict[str, list[OutboxEntry]]
) -> tuple[Check, Check, int]:
    """``outbox_one_row`` and ``no_conflicting_content``, and how many rows were replayed."""
    row_problems: list[str] = []
    content_problems = list(ev.bad_outcomes)
    replays = 0
    for key in ev.ids:
        rows = outbox_rows.get(key, [])
        if len(rows) != 1:
            row_problems.append(f"{key}: {len(rows)} outbox rows")
            continue
        entry = rows[0]
        replays += entry.highest_attempt > entry.first_attempt
        record = ev.records[key]
        if record is not None and not (
            1 <= entry.first_attempt <= entry.highest_attempt <= record.attempts
        ):
            row_problems.append(
                f"{key}: attempts first={entry.first_attempt} highest={entry.highest_attempt} "
                f"ledger={record.attempts}"
            )
        actual = hashlib.sha256(entry.request_json).hexdigest()
        if actual != entry.request_hash:
            content_problems.append(f"{key}: stored bytes do not hash to request_hash")
        if record is not None and entry.request_hash != record.request_hash:
            content_problems.append(f"{key}: outbox content differs from the ledger's binding")
        if entry.request_hash not in ev.proposed_hashes:
            content_problems.append(f"{key}: outbox holds content no worker proposed")
    extra = set(outbox_rows) - set(ev.ids)
    row_problems += [f"{key}: unexpected outbox row" for key in sorted(extra)]
    sink_conflicts = ev.sink_events["conflict"]
    if sink_conflicts:
        content_problems.append(f"the outbox refused conflicting content {sink_conflicts} times")
    rows_check = (
        not row_problems,
        fmt_problems(row_problems)
        or f"{len(ev.ids)} rows, one per decision, attempts within the ledger's",
    )
    content_check = (
        not content_problems,
        fmt_problems(content_problems)
        or (
            f"every row is the bound content; {ev.outcomes['conflict']} conflicting proposals "
            "refused"
        ),
    )
    return rows_check, content_check, replays


def _last_grant(history: list[Event], attempts: int) -> tuple[Event | None, bool, int | None]:
    """The completer's last lease grant before completing, whether a renewal was
    still unanswered then, and when the completion started."""
    grant: Event | None = None
    unresolved = False
    for ev in history:
        if ev["e"] == "claim" and ev.get("r") == "claimed" and ev["a"] == attempts:
            grant, unresolved = ev, False
        elif grant is not None and ev["e"] == "renew0":
            unresolved = True
        elif grant is not None and ev["e"] == "renew":
            unresolved = False
            if ev.get("ok"):
                grant = ev
        elif grant is not None and ev["e"] == "complete0":
            return grant, unresolved, int(ev["t0"])
    return grant, unresolved, None


def check_acknowledged(ev: Evidence) -> tuple[Check, int, int]:
    """``acknowledged_by_owner``, and how many acknowledged decisions were lost
    and how many repeated (completed by an owner that was not told "submitted")."""
    lost: list[str] = []
    repeated: list[str] = []
    for key, owners in ev.acked.items():
        record = ev.records.get(key)
        if record is None or record.status is not ClaimStatus.COMPLETED:
            state = "missing" if record is None else record.status.value
            lost.append(f"{key}: acknowledged to {owners[0]}, but {state} on the survivor")
            continue
        others = [owner for owner in owners if owner != record.owner_id]
        if others or len(owners) > 1:
            repeated.append(
                f"{key}: acknowledged to {', '.join(owners)}, completed by {record.owner_id}"
            )
    problems = lost + repeated
    check = (
        not problems,
        fmt_problems(problems)
        or f"{len(ev.acked)} acknowledged decisions, each completed by the owner told so",
    )
    return check, len(lost), len(repeated)


def check_stale(ev: Evidence) -> tuple[Check, int]:
    """``no_stale_completion``, and how many completions fell within clock slack."""
    stale: list[str] = []
    proven = ambiguous = 0
    lease = ev.cfg.lease_ms
    for key in ev.ids:
        record = ev.records[key]
        if record is None or record.completed_at_ms is None:
            continue
        history = ev.by_owner.get((record.owner_id, key), [])
        grant, unresolved, complete_start = _last_grant(history, record.attempts)
        if grant is None and _joint_unanswered(history):
            proven += 1  # claimed and completed in one transaction: inside its own lease
            continue
        if grant is None:
            stale.append(f"{key}: no lease grant journaled for the completer")
            continue
        done_at = record.completed_at_ms
        lower = int(grant["t0"]) + lease
        upper_base = complete_start if unresolved and complete_start is not None else grant["t1"]
        upper = int(upper_base) + lease
        if done_at < lower:
            proven += 1
        elif done_at >= upper:
            stale.append(
                f"{key}: completed at {done_at}, lease granted at {grant['t0']}..{grant['t1']} "
                f"ended by {upper}"
            )
        else:
            ambiguous += 1
    check = (
        not stale,
        fmt_problems(stale)
        or f"{proven} completions proven inside a live lease, {ambiguous} within clock slack",
    )
    return check, ambiguous


async def verify(
    cfg: ChaosConfig, stats: Counter[str] | None = None, elapsed_s: float = 0.0
) -> ChaosReport:
    """Check the stores against the journals (see the module docs)."""
    stats = stats if stats is not None else Counter()
    ev = await gather_evidence(cfg)
    report = ChaosReport(config=asdict(cfg))
    report.checks["ledger_exactly_once"], unanswered = check_ledger(ev)
    rows_check, content_check, replays = check_outbox(ev, await _load_outbox(cfg))
    report.checks["outbox_one_row"] = rows_check
    report.checks["no_conflicting_content"] = content_check
    report.checks["no_stale_completion"], ambiguous = check_stale(ev)
    report.checks["acknowledged_by_owner"], lost, repeated = check_acknowledged(ev)
    health = check_health(ev.cfg, ev.events_by_worker, ev.records, ev.claims, stats)
    report.checks["health_adds_up"] = health.check
    records = [r for r in ev.records.values() if r is not None]
    report.figures = {
        "ledger": cfg.ledger_kind,
        "layout": cfg.layout,
        "decisions": cfg.decisions,
        "proposals": ev.proposals,
        "workers": cfg.workers,
        "incarnations": stats["incarnations"],
        "kills": stats["kills"],
        "pauses": stats["pauses"],
        "crashes": stats["crashes"],
        "dispatches": sum(ev.outcomes.values()),
        "takeovers_ledger": sum(r.attempts - 1 for r in records),
        "takeovers_reported": health.reported_takeovers,
        "lost_leases": ev.outcomes["lease_lost"],
        "duplicates_suppressed_dispatcher": ev.outcomes["duplicate"],
        "duplicates_suppressed_outbox": ev.sink_events["replay"],
        "outbox_rows_replayed": replays,
        "conflicts_refused": ev.outcomes["conflict"],
        "busy_retries": ev.outcomes["busy"],
        "sink_failures": ev.outcomes["sink_error"],
        "ledger_failures": ev.outcomes["ledger_error"],
        "stale_completions_refused": ev.refused,
        "late_acks": ev.late_acks,
        "acknowledged": len(ev.acked),
        "completed_unanswered": unanswered,
        "lost_after_ack": lost,
        "repeated_after_ack": repeated,
        "stale_check_ambiguous": ambiguous,
        "torn_journal_lines": ev.torn,
        "elapsed_s": round(elapsed_s, 1),
        "decisions_per_s": round(cfg.decisions / elapsed_s, 1) if elapsed_s else None,
    }
    return report
