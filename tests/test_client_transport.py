"""DecisionClient over its aiohttp pool (flowdecision.connections.transport): the caller's trace
context goes with each request, and the pool can be shared or swapped for httpx's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowdecision.client import DecisionClient, Outcome, UnexpectedResponseError
from flowdecision.connections.transport import HttpPool
from tests.otel_support import spans_fixture, traceparent  # noqa: F401 (the `spans` fixture)
from tests.service_process import ServiceProcess, decision
from tests.webhook_receiver import WebhookReceiver


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("transport")) as proc:
        yield proc


async def test_the_callers_trace_context_goes_with_the_request(
    spans: InMemorySpanExporter,
) -> None:
    # A receiver that records headers (its answer is not the service's: the call fails
    # after the request went out, which is all this test needs).
    with WebhookReceiver() as receiver:
        async with DecisionClient(receiver.url.removesuffix("/hooks/decisions")) as client:
            with trace.get_tracer("caller").start_as_current_span("caller"):
                with pytest.raises(UnexpectedResponseError):
                    await client.submit(decision())
        [(_path, headers, _body)] = receiver.requests
    [caller] = spans.get_finished_spans()
    assert headers["traceparent"] == traceparent(caller)


async def test_one_pool_shared_by_clients_and_an_httpx_client_instead(
    service: ServiceProcess,
) -> None:
    pool = HttpPool(max_connections=4)
    try:
        async with (
            DecisionClient(service.url, http=pool) as one,
            DecisionClient(service.url, http=pool) as two,
        ):
            first = decision()
            assert (await one.submit(first)).outcome is Outcome.SUBMITTED
            assert (await two.submit(first)).outcome is Outcome.DUPLICATE
        async with DecisionClient(service.url, http=pool) as three:  # not closed by them
            assert (await three.health()).healthy
    finally:
        await pool.close()
    async with httpx.AsyncClient() as http, DecisionClient(service.url, http=http) as client:
        request = decision()
        assert (await client.submit(request)).outcome is Outcome.SUBMITTED
        state = await client.get(request.decision_id)
    assert state is not None and state.completed


def test_the_pool_size_is_checked() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        DecisionClient("http://127.0.0.1:1", max_connections=0)
