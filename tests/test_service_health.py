"""``/healthz`` reports a ledger or a sink that stops answering while the service runs:
the probes (``runtime._check``, ``_sink_probe``), not a failed dispatch, turn it to 503,
and it turns back to 200 once the store or the engine answers again. Real
``flowdecision serve`` processes, real SQLite files, real HTTP."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowdecision.service.runtime import PROBE_TIMEOUT_S, PROBE_TTL_S
from tests.service_process import ServiceProcess, decision, wait_for
from tests.webhook_receiver import WebhookReceiver

OK = {"status": "ok", "code": None}


def _until_status(client: httpx.Client, status: int) -> httpx.Response:
    """Poll ``/healthz`` until it answers ``status`` (probe results live ~1 s; a hung
    probe takes its timeout), and return that answer."""
    last: list[httpx.Response] = []

    def reached() -> bool:
        last[:] = [client.get("/healthz")]
        return last[0].status_code == status

    wait_for(reached, timeout=30, interval=0.1)
    return last[0]


def _log_records(service: ServiceProcess, message: str) -> list[dict[str, Any]]:
    records = []
    for line in service.log_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if record.get("message") == message:
                records.append(record)
    return records


@contextlib.contextmanager
def _table_moved_away(db: Path, table: str) -> Iterator[None]:
    """Rename ``table`` from another connection, then back.

    The service keeps its connection open, so removing or overwriting the file
    would not reach it (it reads the open inode and its page cache), and root
    ignores file modes. A renamed table fails every read of the running service
    at once, and renaming it back restores it with its rows.
    """
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
        conn.commit()
    try:
        yield
    finally:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
            conn.commit()


@pytest.mark.parametrize(
    ("broken", "db_name", "table", "code"),
    [
        ("sink", "outbox.db", "flow_decision_outbox", "outbox_schema"),
        ("ledger", "ledger.db", "flowdecision_claims", "ledger_schema"),
    ],
)
def test_a_store_that_stops_answering_turns_healthz_to_503_and_back(
    tmp_path: Path, broken: str, db_name: str, table: str, code: str
) -> None:
    ledger_db = tmp_path / "ledger" / "ledger.db"
    outbox_db = tmp_path / "outbox" / "outbox.db"  # a separate file: the sink is probed alone
    db = {"ledger.db": ledger_db, "outbox.db": outbox_db}[db_name]
    other = "ledger" if broken == "sink" else "sink"
    with (
        ServiceProcess(
            tmp_path, "--ledger", f"sqlite:///{ledger_db}", "--sink", f"sqlite:///{outbox_db}"
        ) as svc,
        httpx.Client(base_url=svc.url, headers=svc.headers) as client,
    ):
        assert client.post("/v1/decisions", content=decision().to_json()).status_code == 201
        healthy = client.get("/healthz")
        assert healthy.status_code == 200, healthy.text
        # The outbox is probed (a read), unlike a webhook ("not_probed").
        checks = healthy.json()["checks"]
        assert checks["ledger"] == OK and checks["sink"] == OK

        with _table_moved_away(db, table):
            degraded = _until_status(client, 503)
            body = degraded.json()
            assert body["status"] == "degraded" and body["reason"] == code
            assert body["checks"][broken] == {"status": "failed", "code": code}
            assert body["checks"][other] == OK
            # No dispatch failed: the probe alone found it.
            assert body["attempted"] == 1
            assert body["sink_failures"] == 0 and body["ledger_failures"] == 0
            assert str(tmp_path) not in degraded.text
            assert "flowdecision_healthy 0.0" in client.get("/metrics").text
            [record, *_] = _log_records(svc, f"{broken} probe failed")
            assert record["code"] == code and table in record["cause"]

        recovered = _until_status(client, 200)
        assert recovered.json()["status"] == "healthy" and recovered.json()["reason"] is None
        assert recovered.json()["checks"][broken] == OK
        assert client.post("/v1/decisions", content=decision().to_json()).status_code == 201


def test_a_custom_sink_whose_probe_fails_or_hangs_turns_healthz_to_503(tmp_path: Path) -> None:
    fails, hangs = tmp_path / "probe-fails", tmp_path / "probe-hangs"
    with (
        ServiceProcess(
            tmp_path,
            "--sink",
            "python:tests.service_sinks:ProbedSink",
            env={"FLOWDECISION_TEST_DIR": str(tmp_path)},
        ) as svc,
        httpx.Client(base_url=svc.url, headers=svc.headers, timeout=30) as client,
    ):
        healthy = client.get("/healthz")
        assert healthy.status_code == 200, healthy.text
        assert healthy.json()["checks"]["sink"] == OK
        assert (tmp_path / "probes").exists()  # its probe() was called

        fails.touch()  # the engine refuses
        degraded = _until_status(client, 503)
        body = degraded.json()
        assert body["reason"] == "sink_unavailable"
        assert body["checks"]["sink"] == {"status": "failed", "code": "sink_unavailable"}
        assert body["checks"]["ledger"] == OK
        assert body["attempted"] == 0 and body["sink_failures"] == 0
        assert "private.sock" not in degraded.text  # the cause goes to the log only
        [record, *_] = _log_records(svc, "sink probe failed")
        assert "private.sock" in record["cause"]
        fails.unlink()
        assert _until_status(client, 200).json()["checks"]["sink"] == OK

        hangs.touch()  # the engine never answers: the probe's timeout decides
        degraded = _until_status(client, 503)
        assert degraded.json()["reason"] == "sink_unavailable"
        assert degraded.json()["checks"]["sink"] == {"status": "failed", "code": "sink_unavailable"}
        [record, *_] = _log_records(svc, "sink probe timed out")
        assert record["timeout_s"] == PROBE_TIMEOUT_S
        # Submissions do not wait for the probe.
        assert client.post("/v1/decisions", content=decision().to_json()).status_code == 201
        hangs.unlink()
        assert _until_status(client, 200).json()["checks"]["sink"] == OK


def test_a_webhook_sink_is_never_probed(tmp_path: Path) -> None:
    with (
        WebhookReceiver([(202, {})]) as engine,
        ServiceProcess(tmp_path, "--sink", engine.url) as svc,
        httpx.Client(base_url=svc.url, headers=svc.headers) as client,
    ):
        for _ in range(2):
            time.sleep(PROBE_TTL_S + 0.1)  # past the cached result: the next call probes again
            health = client.get("/healthz")
            assert health.status_code == 200, health.text
            assert health.json()["checks"]["sink"] == {"status": "ok", "code": "not_probed"}
            assert client.get("/").status_code == 200  # the status page checks health too
        assert engine.requests == []  # a probe request would be a side effect on the engine

        assert client.post("/v1/decisions", content=decision().to_json()).status_code == 201
        time.sleep(PROBE_TTL_S + 0.1)
        assert client.get("/healthz").status_code == 200
        assert len(engine.requests) == 1  # only the decision itself
