"""The service against careless and hostile clients (issue 9): honest health, errors
to the right side, busy without client loops, shutdown past the grace period and
clients that vanish mid-body. Real `flowdecision serve` processes over real HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.datastructures import Headers

from flowdecision import Dispatcher, SqliteLedger
from flowdecision.core.dispatcher import ERROR_CLASSES
from flowdecision.errors import DispatchError, FlowDecisionError, LedgerError
from flowdecision.service.errors import HTTP_ERRORS
from flowdecision.service.handlers import preferred_wait_s
from tests.helpers import ControlledSink
from tests.service_process import ServiceProcess, decision, wait_for

JSON = {"Content-Type": "application/json"}


def _log_records(service: ServiceProcess) -> list[dict[str, Any]]:
    records = []
    for line in service.log_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            records.append({"level": "raw", "message": line})
    return records


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def test_every_error_code_has_one_http_answer_and_one_health_row() -> None:
    for cls in _subclasses(DispatchError):
        assert cls.code in HTTP_ERRORS, f"{cls.__name__} ({cls.code}) has no HTTP row"
        assert cls.code in ERROR_CLASSES, f"{cls.__name__} ({cls.code}) has no health row"
    for cls in [LedgerError, *_subclasses(LedgerError)]:
        # A ledger error is answered by its own row or, as classify() does, its parent's.
        codes = [vars(k)["code"] for k in cls.__mro__ if "code" in vars(k)]
        assert any(code in HTTP_ERRORS for code in codes), f"{cls.__name__} has no HTTP row"
    for code, row in HTTP_ERRORS.items():
        if row.status >= 500:  # failures of the service: a fixed message, never the cause
            assert row.message, code
    assert issubclass(DispatchError, FlowDecisionError)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("wait=10", 10),
        ("respond-async, wait=5", 5),
        ('wait="7"', 7),
        ("wait=600", 30),
        ("wait=0", None),
        ("wait=soon", None),
        ("wait=\u00b2", None),
        ("return=minimal", None),
    ],
)
def test_prefer_wait_is_parsed_and_bounded(value: str, expected: int | None) -> None:
    assert preferred_wait_s(Headers({"prefer": value})) == expected


# -- errors to the right side -------------------------------------------------------


def test_sink_errors_reach_the_log_with_ids_not_the_client(tmp_path: Path) -> None:
    with (
        ServiceProcess(tmp_path, "--sink", "python:tests.service_sinks:SecretFailingSink") as svc,
        httpx.Client(base_url=svc.url, headers=svc.headers) as client,
    ):
        request = decision()
        failed = client.post(
            "/v1/decisions",
            content=request.to_json(),
            headers={**JSON, "X-Request-Id": "client-req-0001"},
        )
        assert failed.status_code == 502
        error = failed.json()["error"]
        assert error["code"] == "sink_failed"
        assert error["request_id"] == failed.headers["X-Request-Id"] == "client-req-0001"
        for secret in ("SECRET", "private.sock", "db.internal", "RuntimeError", "5432"):
            assert secret not in failed.text

        unsafe = client.post(
            "/v1/decisions",
            content=request.to_json(),
            headers={**JSON, "X-Request-Id": "caf\u00e9-id".encode()},  # non-ASCII bytes
        )
        assert unsafe.headers["X-Request-Id"].isalnum()  # replaced by a fresh id
        assert unsafe.json()["error"]["request_id"] == unsafe.headers["X-Request-Id"]

        def logged() -> list[dict[str, Any]]:
            return [r for r in _log_records(svc) if r.get("message") == "request failed"]

        wait_for(logged)
        [record, *_rest] = logged()
        assert record["request_id"] == "client-req-0001"
        assert record["decision_id"] == request.decision_id
        assert record["error"] == "SinkError" and record["code"] == "sink_failed"
        assert "sk-live-SECRET-42" in record["cause"]  # the operator sees the cause
        assert record["level"] == "warning"


def test_a_failing_sink_degrades_health_over_the_window(tmp_path: Path) -> None:
    with (
        ServiceProcess(tmp_path, "--sink", "python:tests.service_sinks:SecretFailingSink") as svc,
        httpx.Client(base_url=svc.url, headers=svc.headers) as client,
    ):
        for count in range(1, 11):
            assert client.post("/v1/decisions", content=decision().to_json()).status_code == 502
            health = client.get("/healthz")
            if count < 10:  # below the minimum sample: no verdict from the rate yet
                assert health.status_code == 200, (count, health.text)
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "degraded" and body["reason"] == "error_rate"
        rate = body["checks"]["error_rate"]
        assert rate["dispatches"] == 10 and rate["failures"] == 10
        assert rate["window_s"] == 60 and rate["min_dispatches"] == 10
        scrape = _samples(client.get("/metrics").text)
        assert scrape[("flowdecision_healthy", ())] == 0


def test_a_service_started_on_a_corrupt_ledger_is_not_ready(tmp_path: Path) -> None:
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    (ledger_dir / "flow-decisions.json").write_text("garbage{")
    with (
        ServiceProcess(tmp_path, "--ledger", f"file://{ledger_dir}") as svc,
        httpx.Client(base_url=svc.url, headers=svc.headers) as client,
    ):
        health = client.get("/healthz")  # before any decision
        assert health.status_code == 503
        assert health.json()["reason"] == "ledger_corrupt"
        assert health.json()["attempted"] == 0
        failed = client.post("/v1/decisions", content=decision().to_json())
        assert failed.status_code == 503
        assert failed.json()["error"]["code"] == "ledger_corrupt"
        assert "Retry-After" not in failed.headers  # permanent: an operator must act
        assert str(ledger_dir) not in failed.text and "decode" not in failed.text
        assert "Retry-After" not in client.get("/v1/decisions/x").headers
        startup = [
            r for r in _log_records(svc) if r.get("message", "").startswith("ledger check failed")
        ]
        assert startup and startup[0]["level"] == "error"
        assert startup[0]["code"] == "ledger_corrupt"


# -- busy without client loops ---------------------------------------------------------


async def test_prefer_wait_returns_the_other_owners_answer(tmp_path: Path) -> None:
    db = tmp_path / ".flowdecision" / "flowdecision.db"
    with ServiceProcess(tmp_path, "--lease-ms", "3000") as svc:
        # Another replica (a dispatcher in this process, same SQLite ledger) is
        # submitting the decision and its sink is slow.
        ledger = SqliteLedger(db)
        sink = ControlledSink()
        other = Dispatcher("production", sink, ledger, lease_ms=60_000)
        request = decision()
        owner = asyncio.create_task(other.dispatch(request))
        try:
            await asyncio.wait_for(sink.started.wait(), 30)
            async with httpx.AsyncClient(
                base_url=svc.url, headers=svc.headers, timeout=60
            ) as client:
                busy = await client.post("/v1/decisions", content=request.to_json())
                assert busy.status_code == 409
                # The owner may finish any time: ask again after at most one
                # heartbeat period (lease 3 s -> 1 s), not after its 60 s lease.
                assert busy.headers["Retry-After"] == "1"

                timed_out = await client.post(
                    "/v1/decisions",
                    content=request.to_json(),
                    headers={**JSON, "Prefer": "wait=1"},
                )
                assert timed_out.status_code == 409  # still busy after waiting 1 s
                assert timed_out.headers["Preference-Applied"] == "wait=1"

                waiting = asyncio.create_task(
                    client.post(
                        "/v1/decisions",
                        content=request.to_json(),
                        headers={**JSON, "Prefer": "wait=20"},
                    )
                )
                await asyncio.sleep(0.5)
                assert not waiting.done()
                sink.finish.set()
                submitted = await owner
                answer = await asyncio.wait_for(waiting, 30)
            assert answer.status_code == 200, answer.text
            assert answer.headers["Preference-Applied"] == "wait=20"
            assert answer.json() == {**submitted.to_dict(), "outcome": "duplicate"}
            assert sink.calls == 1
        finally:
            sink.finish.set()
            await asyncio.gather(owner, return_exceptions=True)
            await ledger.close()


# -- shutdown past the grace period ----------------------------------------------------


async def test_requests_open_past_the_grace_period_get_json_503(tmp_path: Path) -> None:
    svc = ServiceProcess(
        tmp_path,
        "--sink",
        "python:tests.service_sinks:SlowSink",
        "--shutdown-grace-s",
        "0.3",
        env={"FLOWDECISION_TEST_DIR": str(tmp_path)},
    )
    entered = tmp_path / "entered"
    try:
        requests = [decision(f"dec-slow-{i:02d}") for i in range(20)]
        async with httpx.AsyncClient(
            base_url=svc.url,
            headers=svc.headers,
            timeout=60,
            limits=httpx.Limits(max_connections=40),
        ) as client:
            posts = [
                asyncio.create_task(client.post("/v1/decisions", content=r.to_json()))
                for r in requests
            ]

            def all_in_flight() -> bool:
                return entered.exists() and len(entered.read_text().split()) == 20

            await asyncio.to_thread(wait_for, all_in_flight)
            svc.terminate()
            responses = await asyncio.gather(*posts)
        assert await asyncio.to_thread(svc.wait) == 0
    finally:
        svc.stop()
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {201, 503}, statuses
    assert 503 in statuses  # the slowest sinks take 1.5 s, far past the 0.3 s grace
    for response in responses:
        if response.status_code == 503:
            error = response.json()["error"]
            assert error["code"] == "shutting_down"
            assert error["request_id"] == response.headers["X-Request-Id"]
    text = svc.log_text()
    assert "Traceback" not in text
    assert "Exception in ASGI application" not in text
    assert not [r for r in _log_records(svc) if r["level"] in ("error", "critical", "raw")]


# -- a client that vanishes mid-body ---------------------------------------------------


def test_a_client_that_disconnects_mid_body_is_a_499_not_an_error(tmp_path: Path) -> None:
    with (
        ServiceProcess(tmp_path) as svc,
        httpx.Client(base_url=svc.url, headers=svc.headers) as client,
    ):
        host, port = svc.url.removeprefix("http://").rsplit(":", 1)
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                raw.sendall(
                    b"POST /v1/decisions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                    b'{"decision_id":'
                )

        def counted() -> bool:
            scrape = _samples(client.get("/metrics").text)
            key = (
                "flowdecision_http_requests_total",
                (("method", "POST"), ("route", "/v1/decisions"), ("status", "499")),
            )
            return scrape.get(key) == 3

        wait_for(counted)
        scrape = _samples(client.get("/metrics").text)
        assert not any(
            name == "flowdecision_http_requests_total" and ("status", "500") in labels
            for name, labels in scrape
        )
        assert client.get("/healthz").status_code == 200
        records = _log_records(svc)
        assert not [r for r in records if r["level"] in ("error", "critical", "raw")]
        access = [r for r in records if r.get("event") == "http_request" and r["status"] == 499]
        assert len(access) == 3
