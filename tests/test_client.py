"""`flowdecision.client` against the real service: `flowdecision serve` as a subprocess
(uvicorn on a real socket), plus the error mapping on hand-built answers."""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flowdecision import (
    DecisionBusyError,
    DecisionConflictError,
    DispatchError,
    DispatchLedgerError,
    FlowDecisionError,
    ResultReceipt,
    UnauthorizedBranchError,
)
from flowdecision.client import (
    DecisionClient,
    Outcome,
    RetryEvent,
    RetryOptions,
    ServiceAuthError,
    ServiceBranchError,
    ServiceBusyError,
    ServiceConflictError,
    ServiceConnectionError,
    ServiceError,
    ServiceInvalidRequestError,
    ServiceLedgerError,
    ServiceUnavailableError,
    SyncDecisionClient,
    UnexpectedResponseError,
    error_from_response,
    read_token_file,
)
from flowdecision.core.identity import decision_receipt
from flowdecision.core.model import request_hash
from flowdecision.ledger import open_ledger
from tests.service_process import ServiceProcess, decision

TOKEN = "client-test-token-51c2"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The default configuration (SQLite ledger and outbox) with a token."""
    with ServiceProcess(tmp_path_factory.mktemp("client"), token=TOKEN) as proc:
        yield proc


def _recorder() -> tuple[list[RetryEvent], RetryOptions]:
    return [], RetryOptions(max_tries=5, backoff_base_s=0.01, backoff_max_s=0.05)


# -- the happy path ---------------------------------------------------------------------


async def test_submitted_then_duplicate_with_a_typed_receipt(service: ServiceProcess) -> None:
    request = decision()
    _identity, receipt = decision_receipt(request)
    async with DecisionClient(service.url, token=TOKEN) as client:
        first = await client.submit(request)
        again = await client.submit(request.to_json())  # bytes, sent verbatim
        state = await client.get(request.decision_id)
        missing = await client.get("no-such-decision")
        health = await client.health()
        page = await client.outbox(after=0, limit=1000)

    assert first.outcome is Outcome.SUBMITTED and first.submitted
    assert (first.decision_id, first.attempt, first.tries) == (request.decision_id, 1, 1)
    assert isinstance(first.receipt, ResultReceipt) and first.receipt == receipt
    assert first.request_id
    assert again.outcome is Outcome.DUPLICATE and not again.submitted
    assert again.receipt == receipt and again.attempt == 1
    assert again.request_id and again.request_id != first.request_id

    assert state is not None and state.completed
    assert state.attempts == 1 and state.request_hash == request_hash(request)
    assert state.receipt == receipt and state.lease_expires_at_ms is None
    assert state.execution_identity is not None
    assert missing is None

    assert health.healthy and health.status == "healthy"
    assert health.snapshot["completed"] >= 1

    [item] = [e for e in page.entries if e.decision_id == request.decision_id]
    assert item.request == request and item.first_attempt == 1
    assert item.request_hash == request_hash(request)


def test_the_sync_client_speaks_the_same_contract(service: ServiceProcess) -> None:
    request = decision(step=False)
    events, retry = _recorder()
    with SyncDecisionClient(
        service.url, token=TOKEN, retry=retry, on_retry=events.append
    ) as client:
        first = client.submit(request.to_dict())  # a dict is JSON-encoded
        assert first.outcome is Outcome.SUBMITTED and first.attempt == 1
        assert client.submit(request).outcome is Outcome.DUPLICATE
        state = client.get(request.decision_id)
        assert state is not None and state.receipt == first.receipt

        with pytest.raises(ServiceConflictError) as conflict:
            client.submit(decision(request.decision_id, n=2, step=False))
        assert isinstance(conflict.value, DecisionConflictError)
        assert isinstance(conflict.value, DispatchError)
        assert conflict.value.decision_id == request.decision_id
        assert conflict.value.status == 409 and conflict.value.error_code == "conflict"
        assert conflict.value.request_id

        with pytest.raises(ServiceBranchError) as fork:
            client.submit(decision(branch="feature-fork"))
        assert isinstance(fork.value, UnauthorizedBranchError)
        assert (fork.value.expected, fork.value.actual) == ("production", "feature-fork")

        with pytest.raises(ServiceInvalidRequestError) as invalid:
            client.submit(b'{"decision_id":"d","run_id":"r","authority_branch_id":"production"}')
        assert invalid.value.field == "causation_event_id"
        assert invalid.value.status == 422

        with pytest.raises(ServiceInvalidRequestError) as bad_limit:
            client.outbox(limit=5000)  # the service's own bound
        assert bad_limit.value.field == "limit"
    assert events == []  # none of these answers is worth a retry


def test_the_sync_client_has_the_async_clients_calls() -> None:
    # Each call is written once (on DecisionClient) and run blocking: the same
    # parameters and docs, and no call of one client missing from the other.
    calls = {name for name in vars(DecisionClient) if not name.startswith("_")}
    calls -= {"close", "aclose"}
    assert calls == {
        "submit",
        "get",
        "health",
        "outbox",
        "list",
        "run",
        "audit",
        "release",
        "forget",
        "parked",
        "retry_parked",
        "skip_parked",
        "approve",
        "reject",
        "approve_run",
        "reject_run",
        "wait",
    }
    for name in calls:
        blocking, awaited = getattr(SyncDecisionClient, name), getattr(DecisionClient, name)
        assert inspect.signature(blocking) == inspect.signature(awaited), name
        assert blocking.__doc__ == awaited.__doc__ and blocking.__name__ == name
        assert not inspect.iscoroutinefunction(blocking)


async def test_the_sync_client_blocks_even_inside_a_running_event_loop(
    service: ServiceProcess,
) -> None:
    # Its calls never suspend (its sends and sleeps block), so they need no loop
    # of their own and do not trip over the caller's.
    request = decision(step=False)
    with SyncDecisionClient(service.url, token=TOKEN) as client:
        assert client.submit(request).outcome is Outcome.SUBMITTED
        assert client.health().healthy
        state = client.get(request.decision_id)
    assert state is not None and state.completed


# -- what is not retried ----------------------------------------------------------------


async def test_an_auth_failure_is_not_retried(service: ServiceProcess) -> None:
    events, retry = _recorder()
    async with DecisionClient(
        service.url, token="wrong-token", retry=retry, on_retry=events.append
    ) as client:
        with pytest.raises(ServiceAuthError) as error:
            await client.submit(decision())
    assert error.value.status == 401 and error.value.tries == 1
    assert not error.value.retryable
    assert events == []


async def test_a_conflict_raises_at_once(service: ServiceProcess) -> None:
    original = decision()
    events, retry = _recorder()
    async with DecisionClient(
        service.url, token=TOKEN, retry=retry, on_retry=events.append
    ) as client:
        await client.submit(original)
        with pytest.raises(DecisionConflictError) as error:
            await client.submit(decision(original.decision_id, n=7))
    assert isinstance(error.value, ServiceConflictError) and error.value.tries == 1
    assert events == []


# -- what is retried --------------------------------------------------------------------


async def test_busy_is_retried_after_retry_after_and_ends_as_a_duplicate(tmp_path: Path) -> None:
    """Two replicas share one SQLite ledger; A's sink is slow, so B answers busy."""
    gate = tmp_path / "gate"
    ledger = f"sqlite:///{tmp_path / 'shared' / 'ledger.db'}"
    args = ("--ledger", ledger, "--sink", "python:tests.service_sinks:GateSink",
            "--lease-ms", "3000")  # fmt: skip
    env = {"FLOWDECISION_TEST_GATE": str(gate)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    request = decision()
    events: list[RetryEvent] = []

    def on_retry(event: RetryEvent) -> None:
        events.append(event)
        gate.touch()  # replica A's sink may finish now

    with (
        ServiceProcess(tmp_path / "a", *args, env=env) as replica_a,
        ServiceProcess(tmp_path / "b", *args, env=env) as replica_b,
    ):
        async with (
            DecisionClient(replica_a.url, timeout=60) as client_a,
            DecisionClient(
                replica_b.url, timeout=60, retry=RetryOptions(max_tries=5), on_retry=on_retry
            ) as client_b,
        ):
            in_flight = asyncio.create_task(client_a.submit(request))
            while not Path(f"{gate}.entered").exists():
                assert not in_flight.done(), in_flight
                await asyncio.sleep(0.02)
            via_b = await client_b.submit(request)
            via_a = await in_flight

    assert via_a.outcome is Outcome.SUBMITTED and via_a.attempt == 1
    assert via_b.outcome is Outcome.DUPLICATE and via_b.tries == 2
    assert via_b.receipt == via_a.receipt
    [busy] = events
    assert isinstance(busy.error, ServiceBusyError) and isinstance(busy.error, DecisionBusyError)
    assert busy.error.lease_expires_at_ms > 0
    assert busy.retry_after_s is not None and 1 <= busy.retry_after_s <= 3
    assert busy.retry_after_s == busy.error.details["retry_after_s"]
    assert busy.delay_s >= busy.retry_after_s  # never sooner than the service asked
    assert Path(f"{gate}.accepted").read_text() == f"{request.decision_id} 1\n"


def test_503_is_retried_after_retry_after(tmp_path: Path) -> None:
    """The JSON file ledger's lock file turns into a directory: every operation fails
    with 503 ledger_unavailable until it is a file again."""
    root = tmp_path / "ledger"
    events: list[RetryEvent] = []
    lock = root / ".flow-decisions.lock"

    def on_retry(event: RetryEvent) -> None:
        events.append(event)
        lock.rmdir()  # the store recovers

    with (
        ServiceProcess(tmp_path, "--ledger", f"file://{root}") as service,
        SyncDecisionClient(service.url, on_retry=on_retry) as client,
    ):
        assert client.submit(decision()).submitted
        lock.unlink()
        lock.mkdir()
        request = decision()
        result = client.submit(request)
        assert client.get(request.decision_id) is not None

    assert result.outcome is Outcome.SUBMITTED and result.attempt == 1 and result.tries == 2
    [failed] = events
    assert isinstance(failed.error, ServiceLedgerError)
    assert isinstance(failed.error, DispatchLedgerError)
    assert failed.error.status == 503 and failed.error.error_code == "ledger_unavailable"
    assert not failed.error.permanent
    assert failed.retry_after_s == 1.0 and failed.delay_s >= 1.0


async def test_a_retry_after_beyond_the_bounds_ends_the_retries_at_once(
    service: ServiceProcess,
) -> None:
    """Another replica holds a long lease: waiting that long is the caller's choice."""
    request = decision()
    identity, _receipt = decision_receipt(request)
    ledger = await open_ledger(f"sqlite:///{service.cwd / '.flowdecision' / 'flowdecision.db'}")
    try:
        await ledger.claim(request.decision_id, request_hash(request), "replica-b-owner",
                           lease_ms=60_000, identity=identity)  # fmt: skip
    finally:
        await ledger.close()
    for retry in (RetryOptions(max_retry_after_s=0.5), RetryOptions(deadline_s=0.5)):
        events: list[RetryEvent] = []
        async with DecisionClient(
            service.url, token=TOKEN, retry=retry, on_retry=events.append
        ) as client:
            with pytest.raises(ServiceBusyError) as error:
                await client.submit(request)
        assert error.value.tries == 1 and events == []
        assert error.value.retry_after_s is not None and error.value.retry_after_s >= 1
        assert error.value.retryable  # safe to retry: the caller decides when


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_a_refused_connection_is_retried_then_reported_as_not_sent() -> None:
    events, retry = _recorder()
    url = f"http://127.0.0.1:{_free_port()}"
    with (
        SyncDecisionClient(url, retry=retry, on_retry=events.append) as client,
        pytest.raises(ServiceConnectionError) as error,
    ):
        client.submit(decision())
    assert error.value.request_sent is False and error.value.tries == 5
    assert isinstance(error.value.__cause__, httpx.ConnectError)
    assert len(events) == 4 and all(e.retry_after_s is None for e in events)


async def test_a_read_timeout_resends_and_the_ledger_makes_it_a_duplicate(
    tmp_path: Path,
) -> None:
    """The answer is lost after the decision was sent; the resend cannot submit it twice."""
    gate = tmp_path / "gate"
    events: list[RetryEvent] = []

    def on_retry(event: RetryEvent) -> None:
        events.append(event)
        gate.touch()

    with ServiceProcess(
        tmp_path,
        "--sink",
        "python:tests.service_sinks:GateSink",
        env={"FLOWDECISION_TEST_GATE": str(gate)},
    ) as service:
        request = decision()
        async with DecisionClient(
            service.url,
            timeout=httpx.Timeout(5, read=0.5),
            on_retry=on_retry,
            retry=RetryOptions(resend_after_ambiguous=True),
        ) as client:
            result = await client.submit(request)
        gate.unlink()
        async with DecisionClient(  # the default: a possibly-sent submit is not resent
            service.url, timeout=httpx.Timeout(5, read=0.5)
        ) as careful:
            with pytest.raises(ServiceConnectionError) as error:
                await careful.submit(decision())
        gate.touch()
    assert result.outcome is Outcome.DUPLICATE and result.tries == 2
    [timeout] = events
    assert isinstance(timeout.error, ServiceConnectionError) and timeout.error.request_sent
    assert Path(f"{gate}.accepted").read_text().splitlines()[0] == f"{request.decision_id} 1"
    assert error.value.request_sent and error.value.tries == 1


async def test_prefer_wait_lengthens_the_read_timeout(tmp_path: Path) -> None:
    """With wait_s the client waits for a slow answer instead of timing out and resending."""
    gate = tmp_path / "gate"
    events: list[RetryEvent] = []

    def open_gate_soon() -> None:
        while not Path(f"{gate}.entered").exists():
            time.sleep(0.02)
        time.sleep(1.0)  # longer than the read timeout alone
        gate.touch()

    with ServiceProcess(
        tmp_path,
        "--sink",
        "python:tests.service_sinks:GateSink",
        env={"FLOWDECISION_TEST_GATE": str(gate)},
    ) as service:
        opener = threading.Thread(target=open_gate_soon, daemon=True)
        opener.start()
        async with DecisionClient(
            service.url,
            timeout=httpx.Timeout(5, read=0.3),
            wait_s=30,
            on_retry=events.append,
        ) as client:
            result = await client.submit(decision())
        opener.join(30)
    assert result.outcome is Outcome.SUBMITTED and result.tries == 1
    assert events == []


# -- the error mapping: unknown codes and members are tolerated ---------------------------


def _answer(status: int, body: object, **headers: str) -> httpx.Response:
    request = httpx.Request("POST", "http://service/v1/decisions")
    if isinstance(body, bytes):
        return httpx.Response(status, content=body, headers=headers, request=request)
    return httpx.Response(status, json=body, headers=headers, request=request)


def test_unknown_codes_map_to_generic_errors_by_status() -> None:
    unknown = error_from_response(
        _answer(409, {"error": {"code": "brand_new", "message": "m", "extra": [1]}})
    )
    assert type(unknown) is ServiceError and unknown.error_code == "brand_new"
    assert unknown.details == {"extra": [1]} and not unknown.retryable

    unavailable = error_from_response(
        _answer(503, {"error": {"code": "draining", "message": "m"}}, **{"Retry-After": "4"})
    )
    assert isinstance(unavailable, ServiceUnavailableError)
    assert unavailable.retryable and unavailable.retry_after_s == 4.0

    proxy = error_from_response(_answer(502, b"<html>bad gateway</html>"))
    assert type(proxy) is ServiceError and proxy.error_code == "http_502"
    assert "bad gateway" in str(proxy) and not proxy.retryable
    assert isinstance(proxy, FlowDecisionError)


@pytest.mark.parametrize("code", ["ledger_corrupt", "ledger_schema"])
def test_permanent_ledger_failures_are_not_retryable(code: str) -> None:
    error = error_from_response(
        _answer(503, {"error": {"code": code, "message": "m", "request_id": "r-1"}})
    )
    assert isinstance(error, ServiceLedgerError) and error.permanent and not error.retryable
    assert error.request_id == "r-1"  # the body's request id wins over the header's


def test_shutting_down_and_lease_lost_are_retryable() -> None:
    for code in ("shutting_down", "lease_lost", "ledger_unavailable"):
        assert error_from_response(
            _answer(503, {"error": {"code": code, "message": "m"}})
        ).retryable
    busy = error_from_response(
        _answer(409, {"error": {"code": "busy", "message": "m", "lease_expires_at_ms": 5}})
    )
    assert isinstance(busy, ServiceBusyError) and busy.retryable and busy.lease_expires_at_ms == 5


def test_an_answer_of_the_wrong_shape_is_an_unexpected_response() -> None:
    from flowdecision.client.decode import submit_result as _submit_result

    bad = _answer(201, {"outcome": "teleported", "decision_id": "d"})
    with pytest.raises(UnexpectedResponseError, match="unknown outcome `teleported`"):
        _submit_result(bad, 1)
    # Unknown members are ignored.
    fine = _answer(200, {"outcome": "duplicate", "decision_id": "d", "attempt": 2, "new": 1})
    assert _submit_result(fine, 1).attempt == 2


def test_client_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="http"):
        SyncDecisionClient("ftp://example")
    with pytest.raises(ValueError, match="single line"):
        SyncDecisionClient(token="a\nb")
    with pytest.raises(ValueError, match="max_tries"):
        RetryOptions(max_tries=0)
    token_file = tmp_path / "tokens"
    token_file.write_text("\n  new-token  \nold-token\n")
    assert read_token_file(token_file) == "new-token"
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="no token"):
        read_token_file(token_file)


def test_a_404_from_a_wrong_base_url_is_an_error_not_a_missing_decision(tmp_path: Path) -> None:
    with (
        ServiceProcess(tmp_path) as service,  # no token: unknown paths answer 404
        SyncDecisionClient(service.url + "/api") as wrong,
        SyncDecisionClient(service.url) as right,
    ):
        with pytest.raises(ServiceError) as error:
            wrong.get("dec-1")
        assert right.get("dec-1") is None
    assert error.value.status == 404 and error.value.error_code == "not_found"


def test_a_tombstone_reads_back_as_completed_with_its_completion_time() -> None:
    """A tombstone is a completed decision pruned to its digests: the client's
    ``completed`` says so, and ``to_dict()`` is the service's body, completion time kept."""
    import httpx

    from flowdecision.client.decode import decision_state

    body = {
        "decision_id": "dec-t",
        "state": "tombstoned",
        "attempts": 1,
        "request_hash": "ab" * 32,
        "execution_identity": None,
        "receipt": None,
        "completed_at_ms": 1_700_000_000_000,
    }
    state = decision_state(httpx.Response(200, json=body))
    assert state.completed
    assert state.to_dict()["completed_at_ms"] == 1_700_000_000_000
    assert state.to_dict()["state"] == "tombstoned"
