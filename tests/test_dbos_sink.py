"""DBOSSink against a real DBOS, on its SQLite system database and on the test PostgreSQL.

DBOS is a process-wide singleton: each test configures and launches it and
destroys it afterwards. Workflows run in this process (tests/dbos_workflows.py).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
from dbos import DBOS

from flowdecision import DecisionRequest, Dispatcher, request_hash
from flowdecision.core.identity import decision_receipt
from flowdecision.ledger.sqlite import SqliteLedger
from flowdecision.sinks import Sink
from flowdecision.sinks.dbos import DBOSSink, DBOSSinkError, parse_dbos_url
from flowdecision.sinks.loader import SinkConfigError, close_sink, open_sink, sink_kind
from tests import dbos_workflows
from tests.dbos_workflows import RUNS, not_async, record_decision
from tests.helpers import request
from tests.service_process import ServiceProcess, decision

WORKFLOW = "tests.dbos_workflows:record_decision"


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def runs_of(decision_id: str) -> int:
    return sum(1 for run in RUNS if run[0] == decision_id)


@pytest.fixture(params=["sqlite", "postgres"])
def system_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A DBOS system database URL: a SQLite file, or a fresh PostgreSQL database."""
    RUNS.clear()
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'dbos.sqlite'}"
    url: str = request.getfixturevalue("pg_empty_url")
    return url


@pytest.fixture
def launched(system_db: str) -> Iterator[str]:
    DBOS(config={"name": "flowdecision-test", "system_database_url": system_db})
    DBOS.launch()
    try:
        yield system_db
    finally:
        DBOS.destroy()


async def finished(workflow_id: str) -> object:
    """Wait for the workflow's result (DBOS polls; a liveness bound, not a timing assert)."""
    handle = await DBOS.retrieve_workflow_async(workflow_id)
    return await asyncio.wait_for(handle.get_result(), timeout=60)


async def test_same_decision_started_again_after_it_ran_runs_once(launched: str) -> None:
    sent = request(decision_id="d-1")
    sink = DBOSSink(record_decision)
    assert isinstance(sink, Sink)
    assert await sink.start(sent, 1) == "d-1"
    assert await finished("d-1") == "d-1"
    assert await sink.start(sent, 2) == "d-1"  # the crash window: attempt 2 re-submits
    await sink.submit(sent, 1)  # a stale owner's late delivery
    assert await finished("d-1") == "d-1"
    assert RUNS == [("d-1", sent.to_json().decode(), 1)]
    assert DecisionRequest.parse(RUNS[0][1]) == sent


async def test_dispatcher_takeover_after_a_crash_runs_the_workflow_once(
    launched: str, tmp_path: Path
) -> None:
    sink = DBOSSink(record_decision)
    crashed = request(decision_id="d-takeover")
    ledger = SqliteLedger(tmp_path / "ledger.db")
    try:
        identity, _ = decision_receipt(crashed)
        claim = await ledger.claim(
            "d-takeover", request_hash(crashed), "owner-a", lease_ms=1, identity=identity
        )
        await sink.submit(crashed, claim.attempt)  # type: ignore[union-attr]
        await finished("d-takeover")
        await asyncio.sleep(0.01)  # let the 1 ms lease lapse
        owner_b = Dispatcher("production", sink, ledger, owner_id="owner-b")
        assert (await owner_b.dispatch(crashed)).submitted is True
        assert owner_b.health().takeovers == 1
        assert (await owner_b.dispatch(crashed)).submitted is False
    finally:
        await ledger.close()
    await finished("d-takeover")
    assert runs_of("d-takeover") == 1


async def test_concurrent_starts_of_one_id_run_once(launched: str) -> None:
    sink = DBOSSink(record_decision)
    ids = [f"d-race-{index}" for index in range(10)]
    await asyncio.gather(*(sink.submit(request(decision_id=i), n) for i in ids for n in (1, 2)))
    for i in ids:
        await finished(i)
    assert sorted(run[0] for run in RUNS) == sorted(ids)


async def test_enqueued_on_a_queue_the_decision_still_runs_once(launched: str) -> None:
    queue = await DBOS.register_queue_async("flowdecision_test_decisions", polling_interval_sec=0.1)
    sink = DBOSSink(record_decision, queue=queue)
    await sink.submit(request(decision_id="d-queued"), 1)
    await sink.submit(request(decision_id="d-queued"), 2)
    assert await finished("d-queued") == "d-queued"
    await sink.submit(request(decision_id="d-queued"), 3)
    status = await DBOS.get_workflow_status_async("d-queued")
    assert status is not None and status.queue_name == "flowdecision_test_decisions"
    assert runs_of("d-queued") == 1


async def test_a_different_workflow_under_a_used_id_is_an_error(launched: str) -> None:
    @DBOS.workflow(name="flowdecision_test_other")
    async def other(request_json: str, attempt: int) -> None:
        pass

    await DBOSSink(record_decision).submit(request(decision_id="d-x"), 1)
    with pytest.raises(DBOSSinkError, match="d-x"):
        await DBOSSink(other).submit(request(decision_id="d-x"), 2)


def test_a_sync_workflow_is_refused() -> None:
    with pytest.raises(DBOSSinkError, match="async workflow"):
        DBOSSink(not_async)  # type: ignore[arg-type]


def dbos_url(system_db: str, **params: str) -> str:
    separator = "&" if "?" in system_db else "?"
    return f"dbos+{system_db}{separator}{urlencode(params)}"


async def test_url_sink_configures_launches_and_destroys_dbos(system_db: str) -> None:
    url = dbos_url(system_db, workflow=WORKFLOW, name="fd-url")
    assert sink_kind(url) == "dbos"
    sink = await open_sink(url)
    try:
        await sink.submit(request(decision_id="d-url"), 1)
        await sink.submit(request(decision_id="d-url"), 2)
        assert await finished("d-url") == "d-url"
    finally:
        await close_sink(sink)
    assert runs_of("d-url") == 1
    # close() destroyed DBOS, so a new configuration on the same store works at once
    # and finds the workflow already there.
    sink = await open_sink(url)
    try:
        await sink.submit(request(decision_id="d-url"), 3)
        assert await finished("d-url") == "d-url"
    finally:
        await close_sink(sink)
    assert runs_of("d-url") == 1


def test_url_parsing_and_bad_urls() -> None:
    parsed = parse_dbos_url("dbos+postgresql://u@h/db?sslmode=disable&workflow=m.n:f")
    assert parsed.system_database_url == "postgresql://u@h/db?sslmode=disable"
    assert (parsed.workflow, parsed.app_name) == ("m.n:f", "flowdecision")
    for bad, problem in [
        ("dbos+sqlite:///x.sqlite", "needs ?workflow=module:function"),
        ("dbos+sqlite:///x.sqlite?workflow=nocolon", "needs ?workflow=module:function"),
        ("dbos+mysql://h/db?workflow=m:f", "must name its system database"),
    ]:
        with pytest.raises(SinkConfigError, match=re.escape(problem)):
            parse_dbos_url(bad)


async def test_url_naming_a_missing_workflow_is_a_clear_error(tmp_path: Path) -> None:
    url = f"dbos+sqlite:///{tmp_path / 'd.sqlite'}?workflow=tests.dbos_workflows:missing"
    with pytest.raises(SinkConfigError, match="has no attribute `missing`"):
        await open_sink(url)


async def test_serve_with_a_dbos_sink_url(tmp_path: Path) -> None:
    """The real service process runs the workflow; its DBOS system database shows it once."""
    system_db = f"sqlite:///{tmp_path / 'dbos.sqlite'}"
    sent = decision("d-serve")
    with ServiceProcess(
        tmp_path,
        "--ledger",
        f"sqlite:///{tmp_path / 'ledger.db'}",
        "--sink",
        dbos_url(system_db, workflow=WORKFLOW),
    ) as service:
        async with httpx.AsyncClient(base_url=service.url, headers=service.headers) as client:
            first = await client.post("/v1/decisions", content=sent.to_json())
            again = await client.post("/v1/decisions", content=sent.to_json())
    assert (first.status_code, again.status_code) == (201, 200), first.text
    # SERVICE.md: everything on stderr is JSON lines, DBOS's own records included.
    lines = [line for line in service.stderr_path.read_text().splitlines() if line.strip()]
    not_json = [line for line in lines if not _is_json_object(line)]
    assert not_json == [], not_json[:5]
    assert any(json.loads(line).get("logger", "").startswith("dbos") for line in lines)
    # The system database holds decision payloads: private, like every other store.
    assert (tmp_path / "dbos.sqlite").stat().st_mode & 0o777 == 0o600
    # Read the service's system database from here, after the service stopped.
    DBOS(config={"name": "flowdecision-reader", "system_database_url": system_db})
    DBOS.launch()
    try:
        workflows = await DBOS.list_workflows_async(workflow_ids=["d-serve"])
        assert [(w.workflow_id, w.status) for w in workflows] == [("d-serve", "SUCCESS")]
    finally:
        DBOS.destroy()


@pytest.fixture(autouse=True)
def _module_is_the_registered_one() -> None:
    # The URL form imports tests.dbos_workflows by name; it must be this very module,
    # or its RUNS would be a different list.
    assert dbos_workflows.RUNS is RUNS
