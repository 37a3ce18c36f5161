"""flowdecision.connections.transport (the async HTTP transport of DecisionClient and the
HTTP sinks)
against real local servers: the pool's bound, concurrent callers, and which failures say
the request may have been sent."""

from __future__ import annotations

import asyncio
import socket

import pytest

from flowdecision.connections.transport import (
    ConnectError,
    HttpPool,
    ReadError,
    ReadTimeoutError,
    TransportError,
)
from flowdecision.errors import FlowDecisionError, InvalidArgumentError
from flowdecision.sinks.webhook import WebhookSink
from tests.service_process import decision
from tests.webhook_receiver import WebhookReceiver


@pytest.fixture
def receiver() -> object:
    with WebhookReceiver() as server:
        yield server


@pytest.mark.parametrize("size", [1, 3])
async def test_a_sinks_pool_bounds_its_connections_and_serves_every_caller(
    receiver: WebhookReceiver, size: int
) -> None:
    receiver.delay_s = 0.05
    requests = [decision() for _ in range(12)]
    async with WebhookSink(receiver.url, max_connections=size) as sink:
        await asyncio.gather(*(sink.submit(request, 1) for request in requests))
    assert receiver.most_in_flight <= size
    delivered = sorted(headers["Idempotency-Key"] for _p, headers, _b in receiver.requests)
    assert delivered == sorted(r.decision_id for r in requests)


async def test_the_default_pool_serves_concurrent_callers_at_once(
    receiver: WebhookReceiver,
) -> None:
    # The default (64 connections) does not serialize a relay's or a service's
    # concurrent deliveries: they are in the receiver together.
    receiver.delay_s = 0.3
    async with WebhookSink(receiver.url) as sink:
        assert sink.max_connections == 64
        await asyncio.gather(*(sink.submit(decision(), 1) for _ in range(16)))
    assert receiver.most_in_flight > 1
    assert len(receiver.requests) == 16


def test_a_pool_size_below_one_is_refused() -> None:
    for make in (
        lambda: HttpPool(max_connections=0),
        lambda: WebhookSink("http://h/", max_connections=0),
    ):
        with pytest.raises(InvalidArgumentError, match="max_connections"):
            make()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_failures_say_whether_the_request_may_have_been_sent(
    receiver: WebhookReceiver,
) -> None:
    pool = HttpPool()
    try:
        with pytest.raises(ConnectError) as refused:
            await pool.request("POST", f"http://127.0.0.1:{_free_port()}/", content=b"{}",
                               connect_s=5, read_s=5)  # fmt: skip
        receiver.set_script([(0, {})])  # the connection closes without an answer
        with pytest.raises(ReadError) as dropped:
            await pool.request("POST", receiver.url, content=b"{}", connect_s=5, read_s=5)
        receiver.set_script([(200, {})])
        receiver.delay_s = 1.0
        with pytest.raises(ReadTimeoutError) as slow:
            await pool.request("POST", receiver.url, content=b"{}", connect_s=5, read_s=0.2)
        with pytest.raises(TransportError) as unsendable:
            await pool.request("POST", "ftp://127.0.0.1/?token=secret-1", connect_s=5, read_s=5)
    finally:
        await pool.close()
    assert not refused.value.sent and dropped.value.sent and slow.value.sent
    assert type(unsendable.value) is TransportError and not unsendable.value.sent
    assert "secret-1" not in str(unsendable.value)
    for error in (refused, dropped, slow, unsendable):
        assert isinstance(error.value, FlowDecisionError)
        assert error.value.__cause__ is not None  # aiohttp's own error, for the record
