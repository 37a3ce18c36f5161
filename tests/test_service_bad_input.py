"""What a hostile or careless client sends to the newer routes (issue 38), against a real
``flowdecision serve``: each bad value is a 422 or 413 naming it, never a 500."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import requests

from flowdecision.service.handlers import MAX_WAIT_S

from .service_process import ROOT, ServiceProcess, decision

TOKEN = "submit-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
JSON = {"Content-Type": "application/json"}
HUGE = "1" * 5000  # past int()'s 4,300-digit limit


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _cursor(position: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(
        tmp_path_factory.mktemp("bad-input"),
        token=TOKEN,
        env={"FLOWDECISION_ADMIN_TOKEN": ADMIN},
    ) as proc:
        yield proc


def _get(service: ServiceProcess, path: str, **headers: str) -> requests.Response:
    return requests.get(f"{service.url}{path}", headers={**_auth(TOKEN), **headers}, timeout=30)


def _no_bug_logged(service: ServiceProcess) -> None:
    log = service.log_text()
    assert "Traceback" not in log and '"level": "error"' not in log, log[-3000:]


@pytest.mark.parametrize(
    "path",
    [
        f"/v1/outbox?after={HUGE}",
        f"/v1/outbox?limit={HUGE}",
        f"/v1/outbox?wait={HUGE}",
        f"/v1/decisions?after={HUGE}",
        f"/v1/decisions?before={HUGE}",
        f"/v1/decisions?limit={HUGE}",
        f"/v1/audit?after={HUGE}",
        f"/v1/audit?limit={HUGE}",
        f"/v1/runs/r?before={HUGE}",
    ],
)
def test_an_integer_of_thousands_of_digits_is_out_of_range(
    service: ServiceProcess, path: str
) -> None:
    answer = _get(service, path)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    name = path.split("?")[1].split("=")[0]
    assert (error["code"], error["field"]) == ("invalid_parameter", name)
    assert error["message"].startswith(f"query parameter `{name}` must be an integer in ")
    _no_bug_logged(service)


def test_last_event_id_is_a_header_read_once_and_shown_as_sent(service: ServiceProcess) -> None:
    huge = _get(service, "/v1/outbox", **{"Last-Event-ID": HUGE})
    assert huge.status_code == 422, huge.text
    assert huge.json()["error"]["message"].startswith("header `Last-Event-ID` must be an integer")
    fullwidth = requests.get(
        f"{service.url}/v1/outbox",
        headers={**_auth(TOKEN), "Last-Event-ID": "\uff11".encode()},  # type: ignore[dict-item]
        timeout=30,
    )
    assert fullwidth.status_code == 422
    assert "got `\uff11`" in fullwidth.json()["error"]["message"]
    twice = httpx.get(
        f"{service.url}/v1/outbox",
        headers=[("Authorization", f"Bearer {TOKEN}"), ("Last-Event-ID", "1"),
                 ("Last-Event-ID", "2")],
        timeout=30,
    )  # fmt: skip
    assert twice.status_code == 422, twice.text
    assert twice.json()["error"]["message"] == (
        "header `Last-Event-ID` must be sent at most once, got 2"
    )
    _no_bug_logged(service)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/decisions?cursor=" + _cursor([1, "\ud800"]),
        "/v1/decisions?by=completed&cursor=" + _cursor([1, "\ud800", "completed"]),
        "/v1/runs/r?cursor=" + _cursor([1, "\ud800"]),
        "/v1/decisions?cursor=" + _cursor([2**76, "a"]),
        "/v1/audit?cursor=" + _cursor([2**64]),
    ],
)
def test_a_tampered_cursor_is_refused_by_name(service: ServiceProcess, path: str) -> None:
    answer = _get(service, path)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == "cursor"
    assert error["message"].startswith("query parameter `cursor` is not a cursor")
    _no_bug_logged(service)


def test_a_parameter_is_named_once_in_its_message(service: ServiceProcess) -> None:
    state = _get(service, "/v1/decisions?state=zz").json()["error"]
    assert state["message"].startswith("query parameter `state` must be one of ")
    assert state["problem"].startswith("must be one of ")
    by = _get(service, "/v1/decisions?by=zz").json()["error"]
    assert by["message"].startswith("query parameter `by` must be one of ")


def test_runs_needs_a_run_id_within_the_identifier_limit(service: ServiceProcess) -> None:
    for path in ("/v1/runs/", "/v1/runs"):
        empty = _get(service, path)
        assert empty.status_code == 422, (path, empty.text)
        assert empty.json()["error"]["field"] == "run_id"
    long_path = _get(service, "/v1/runs/" + "r" * 1025)
    assert long_path.status_code == 422
    assert long_path.json()["error"]["message"] == (
        "path parameter `run_id` is 1025 bytes of UTF-8, over the limit of 1024 bytes"
    )
    long_query = _get(service, "/v1/decisions?run_id=" + "r" * 1025)
    assert long_query.status_code == 422
    assert long_query.json()["error"]["field"] == "run_id"


def _act(service: ServiceProcess, action: str, body: bytes) -> requests.Response:
    headers = {**_auth(ADMIN), **JSON}
    return requests.post(
        f"{service.url}/v1/actions/{action}", data=body, headers=headers, timeout=30
    )


def test_an_action_body_is_bounded_before_it_is_read(service: ServiceProcess) -> None:
    body = json.dumps({"decision_id": "d", "actor": "a", "reason": "r" * 3_000_000}).encode()
    answer = _act(service, "forget", body)
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert error["code"] == "payload_too_large" and error["limit_bytes"] == 64 * 1024
    assert answer.headers["connection"] == "close"  # refused before the body was read


def test_an_action_body_with_a_repeated_field_is_refused(service: ServiceProcess) -> None:
    answer = _act(service, "release", b'{"decision_id":"d","actor":"a","reason":"1","reason":"2"}')
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["message"] == "field `reason` is given twice"


def test_a_tombstone_is_named_as_one_when_looked_up(service: ServiceProcess) -> None:
    submitted = requests.post(
        f"{service.url}/v1/decisions",
        data=decision("tomb-1").to_json(),
        headers={**_auth(TOKEN), "Content-Type": "application/json"},
        timeout=30,
    )
    assert submitted.status_code == 201, submitted.text
    pruned = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "prune", "--older-than", "0s",
         "--keep-tombstones"],
        cwd=service.cwd, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert pruned.returncode == 0, pruned.stderr
    looked_up = _get(service, "/v1/decisions/tomb-1").json()
    assert looked_up["state"] == "tombstoned" and looked_up["completed_at_ms"] is not None
    listed = _get(service, "/v1/decisions?state=tombstoned").json()["decisions"]
    assert [row["decision_id"] for row in listed] == ["tomb-1"]


def test_service_md_gives_the_wait_range_the_validator_takes(service: ServiceProcess) -> None:
    text = (ROOT / "docs" / "SERVICE.md").read_text()
    assert f"`wait=S` (0..{MAX_WAIT_S};" in text and "`wait=S` (1..30)" not in text
    assert _get(service, "/v1/outbox?wait=0").status_code == 200
    assert _get(service, f"/v1/outbox?wait={MAX_WAIT_S + 1}").status_code == 422


def test_a_body_with_too_many_values_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    chain = "[" * 100 + "]" * 100
    nested = ",".join([chain] * 20)  # 2,019 items: 2,000 arrays, 19 commas
    with ServiceProcess(tmp_path, "--max-body-values", "2000") as svc:
        body = decision("deep-1", step=False).to_json().replace(b'{"n":1}', f"[{nested}]".encode())
        refused = requests.post(f"{svc.url}/v1/decisions", data=body, headers=JSON, timeout=30)
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["limit_values"]) == ("too_many_values", 2000)
        # Brackets and commas inside strings are text, not values.
        text = json.dumps("[,{" * 3000)
        prose = decision("prose-1", step=False).to_json().replace(b'{"n":1}', text.encode())
        accepted = requests.post(f"{svc.url}/v1/decisions", data=prose, headers=JSON, timeout=30)
        assert accepted.status_code == 201, accepted.text
        fewer = ",".join([chain] * 9)  # 1,800 arrays: under the limit, parsed
        body = decision("deep-2", step=False).to_json().replace(b'{"n":1}', f"[{fewer}]".encode())
        taken = requests.post(f"{svc.url}/v1/decisions", data=body, headers=JSON, timeout=30)
        assert taken.status_code == 201, taken.text
