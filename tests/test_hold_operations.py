"""What operators see of approval holds: the status page's "Awaiting approval"
section, the held gauges of ``/metrics``, and the notification a webhook gets
when a decision is held. A real ``flowdecision serve`` process in a fresh
directory (the default layout: ledger and outbox in one SQLite file) and a
real local HTTP receiver.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from flowdecision.core.model import DecisionRequest, DecisionStep, ScheduleStep
from flowdecision.service.config import ConfigError, load_settings

from .service_process import ServiceProcess, wait_for
from .webhook_receiver import WebhookReceiver

TOKEN = "holdops-token-0123456789abcdef"
ADMIN = "holdops-admin-0123456789abcdef"
NOTIFY = "holdops-notify-0123456789abcdef"


def _step(decision_id: str, run_id: str, name: str, args: object = None) -> DecisionRequest:
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id="production",
        causation_event_id=f"{decision_id}-cause",
        decision=ScheduleStep(DecisionStep(f"{decision_id}-s", name, args or {"n": 1})),
    )


def _uid() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as hook:
        yield hook


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, receiver: WebhookReceiver
) -> Iterator[ServiceProcess]:
    with ServiceProcess(
        tmp_path_factory.mktemp("holdops"),
        "--approve-steps",
        "payments.*",
        "--hold-notify-url",
        receiver.url,
        token=TOKEN,
        env={
            "FLOWDECISION_ADMIN_TOKEN": ADMIN,
            "FLOWDECISION_HOLD_NOTIFY_TOKEN": NOTIFY,
            "FLOWDECISION_WEBHOOK_MAX_ATTEMPTS": "2",
        },
    ) as proc:
        yield proc


def _post(service: ServiceProcess, request: DecisionRequest) -> requests.Response:
    return requests.post(
        f"{service.url}/v1/decisions", data=request.to_json(), headers=service.headers, timeout=30
    )


def _approve(service: ServiceProcess, decision_id: str) -> requests.Response:
    return requests.post(
        f"{service.url}/v1/actions/approve",
        json={"decision_id": decision_id, "actor": "ops", "reason": "checked"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    )


def _metric(service: ServiceProcess, name: str, labels: str = "") -> float | None:
    text = requests.get(f"{service.url}/metrics", headers=service.headers, timeout=30).text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return None if match is None else float(match.group(1))


def _notices(receiver: WebhookReceiver, decision_id: str) -> list[tuple[dict[str, str], bytes]]:
    return [
        (headers, body)
        for _path, headers, body in receiver.requests
        if headers.get("Idempotency-Key") == f"held:{decision_id}"
    ]


def test_a_new_hold_is_announced_once_with_its_content(
    service: ServiceProcess, receiver: WebhookReceiver
) -> None:
    run, held_id = f"run-{_uid()}", f"pay-{_uid()}"
    request = _step(held_id, run, "payments.refund", {"amount": 120})
    assert _post(service, request).status_code == 202
    wait_for(lambda: len(_notices(receiver, held_id)) == 1)
    headers, body = _notices(receiver, held_id)[0]
    assert headers["Authorization"] == f"Bearer {NOTIFY}"
    assert headers["X-Flow-Event"] == "decision.held"
    notice = json.loads(body)
    assert notice["event"] == "decision.held"
    assert (notice["decision_id"], notice["run_id"]) == (held_id, run)
    assert notice["decision_type"] == "schedule_step"
    assert notice["hold_expires_at_ms"] is None and notice["held_at_ms"] > 0
    assert notice["request"] == json.loads(request.to_json())
    # A re-POST of the held decision is answered held again, not announced again.
    assert _post(service, request).status_code == 202
    # A decision the policy does not hold is not announced at all.
    free_id = f"free-{_uid()}"
    assert _post(service, _step(free_id, run, "emails.send")).status_code == 201
    sent = lambda: _metric(service, "flowdecision_hold_notifications_total", '{result="sent"}')  # noqa: E731
    wait_for(lambda: (sent() or 0) >= 1)
    assert len(_notices(receiver, held_id)) == 1
    assert _notices(receiver, free_id) == []


def test_a_notification_the_webhook_refuses_is_counted_as_failed(
    service: ServiceProcess, receiver: WebhookReceiver
) -> None:
    failed = lambda: _metric(service, "flowdecision_hold_notifications_total", '{result="failed"}')  # noqa: E731
    before = failed() or 0
    held_id = f"pay-{_uid()}"
    receiver.refuse.add(f"held:{held_id}")  # answered 400: refused for good, no retry
    assert _post(service, _step(held_id, f"run-{_uid()}", "payments.charge")).status_code == 202
    wait_for(lambda: (failed() or 0) == before + 1)
    assert len(_notices(receiver, held_id)) == 1
    # The hold itself is untouched: it is in the ledger, awaiting approval.
    state = requests.get(
        f"{service.url}/v1/decisions/{held_id}", headers=service.headers, timeout=30
    ).json()
    assert state["state"] == "held"


def _held_now(service: ServiceProcess) -> int:
    page = requests.get(
        f"{service.url}/v1/decisions",
        params={"state": "held", "limit": 1000},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert page.status_code == 200, page.text
    return len(page.json()["decisions"])


def test_metrics_count_the_held_decisions_and_the_oldest_wait(service: ServiceProcess) -> None:
    before = _held_now(service)  # earlier tests' holds (the gauge is up to a second old)
    ids = [f"pay-{_uid()}" for _ in range(3)]
    for decision_id in ids:
        assert _post(service, _step(decision_id, f"run-{_uid()}", "payments.x")).status_code == 202
    # Read at most once a second: wait for the count to catch up.
    wait_for(lambda: _metric(service, "flowdecision_held_decisions") == before + 3)
    oldest = _metric(service, "flowdecision_held_oldest_seconds")
    assert oldest is not None and oldest > 0
    assert _approve(service, ids[0]).status_code == 200
    wait_for(lambda: _metric(service, "flowdecision_held_decisions") == before + 2)


def test_the_status_page_lists_held_decisions_escaped_with_their_actions(
    service: ServiceProcess,
) -> None:
    held_id = f"pay-{_uid()}"
    hostile = "<script>alert(1)</script>\u202eexe.fdp"
    run = f"run-{_uid()}"
    assert _post(service, _step(held_id, run, "payments.wire", {"memo": hostile})).status_code == (
        202
    )
    page = requests.get(f"{service.url}/", headers=service.headers, timeout=30).text
    section = page[page.index('<section id="holds">') :]
    section = section[: section.index("</section>")]
    assert re.search(r'<p id="held-count">\d+ decision\(s\) held for approval', section)
    assert f"<code>{held_id}</code>" in section and f"<code>{run}</code>" in section
    assert "payments.wire" in section
    # The content is escaped, and a bidi override is shown, not obeyed.
    assert "<script>" not in section
    assert "&lt;script&gt;alert(1)&lt;/script&gt;\\u202eexe.fdp" in section
    assert f"flowdecision approve {held_id} --reason" in section
    assert f"flowdecision reject {held_id} --reason" in section
    # Once approved, it leaves the section.
    assert _approve(service, held_id).status_code == 200
    page = requests.get(f"{service.url}/", headers=service.headers, timeout=30).text
    section = page[page.index('<section id="holds">') :]
    assert f"<code>{held_id}</code>" not in section[: section.index("</section>")]


def test_a_fresh_service_shows_no_holds(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--approve-kinds", "fail", token=TOKEN) as fresh:
        page = requests.get(f"{fresh.url}/", headers=fresh.headers, timeout=30).text
        assert '<p id="held-count">No decision is held for approval.</p>' in page
        assert _metric(fresh, "flowdecision_held_decisions") == 0
        assert _metric(fresh, "flowdecision_held_oldest_seconds") == 0


def test_the_notify_url_must_be_http(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hold_notify_url must be an http") as refused:
        load_settings({"hold_notify_url": "ftp://u:secret@example.com/x"}, env={})
    assert "secret" not in str(refused.value)  # the password is redacted
    settings = load_settings({}, env={"FLOWDECISION_HOLD_NOTIFY_URL": "https://h.example/hook"})
    assert settings.hold_notify_url == "https://h.example/hook"
