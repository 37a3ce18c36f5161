"""The operator routes of a real ``flowdecision serve``: queries, audit, admin actions, status.

Starts where docs/OPERATIONS.md starts: an empty directory, ``serve`` with a
submit token and an admin token, decisions POSTed over HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from flowdecision.client import DecisionClient, ServiceError, SyncDecisionClient
from flowdecision.ledger.states import DecisionState
from flowdecision.service.config import Settings

from .service_process import ROOT, ServiceProcess, decision

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


def test_the_admin_token_opens_the_operators_routes_and_nothing_else(
    service: ServiceProcess,
) -> None:
    _submit(service, "scope-1", "run-scope")
    admin = {**_auth(ADMIN), "Content-Type": "application/json"}
    submitted = requests.post(
        f"{service.url}/v1/decisions", data=decision("scope-2").to_json(), headers=admin,
        timeout=30,
    )  # fmt: skip
    assert submitted.status_code == 403, submitted.text
    assert submitted.json()["error"]["code"] == "forbidden"
    for path in ("/v1/outbox", "/metrics", "/"):
        refused = requests.get(f"{service.url}{path}", headers=_auth(ADMIN), timeout=30)
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json()["error"]["code"] == "forbidden"
    for path in ("/v1/decisions", "/v1/decisions/scope-1", "/v1/runs/run-scope", "/v1/audit"):
        read = requests.get(f"{service.url}{path}", headers=_auth(ADMIN), timeout=30)
        assert read.status_code == 200, (path, read.text)
    # The submit token reads and submits (scope-2 was never submitted above).
    assert (
        requests.get(
            f"{service.url}/v1/decisions/scope-2", headers=_auth(TOKEN), timeout=30
        ).status_code
        == 404
    )


def test_an_action_over_http_names_its_actor(service: ServiceProcess) -> None:
    _submit(service, "actor-1", "run-actor")
    answer = _post(service, ACTIONS[1], {"decision_id": "actor-1", "reason": "r"}, ADMIN)
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "invalid_action"


def test_with_only_an_admin_token_submissions_stay_open_on_loopback(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, env={"FLOWDECISION_ADMIN_TOKEN": ADMIN}) as service:
        body = decision("open-1").to_json()
        json_type = {"Content-Type": "application/json"}
        opened = requests.post(f"{service.url}/v1/decisions", data=body, headers=json_type,
                               timeout=30)  # fmt: skip
        assert opened.status_code == 201, opened.text
        as_admin = requests.post(
            f"{service.url}/v1/decisions", data=body, headers={**json_type, **_auth(ADMIN)},
            timeout=30,
        )  # fmt: skip
        assert as_admin.status_code == 403
        action = _post(service, ACTIONS[1], {"decision_id": "open-1", "actor": "a",
                                             "reason": "r"}, None)  # fmt: skip
        assert action.status_code == 401
        forgot = _post(service, ACTIONS[1], {"decision_id": "open-1", "actor": "a",
                                             "reason": "r"}, ADMIN)  # fmt: skip
        assert forgot.status_code == 200, forgot.text


def test_service_md_lists_every_setting() -> None:
    text = (ROOT / "docs" / "SERVICE.md").read_text()
    table = text[text.index("| setting (TOML key) |") :]
    for name in (field.name for field in dataclasses.fields(Settings)):
        assert f"\n| `{name}` |" in table, f"{name} is not in SERVICE.md's settings table"


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
        by_completion = await client.list(run_id="run-c", by="completed")
        assert sorted(row.decision_id for row in by_completion.decisions) == ["c-0", "c-1"]
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


def test_decisions_by_completion_time_over_http_and_the_clients(service: ServiceProcess) -> None:
    for i in range(3):
        _submit(service, f"w-{i}", "run-w")

    def get(**params: str) -> requests.Response:
        return requests.get(
            f"{service.url}/v1/decisions", params=params, headers=_auth(TOKEN), timeout=30
        )

    rows = get(run_id="run-w", by="completed").json()["decisions"]
    assert {row["decision_id"] for row in rows} == {"w-0", "w-1", "w-2"}
    order = [(row["completed_at_ms"], row["decision_id"]) for row in rows]
    assert order == sorted(order)  # completion order, then id
    cut = rows[1]["completed_at_ms"]
    later = get(run_id="run-w", by="completed", after=str(cut), count="true").json()
    expected = [row["decision_id"] for row in rows if row["completed_at_ms"] >= cut]
    assert [row["decision_id"] for row in later["decisions"]] == expected
    assert later["count"] == len(expected)
    earlier = get(run_id="run-w", by="completed", before=str(cut)).json()["decisions"]
    assert [row["decision_id"] for row in earlier] == [
        row["decision_id"] for row in rows if row["completed_at_ms"] < cut
    ]
    first = get(run_id="run-w", by="completed", limit="1").json()
    rest = get(run_id="run-w", by="completed", cursor=first["next_cursor"]).json()
    assert [row["decision_id"] for row in first["decisions"] + rest["decisions"]] == [
        row["decision_id"] for row in rows
    ]
    # A cursor of one order is not one of the other; bad or contradictory `by` is a 422.
    for params in (
        {"cursor": first["next_cursor"]},
        {"by": "finished"},
        {"by": "completed", "state": "pending_expired"},
    ):
        bad = get(**params)
        assert bad.status_code == 422, (params, bad.text)
        assert bad.json()["error"]["field"] == ("cursor" if "cursor" in params else "by")
    with SyncDecisionClient(service.url, token=TOKEN) as client:
        page = client.list(run_id="run-w", by="completed", after_ms=cut)
        assert [row.decision_id for row in page.decisions] == expected


def test_the_status_page_finds_decisions_and_shows_operator_actions(
    service: ServiceProcess,
) -> None:
    """The four questions on the status page: a run's decisions (and by state or age)
    through its "Find decisions" form, and who did what under "Operator actions"."""
    for i in range(27):
        _submit(service, f"f-{i:02d}", "run-f")

    def section(html: str, name: str) -> str:
        return html.split(f'<section id="{name}">', 1)[1].split("</section>", 1)[0]

    def page(**params: str) -> str:
        """The "Find decisions" section of the page for these form values."""
        answer = requests.get(f"{service.url}/", params=params, headers=_auth(TOKEN), timeout=30)
        assert answer.status_code == 200, answer.text
        return section(answer.text, "find")

    assert 'id="find-form"' in page() and 'id="find-results"' not in page()
    first = page(run_id="run-f")
    assert "27 decision(s) match" in first
    assert "f-00" in first and "f-24" in first and "f-25" not in first
    next_link = first.split('id="find-next" href="', 1)[1].split('"', 1)[0]
    rest = section(
        requests.get(
            f"{service.url}/{next_link.replace('&amp;', '&')}", headers=_auth(TOKEN), timeout=30
        ).text,
        "find",
    )
    assert "f-25" in rest and "f-26" in rest and "f-00" not in rest
    hour_ago = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() - 3600))
    done = page(run_id="run-f", by="completed", after=hour_ago, state="completed")
    assert "27 decision(s) match" in done
    assert "0 decision(s) match" in page(run_id="run-f", state="pending_live")
    for name, value in (("state", "stuck"), ("after", "yesterday"), ("by", "finished")):
        bad = page(**{name: value})
        assert 'id="find-error"' in bad and f"`{name}`" in bad, bad

    forgot = _post(
        service, ACTIONS[1], {"decision_id": "f-00", "actor": "carol", "reason": "replay <f-00>"},
        ADMIN,
    )  # fmt: skip
    assert forgot.status_code == 200, forgot.text
    status = requests.get(f"{service.url}/", headers=_auth(TOKEN), timeout=30).text
    actions = section(status, "actions")
    assert "carol" in actions and "replay &lt;f-00&gt;" in actions and "forget" in actions


def test_parked_rows_over_http_and_both_clients(tmp_path: Path) -> None:
    """serve --relay-to a receiver that refuses one decision: the row is parked, listed
    over HTTP and on the status page, and an operator retries and skips through the
    clients with the admin token (audited in the outbox)."""
    import httpx

    from tests.webhook_receiver import WebhookReceiver

    with WebhookReceiver() as hook:
        hook.refuse = {"p-1", "p-3"}
        with ServiceProcess(
            tmp_path, "--relay-to", hook.url, token=TOKEN,
            env={"FLOWDECISION_ADMIN_TOKEN": ADMIN},
        ) as service:  # fmt: skip
            for i in range(4):
                _submit(service, f"p-{i}", f"run-p{i % 2}")  # p-1 and p-3: one run

            def parked() -> list[dict[str, object]]:
                answer = httpx.get(
                    f"{service.url}/v1/outbox/parked", headers=_auth(TOKEN), timeout=30
                )
                assert answer.status_code == 200, answer.text
                rows: list[dict[str, object]] = answer.json()["parked"]
                return rows

            for _ in range(300):
                if [r["state"] for r in parked()] == ["parked", "held"]:
                    break
                time.sleep(0.1)
            assert [(r["decision_id"], r["state"]) for r in parked()] == [
                ("p-1", "parked"),
                ("p-3", "held"),
            ]
            page = httpx.get(f"{service.url}/", headers=_auth(TOKEN), timeout=30).text
            assert 'id="parked"' in page and "p-1" in page and "HTTP 400" in page
            metrics = httpx.get(f"{service.url}/metrics", headers=_auth(TOKEN), timeout=30).text
            assert 'flowdecision_relay_parked_rows{relay="default"} 1.0' in metrics
            assert 'flowdecision_relay_held_rows{relay="default"} 1.0' in metrics

            asyncio.run(_skip_with_the_async_client(service.url))
            # The skip released the run: p-3 is delivered next, and refused in its turn.
            for _ in range(300):
                if [(r["decision_id"], r["state"]) for r in parked()] == [("p-3", "parked")]:
                    break
                time.sleep(0.1)
            assert [(r["decision_id"], r["state"]) for r in parked()] == [("p-3", "parked")]
            hook.refuse.clear()
            with SyncDecisionClient(service.url, token=TOKEN) as sync:
                again = sync.retry_parked("p-3", actor="ops", reason="fixed", admin_token=ADMIN)
                assert again.action == "retry"
                for _ in range(300):
                    if not sync.parked():
                        break
                    time.sleep(0.1)
                assert sync.parked() == []
            with SyncDecisionClient(service.url, token=ADMIN) as admin:
                with pytest.raises(ServiceError) as gone:
                    admin.retry_parked("p-3", actor="ops", reason="twice")
            assert (gone.value.status, gone.value.error_code) == (404, "not_found")
    delivered = [h.get("Idempotency-Key") for _, h, _ in hook.requests]
    assert delivered.count("p-0") == 1 and delivered.count("p-2") == 1
    assert "p-1" in delivered and delivered[-1] == "p-3"  # refused, skipped; p-3 last


async def _skip_with_the_async_client(url: str) -> None:
    """List the parked rows, be refused twice, then skip the parked one (admin token)."""
    async with DecisionClient(url, token=TOKEN) as client:
        rows = await client.parked()
        assert [(r.decision_id, r.state) for r in rows] == [
            ("p-1", "parked"),
            ("p-3", "held"),
        ]
        with pytest.raises(ServiceError) as refused:  # the submit token cannot act
            await client.retry_parked("p-1", actor="ops", reason="r")
        assert refused.value.status == 403
        with pytest.raises(ServiceError) as held:  # a held row is not the one
            await client.skip_parked("p-3", actor="ops", reason="r", admin_token=ADMIN)
        assert (held.value.status, held.value.error_code) == (409, "action_refused")
        entry = await client.skip_parked(
            "p-1", actor="ops", reason="never deliverable", admin_token=ADMIN
        )
        assert (entry.action, entry.relay, entry.state_before) == (
            "skip",
            "default",
            "parked",
        )
