"""The relay's lanes and parked rows, on SQLite and on the throwaway PostgreSQL server:
each run's rows in seq order while runs overlap, a row refused for good parked with its
run held behind it while every other run goes on, operators retrying and skipping it
(audited, fenced), a sink that is down backing off as a whole, and the redelivery bound."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import defaultdict

import pytest

from flowdecision import DecisionRequest
from flowdecision.errors import ActionRefusedError, SinkRefusedError, UnknownDecisionError
from flowdecision.sinks import OutboxSink
from flowdecision.sinks.relay import OutboxRelay
from tests.helpers import request
from tests.test_relay import outbox_url  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(120)


class EngineSink:
    """Records what it applied, per run, with the engine's dedup on decision_id; refuses
    the ids in ``poison`` for good and fails every call while ``down``."""

    def __init__(self, *, seed: int = 7, delay_s: float = 0.002) -> None:
        self.applied: dict[str, list[str]] = defaultdict(list)
        self.effects: set[str] = set()
        self.calls = 0
        self.poison: set[str] = set()
        self.down = False
        self.in_flight = 0
        self.most_in_flight = 0
        self.per_run_in_flight: dict[str, int] = defaultdict(int)
        self.overlap_in_a_run = False
        self._rng = random.Random(seed)
        self.delay_s = delay_s

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.calls += 1
        run = request.run_id
        self.in_flight += 1
        self.per_run_in_flight[run] += 1
        self.overlap_in_a_run |= self.per_run_in_flight[run] > 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self._rng.random() * self.delay_s)
            if self.down:
                raise ConnectionError("engine unavailable")
            if request.decision_id in self.poison:
                raise SinkRefusedError(f"the engine refuses `{request.decision_id}` for good")
            if request.decision_id not in self.effects:
                self.effects.add(request.decision_id)
                self.applied[run].append(request.decision_id)
        finally:
            self.in_flight -= 1
            self.per_run_in_flight[run] -= 1


async def _fill(outbox: OutboxSink, runs: int, per_run: int) -> dict[str, list[str]]:
    """``runs`` runs of ``per_run`` decisions each, interleaved in the outbox."""
    expected: dict[str, list[str]] = defaultdict(list)
    for index in range(per_run):
        for run in range(runs):
            run_id = f"run-{run:03d}"
            decision_id = f"{run_id}-d{index:03d}"
            await outbox.submit(request(decision_id=decision_id, run_id=run_id), 1)
            expected[run_id].append(decision_id)
    return expected


async def test_each_run_in_seq_order_while_runs_are_delivered_concurrently(
    outbox_url: str,  # noqa: F811
) -> None:
    async with OutboxSink(outbox_url) as outbox:
        expected = await _fill(outbox, runs=20, per_run=10)
        sink = EngineSink()
        relay = OutboxRelay(outbox, sink, concurrency=8, save_interval_s=0.01)
        assert await relay.drain() == 200
        assert dict(sink.applied) == expected  # every run complete, each in seq order
        assert not sink.overlap_in_a_run  # one row of a run at a time
        assert 1 < sink.most_in_flight <= 8  # runs overlapped, within the concurrency
        (cursor,) = await outbox.cursors()
        assert (cursor.position, cursor.lag_rows, cursor.delivered) == (200, 0, 200)


async def test_concurrency_one_is_a_single_line_in_seq_order(outbox_url: str) -> None:  # noqa: F811
    async with OutboxSink(outbox_url) as outbox:
        expected = await _fill(outbox, runs=4, per_run=5)
        sink = EngineSink()
        seen: list[str] = []
        original = sink.submit

        async def submit(request: DecisionRequest, attempt: int) -> None:
            seen.append(request.decision_id)
            await original(request, attempt)

        sink.submit = submit  # type: ignore[method-assign]
        assert await OutboxRelay(outbox, sink, concurrency=1).drain() == 20
        rows = await outbox.fetch(after=0, limit=100)
        assert seen == [row.decision_id for row in rows]
        assert sink.most_in_flight == 1
        assert dict(sink.applied) == expected


async def test_a_refused_row_is_parked_its_run_held_and_every_other_run_delivered(
    outbox_url: str,  # noqa: F811
) -> None:
    async with OutboxSink(outbox_url) as outbox:
        expected = await _fill(outbox, runs=3, per_run=10)
        poison = expected["run-001"][1]
        sink = EngineSink()
        sink.poison.add(poison)
        relay = OutboxRelay(outbox, sink, concurrency=4)
        delivered = await relay.drain()  # returns: nothing deliverable is left
        assert delivered == 21
        assert sink.applied["run-000"] == expected["run-000"]
        assert sink.applied["run-002"] == expected["run-002"]
        assert sink.applied["run-001"] == expected["run-001"][:1]  # stopped at the poison
        status = await relay.refresh()
        assert (status.parked, status.parked_rows, status.held_rows) == (1, 1, 8)
        assert status.lag_rows == 0  # the cursor passed them: they are recorded, not lost
        parked = await outbox.parked()
        assert [(row.decision_id, row.state) for row in parked] == [
            (poison, "parked"),
            *((decision_id, "held") for decision_id in expected["run-001"][2:]),
        ]
        assert parked[0].attempts == 1 and "refuses" in (parked[0].error or "")
        assert parked[0].run_id == "run-001" and parked[0].relay == "default"

        # A held row cannot be acted on: the parked one is what blocks its run.
        with pytest.raises(ActionRefusedError, match="held behind"):
            await outbox.act_on_parked(
                "default", "skip", expected["run-001"][5], actor="ops", reason="x"
            )
        with pytest.raises(UnknownDecisionError):
            await outbox.act_on_parked("default", "retry", "nope", actor="ops", reason="x")

        # Still refused: retried, parked again with its attempts counted; nothing else moves.
        entry = await outbox.act_on_parked(
            "default", "retry", poison, actor="ops", reason="engine fixed?"
        )
        assert (entry.action, entry.state_before, entry.attempts) == ("retry", "parked", 1)
        assert await OutboxRelay(outbox, sink).drain() == 0
        (again,) = [row for row in await outbox.parked() if row.state == "parked"]
        assert (again.decision_id, again.attempts) == (poison, 2)

        # Fixed for real: the retried row goes first, then the run's held rows, in order.
        sink.poison.clear()
        await outbox.act_on_parked("default", "retry", poison, actor="ops", reason="fixed")
        assert await OutboxRelay(outbox, sink).drain() == 9
        assert sink.applied["run-001"] == expected["run-001"]
        assert await outbox.parked() == []
        audit = await outbox.audit()
        assert [(e.action, e.decision_id, e.actor, e.attempts) for e in audit] == [
            ("retry", poison, "ops", 1),
            ("retry", poison, "ops", 2),
        ]


async def test_a_skipped_row_is_never_delivered_and_its_run_goes_on(
    outbox_url: str,  # noqa: F811
) -> None:
    async with OutboxSink(outbox_url) as outbox:
        expected = await _fill(outbox, runs=2, per_run=4)
        poison = expected["run-000"][2]
        sink = EngineSink()
        sink.poison.add(poison)
        relay = OutboxRelay(outbox, sink, concurrency=4, idle_wait_s=0.05)
        task = asyncio.ensure_future(relay.run())
        try:
            await _until(lambda: len(sink.applied["run-001"]) == 4)
            for _ in range(3000):  # until the refused row is recorded as parked
                if any(row.state == "parked" for row in await outbox.parked()):
                    break
                await asyncio.sleep(0.01)
            entry = await outbox.act_on_parked(
                "default", "skip", poison, actor="ops", reason="the engine will never take it"
            )
            assert (entry.action, entry.relay) == ("skip", "default")
            # The running relay finds the run released and delivers its held row.
            await _until(lambda: len(sink.applied["run-000"]) == 3)
            # A new row of the run, after the skip, goes straight through.
            await outbox.submit(request(decision_id="run-000-late", run_id="run-000"), 1)
            await _until(lambda: len(sink.applied["run-000"]) == 4)
        finally:
            relay.stop()
            await task
        assert sink.applied["run-000"] == [
            *(d for d in expected["run-000"] if d != poison),
            "run-000-late",
        ]
        assert poison not in sink.effects
        assert await outbox.parked() == []
        assert [e.action for e in await outbox.audit("default")] == ["skip"]
        with pytest.raises(UnknownDecisionError):  # skipped: nothing is parked any more
            await outbox.act_on_parked("default", "skip", poison, actor="ops", reason="again")


async def test_parked_rows_survive_a_new_relay_and_stay_held(outbox_url: str) -> None:  # noqa: F811
    """A relay that starts after another parked a row holds that run's rows too."""
    async with OutboxSink(outbox_url) as outbox:
        expected = await _fill(outbox, runs=2, per_run=3)
        poison = expected["run-000"][0]
        sink = EngineSink()
        sink.poison.add(poison)
        assert await OutboxRelay(outbox, sink).drain() == 3
        for index in range(3, 5):  # more rows of both runs, for the next relay
            for run_id in ("run-000", "run-001"):
                decision_id = f"{run_id}-d{index:03d}"
                await outbox.submit(request(decision_id=decision_id, run_id=run_id), 1)
                expected[run_id].append(decision_id)
        sink.poison.clear()  # even so: nothing of run-000 goes before an operator acts
        assert await OutboxRelay(outbox, sink).drain() == 2
        assert "run-000" not in sink.applied
        assert sink.applied["run-001"] == expected["run-001"]
        held = [row.decision_id for row in await outbox.parked() if row.state == "held"]
        assert held == expected["run-000"][1:]


async def test_a_stale_relay_cannot_park_or_unpark(outbox_url: str) -> None:  # noqa: F811
    async with OutboxSink(outbox_url) as outbox:
        await _fill(outbox, runs=1, per_run=2)
        rows = await outbox.fetch(after=0, limit=10)
        first = await outbox.acquire_cursor("fenced", "old", lease_ms=100)
        await asyncio.sleep(0.15)
        second = await outbox.acquire_cursor("fenced", "new", lease_ms=10_000)
        assert first.fence < second.fence  # type: ignore[union-attr]
        assert not await outbox.park(first, rows[:1], "run-000", state="parked")  # type: ignore[arg-type]
        assert await outbox.parked("fenced") == []
        assert await outbox.park(second, rows[1:], "run-000", state="held")  # type: ignore[arg-type]
        assert not await outbox.unpark(first, rows[1].seq)  # type: ignore[arg-type]
        assert await outbox.unpark(second, rows[1].seq)  # type: ignore[arg-type]
        assert await outbox.parked("fenced") == []


async def test_a_sink_that_is_down_is_probed_one_delivery_at_a_time(
    outbox_url: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with OutboxSink(outbox_url) as outbox:
        expected = await _fill(outbox, runs=16, per_run=2)
        sink = EngineSink(delay_s=0.0)
        sink.down = True
        relay = OutboxRelay(
            outbox, sink, concurrency=16, retry_base_s=0.02, retry_cap_s=0.2, idle_wait_s=0.05
        )
        caplog.set_level(logging.WARNING, logger="flowdecision.relay")
        task = asyncio.ensure_future(relay.run())
        try:
            await _until(lambda: relay.status().state == "backing_off")
            calls = sink.calls
            most = sink.most_in_flight
            await asyncio.sleep(1.0)
            # In the outage one delivery at a time probes the sink: no storm of 16 lanes.
            probes = sink.calls - calls
            assert sink.most_in_flight == most and probes < 16, (probes, most)
            sink.down = False
            await _until(lambda: sum(map(len, sink.applied.values())) == 32)
        finally:
            relay.stop()
            await task
        assert dict(sink.applied) == expected
        lines = [r.getMessage() for r in caplog.records if r.name == "flowdecision.relay"]
        # One line when the outage starts and one when it ends, not one per try.
        assert lines.count("relay's sink looks down: one delivery at a time probes it, "
                           "backing off") == 1  # fmt: skip
        assert lines.count("relay's sink answers again") == 1
        assert lines.count("relay delivery failed; retrying") <= 2, lines


async def test_the_reader_stays_within_its_window_of_the_saved_mark(
    outbox_url: str,  # noqa: F811
) -> None:
    """The redelivery bound: with one run stuck on a transient failure, the reader reads
    at most ``window`` rows past the mark, so a crash could redeliver at most that many."""
    async with OutboxSink(outbox_url) as outbox:
        await _fill(outbox, runs=40, per_run=2)
        sink = EngineSink(delay_s=0.0)
        stuck = "run-000-d000"
        original = sink.submit

        async def submit(request: DecisionRequest, attempt: int) -> None:
            if request.decision_id == stuck:
                raise ConnectionError("this one times out, for now")
            await original(request, attempt)

        sink.submit = submit  # type: ignore[method-assign]
        relay = OutboxRelay(
            outbox, sink, concurrency=4, window=10, retry_cap_s=0.05, idle_wait_s=0.05
        )
        task = asyncio.ensure_future(relay.run())
        try:
            await _until(lambda: len(sink.effects) >= 9)
            await asyncio.sleep(0.3)
            # The mark is stuck below the first row: 9 others delivered, then the reader waits.
            assert len(sink.effects) == 9
            (cursor,) = await outbox.cursors()
            assert cursor.position == 0
        finally:
            relay.stop()
            await task


async def _until(predicate: object, limit_s: float = 30) -> None:
    assert callable(predicate)
    for _ in range(int(limit_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
