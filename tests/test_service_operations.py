"""The operator routes of a real ``flowdecision serve``: queries, audit, admin actions, status.

Starts where docs/OPERATIONS.md starts: an empty directory, ``serve`` with a
submit token and an admin token, decisions POSTed over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from flowdecision.client import DecisionClient, ServiceError, SyncDecisionClient
from flowdecision.ledger.states import DecisionState

from .service_process import ServiceProcess, decision

TOKEN = "submit-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
ACTIONS = ("/v1/actions/release", "/v1/actions/forget")


def _auth(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(
        tmp_path_factory.mktemp("operations"),
        token=TOKEN,
        env={"FLOWDECISION_ADMIN_TOKEN": ADMIN},
    ) as proc:
        yield proc


def _post(service: ServiceProcess, path: str, body: object, token: str | None) -> requests.Response:
    return requests.post(f"{service.url}{path}", json=body, headers=_auth(token), timeout=30)


def _submit(service: ServiceProcess, decision_id: str, run_id: str) -> None:
    answer = requests.post(
        f"{service.url}/v1/decisions",
        data=decision(decision_id, run_id=run_id).to_json(),
        headers={**_auth(TOKEN), "Content-Type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text


@pytest.mark.parametrize("path", ACTIONS)
@pytest.mark.parametrize("token", [None, TOKEN, "a-wrong-token-0123456789"])
def test_every_admin_route_refuses_the_submit_token_and_no_token(
    service: ServiceProcess, path: str, token: str | None
) -> None:
    _submit(service, f"auth-{path[-6:]}-{token}", "run-auth")
    answer = _post(service, path, {"decision_id": f"auth-{path[-6:]}-{token}", "actor": "a",
                                   "reason": "r"}, token)  # fmt: skip
    assert answer.status_code in (401, 403), answer.text
    assert answer.status_code == (403 if token == TOKEN else 401)
    assert answer.json()["error"]["code"] in ("unauthorized", "forbidden")


def test_queries_by_run_state_and_the_admin_actions(service: ServiceProcess) -> None:
    for i in range(3):
        _submit(service, f"q-{i}", "run-q")
    run = requests.get(f"{service.url}/v1/runs/run-q", headers=_auth(TOKEN), timeout=30)
    assert run.status_code == 200, run.text
    assert [row["decision_id"] for row in run.json()["decisions"]] == ["q-0", "q-1", "q-2"]
    first = requests.get(
        f"{service.url}/v1/decisions",
        params={"run_id": "run-q", "limit": "2", "count": "true", "state": "completed"},
        headers=_auth(TOKEN),
        timeout=30,
    ).json()
    assert first["count"] == 3 and len(first["decisions"]) == 2
    rest = requests.get(
        f"{service.url}/v1/decisions",
        params={"run_id": "run-q", "cursor": first["next_cursor"]},
        headers=_auth(TOKEN),
        timeout=30,
    ).json()
    assert [row["decision_id"] for row in rest["decisions"]] == ["q-2"]
    bad = requests.get(
        f"{service.url}/v1/decisions", params={"state": "stuck"}, headers=_auth(TOKEN), timeout=30
    )
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "state"

    refused = _post(service, ACTIONS[0], {"decision_id": "q-0", "actor": "ops", "reason": "x"},
                    ADMIN)  # fmt: skip
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "action_refused"
    forgot = _post(
        service, ACTIONS[1], {"decision_id": "q-0", "actor": "ops", "reason": "resend"}, ADMIN
    )
    assert forgot.status_code == 200, forgot.text
    assert (forgot.json()["action"], forgot.json()["state_before"]) == ("forget", "completed")
    missing = _post(service, ACTIONS[1], {"decision_id": "q-0", "actor": "o", "reason": "r"},
                    ADMIN)  # fmt: skip
    assert missing.status_code == 404
    _submit(service, "q-0", "run-q")  # the id is free again: 201, submitted
    audit = requests.get(
        f"{service.url}/v1/audit", params={"decision_id": "q-0"}, headers=_auth(TOKEN), timeout=30
    ).json()
    assert [(e["action"], e["actor"], e["reason"]) for e in audit["entries"]] == [
        ("forget", "ops", "resend")
    ]


def test_the_status_page_shows_what_needs_attention(service: ServiceProcess) -> None:
    page = requests.get(f"{service.url}/", headers=_auth(TOKEN), timeout=30)
    assert page.status_code == 200
    assert "Needs attention" in page.text
    assert 'id="expired"' in page.text and 'id="failures"' in page.text


def test_a_service_without_an_admin_token_refuses_actions(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, token=TOKEN) as service:
        answer = _post(service, ACTIONS[0], {"decision_id": "x", "actor": "a", "reason": "r"},
                       TOKEN)  # fmt: skip
        assert answer.status_code == 403
        assert answer.json()["error"]["code"] == "admin_disabled"


async def test_the_async_client_lists_a_run_and_releases_with_the_admin_token(
    service: ServiceProcess,
) -> None:
    for i in range(2):
        _submit(service, f"c-{i}", "run-c")
    async with DecisionClient(service.url, token=TOKEN) as client:
        page = await client.run("run-c", limit=1)
        assert [row.decision_id for row in page.decisions] == ["c-0"]
        assert page.decisions[0].state is DecisionState.COMPLETED
        rest = await client.list(run_id="run-c", cursor=page.next_cursor)
        assert [row.decision_id for row in rest.decisions] == ["c-1"]
        with pytest.raises(ServiceError) as refused:  # the submit token is not an admin token
            await client.release("c-0", actor="ops", reason="r")
        assert refused.value.status == 403
        with pytest.raises(ServiceError) as done:  # a completed decision cannot be released
            await client.release("c-0", actor="ops", reason="r", admin_token=ADMIN)
        assert (done.value.status, done.value.error_code) == (409, "action_refused")
        entry = await client.forget("c-1", actor="ops", reason="again", admin_token=ADMIN)
        assert (entry.action, entry.decision_id) == ("forget", "c-1")
        trail = await client.audit(decision_id="c-1")
        assert [e.reason for e in trail.entries] == ["again"]


def test_the_sync_client_does_the_same(service: ServiceProcess) -> None:
    _submit(service, "s-0", "run-s")
    with SyncDecisionClient(service.url, token=TOKEN) as client:
        page = client.run("run-s")
        assert [row.decision_id for row in page.decisions] == ["s-0"]
        assert client.list(run_id="run-s", state="completed").decisions == page.decisions
        entry = client.forget("s-0", actor="ops", reason="again", admin_token=ADMIN)
        assert entry.state_before == "completed"
