"""The webhook sink against a real local HTTP server (no mocked transport)."""

from __future__ import annotations

import asyncio
import logging
import random
import socket

import pytest

from flowdecision.errors import sink_refused
from flowdecision.sinks.webhook import (
    WebhookError,
    WebhookRejectedError,
    WebhookSink,
    parse_retry_after,
)
from tests.service_process import decision
from tests.webhook_receiver import WebhookReceiver

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def receiver() -> object:
    with WebhookReceiver() as server:
        yield server


async def test_posts_exact_wire_bytes_with_idempotency_headers(receiver: WebhookReceiver) -> None:
    request = decision("dec-hook-1")
    async with WebhookSink(receiver.url, token="engine-secret", **FAST) as sink:
        await sink.submit(request, 3)
    [(path, headers, body)] = receiver.requests
    assert path == "/hooks/decisions"
    assert body == request.to_json()
    assert headers["Idempotency-Key"] == "dec-hook-1"
    assert headers["X-Flow-Attempt"] == "3"
    assert headers["Content-Type"] == "application/json"
    assert headers["Authorization"] == "Bearer engine-secret"


@pytest.mark.parametrize("status", [200, 201, 202, 204])
async def test_any_2xx_is_accepted(receiver: WebhookReceiver, status: int) -> None:
    receiver.set_script([(status, {})])
    async with WebhookSink(receiver.url, **FAST) as sink:
        await sink.submit(decision(), 1)
    assert len(receiver.requests) == 1


async def test_5xx_is_retried_with_the_same_key_and_body(receiver: WebhookReceiver) -> None:
    receiver.set_script([(503, {}), (500, {}), (502, {}), (201, {})])
    request = decision("dec-hook-retry")
    async with WebhookSink(receiver.url, max_attempts=5, **FAST) as sink:
        await sink.submit(request, 2)
    assert len(receiver.requests) == 4
    assert {r[2] for r in receiver.requests} == {request.to_json()}
    assert {r[1]["Idempotency-Key"] for r in receiver.requests} == {"dec-hook-retry"}
    assert {r[1]["X-Flow-Attempt"] for r in receiver.requests} == {"2"}


@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 302])
async def test_other_4xx_and_3xx_fail_at_once(receiver: WebhookReceiver, status: int) -> None:
    receiver.set_script([(status, {"Location": "/elsewhere"} if status == 302 else {})])
    async with WebhookSink(receiver.url, max_attempts=5, **FAST) as sink:
        with pytest.raises(WebhookRejectedError) as caught:
            await sink.submit(decision(), 1)
    assert caught.value.status == status
    assert caught.value.tries == 1
    assert len(receiver.requests) == 1
    assert sink_refused(caught.value)  # permanent: a relay parks the row


@pytest.mark.parametrize(("status", "headers"), [(408, {}), (429, {}), (409, {"Retry-After": "0"})])
async def test_a_timeout_too_many_requests_and_a_busy_409_are_transient(
    receiver: WebhookReceiver, status: int, headers: dict[str, str]
) -> None:
    receiver.set_script([(status, headers), (200, {})])
    async with WebhookSink(receiver.url, max_attempts=3, **FAST) as sink:
        await sink.submit(decision(), 1)
    assert len(receiver.requests) == 2
    receiver.set_script([(status, headers)])
    async with WebhookSink(receiver.url, max_attempts=2, **FAST) as sink:
        with pytest.raises(WebhookError) as caught:
            await sink.submit(decision(), 1)
    assert not sink_refused(caught.value)  # a relay retries it, never parks it


async def test_retries_are_bounded(receiver: WebhookReceiver) -> None:
    receiver.set_script([(500, {})])
    async with WebhookSink(receiver.url, max_attempts=3, **FAST) as sink:
        with pytest.raises(WebhookError) as caught:
            await sink.submit(decision(), 1)
    assert not isinstance(caught.value, WebhookRejectedError)
    assert caught.value.tries == 3
    assert caught.value.status == 500
    assert len(receiver.requests) == 3


async def test_429_honours_retry_after(
    receiver: WebhookReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.set_script([(429, {"Retry-After": "1"}), (200, {})])
    caplog.set_level(logging.WARNING, logger="flowdecision.sinks.webhook")
    async with WebhookSink(receiver.url, **FAST) as sink:
        await sink.submit(decision(), 1)
    assert len(receiver.requests) == 2
    [retry] = [r for r in caplog.records if r.getMessage() == "webhook delivery failed, retrying"]
    assert retry.problem == "HTTP 429"  # type: ignore[attr-defined]
    # The wait chosen is what the server asked for, not the 10 ms backoff.
    assert retry.retry_in_s >= 1.0  # type: ignore[attr-defined]


async def test_a_retry_after_beyond_the_cap_gives_up(receiver: WebhookReceiver) -> None:
    receiver.set_script([(429, {"Retry-After": "3600"}), (200, {})])
    async with WebhookSink(receiver.url, max_retry_after_s=30, **FAST) as sink:
        with pytest.raises(WebhookError, match="retry after 3600s"):
            await sink.submit(decision(), 1)
    assert len(receiver.requests) == 1


async def test_connection_refused_is_retried_until_the_engine_is_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/hooks/decisions"
    caplog.set_level(logging.WARNING, logger="flowdecision.sinks.webhook")
    async with WebhookSink(url, max_attempts=200, backoff_base_s=0.02, backoff_max_s=0.05) as sink:
        task = asyncio.create_task(sink.submit(decision("dec-late-engine"), 1))
        while not any("ConnectError" in str(getattr(r, "problem", "")) for r in caplog.records):
            assert not task.done(), task
            await asyncio.sleep(0.01)
        with WebhookReceiver(port=port) as receiver:
            await task
            assert [r[1]["Idempotency-Key"] for r in receiver.requests] == ["dec-late-engine"]


async def test_connection_refused_retries_are_bounded() -> None:
    url = f"http://127.0.0.1:{_free_port()}/hooks/decisions"
    async with WebhookSink(url, max_attempts=3, **FAST) as sink:
        with pytest.raises(WebhookError, match="ConnectError") as caught:
            await sink.submit(decision(), 1)
    assert caught.value.tries == 3
    assert caught.value.status is None


async def test_a_dropped_connection_is_transient(receiver: WebhookReceiver) -> None:
    receiver.set_script([(0, {}), (200, {})])
    async with WebhookSink(receiver.url, **FAST) as sink:
        await sink.submit(decision(), 1)
    assert len(receiver.requests) == 2


def test_parse_retry_after() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    now = 1_700_000_000.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:40 GMT", now=now) == 20.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:00 GMT", now=now) == 0.0


def test_backoff_is_jittered_and_capped() -> None:
    sink = WebhookSink("http://127.0.0.1:9/", backoff_base_s=0.2, backoff_max_s=1.0,
                       rng=random.Random(7))  # fmt: skip
    for retry, ceiling in [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)]:
        delays = {sink.backoff_s(retry) for _ in range(50)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1  # jittered
