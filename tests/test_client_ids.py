"""Every id the service accepts round-trips through every client method that takes an id.

Property-tested over the identifier alphabet (any character but controls and
lone surrogates, see ``flowdecision.core.limits``) against the real service
(``flowdecision serve`` as a subprocess). The path-like ids (``.``, ``..``,
``a/../b``, ``%2E``) are named as examples: an HTTP stack removes dot segments
from a path unless they are percent-encoded.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flowdecision.client import (
    DecisionClient,
    Outcome,
    ServiceInvalidRequestError,
    SyncDecisionClient,
)
from flowdecision.client.protocol import decision_path
from tests.service_process import ServiceProcess, decision

TOKEN = "client-ids-token-7d1e"

#: The identifier alphabet: every character but controls (Cc) and surrogates (Cs).
IDS = st.text(
    st.characters(blacklist_categories=("Cc", "Cs")),  # type: ignore[arg-type]
    min_size=1,
    max_size=24,
)

PATH_LIKE = [".", "..", "...", "./..", "../x", "a/../b", "a/./b", "/", "//", "%2E", "%2e%2E",
             "%", "?", "#", "?a=1#b", " ", "a b", "\\..", ".%2E", "+", "~", ";..",
             "..;"]  # fmt: skip


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("client-ids"), token=TOKEN) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(service: ServiceProcess) -> Iterator[SyncDecisionClient]:
    with SyncDecisionClient(service.url, token=TOKEN) as opened:
        yield opened


def _round_trip(client: SyncDecisionClient, service: ServiceProcess, decision_id: str) -> None:
    sent = decision(decision_id, step=False)
    try:
        first = client.submit(sent)
    except ServiceInvalidRequestError as refused:
        # Not an id the service accepts: the service itself says so, not the client.
        direct = httpx.post(
            f"{service.url}/v1/decisions", content=sent.to_json(), headers=service.headers
        )
        assert direct.status_code == 422, (decision_id, direct.text)
        assert refused.field == direct.json()["error"]["field"]
        return
    assert first.outcome in (Outcome.SUBMITTED, Outcome.DUPLICATE), decision_id
    state = client.get(decision_id)
    assert state is not None, f"get({decision_id!r}) found nothing"
    assert state.decision_id == decision_id
    assert state.receipt == first.receipt
    assert client.submit(sent).outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("decision_id", PATH_LIKE)
def test_path_like_ids_round_trip(
    client: SyncDecisionClient, service: ServiceProcess, decision_id: str
) -> None:
    _round_trip(client, service, decision_id)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(decision_id=IDS)
@example(decision_id="..")
@example(decision_id="\u202e..")
@example(decision_id="décision/..")
def test_any_accepted_id_round_trips_through_the_sync_client(
    client: SyncDecisionClient, service: ServiceProcess, decision_id: str
) -> None:
    _round_trip(client, service, decision_id)


async def test_the_async_client_reads_dot_ids_too(service: ServiceProcess) -> None:
    async with DecisionClient(service.url, token=TOKEN) as client:
        for decision_id in (".", "..", "a/../b"):
            await client.submit(decision(decision_id, step=False))
            state = await client.get(decision_id)
            assert state is not None and state.decision_id == decision_id


def test_decision_path_keeps_every_id_one_segment() -> None:
    for decision_id in PATH_LIKE:
        path = decision_path(decision_id)
        assert path.startswith("/v1/decisions/")
        segment = path.removeprefix("/v1/decisions/")
        assert "/" not in segment and segment not in (".", "..")
        assert httpx.URL("http://h" + path).path == "/v1/decisions/" + decision_id
