"""Quiet, useful logs through an outage: PostgreSQL restarted under load.

``flowdecision serve`` on a PostgreSQL ledger takes a steady stream of POSTs
while the server is stopped (immediate: connections cut), kept down for a few
seconds and started again. The log must say it once when the store goes down,
summarize every ``outage_summary_s`` while it stays down (attempts, duration),
once when it is back; no line per refused request, no driver traceback (those
are for debug level).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.postgres_server import PostgresServer, migrate_postgres, running
from tests.service_process import ServiceProcess, decision

DOWN_S = 3.5


@pytest.fixture
def pg_server() -> Iterator[PostgresServer]:
    with running(PostgresServer(fast=True), "a throwaway PostgreSQL server") as server:
        yield server


def _post(url: str, n: int) -> tuple[int, str | None]:
    body = decision(f"outage-{n}", n=n).to_json()
    req = urllib.request.Request(
        f"{url}/v1/decisions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]["code"]


def _records(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_a_postgres_restart_under_load_logs_start_summaries_and_end_only(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    url = pg_server.url("postgres")
    asyncio.run(migrate_postgres(url))
    answers: list[tuple[int, str | None]] = []
    stop = threading.Event()
    with ServiceProcess(
        tmp_path, "--ledger", url, "--outage-summary-s", "1", "--no-access-log"
    ) as svc:

        def load(lane: int) -> None:
            n = lane * 1_000_000
            while not stop.is_set():
                answers.append(_post(svc.url, n))
                n += 1
                time.sleep(0.01)

        lanes = [threading.Thread(target=load, args=(lane,)) for lane in range(4)]
        for thread in lanes:
            thread.start()
        try:
            time.sleep(1.0)
            before = len(answers)
            pg_server.halt("immediate")
            time.sleep(DOWN_S)
            pg_server.resume()
            # Until the pool has reconnected and answers flow again, then a little more.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                answers and answers[-1][0] == 201 and len(answers) > before + 50
            ):
                time.sleep(0.1)
            time.sleep(1.0)
        finally:
            stop.set()
            for thread in lanes:
                thread.join(60)
        svc.stop()
        log = svc.log_text()
    refused = [a for a in answers if a[0] != 201]
    assert refused, "the outage refused nothing: the test did not test anything"
    assert {a for a in refused} <= {(503, "ledger_unavailable")}, set(refused)
    assert answers[-1][0] == 201
    records = _records(log)
    started = [r for r in records if r["message"] == "store unavailable"]
    summaries = [r for r in records if r["message"] == "store still unavailable"]
    ended = [r for r in records if r["message"] == "store available again"]
    shown = "\n".join(line for line in log.splitlines()[-60:])
    assert len(started) == 1 and started[0]["code"] == "ledger_unavailable", shown
    assert "postgres" in started[0]["store"] and "@" in started[0]["store"]
    # About one a second while down (DOWN_S), plus the reconnection's tail.
    assert 1 <= len(summaries) <= DOWN_S + 6, shown
    assert [s["attempts"] for s in summaries] == sorted(s["attempts"] for s in summaries)
    assert len(ended) == 1 and ended[0]["attempts"] >= len(refused), shown
    assert ended[0]["duration_s"] >= DOWN_S - 1
    # Nothing else above info about it: no line per refused request, no traceback.
    noisy = [
        r
        for r in records
        if r["level"] in ("warning", "error")
        and r["message"] not in ("store unavailable", "store still unavailable")
    ]
    assert not noisy, noisy[:5]
    assert not [r for r in records if "exception" in r], "a traceback was logged"
    assert "Traceback" not in log


def test_an_answer_begun_before_the_outage_does_not_end_it() -> None:
    """A request in flight on a connection the crash had not reached yet may succeed
    just after the first failure: that says nothing about the store now."""
    import logging

    from flowdecision.observability.outage import Outage

    now = [10.0]
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("test.outage.began")
    log.addHandler(Collect())
    log.setLevel(logging.INFO)
    outage = Outage(log, "db", summary_s=60, clock=lambda: now[0])
    began_before = outage.now()
    now[0] = 11.0
    outage.failed("ledger_unavailable", "connection was closed")
    outage.succeeded(began=began_before)
    assert outage.active and records == ["store unavailable"]
    now[0] = 12.0
    outage.succeeded(began=11.5)
    assert not outage.active and records == ["store unavailable", "store available again"]
