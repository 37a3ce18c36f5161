"""Operator queries, actions, audit and tombstones: one conformance suite over all four ledgers.

Every ledger must answer exactly as the memory ledger's scan (the reference,
:func:`flowdecision.ledger.query.scan_page`) does, page by page, and the
reference itself is pinned by explicit expectations.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from flowdecision.errors import (
    ActionRefusedError,
    InvalidArgumentError,
    LedgerError,
    UnknownDecisionError,
)
from flowdecision.ledger import Ledger, MemoryLedger
from flowdecision.ledger.jsonfile import DATA_FILE, JsonFileLedger, encode_ledger
from flowdecision.ledger.machine import DecisionOrigin, receipt_digest
from flowdecision.ledger.query import MAX_PAGE_LIMIT, AuditQuery, DecisionQuery, TimeField
from flowdecision.ledger.states import AlreadyCompleted, Claimed, Conflict, DecisionState

from .helpers import identity, receipt
from .ledger_stores import LedgerStore

NOW = 10_000  # the time every query judges leases at

S = DecisionState
T = TimeField


async def _scenario(ledger: Ledger) -> None:
    """Decisions of three runs (and some without one) in every state, at fixed times."""
    for i in range(24):
        run = (f"run-{i % 3}", f"event-{i}") if i % 8 != 7 else None
        origin = None if run is None else DecisionOrigin(*run)
        # Two decisions share each creation time: the id breaks the tie.
        at = 1_000 + (i // 2) * 100
        lease = {1: 50_000, 3: 10}.get(i % 4, 5_000)  # live, expired, or completed in time
        assert await ledger.claim(
            f"d-{i:02d}", f"h{i}", "owner", lease_ms=lease, now_ms=at, origin=origin
        ) == Claimed(1)  # fmt: skip
        if i % 4 in (0, 2):
            # Completion order is not claim order: later from d-04 on, pairs tied.
            done_at = at + 5 if i < 4 else 3_000 - (i // 4) * 100
            await ledger.complete(f"d-{i:02d}", f"h{i}", "owner", completed_at_ms=done_at)
    # Completed before 1_200 (d-00, d-02): tombstones; then d-00 forgotten outright.
    await ledger.prune_completed(1_200, keep_tombstones=True)
    await ledger.forget("d-00", actor="ops", reason="reuse the id")


QUERIES = [
    DecisionQuery(),
    DecisionQuery(run_id="run-1"),
    DecisionQuery(run_id="run-2", state=S.COMPLETED),
    DecisionQuery(run_id="nobody"),
    DecisionQuery(state=S.PENDING_LIVE),
    DecisionQuery(state=S.PENDING_EXPIRED),
    DecisionQuery(state=S.COMPLETED),
    DecisionQuery(state=S.TOMBSTONED),
    DecisionQuery(after_ms=1_400),
    DecisionQuery(before_ms=1_400),
    DecisionQuery(after_ms=1_300, before_ms=1_900, state=S.PENDING_EXPIRED),
    DecisionQuery(by=T.COMPLETED),
    DecisionQuery(by=T.COMPLETED, after_ms=2_600),
    DecisionQuery(by=T.COMPLETED, before_ms=2_700),
    DecisionQuery(by=T.COMPLETED, after_ms=1_000, before_ms=2_800, state=S.COMPLETED),
    DecisionQuery(by=T.COMPLETED, state=S.TOMBSTONED),
    DecisionQuery(by=T.COMPLETED, run_id="run-0"),
    DecisionQuery(by=T.CLAIMED, after_ms=1_400, state=S.COMPLETED),
]


async def _pages(ledger: Ledger, query: DecisionQuery, limit: int) -> list[list[dict[str, Any]]]:
    """Every page of ``query`` at ``limit`` per page, as JSON."""
    pages: list[list[dict[str, Any]]] = []
    cursor: str | None = None
    while True:
        page = await ledger.list_decisions(query.next_page(cursor, limit), now_ms=NOW)
        pages.append([row.to_dict() for row in page.decisions])
        cursor = page.next_cursor
        if cursor is None:
            return pages
        assert len(pages) < 100


async def test_queries_answer_as_the_reference_scan_does(backend: LedgerStore) -> None:
    ledger = await backend()
    reference = MemoryLedger()
    await _scenario(ledger)
    await _scenario(reference)
    for query in QUERIES:
        for limit in (1, 4, MAX_PAGE_LIMIT):
            got = await _pages(ledger, query, limit)
            assert got == await _pages(reference, query, limit), (query, limit)
        assert await ledger.count_decisions(query, now_ms=NOW) == await reference.count_decisions(
            query, now_ms=NOW
        )


async def test_the_reference_answers_are_the_documented_ones() -> None:
    ledger = MemoryLedger()
    await _scenario(ledger)

    async def ids(query: DecisionQuery) -> list[str]:
        page = await ledger.list_decisions(query, now_ms=NOW)
        assert page.next_cursor is None
        return [row.decision_id for row in page.decisions]

    # A run's decisions in the order they were first claimed (the forgotten d-00 is gone).
    assert await ids(DecisionQuery(run_id="run-0")) == [
        "d-03",
        "d-06",
        "d-09",
        "d-12",
        "d-18",
        "d-21",
    ]
    assert await ids(DecisionQuery(state=S.TOMBSTONED)) == ["d-02"]
    assert await ids(DecisionQuery(state=S.PENDING_LIVE)) == [
        "d-01",
        "d-05",
        "d-09",
        "d-13",
        "d-17",
        "d-21",
    ]
    assert await ids(DecisionQuery(state=S.COMPLETED)) == [f"d-{i:02d}" for i in range(4, 24, 2)]
    assert await ids(DecisionQuery(state=S.PENDING_EXPIRED, before_ms=1_400)) == ["d-03", "d-07"]
    assert await ledger.count_decisions(DecisionQuery(), now_ms=NOW) == 23
    # By completion: completed and tombstoned decisions in the order they completed.
    assert await ids(DecisionQuery(by=T.COMPLETED)) == [
        "d-02", "d-20", "d-22", "d-16", "d-18", "d-12", "d-14", "d-08", "d-10", "d-04", "d-06",
    ]  # fmt: skip
    assert await ids(DecisionQuery(by=T.COMPLETED, after_ms=2_600, before_ms=2_900)) == [
        "d-16", "d-18", "d-12", "d-14", "d-08", "d-10",
    ]  # fmt: skip
    assert await ids(DecisionQuery(by=T.COMPLETED, run_id="run-0")) == ["d-18", "d-12", "d-06"]
    assert await ids(DecisionQuery(by=T.COMPLETED, before_ms=2_000)) == ["d-02"]
    assert await ledger.count_decisions(DecisionQuery(by=T.COMPLETED), now_ms=NOW) == 11
    pages = [await ledger.list_decisions(DecisionQuery(by=T.COMPLETED, limit=2), now_ms=NOW)]
    while (cursor := pages[-1].next_cursor) is not None:
        pages.append(
            await ledger.list_decisions(
                DecisionQuery(by=T.COMPLETED, cursor=cursor, limit=2), now_ms=NOW
            )
        )
    assert [row.completed_at_ms for page in pages for row in page.decisions] == [
        1_105, 2_500, 2_500, 2_600, 2_600, 2_700, 2_700, 2_800, 2_800, 2_900, 2_900,
    ]  # fmt: skip
    first = await ledger.list_decisions(DecisionQuery(run_id="run-1", limit=1), now_ms=NOW)
    row = first.decisions[0].to_dict()
    assert row == {
        "decision_id": "d-01", "state": "pending_live", "request_hash": "h1", "attempts": 1,
        "created_at_ms": 1_000, "lease_expires_at_ms": 51_000, "completed_at_ms": None,
        "run_id": "run-1", "causation_event_id": "event-1", "receipt_digest": None,
    }  # fmt: skip


async def test_pagination_across_concurrent_inserts_shows_each_existing_decision_once(
    backend: LedgerStore,
) -> None:
    ledger = await backend()
    for i in range(40):
        await ledger.claim(f"old-{i:02d}", "h", "o", lease_ms=10, now_ms=1_000 + i * 10)
    existing = {f"old-{i:02d}" for i in range(40)}
    inserted: list[str] = []
    pages_done = 0

    async def insert() -> None:
        for n in range(15):
            # Before, inside and after the range being paged.
            for at in (500, 1_195, 1_200, 5_000):
                inserted.append(f"new-{n:02d}-{at}")
                await ledger.claim(inserted[-1], "h", "o", lease_ms=10, now_ms=at)
            await asyncio.sleep(0.001)

    inserter = asyncio.create_task(insert())
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = await ledger.list_decisions(DecisionQuery(cursor=cursor, limit=3), now_ms=NOW)
        seen.extend(row.decision_id for row in page.decisions)
        pages_done += 1
        if pages_done == 5:
            assert inserted, "the inserts did not race the pages"
        await asyncio.sleep(0.001)
        cursor = page.next_cursor
        if cursor is None:
            break
    await inserter
    assert len(seen) == len(set(seen)), "a decision was shown twice"
    assert existing <= set(seen), f"skipped: {sorted(existing - set(seen))}"
    # What was inserted behind the cursor is not shown; what lands ahead of it may be.
    assert set(seen) - existing <= set(inserted)


async def test_page_limits_and_bad_queries_are_refused_clearly() -> None:
    with pytest.raises(InvalidArgumentError, match="limit"):
        DecisionQuery(limit=MAX_PAGE_LIMIT + 1)
    with pytest.raises(InvalidArgumentError, match="limit"):
        DecisionQuery(limit=0)
    with pytest.raises(InvalidArgumentError, match=r"state.*pending_live"):
        DecisionQuery(state="stuck")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="cursor"):
        DecisionQuery(cursor="not-a-cursor")
    with pytest.raises(InvalidArgumentError, match="before_ms"):
        DecisionQuery(before_ms=-1)
    with pytest.raises(InvalidArgumentError, match="cursor"):
        AuditQuery(cursor=DecisionQuery().cursor or "WzEsImEiXQ")
    with pytest.raises(InvalidArgumentError, match=r"`by`.*claimed, completed"):
        DecisionQuery(by="finished")  # type: ignore[arg-type]
    for pending in (S.PENDING_LIVE, S.PENDING_EXPIRED):
        with pytest.raises(InvalidArgumentError, match=rf"`by` completed.*{pending.value}"):
            DecisionQuery(by=T.COMPLETED, state=pending)
    # A cursor belongs to its order: one by claim time is refused by completion time
    # and the other way round.
    ledger = MemoryLedger()
    await _scenario(ledger)
    for mine, other in ((T.CLAIMED, T.COMPLETED), (T.COMPLETED, T.CLAIMED)):
        page = await ledger.list_decisions(DecisionQuery(by=mine, limit=1), now_ms=NOW)
        assert page.next_cursor is not None
        with pytest.raises(InvalidArgumentError, match="cursor"):
            DecisionQuery(by=other, cursor=page.next_cursor)


# -- actions --------------------------------------------------------------------------


async def test_release_is_fenced_and_audited(backend: LedgerStore) -> None:
    ledger = await backend()
    first = identity("first")
    assert await ledger.claim(
        "stuck", "h", "dead-owner", lease_ms=3_600_000, identity=first
    ) == Claimed(1)
    entry = await ledger.operator_release("stuck", actor="alice", reason="owner host died")
    assert (entry.action, entry.decision_id, entry.actor, entry.reason) == (
        "release", "stuck", "alice", "owner host died",
    )  # fmt: skip
    assert (entry.state_before, entry.attempts) == ("pending_live", 2)
    # The old owner can never complete nor renew; the next caller takes over at once,
    # with an attempt (fencing token) past the release's.
    with pytest.raises(LedgerError):
        await ledger.complete("stuck", "h", "dead-owner", identity=first, receipt=receipt(first))
    assert not await ledger.renew("stuck", "h", "dead-owner", lease_ms=10, identity=first)
    assert await ledger.claim("stuck", "h", "next", lease_ms=60_000, identity=first) == Claimed(3)
    await ledger.complete("stuck", "h", "next", identity=first, receipt=receipt(first))
    # After the takeover completed, the old owner's completion is not its own (the
    # dispatcher turns that into LeaseLostError).
    assert not await ledger.complete(
        "stuck", "h", "dead-owner", identity=first, receipt=receipt(first)
    )
    trail = await ledger.audit(AuditQuery(decision_id="stuck"))
    assert [e.to_dict() for e in trail.entries] == [entry.to_dict()]
    assert entry.seq >= 1


async def test_actions_refuse_what_does_not_apply(backend: LedgerStore) -> None:
    ledger = await backend()
    await ledger.claim("done", "h", "o", lease_ms=60_000)
    await ledger.complete("done", "h", "o")
    await ledger.claim("pending", "h", "o", lease_ms=60_000)
    with pytest.raises(ActionRefusedError, match="completed"):
        await ledger.operator_release("done", actor="a", reason="r")
    with pytest.raises(ActionRefusedError, match="pending"):
        await ledger.forget("pending", actor="a", reason="r")
    with pytest.raises(UnknownDecisionError):
        await ledger.operator_release("nothing", actor="a", reason="r")
    with pytest.raises(UnknownDecisionError):
        await ledger.forget("nothing", actor="a", reason="r")
    with pytest.raises(LedgerError, match="reason"):
        await ledger.forget("done", actor="a", reason="  ")
    with pytest.raises(LedgerError, match="actor"):
        await ledger.forget("done", actor="", reason="r")
    assert (await ledger.audit(AuditQuery())).entries == ()  # nothing refused was audited
    assert await ledger.claim("done", "h", "x", lease_ms=1) == AlreadyCompleted()


async def test_forget_frees_the_id_and_the_trail_pages(backend: LedgerStore) -> None:
    ledger = await backend()
    for i in range(5):
        await ledger.claim(f"f-{i}", "h", "o", lease_ms=60_000)
        await ledger.complete(f"f-{i}", "h", "o")
        await ledger.forget(f"f-{i}", actor="bob", reason=f"reuse {i}")
    assert await ledger.claim("f-0", "other-payload", "o", lease_ms=60_000) == Claimed(1)
    entries = []
    cursor = None
    while True:
        page = await ledger.audit(AuditQuery(cursor=cursor, limit=2))
        entries.extend(page.entries)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert [(e.decision_id, e.reason, e.state_before) for e in entries] == [
        (f"f-{i}", f"reuse {i}", "completed") for i in range(5)
    ]
    assert [e.seq for e in entries] == sorted({e.seq for e in entries})


# -- tombstones -----------------------------------------------------------------------


async def test_tombstones_keep_dedup_past_pruning(backend: LedgerStore) -> None:
    ledger = await backend()
    ident = identity("t")
    kept = receipt(ident)
    await ledger.claim("t", "h", "o", lease_ms=60_000, identity=ident)
    await ledger.complete("t", "h", "o", completed_at_ms=100, identity=ident, receipt=kept)
    await ledger.claim("u", "h", "o", lease_ms=60_000)
    await ledger.complete("u", "h", "o", completed_at_ms=100)
    assert await ledger.prune_completed(200, keep_tombstones=True) == 2
    late = await ledger.claim("t", "h", "late", lease_ms=60_000, identity=ident)
    assert isinstance(late, AlreadyCompleted)
    assert (late.attempts, late.receipt, late.receipt_digest) == (1, None, receipt_digest(kept))
    assert await ledger.claim("t", "other", "late", lease_ms=60_000) == Conflict()
    assert await ledger.prune_completed(10**6, keep_tombstones=True) == 0  # already tombstones
    assert await ledger.prune_completed(10**6) == 0  # the default prune leaves tombstones
    entry = await ledger.lookup("t")
    assert entry is not None and entry.attempts == 1
    # The horizon: tombstones of decisions completed before it go; the ids are new again.
    assert await ledger.prune_tombstones(100) == 0
    assert await ledger.prune_tombstones(101) == 2
    assert await ledger.claim("t", "h", "again", lease_ms=60_000) == Claimed(1)


async def test_default_prune_keeps_the_seeds_behaviour(backend: LedgerStore) -> None:
    ledger = await backend()
    await ledger.claim("p", "h", "o", lease_ms=60_000)
    await ledger.complete("p", "h", "o", completed_at_ms=100)
    assert await ledger.prune_completed(200) == 1
    assert await ledger.lookup("p") is None
    assert await ledger.claim("p", "h", "o2", lease_ms=60_000) == Claimed(1)  # submitted again


async def test_a_ledger_setting_keeps_tombstones_by_default(backend: LedgerStore) -> None:
    ledger = await backend()
    ledger.keep_tombstones = True  # type: ignore[attr-defined]
    try:
        await ledger.claim("s", "h", "o", lease_ms=60_000)
        await ledger.complete("s", "h", "o", completed_at_ms=100)
        assert await ledger.prune_completed(200) == 1
        assert isinstance(await ledger.claim("s", "h", "o2", lease_ms=1), AlreadyCompleted)
        assert await ledger.prune_completed(200, keep_tombstones=False) == 0
    finally:
        ledger.keep_tombstones = False  # type: ignore[attr-defined]


async def test_the_json_file_stays_the_seeds_with_tombstones_and_audit_beside_it(
    tmp_path: Path,
) -> None:
    ledger = JsonFileLedger(tmp_path)
    await ledger.claim("a", "h", "o", lease_ms=60_000, origin=DecisionOrigin("r", "e"))
    await ledger.complete("a", "h", "o", completed_at_ms=100)
    await ledger.claim("b", "h", "o", lease_ms=60_000)
    await ledger.prune_completed(200, keep_tombstones=True)
    await ledger.operator_release("b", actor="a", reason="r")
    data = (tmp_path / DATA_FILE).read_bytes()
    records = json.loads(data)["records"]
    assert sorted(records) == ["b"] and records["b"]["status"] == "pending"
    assert data == encode_ledger(await ledger.records())
    names = sorted(path.name for path in tmp_path.iterdir())
    assert "flow-decisions.ops.json" in names and "flow-decisions.audit.jsonl" in names
