"""Service limits (issue 9), through `flowdecision serve` on a real socket: ids over the
identifier limit or with control characters, numbers JSON cannot keep, the status page."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from flowdecision.core.limits import IDENTIFIER_MAX_BYTES
from flowdecision.core.model import DecisionRequest
from tests.service_process import ServiceProcess, decision

AT_LIMIT = "€" * 341 + "a"  # exactly 1024 bytes of UTF-8
assert len(AT_LIMIT.encode("utf-8")) == IDENTIFIER_MAX_BYTES
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The default configuration: SQLite ledger and outbox, exact numbers."""
    with ServiceProcess(tmp_path_factory.mktemp("limits")) as proc:
        yield proc


@pytest.fixture
def client(service: ServiceProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=30) as http:
        yield http


def _with(base: DecisionRequest, **ids: str) -> DecisionRequest:
    values = {
        "decision_id": base.decision_id,
        "run_id": base.run_id,
        "authority_branch_id": base.authority_branch_id,
        "causation_event_id": base.causation_event_id,
        **ids,
    }
    return DecisionRequest(**values, decision=base.decision)


def _assert_422(
    response: httpx.Response, field: str, problem: str, code: str = "invalid_identifier"
) -> None:
    assert response.status_code == 422, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == code
    assert error["field"] == field
    assert problem in error["problem"]
    assert error["fields"] == [{"field": field, "problem": error["problem"]}]
    assert len(response.content) < 1000  # the id is named, never echoed back


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("decision_id", "d" * 1_000_000, "is 1000000 bytes of UTF-8, over the limit of 1024"),
        ("decision_id", AT_LIMIT + "a", "is 1025 bytes of UTF-8"),
        ("decision_id", "dec\u0000-1", "control characters: U+0000"),
        ("run_id", "run\u0085", "control characters: U+0085"),
        ("causation_event_id", "e" * 1025, "is 1025 bytes"),
        ("authority_branch_id", "b" * 3000, "is 3000 bytes"),
    ],
)
def test_a_bad_identifier_is_a_422_naming_the_field(
    client: httpx.Client, field: str, value: str, problem: str
) -> None:
    response = client.post("/v1/decisions", content=_with(decision(), **{field: value}).to_json(),
                           headers=JSON)  # fmt: skip
    _assert_422(response, field, problem)
    assert client.get("/healthz").status_code == 200


def test_an_id_of_exactly_the_limit_is_accepted_and_can_be_fetched(client: httpx.Client) -> None:
    request = _with(decision(AT_LIMIT), causation_event_id=AT_LIMIT)
    created = client.post("/v1/decisions", content=request.to_json(), headers=JSON)
    assert created.status_code in (200, 201), created.text  # 200 if a rerun
    fetched = client.get(f"/v1/decisions/{quote(AT_LIMIT, safe='')}")
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["decision_id"] == AT_LIMIT
    assert fetched.json()["state"] == "completed"


def test_get_with_an_id_over_the_limit_is_a_422(client: httpx.Client) -> None:
    response = client.get(f"/v1/decisions/{'g' * 2000}")
    _assert_422(response, "decision_id", "is 2000 bytes")


def test_the_status_page_stays_small_and_printable(client: httpx.Client) -> None:
    for value in ("x" * 1_000_000, "nul\u0000id"):
        request = _with(decision(), decision_id=value, run_id=value)
        response = client.post("/v1/decisions", content=request.to_json(), headers=JSON)
        assert response.status_code == 422
    page = client.get("/")
    assert page.status_code == 200
    assert len(page.content) < 100_000
    assert b"\x00" not in page.content
    assert "x" * 97 not in page.text
    assert "x" * 96 + "…" in page.text
    assert "nul\\u0000id" in page.text


# -- numbers ----------------------------------------------------------------------------


def _with_input(value: str, decision_id: str | None = None) -> bytes:
    """A valid request whose step input is ``{"n": <value>}``, spliced in as raw JSON text."""
    body = decision(decision_id, n=12345).to_json()
    assert body.count(b'{"n":12345}') == 1
    return body.replace(b'{"n":12345}', b'{"n":' + value.encode() + b"}")


@pytest.mark.parametrize(
    ("number", "problem"),
    [
        (str(2**70), "integer `1180591620717411303424` is outside the 64-bit range"),
        (str(-(2**63) - 1), "is outside the 64-bit range"),
        ("0.10000000000000000001", "cannot be held exactly by a 64-bit float"),
    ],
)
def test_a_number_json_cannot_keep_is_a_422_naming_its_path(
    client: httpx.Client, number: str, problem: str
) -> None:
    response = client.post("/v1/decisions", content=_with_input(number), headers=JSON)
    _assert_422(response, "decision.step.input.n", problem, code="invalid_request")


def test_numbers_at_the_edges_of_the_range_are_accepted(client: httpx.Client) -> None:
    for number in (str(2**64 - 1), str(-(2**63)), "0.1", "1e300"):
        response = client.post("/v1/decisions", content=_with_input(number), headers=JSON)
        assert response.status_code == 201, (number, response.text)


def test_lossy_numbers_restores_the_rust_behaviour(tmp_path: Path) -> None:
    with (
        ServiceProcess(tmp_path, "--lossy-numbers") as service,
        httpx.Client(base_url=service.url, timeout=30) as client,
    ):
        body = _with_input(str(2**70), "dec-lossy")
        response = client.post("/v1/decisions", content=body, headers=JSON)
        assert response.status_code == 201, response.text
        stored = client.get("/v1/outbox").json()["entries"][0]["request"]
        assert stored["decision"]["step"]["input"]["n"] == float(2**70)
        # As in the Rust original: 2**70 + 1 rounds to the same float, so a duplicate.
        body = _with_input(str(2**70 + 1), "dec-lossy")
        again = client.post("/v1/decisions", content=body, headers=JSON)
        assert again.status_code == 200
        assert json.loads(again.text)["outcome"] == "duplicate"


# -- PostgreSQL: the backend whose index used to refuse long ids as a 503 ----------------


def test_postgresql_answers_the_same_422_and_stays_healthy(tmp_path: Path, pg_url: str) -> None:
    with (
        ServiceProcess(tmp_path, "--ledger", pg_url, "--sink", pg_url) as service,
        httpx.Client(base_url=service.url, timeout=30) as client,
    ):
        for field, value in (("decision_id", "p" * 3000), ("decision_id", "pg\u0000")):
            request = _with(decision(), **{field: value})
            response = client.post("/v1/decisions", content=request.to_json(), headers=JSON)
            _assert_422(response, field, "")
            assert "Retry-After" not in response.headers
        assert client.get("/healthz").status_code == 200
        at_limit = _with(decision("q" + AT_LIMIT[1:]), causation_event_id="event-q")
        created = client.post("/v1/decisions", content=at_limit.to_json(), headers=JSON)
        assert created.status_code in (200, 201), created.text
        fetched = client.get(f"/v1/decisions/{quote(at_limit.decision_id, safe='')}")
        assert fetched.status_code == 200 and fetched.json()["state"] == "completed"


def test_a_body_sent_in_pieces_is_read_whole(client: httpx.Client) -> None:
    """A chunked body reaches the handler as several messages: it is joined, parsed
    and answered as if sent at once (the handler reads ``receive`` itself)."""
    import time

    from flowdecision.core.identity import decision_receipt

    request = decision()
    body = request.to_json()

    def pieces() -> Iterator[bytes]:
        for start in range(0, len(body), 40):
            yield body[start : start + 40]
            time.sleep(0.005)  # separate reads, so separate messages

    response = client.post("/v1/decisions", content=pieces(), headers=JSON)
    assert response.status_code == 201, response.text[:300]
    assert response.request.headers.get("transfer-encoding") == "chunked"
    answer = response.json()
    assert answer["decision_id"] == request.decision_id
    assert answer["receipt"] == decision_receipt(request)[1].to_dict()
