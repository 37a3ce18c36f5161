"""The decision service through the real thing: `flowdecision serve` as a subprocess
(uvicorn on a random port), called over HTTP with httpx."""

from __future__ import annotations

import asyncio
import base64
import json
import shlex
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from flowdecision.cli import cli
from flowdecision.core.identity import decision_receipt
from flowdecision.core.model import DecisionRequest, request_hash
from flowdecision.ledger import Completed, Pending, open_ledger
from tests.service_process import ServiceProcess, decision, wait_for
from tests.webhook_receiver import WebhookReceiver

TOKEN = "test-token-7f3a9c"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The default configuration (SQLite ledger + SQLite outbox in the cwd), with a token."""
    cwd = tmp_path_factory.mktemp("service")
    with ServiceProcess(cwd, token=TOKEN) as proc:
        yield proc


@pytest.fixture
async def client(service: ServiceProcess) -> Any:
    async with httpx.AsyncClient(base_url=service.url, headers=service.headers) as http:
        yield http


async def _post(client: httpx.AsyncClient, request: DecisionRequest) -> httpx.Response:
    return await client.post(
        "/v1/decisions", content=request.to_json(), headers={"Content-Type": "application/json"}
    )


def _no_secrets(text: str) -> None:
    assert TOKEN not in text
    assert "decision-dispatcher-" not in text  # the dispatcher's owner id prefix
    assert "owner" not in text


# -- startup ----------------------------------------------------------------------------


def test_startup_prints_the_url_and_a_working_curl(service: ServiceProcess) -> None:
    assert service.url.startswith("http://127.0.0.1:")
    [curl] = [line.strip() for line in service.stdout_lines if line.strip().startswith("curl ")]
    assert "$FLOWDECISION_TOKEN" in curl
    command = shlex.split(curl.replace("$FLOWDECISION_TOKEN", TOKEN))
    done = subprocess.run([*command, "-w", "\n%{http_code}"], capture_output=True, text=True,
                          timeout=30, check=True)  # fmt: skip
    body, status = done.stdout.rsplit("\n", 1)
    assert status in ("201", "200")  # 200 if the example was already submitted
    assert json.loads(body)["decision_id"] == "dec-example-1"


# -- POST /v1/decisions -----------------------------------------------------------------


async def test_201_then_200_duplicate_with_the_stored_receipt(
    client: httpx.AsyncClient,
) -> None:
    request = decision()
    first = await _post(client, request)
    assert first.status_code == 201, first.text
    body = first.json()
    _identity, receipt = decision_receipt(request)
    assert body == {
        "outcome": "submitted",
        "decision_id": request.decision_id,
        "attempt": 1,
        "receipt": receipt.to_dict(),
    }
    again = await _post(client, request)
    assert again.status_code == 200
    assert again.json() == {**body, "outcome": "duplicate"}

    state = await client.get(f"/v1/decisions/{request.decision_id}")
    assert state.status_code == 200
    got = state.json()
    assert got["state"] == "completed"
    assert got["attempts"] == 1
    assert got["request_hash"] == request_hash(request)
    assert got["receipt"] == receipt.to_dict()
    assert isinstance(got["completed_at_ms"], int)
    _no_secrets(state.text + first.text + again.text)


async def test_403_for_a_branch_that_is_not_production(client: httpx.AsyncClient) -> None:
    request = decision(branch="feature-fork")
    response = await _post(client, request)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "forbidden_branch"
    assert error["branch"] == "feature-fork"
    assert error["expected_branch"] == "production"
    assert (await client.get(f"/v1/decisions/{request.decision_id}")).status_code == 404


async def test_409_conflict_for_a_reused_id_with_different_content(
    client: httpx.AsyncClient,
) -> None:
    original = decision(n=1)
    assert (await _post(client, original)).status_code == 201
    response = await _post(client, decision(original.decision_id, n=2))
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "conflict"
    assert "Retry-After" not in response.headers


async def test_409_busy_with_retry_after_from_the_lease(
    service: ServiceProcess, client: httpx.AsyncClient
) -> None:
    request = decision()
    identity, _receipt = decision_receipt(request)
    # Another replica sharing the ledger holds a live lease on this decision.
    ledger = await open_ledger(f"sqlite:///{service.cwd / '.flowdecision' / 'flowdecision.db'}")
    try:
        await ledger.claim(
            request.decision_id,
            request_hash(request),
            "replica-b-owner",
            lease_ms=60_000,
            identity=identity,
        )
        state = await ledger.inspect(request.decision_id, request_hash(request))
    finally:
        await ledger.close()
    assert isinstance(state, Pending)

    response = await _post(client, request)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "busy"
    assert error["lease_expires_at_ms"] == state.lease_expires_at_ms
    retry_after = int(response.headers["Retry-After"])
    # Bounded by the heartbeat period (a third of the 30 s lease), not the 60 s lease:
    # the owner may finish long before its lease would expire.
    assert 1 <= retry_after <= 10
    assert error["retry_after_s"] == retry_after

    pending = await client.get(f"/v1/decisions/{request.decision_id}")
    assert pending.json()["state"] == "pending"
    assert pending.json()["lease_expires_at_ms"] == state.lease_expires_at_ms
    assert pending.json()["receipt"] is None
    assert "replica-b-owner" not in pending.text
    _no_secrets(pending.text)


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        (b"{not json", "", "line 1 column 2"),
        (b"[]", "", "sequence"),
        (b'{"decision_id":"d","run_id":"r","authority_branch_id":"production"}',
         "causation_event_id", "missing field `causation_event_id`"),
        (b'{"decision_id":"d","run_id":"r","authority_branch_id":"production",'
         b'"causation_event_id":"e","decision":{"type":"schedule_step","step":{"step_id":"s",'
         b'"step_name":"n","input":null,"retry":{"max_attempts":-1,"delay_ms":0}}}}',
         "decision.step.retry.max_attempts", "invalid value: integer `-1`"),
        (b'{"decision_id":"d","run_id":"r","authority_branch_id":"production",'
         b'"causation_event_id":"e","decision":{"type":"explode"}}',
         "decision.type", "unknown variant `explode`"),
        (b'{"decision_id":"  ","run_id":"r","authority_branch_id":"production",'
         b'"causation_event_id":"e","decision":{"type":"fail","error":"x"}}',
         "decision_id", "non-empty"),
    ],
)  # fmt: skip
async def test_422_names_the_field(
    client: httpx.AsyncClient, body: bytes, field: str, problem: str
) -> None:
    response = await client.post("/v1/decisions", content=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["field"] == field
    assert problem in error["problem"]
    assert error["fields"] == [{"field": field, "problem": error["problem"]}]


async def test_413_over_the_size_limit(client: httpx.AsyncClient) -> None:
    big = b'{"pad":"' + b"x" * (2 * 1024 * 1024) + b'"}'
    declared = await client.post("/v1/decisions", content=big)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "payload_too_large"
    assert declared.json()["error"]["limit_bytes"] == 2 * 1024 * 1024

    async def chunks() -> Any:  # no Content-Length: the limit applies while reading
        for start in range(0, len(big), 65536):
            yield big[start : start + 65536]

    streamed = await client.post("/v1/decisions", content=chunks())
    assert streamed.status_code == 413


async def test_413_for_a_decision_over_the_receipt_limit(client: httpx.AsyncClient) -> None:
    request = DecisionRequest.parse(
        {
            "decision_id": f"dec-{uuid.uuid4().hex[:8]}",
            "run_id": "r",
            "authority_branch_id": "production",
            "causation_event_id": "e",
            "decision": {"type": "complete", "output": {"blob": "y" * (1024 * 1024 + 1)}},
        }
    )
    response = await _post(client, request)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "decision_too_large"


# -- auth -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Token {TOKEN}"},
        {"Authorization": "Basic !!!"},
    ],
)
async def test_401_without_a_valid_token(service: ServiceProcess, headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=service.url, headers=headers) as anonymous:
        for method, path in [
            ("POST", "/v1/decisions"),
            ("GET", "/v1/decisions/x"),
            ("GET", "/v1/outbox"),
            ("GET", "/metrics"),
            ("GET", "/"),
            ("GET", "/no-such-page"),
        ]:
            response = await anonymous.request(method, path, content=decision().to_json())
            assert response.status_code == 401, (method, path)
            assert response.json()["error"]["code"] == "unauthorized"
            assert "Bearer" in ", ".join(response.headers.get_list("WWW-Authenticate"))
        assert (await anonymous.get("/healthz")).status_code in (200, 503)  # public


async def test_basic_auth_with_the_token_as_password_opens_the_status_page(
    service: ServiceProcess,
) -> None:
    credentials = base64.b64encode(f"operator:{TOKEN}".encode()).decode()
    async with httpx.AsyncClient(base_url=service.url) as browser:
        page = await browser.get("/", headers={"Authorization": f"Basic {credentials}"})
    assert page.status_code == 200
    assert "text/html" in page.headers["Content-Type"]


# -- reads ------------------------------------------------------------------------------


async def test_get_an_unknown_decision_is_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/decisions/never-submitted")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "code": "not_found",
            "message": "no claim for decision `never-submitted`",
            "decision_id": "never-submitted",
            "request_id": response.headers["X-Request-Id"],
        }
    }


async def test_healthz_and_metrics_agree(client: httpx.AsyncClient) -> None:
    assert (await _post(client, decision())).status_code == 201
    health = await client.get("/healthz")
    assert health.status_code == 200
    snapshot = health.json()
    assert snapshot["status"] == "healthy"

    scrape = await client.get("/metrics")
    assert scrape.status_code == 200
    assert scrape.headers["Content-Type"].startswith("text/plain")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(scrape.text)
        for sample in family.samples
    }
    for name in ("attempted", "claimed", "completed", "duplicates", "busy", "conflicts",
                 "rejected", "lease_renewals", "lease_lost", "sink_failures", "ledger_failures",
                 "failures", "cancellations", "takeovers"):  # fmt: skip
        assert samples[(f"flowdecision_dispatch_{name}_total", ())] == snapshot[name], name
    assert samples[("flowdecision_dispatch_in_flight", ())] == 0
    assert samples[("flowdecision_healthy", ())] == 1
    submitted = samples[
        ("flowdecision_dispatch_duration_seconds_count", (("outcome", "submitted"),))
    ]
    assert submitted == snapshot["completed"]
    assert (
        samples[
            (
                "flowdecision_dispatch_duration_seconds_bucket",
                (("le", "+Inf"), ("outcome", "submitted")),
            )
        ]
        == submitted
    )
    posts = samples[
        ("flowdecision_http_requests_total",
         (("method", "POST"), ("route", "/v1/decisions"), ("status", "201")))
    ]  # fmt: skip
    assert posts >= 1


async def test_outbox_pages_in_order(client: httpx.AsyncClient) -> None:
    requests = [decision(run_id="run-outbox", n=i) for i in range(5)]
    for request in requests:
        assert (await _post(client, request)).status_code == 201

    seen: list[dict[str, Any]] = []
    after, pages = 0, 0
    while True:
        page = await client.get("/v1/outbox", params={"after": after, "limit": 2})
        assert page.status_code == 200
        body = page.json()
        assert len(body["entries"]) <= 2
        seen += body["entries"]
        pages += 1
        if not body["has_more"]:
            break
        after = body["next_after"]
        assert after == body["entries"][-1]["seq"]
    assert pages >= 3
    seqs = [entry["seq"] for entry in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    ours = [entry for entry in seen if entry["decision_id"] in {r.decision_id for r in requests}]
    assert [entry["decision_id"] for entry in ours] == [r.decision_id for r in requests]
    for entry, request in zip(ours, requests, strict=True):
        assert DecisionRequest.parse(json.dumps(entry["request"])) == request
        assert entry["request_hash"] == request_hash(request)
        assert entry["first_attempt"] == entry["highest_attempt"] == 1
    last = await client.get("/v1/outbox", params={"after": seqs[-1]})
    assert last.json() == {"entries": [], "next_after": seqs[-1], "has_more": False}

    bad = await client.get("/v1/outbox", params={"limit": "0"})
    assert bad.status_code == 422
    assert bad.json()["error"]["field"] == "limit"


def test_outbox_tail_cli_reads_the_same_rows(service: ServiceProcess) -> None:
    url = f"sqlite:///{service.cwd / '.flowdecision' / 'flowdecision.db'}"
    result = CliRunner().invoke(cli, ["outbox", "tail", "--sink", url, "--json", "--limit", "3"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [row["seq"] for row in rows] == sorted(row["seq"] for row in rows)
    assert 1 <= len(rows) <= 3
    after = rows[-1]["seq"]
    rest = CliRunner().invoke(cli, ["outbox", "tail", "--sink", url, "--after", str(after)])
    assert rest.exit_code == 0
    assert "decision_id" in rest.output  # the table header
    wrong = CliRunner().invoke(cli, ["outbox", "tail", "--sink", "https://engine.example/"])
    assert wrong.exit_code == 2


def test_access_log_is_structured_and_leaks_no_secrets(service: ServiceProcess) -> None:
    text = service.log_text()
    _no_secrets(text)
    access = [json.loads(line) for line in text.splitlines() if '"http_request"' in line]
    assert access
    assert {"method", "path", "route", "status", "duration_ms", "request_id"} <= set(access[0])
    assert any(entry["status"] == 401 for entry in access)


# -- failures: a sink that fails (502) and a ledger that fails (503) ------------------


def test_502_when_the_sink_fails_then_a_retry_succeeds(tmp_path: Path) -> None:
    with (
        WebhookReceiver([(400, {})]) as engine,
        ServiceProcess(tmp_path, "--sink", engine.url, "--webhook-max-attempts", "2") as service,
        httpx.Client(base_url=service.url, headers=service.headers) as client,
    ):
        request = decision()
        failed = client.post("/v1/decisions", content=request.to_json())
        assert failed.status_code == 502
        assert failed.json()["error"]["code"] == "sink_failed"
        assert "HTTP 400" not in failed.text  # the sink's detail goes to the log only
        # One failure caused by one bad decision is not a degraded service.
        health = client.get("/healthz")
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "healthy"
        assert health.json()["sink_failures"] == 1
        assert health.json()["checks"]["sink"] == {"status": "ok", "code": "not_probed"}
        no_outbox = client.get("/v1/outbox")
        assert no_outbox.json()["error"]["code"] == "no_outbox"
        assert engine.url not in no_outbox.text  # no internal host to the client

        engine.set_script([(202, {})])
        retried = client.post("/v1/decisions", content=request.to_json())
        assert retried.status_code == 201
        assert retried.json()["attempt"] == 2  # the failed claim was released
        assert client.get("/healthz").status_code == 200
        assert [r[1]["X-Flow-Attempt"] for r in engine.requests] == ["1", "2"]
        assert {r[1]["Idempotency-Key"] for r in engine.requests} == {request.decision_id}
        page = client.get("/").text
        assert "sink_failed" in page and request.decision_id in page


def test_503_when_the_ledger_fails(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with (
        ServiceProcess(tmp_path, "--ledger", f"sqlite:///{db}") as service,
        httpx.Client(base_url=service.url, headers=service.headers) as client,
    ):
        assert client.post("/v1/decisions", content=decision().to_json()).status_code == 201
        with sqlite3.connect(db) as conn:  # the store breaks under the running service
            conn.execute("DROP TABLE flowdecision_claims")
        failed = client.post("/v1/decisions", content=decision().to_json())
        assert failed.status_code == 503
        # A missing table is a schema problem: permanent, so no Retry-After.
        assert failed.json()["error"]["code"] == "ledger_schema"
        assert "Retry-After" not in failed.headers
        assert str(tmp_path) not in failed.text and "sqlite" not in failed.text.lower()
        assert client.get("/v1/decisions/anything").status_code == 503
        health = client.get("/healthz")
        assert health.status_code == 503
        assert health.json()["ledger_failures"] == 1
        assert health.json()["reason"] == "ledger_schema"
        assert health.json()["checks"]["ledger"] == {"status": "failed", "code": "ledger_schema"}


def test_serve_refuses_a_bad_sink_url_with_exit_code_1(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="unsupported sink URL scheme `ftp`"):
        ServiceProcess(tmp_path, "--sink", "ftp://example/")


# -- graceful shutdown ------------------------------------------------------------------


async def test_sigterm_lets_the_in_flight_dispatch_finish(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    service = ServiceProcess(
        tmp_path,
        "--sink",
        "python:tests.service_sinks:make_gate_sink",
        env={"FLOWDECISION_TEST_GATE": str(gate)},
    )
    try:
        request = decision()
        async with httpx.AsyncClient(base_url=service.url, timeout=60) as client:
            in_flight = asyncio.create_task(_post(client, request))
            while not Path(f"{gate}.entered").exists():
                assert not in_flight.done(), in_flight
                await asyncio.sleep(0.02)
            service.terminate()

            def refused() -> bool:
                try:
                    httpx.get(f"{service.url}/healthz", timeout=1)
                except httpx.TransportError:
                    return True
                return False

            await asyncio.to_thread(wait_for, refused)  # no longer accepting
            assert not in_flight.done()
            gate.touch()
            response = await in_flight
        assert response.status_code == 201
        assert await asyncio.to_thread(service.wait) == 0
    finally:
        service.stop()
    assert Path(f"{gate}.accepted").read_text() == f"{request.decision_id} 1\n"
    ledger = await open_ledger(f"sqlite:///{tmp_path / '.flowdecision' / 'flowdecision.db'}")
    try:
        entry = await ledger.lookup(request.decision_id)
    finally:
        await ledger.close()
    assert entry is not None and isinstance(entry.state, Completed)


# -- PostgreSQL -------------------------------------------------------------------------


def test_the_service_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    with (
        ServiceProcess(tmp_path, "--ledger", pg_url, "--sink", pg_url, token=TOKEN) as service,
        httpx.Client(base_url=service.url, headers=service.headers) as client,
    ):
        request = decision()
        created = client.post("/v1/decisions", content=request.to_json())
        assert created.status_code == 201, created.text
        assert created.json()["attempt"] == 1
        duplicate = client.post("/v1/decisions", content=request.to_json())
        assert duplicate.status_code == 200
        assert duplicate.json()["receipt"] == created.json()["receipt"]
        conflict = client.post(
            "/v1/decisions", content=decision(request.decision_id, n=9).to_json()
        )
        assert conflict.status_code == 409
        got = client.get(f"/v1/decisions/{request.decision_id}").json()
        assert got["state"] == "completed"
        entries = client.get("/v1/outbox", params={"after": 0, "limit": 1000}).json()["entries"]
        assert request.decision_id in [entry["decision_id"] for entry in entries]
        assert client.get("/healthz").status_code == 200
        assert "postgresql" in client.get("/").text
