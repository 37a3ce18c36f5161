"""The transactional outbox: an outbox in the ledger's own store (one SQLite file,
one PostgreSQL database) is written in the ledger's transaction, so a decision
is claimed, written and completed in one commit, or not at all.

Runs on SQLite files and on the throwaway PostgreSQL server; memory and file
ledgers (and an outbox in another store) keep the claim → submit → complete path.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from flowdecision import Dispatcher, request_hash
from flowdecision.core.identity import decision_receipt
from flowdecision.core.model import DecisionRequest
from flowdecision.errors import DecisionBusyError, DecisionConflictError, SinkError
from flowdecision.ledger import Ledger
from flowdecision.ledger import sqlite as sqlite_ledger
from flowdecision.ledger.memory import MemoryLedger
from flowdecision.ledger.opening import open_ledger
from flowdecision.ledger.states import AlreadyCompleted, Claimed, JointOutcome
from flowdecision.sinks import JointSink, OutboxConflictError, OutboxSink
from flowdecision.store.joint import JointResult, JointRow
from tests.helpers import step_request

BRANCH = "production"


async def _open(url: str) -> tuple[Ledger, OutboxSink]:
    return await open_ledger(url), await OutboxSink(url).open()


def _req(decision_id: str, output: Any = None) -> DecisionRequest:
    # A step: the tests send many decisions of one run (a run takes one complete).
    return step_request(decision_id, output)


async def test_colocated_dispatch_claims_writes_and_completes_in_one_commit(
    shared_store_url: str,
) -> None:
    ledger, outbox = await _open(shared_store_url)
    try:
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        assert dispatcher.joint and isinstance(outbox, JointSink)
        first = _req("d-1")
        outcome = await dispatcher.dispatch(first)
        _, receipt = decision_receipt(first)
        assert (outcome.submitted, outcome.attempt, outcome.receipt) == (True, 1, receipt)
        record = await ledger.read_record("d-1")
        assert record is not None and record.status.value == "completed"
        assert record.result_receipt == receipt and record.attempts == 1
        entry = await outbox.get("d-1")
        assert entry is not None and entry.request_json == first.to_json()
        assert (entry.first_attempt, entry.highest_attempt) == (1, 1)
        # A duplicate answers with the stored attempt and receipt and writes nothing.
        again = await dispatcher.dispatch(first)
        assert (again.submitted, again.attempt, again.receipt) == (False, 1, receipt)
        assert await outbox.count() == 1
        entry = await outbox.get("d-1")
        assert entry is not None and entry.highest_attempt == 1  # no replay reached it
    finally:
        await outbox.close()
        await ledger.close()


async def test_health_and_outcomes_match_the_claim_submit_complete_path(
    shared_store_url: str, tmp_path: Path
) -> None:
    """Same requests through a co-located store and through separate stores:
    same outcomes, same health counters."""
    ledger, outbox = await _open(shared_store_url)
    apart_ledger = await open_ledger(f"sqlite:///{tmp_path / 'apart-ledger.db'}")
    apart_outbox = await OutboxSink(f"sqlite:///{tmp_path / 'apart-outbox.db'}").open()
    try:
        joint = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        apart = Dispatcher(BRANCH, apart_outbox, apart_ledger, owner_id="owner-a")
        assert joint.joint and not apart.joint
        script = [_req("a"), _req("b"), _req("a"), _req("a", output=1), _req("c"), _req("b")]
        results: list[list[object]] = [[], []]
        for index, dispatcher in enumerate((joint, apart)):
            for item in script:
                try:
                    results[index].append((await dispatcher.dispatch(item)).to_dict())
                except DecisionConflictError as error:
                    results[index].append(error.code)
        assert results[0] == results[1]
        # Every counter; only the timings differ.
        timings = ("average_dispatch_micros", "max_dispatch_micros", "last_success_at_ms")
        one, two = joint.health().to_dict(), apart.health().to_dict()
        for timing in timings:
            del one[timing], two[timing]
        assert one == two
        assert (one["claimed"], one["completed"], one["duplicates"]) == (3, 3, 2)
        assert one["conflicts"] == 1 and one["status"] == "healthy"
        assert await outbox.count() == await apart_outbox.count() == 3
    finally:
        for closable in (outbox, ledger, apart_outbox, apart_ledger):
            await closable.close()


async def test_busy_and_conflicting_claims_write_nothing(shared_store_url: str) -> None:
    ledger, outbox = await _open(shared_store_url)
    try:
        held = _req("held")
        # Another owner holds a live lease (it is between its claim and its sink).
        await ledger.claim("held", request_hash(held), "other-owner", lease_ms=60_000)
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        with pytest.raises(DecisionBusyError):
            await dispatcher.dispatch(held)
        await dispatcher.dispatch(_req("taken"))
        with pytest.raises(DecisionConflictError):
            await dispatcher.dispatch(_req("taken", output="different"))
        assert await outbox.get("held") is None
        assert await outbox.count() == 1
        record = await ledger.read_record("held")
        assert record is not None and record.owner_id == "other-owner" and record.attempts == 1
    finally:
        await outbox.close()
        await ledger.close()


async def test_a_refused_row_stores_no_claim_and_no_completion(shared_store_url: str) -> None:
    """A constraint: the outbox already holds other content for the id (e.g. from an
    earlier layout); the row is refused and the ledger keeps nothing."""
    ledger, outbox = await _open(shared_store_url)
    try:
        await outbox.deliver(_req("old", output="earlier content"), 1)
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        with pytest.raises(SinkError) as caught:
            await dispatcher.dispatch(_req("old"))
        assert isinstance(caught.value.__cause__, OutboxConflictError)
        assert await ledger.read_record("old") is None
        entry = await outbox.get("old")
        assert entry is not None and entry.request == _req("old", output="earlier content")
        # An identical earlier row (a crash on the old path) is a replay, then completed.
        await outbox.deliver(_req("replayed"), 1)
        outcome = await dispatcher.dispatch(_req("replayed"))
        assert outcome.submitted and await outbox.count() == 2
    finally:
        await outbox.close()
        await ledger.close()


@pytest.mark.parametrize("dispatchers", [1, 2])
async def test_concurrent_dispatches_write_exactly_one_row_each(
    shared_store_url: str, dispatchers: int
) -> None:
    """64 concurrent dispatches (distinct ids and repeats of them) through one
    dispatcher, or two with their own ledger and outbox (as two processes)."""
    opened = [await _open(shared_store_url) for _ in range(dispatchers)]
    try:
        fleet = [
            Dispatcher(BRANCH, outbox, ledger, owner_id=f"owner-{index}")
            for index, (ledger, outbox) in enumerate(opened)
        ]
        assert all(dispatcher.joint for dispatcher in fleet)
        ids = [f"c-{n}" for n in range(40)]
        calls = [
            fleet[n % len(fleet)].dispatch_until_done(_req(ids[n % len(ids)]), deadline_s=30)
            for n in range(64 + 40)
        ]
        outcomes = await asyncio.gather(*calls)
        submitted = [o.decision_id for o in outcomes if o.submitted]
        assert sorted(submitted) == sorted(ids)  # each id submitted exactly once
        ledger, outbox = opened[0]
        rows = await outbox.fetch(after=0, limit=1000)
        assert sorted(row.decision_id for row in rows) == sorted(ids)
        assert all(row.first_attempt == row.highest_attempt == 1 for row in rows)
        for key in ids:
            record = await ledger.read_record(key)
            assert record is not None and record.status.value == "completed"
        # seq order is commit order: the cursor has no holes.
        seqs = [row.seq for row in rows]
        assert seqs == sorted(seqs)
        # Concurrent decisions shared commits (group commit), row and completion alike.
        commits = sum(getattr(ledger, "commits", 0) for ledger, _ in opened)
        assert 1 <= commits < len(ids)
    finally:
        for ledger, outbox in opened:
            await outbox.close()
            await ledger.close()


async def test_other_layouts_keep_the_claim_submit_complete_path(tmp_path: Path) -> None:
    outbox = await OutboxSink(f"sqlite:///{tmp_path / 'outbox.db'}").open()
    ledger = await open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        assert not Dispatcher(BRANCH, outbox, MemoryLedger()).joint
        assert not Dispatcher(BRANCH, outbox, ledger).joint
        file_ledger = await open_ledger(f"file://{tmp_path / 'files'}")
        assert not Dispatcher(BRANCH, outbox, file_ledger).joint
        # Another spelling of the same file is the same store.
        same = await OutboxSink(f"sqlite:///{tmp_path / 'sub' / '..' / 'ledger.db'}").open()
        try:
            assert Dispatcher(BRANCH, same, ledger).joint
        finally:
            await same.close()
        outcome = await Dispatcher(BRANCH, outbox, ledger).dispatch(_req("x"))
        assert outcome.submitted and await outbox.count() == 1
    finally:
        await outbox.close()
        await ledger.close()


async def test_a_joint_write_for_another_store_is_refused(tmp_path: Path) -> None:
    ledger = await open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    other = await OutboxSink(f"sqlite:///{tmp_path / 'outbox.db'}").open()
    try:
        item = _req("x")
        ident, receipt = decision_receipt(item)
        from flowdecision.errors import LedgerError

        with pytest.raises(LedgerError, match="cannot join"):
            await ledger.joint_commit(
                "x",
                request_hash(item),
                "owner",
                lease_ms=1000,
                identity=ident,
                receipt=receipt,
                row=await other.prepare(item),
            )
        assert await ledger.read_record("x") is None and await other.count() == 0
        with pytest.raises(LedgerError, match="no shared store"):
            await MemoryLedger().joint_commit(
                "x",
                request_hash(item),
                "owner",
                lease_ms=1000,
                identity=ident,
                receipt=receipt,
                row=await other.prepare(item),
            )
    finally:
        await other.close()
        await ledger.close()


async def test_either_store_may_be_created_first_in_the_shared_file(tmp_path: Path) -> None:
    """The ledger refuses a file holding something else, but not the outbox beside it."""
    for first in ("outbox", "ledger"):
        url = f"sqlite:///{tmp_path / f'{first}-first.db'}"
        if first == "outbox":
            await (await OutboxSink(url).open()).close()
            ledger, outbox = await _open(url)
        else:
            ledger = await open_ledger(url)
            outbox = await OutboxSink(url).open()
        try:
            assert (await Dispatcher(BRANCH, outbox, ledger).dispatch(_req("x"))).submitted
        finally:
            await outbox.close()
            await ledger.close()


async def test_racing_proposals_of_one_new_id_answer_as_the_claim_rules_do(
    shared_store_url: str,
) -> None:
    """Two dispatchers (two processes' worth: own ledger and outbox) race with
    different content for the same new ids: one is submitted, the other is told
    `conflict` by the claim rules, never a sink error from the outbox's refusal."""
    opened = [await _open(shared_store_url) for _ in range(2)]
    try:
        one, two = (
            Dispatcher(BRANCH, outbox, ledger, owner_id=f"owner-{n}")
            for n, (ledger, outbox) in enumerate(opened)
        )
        ids = [f"race-{n}" for n in range(30)]

        async def attempt(dispatcher: Dispatcher, item: DecisionRequest) -> str:
            try:
                return (await dispatcher.dispatch_until_done(item, deadline_s=30)).outcome
            except DecisionConflictError:
                return "conflict"

        answers = await asyncio.gather(
            *(attempt(one, _req(key, output="a")) for key in ids),
            *(attempt(two, _req(key, output="b")) for key in ids),
        )
        for index in range(len(ids)):
            pair = sorted((answers[index], answers[len(ids) + index]))
            assert pair == ["conflict", "submitted"], (ids[index], pair)
        assert await opened[0][1].count() == len(ids)
    finally:
        for ledger, outbox in opened:
            await outbox.close()
            await ledger.close()


async def test_a_consumer_following_the_cursor_never_skips_a_row(shared_store_url: str) -> None:
    """seq order is commit order on the joint path too: a consumer that
    pages with fetch(after=last seq) while two dispatchers commit batches sees
    every row (a batch committing a lower seq after a higher one would be skipped)."""
    opened = [await _open(shared_store_url) for _ in range(2)]
    reader = await OutboxSink(shared_store_url).open()
    try:
        fleet = [
            Dispatcher(BRANCH, outbox, ledger, owner_id=f"owner-{n}")
            for n, (ledger, outbox) in enumerate(opened)
        ]
        ids = [f"cursor-{n}" for n in range(150)]
        seen: list[str] = []
        writing = True

        async def consume() -> None:
            cursor = 0
            while True:
                done = not writing  # read once more after the writers finished
                page = await reader.fetch(after=cursor, limit=1000)
                seen.extend(row.decision_id for row in page)
                if page:
                    cursor = page[-1].seq
                if done and not page:
                    return
                await asyncio.sleep(0)

        consumer = asyncio.create_task(consume())
        await asyncio.gather(*(fleet[n % 2].dispatch(_req(key)) for n, key in enumerate(ids)))
        writing = False
        await asyncio.wait_for(consumer, 60)
        assert sorted(seen) == sorted(ids)  # every row, none twice
    finally:
        await reader.close()
        for ledger, outbox in opened:
            await outbox.close()
            await ledger.close()


async def test_joint_commit_answers_what_it_did(shared_store_url: str) -> None:
    """``joint_commit`` returns the claim's outcome and whether the row was new:
    a new row, a replay of an identical row, and no row for a duplicate."""
    ledger, outbox = await _open(shared_store_url)
    try:
        new, replay = _req("new"), _req("replay")
        await outbox.deliver(replay, 1)  # an identical row from the old path
        answers = []
        for item in (new, replay, new):
            ident, receipt = decision_receipt(item)
            row = await outbox.prepare(item)
            done = await ledger.joint_commit(
                item.decision_id, request_hash(item), "owner", lease_ms=1000,
                identity=ident, receipt=receipt, row=row,
            )  # fmt: skip
            answers.append(done)
        assert answers[0] == JointOutcome(Claimed(1), True)
        assert answers[1] == JointOutcome(Claimed(1), False)
        assert isinstance(answers[2].claim, AlreadyCompleted) and answers[2].inserted is None
    finally:
        await outbox.close()
        await ledger.close()


async def test_a_batch_writes_its_outbox_rows_together_and_refuses_only_the_conflict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: the rows of concurrent decisions go in with one store call per batch;
    a row the outbox refuses (other content under the id) answers only its caller,
    which stores nothing, and a replayed row is completed; seq follows commit order."""
    url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    ledger = await open_ledger(url)
    outbox = OutboxSink(url)
    batches: list[int] = []
    insert_rows = sqlite_ledger.sqlite_insert_rows

    def counted(conn: Any, rows: list[tuple[JointRow, int]]) -> list[JointResult]:
        batches.append(len(rows))
        return insert_rows(conn, rows)

    monkeypatch.setattr(sqlite_ledger, "sqlite_insert_rows", counted)
    await outbox.open()
    try:
        await outbox.deliver(_req("old", output="earlier content"), 1)
        await outbox.deliver(_req("replayed"), 1)
        dispatcher = Dispatcher(BRANCH, outbox, ledger, owner_id="owner-a")
        ids = ["old", "replayed", *(f"b-{n}" for n in range(40))]
        results = await asyncio.gather(
            *(dispatcher.dispatch(_req(key)) for key in ids), return_exceptions=True
        )
        refused = results[0]
        assert isinstance(refused, SinkError)
        assert isinstance(refused.__cause__, OutboxConflictError)
        assert await ledger.read_record("old") is None
        others = results[1:]
        assert all(not isinstance(o, BaseException) and o.submitted for o in others), others
        for key in ids[1:]:
            record = await ledger.read_record(key)
            assert record is not None and record.status.value == "completed"
        rows = await outbox.fetch(after=0, limit=100)
        assert sorted(row.decision_id for row in rows) == sorted(ids)
        assert [row.seq for row in rows] == sorted(row.seq for row in rows)
        # Batched: fewer store calls than decisions, every row in one of them.
        assert sum(batches) == len(ids) and len(batches) < len(ids)
    finally:
        await outbox.close()
        await ledger.close()
