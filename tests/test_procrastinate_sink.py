"""ProcrastinateSink against the test PostgreSQL with a real procrastinate worker.

The worker (``App.run_worker_async(wait=False)``) runs every waiting job and
returns; the task appends to ``RUNS`` so a test can count executions.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import procrastinate
import psycopg
import pytest

from flowdecision import DecisionRequest, Dispatcher, FlowDecisionError
from flowdecision.core.model import Complete
from flowdecision.ledger.sqlite import SqliteLedger
from flowdecision.sinks import Sink
from flowdecision.sinks.loader import SinkConfigError, close_sink, open_sink, sink_kind
from flowdecision.sinks.procrastinate import (
    MARKER_TABLE,
    ProcrastinateConflictError,
    ProcrastinateSink,
    ProcrastinateSinkError,
    parse_procrastinate_url,
)
from tests.helpers import request, step_request
from tests.service_process import ROOT, ServiceProcess, decision

TASK = "flowdecision_test.record_decision"
#: (decision id, request_json, attempt) of every job execution, in order.
RUNS: list[tuple[str, str, int]] = []


def worker_app(url: str) -> procrastinate.App:
    """An app whose worker knows the test task (the sink side does not need it)."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name=TASK, queue="decisions")
    async def record_decision(request_json: str, attempt: int) -> None:
        parsed = DecisionRequest.parse(request_json)
        RUNS.append((parsed.decision_id, request_json, attempt))

    return app


async def run_worker(app: procrastinate.App) -> None:
    """Run every waiting job, then return (a real worker, not an in-memory stand-in)."""
    await app.run_worker_async(
        wait=False, install_signal_handlers=False, listen_notify=False, concurrency=1
    )


def engine_url(engine: str, store_url: str, **params: str) -> str:
    """``ENGINE+STORE_URL`` with ``params`` added to the store URL's own query."""
    separator = "&" if "?" in store_url else "?"
    return f"{engine}+{store_url}{separator}{urlencode(params)}"


async def post_through_the_service(
    db: str, tmp_path: Path, sent: DecisionRequest, *, times: int
) -> list[httpx.Response]:
    """POST ``sent`` ``times`` times to a real service whose sink is procrastinate on ``db``."""
    url = engine_url("procrastinate", db, task=TASK)
    with ServiceProcess(
        tmp_path, "--ledger", f"sqlite:///{tmp_path / 'ledger.db'}", "--sink", url
    ) as service:
        async with httpx.AsyncClient(base_url=service.url, headers=service.headers) as client:
            return [
                await client.post("/v1/decisions", content=sent.to_json()) for _ in range(times)
            ]


def runs_of(decision_id: str) -> int:
    return sum(1 for run in RUNS if run[0] == decision_id)


@pytest.fixture
async def db(pg_empty_url: str) -> AsyncIterator[str]:
    """A fresh database with procrastinate's schema applied."""
    RUNS.clear()
    async with worker_app(pg_empty_url).open_async() as app:
        await app.schema_manager.apply_schema_async()
    yield pg_empty_url


@pytest.fixture
async def app(db: str) -> AsyncIterator[procrastinate.App]:
    async with worker_app(db).open_async() as opened:
        yield opened


async def job_rows(url: str, decision_id: str) -> list[tuple[str, str | None, str, str]]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cursor = await conn.execute(
            "SELECT status::text, lock, queue_name, task_name FROM procrastinate_jobs "
            "WHERE queueing_lock = %s ORDER BY id",
            (decision_id,),
        )
        return [tuple(row) for row in await cursor.fetchall()]  # type: ignore[misc]


async def test_plain_queueing_lock_runs_a_late_duplicate_twice(app: procrastinate.App) -> None:
    """The hole the sink closes: queueing_lock dedups only while the job waits."""
    job = app.configure_task(TASK, queueing_lock="d-raw")
    text = request(decision_id="d-raw").to_json().decode()
    await job.defer_async(request_json=text, attempt=1)
    with pytest.raises(procrastinate.exceptions.AlreadyEnqueued):
        await app.configure_task(TASK, queueing_lock="d-raw").defer_async(
            request_json=text, attempt=1
        )
    await run_worker(app)
    await app.configure_task(TASK, queueing_lock="d-raw").defer_async(request_json=text, attempt=2)
    await run_worker(app)
    assert runs_of("d-raw") == 2


async def test_the_task_receives_the_exact_wire_json(app: procrastinate.App) -> None:
    sent = request(decision_id="d-1", decision=Complete(output={"z": 1, "a": [1.5, "é"]}))
    async with ProcrastinateSink(app, TASK) as sink:
        assert isinstance(sink, Sink)
        await sink.submit(sent, 1)
    await run_worker(app)
    assert RUNS == [("d-1", sent.to_json().decode(), 1)]
    assert DecisionRequest.parse(RUNS[0][1]) == sent


async def test_crash_window_resubmission_after_the_job_ran_runs_once(
    app: procrastinate.App, db: str
) -> None:
    """Attempt 2 re-submits what attempt 1 deferred (the ledger never heard back)."""
    sent = request(decision_id="d-crash")
    async with ProcrastinateSink(app, TASK) as sink:
        assert await sink.defer(sent, 1) is True
        await run_worker(app)
        assert await sink.defer(sent, 2) is False  # the job already ran: absorbed
        await sink.submit(sent, 1)  # a stale owner's late delivery: absorbed too
        await run_worker(app)
        deferral = await sink.deferral("d-crash")
    assert runs_of("d-crash") == 1
    assert [row[0] for row in await job_rows(db, "d-crash")] == ["succeeded"]
    assert deferral is not None
    assert (deferral.first_attempt, deferral.highest_attempt) == (1, 2)


async def test_resubmission_while_the_job_waits_is_absorbed(app: procrastinate.App) -> None:
    sent = request(decision_id="d-wait")
    async with ProcrastinateSink(app, TASK) as sink:
        assert await sink.defer(sent, 1) is True
        assert await sink.defer(sent, 2) is False
    await run_worker(app)
    assert runs_of("d-wait") == 1


async def test_decision_dispatched_after_its_job_ran_does_not_run_again(
    app: procrastinate.App, db: str, tmp_path: Path
) -> None:
    """Through the Dispatcher and a real SQLite ledger, including a takeover after a crash."""
    ledger_path = tmp_path / "ledger.db"
    first = request(decision_id="d-disp")
    async with ProcrastinateSink(app, TASK) as sink:
        ledger = SqliteLedger(ledger_path)
        try:
            assert (await Dispatcher("production", sink, ledger).dispatch(first)).submitted is True
            await run_worker(app)
            # A new process on the same ledger: completed, so the sink is not even called.
            assert (await Dispatcher("production", sink, ledger).dispatch(first)).submitted is False
        finally:
            await ledger.close()

        # The crash window: owner A claims and its sink defers, then A dies before
        # completing; after the lease expires owner B takes over (attempt 2).
        # Its own run: d-disp (a complete) closed run-1 (the run invariants).
        crashed = request(decision_id="d-takeover", run_id="run-2")
        ledger = SqliteLedger(ledger_path)
        try:
            from flowdecision import request_hash
            from flowdecision.core.identity import decision_receipt

            identity, _ = decision_receipt(crashed)
            claim = await ledger.claim(
                "d-takeover", request_hash(crashed), "owner-a", lease_ms=1, identity=identity
            )
            await sink.submit(crashed, claim.attempt)  # type: ignore[union-attr]
            await run_worker(app)
            await asyncio.sleep(0.01)  # let the 1 ms lease lapse
            owner_b = Dispatcher("production", sink, ledger, owner_id="owner-b")
            assert (await owner_b.dispatch(crashed)).submitted is True
            assert owner_b.health().takeovers == 1
            deferral = await sink.deferral("d-takeover")
            assert deferral is not None and deferral.highest_attempt == 2
        finally:
            await ledger.close()
    await run_worker(app)
    assert runs_of("d-disp") == 1
    assert runs_of("d-takeover") == 1
    assert len(await job_rows(db, "d-takeover")) == 1


async def test_after_the_ledger_forgot_a_decision_the_marker_still_stops_a_second_job(
    app: procrastinate.App, tmp_path: Path
) -> None:
    """Pruning completed ledger records re-opens submission; the sink still absorbs it."""
    # A step: a pruned `complete` could not come back (its run stays closed).
    sent = step_request("d-pruned")
    async with ProcrastinateSink(app, TASK) as sink:
        ledger = SqliteLedger(tmp_path / "ledger.db")
        try:
            dispatcher = Dispatcher("production", sink, ledger)
            assert (await dispatcher.dispatch(sent)).submitted is True
            await run_worker(app)
            assert await ledger.prune_completed(ledger.now_ms() + 1) == 1
            assert (await dispatcher.dispatch(sent)).submitted is True  # the ledger forgot it
        finally:
            await ledger.close()
    await run_worker(app)
    assert runs_of("d-pruned") == 1


async def test_concurrent_submitters_of_one_id_defer_one_job(
    app: procrastinate.App, db: str
) -> None:
    async with ProcrastinateSink(app, TASK) as one, ProcrastinateSink(app, TASK) as two:
        ids = [f"d-race-{index}" for index in range(20)]
        pairs = ((1, one), (2, two))
        results = await asyncio.gather(
            *(sink.defer(request(decision_id=i), n) for i in ids for n, sink in pairs)
        )
    assert sum(results) == len(ids)
    await run_worker(app)
    assert sorted(run[0] for run in RUNS) == sorted(ids)


async def test_different_content_under_a_deferred_id_is_refused(
    app: procrastinate.App, db: str
) -> None:
    async with ProcrastinateSink(app, TASK) as sink:
        await sink.submit(request(decision_id="d-x"), 1)
        with pytest.raises(ProcrastinateConflictError) as caught:
            await sink.submit(request(decision_id="d-x", decision=Complete(output=1)), 2)
        deferral = await sink.deferral("d-x")
    assert isinstance(caught.value, FlowDecisionError)
    assert "d-x" in str(caught.value)
    assert deferral is not None and deferral.highest_attempt == 1
    assert len(await job_rows(db, "d-x")) == 1


async def test_a_job_deferred_outside_the_sink_is_not_silently_adopted(
    app: procrastinate.App, db: str
) -> None:
    await app.configure_task(TASK, queueing_lock="d-foreign").defer_async(
        request_json="{}", attempt=0
    )
    async with ProcrastinateSink(app, TASK) as sink:
        with pytest.raises(ProcrastinateSinkError, match="already waiting"):
            await sink.submit(request(decision_id="d-foreign"), 1)
        assert await sink.deferral("d-foreign") is None  # rolled back with the insert


async def test_missing_procrastinate_schema_is_a_clear_error(pg_empty_url: str) -> None:
    async with worker_app(pg_empty_url).open_async() as bare:
        with pytest.raises(ProcrastinateSinkError, match="schema is missing"):
            await ProcrastinateSink(bare, TASK).open()


async def test_url_sink_sets_queue_and_run_lock_and_the_worker_runs_it(
    app: procrastinate.App, db: str
) -> None:
    url = engine_url("procrastinate", db, task=TASK, queue="decisions", lock="run")
    assert sink_kind(url) == "procrastinate"
    sink = await open_sink(url)
    try:
        await sink.submit(request(decision_id="d-url", run_id="run-7"), 1)
        await sink.submit(request(decision_id="d-url", run_id="run-7"), 2)
    finally:
        await close_sink(sink)
    assert await job_rows(db, "d-url") == [("todo", "run-7", "decisions", TASK)]
    await run_worker(app)
    assert runs_of("d-url") == 1


def test_url_parsing_keeps_connection_options_and_rejects_bad_urls() -> None:
    parsed = parse_procrastinate_url(
        "procrastinate+postgresql://u@h/db?sslmode=disable&task=m.t&queue=q"
    )
    assert parsed.conninfo == "postgresql://u@h/db?sslmode=disable"
    assert (parsed.task_name, parsed.queue, parsed.lock_by_run) == ("m.t", "q", False)
    for bad, problem in [
        ("procrastinate+postgresql://h/db", "needs ?task=NAME"),
        ("procrastinate+sqlite:///x.db?task=t", "procrastinate+postgresql://"),
        ("procrastinate+postgresql://h/db?task=t&lock=decision", "lock must be `run`"),
        ("procrastinate+postgresql://h/db?task=t&task=u", "sets `task` twice"),
    ]:
        with pytest.raises(SinkConfigError, match=re.escape(problem)):
            parse_procrastinate_url(bad)


def test_engine_packages_stay_optional() -> None:
    """`import flowdecision` (and the sink loader) imports neither engine; a missing
    engine makes its URL fail with the pip extra to install."""
    code = (
        "import sys\n"
        "import flowdecision, flowdecision.sinks, flowdecision.sinks.loader\n"
        "assert 'procrastinate' not in sys.modules and 'dbos' not in sys.modules\n"
        "sys.modules['procrastinate'] = None\n"
        "import asyncio\n"
        "from flowdecision.sinks.loader import SinkConfigError, open_sink\n"
        "try:\n"
        "    asyncio.run(open_sink('procrastinate+postgresql://h/db?task=t'))\n"
        "except SinkConfigError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'flowdecision[procrastinate]'" in done.stdout


async def test_serve_with_a_procrastinate_sink_url(
    app: procrastinate.App, db: str, tmp_path: Path
) -> None:
    """The real service (uvicorn subprocess) submitting into procrastinate."""
    first, again = await post_through_the_service(db, tmp_path, decision("d-serve"), times=2)
    assert (first.status_code, again.status_code) == (201, 200), first.text
    await run_worker(app)
    assert runs_of("d-serve") == 1
    async with await psycopg.AsyncConnection.connect(db) as conn:
        cursor = await conn.execute(f"SELECT count(*) FROM {MARKER_TABLE}")
        assert await cursor.fetchone() == (1,)


async def test_a_procrastinate_conflict_is_a_permanent_409_not_a_retryable_502(
    app: procrastinate.App, db: str, tmp_path: Path
) -> None:
    """The sink deferred d-c with other content (say, before the ledger was replaced):
    a retry can never succeed, so the answer must not say "retrying is safe"."""
    from flowdecision.errors import SinkConflictError

    async with ProcrastinateSink(app, TASK) as sink:
        await sink.submit(request(decision_id="d-c", decision=Complete(output=1)), 1)
        ledger = SqliteLedger(tmp_path / "fresh.db")
        try:
            with pytest.raises(SinkConflictError) as caught:
                await Dispatcher("production", sink, ledger).dispatch(request(decision_id="d-c"))
        finally:
            await ledger.close()
    assert caught.value.code == "sink_conflict" and caught.value.decision_id == "d-c"
    assert isinstance(caught.value.__cause__, ProcrastinateConflictError)

    answers = await post_through_the_service(db, tmp_path, decision("d-c"), times=2)
    for answer in answers:
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "sink_conflict" and error["decision_id"] == "d-c"
        assert "retrying is safe" not in error["message"]
        assert "Retry-After" not in answer.headers


def test_serve_fails_fast_naming_an_unreachable_procrastinate_database(tmp_path: Path) -> None:
    # Nothing listens on port 1: refused at once. Before, serve waited for the pool's
    # 30 s timeout and then said only "unexpected PoolTimeout".
    url = "procrastinate+postgresql://postgres:S3CRETPW@127.0.0.1:1/db?task=m.t"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0",
         "--ledger", "memory:", "--sink", url],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=25,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "procrastinate" in last and "127.0.0.1:1" in last, last
    assert "PoolTimeout" not in done.stderr and "S3CRETPW" not in done.stderr
