"""``GET /v1/outbox`` as a long-poll and as server-sent events, and ``serve --relay-to``,
over real HTTP against ``flowdecision serve`` on its default layout."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from flowdecision.core.model import DecisionRequest
from tests.service_process import ServiceProcess, decision, wait_for
from tests.webhook_receiver import WebhookReceiver


def _post(proc: ServiceProcess, decision_id: str) -> int:
    body = decision(decision_id).to_json()
    return httpx.post(f"{proc.url}/v1/decisions", content=body, headers=proc.headers).status_code


def test_a_long_poll_answers_when_a_decision_commits(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path) as proc:
        started = time.monotonic()
        empty = httpx.get(f"{proc.url}/v1/outbox", params={"after": 0, "wait": 1}, timeout=30)
        assert empty.status_code == 200 and empty.json()["entries"] == []
        assert time.monotonic() - started >= 1  # it did wait
        answer: dict[str, Any] = {}

        def poll() -> None:
            begun = time.monotonic()
            got = httpx.get(f"{proc.url}/v1/outbox", params={"after": 0, "wait": 25}, timeout=60)
            answer.update(got.json(), elapsed=time.monotonic() - begun)

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.5)
        assert poller.is_alive()  # still waiting: nothing committed yet
        assert _post(proc, "lp-1") == 201
        poller.join(30)
        assert [e["decision_id"] for e in answer["entries"]] == ["lp-1"]
        assert answer["elapsed"] < 20  # woken by the commit, not by the 25 s wait ending
        bad = httpx.get(f"{proc.url}/v1/outbox", params={"wait": 31})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "wait"


def _events(lines: Any, count: int) -> list[dict[str, Any]]:
    """Read ``count`` events (skipping comments and the ``retry`` field)."""
    found: list[dict[str, Any]] = []
    event: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if "data" in event:
                found.append(event)
                if len(found) == count:
                    return found
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            event[name] = value
    raise AssertionError(f"the stream ended after {len(found)} events")


def test_an_event_stream_delivers_rows_as_they_commit_and_resumes(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path) as proc:
        assert _post(proc, "ev-0") == 201
        headers = {"Accept": "text/event-stream"}
        with httpx.stream("GET", f"{proc.url}/v1/outbox", headers=headers, timeout=30) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()
            (first,) = _events(lines, 1)  # the row already there
            for index in (1, 2):
                assert _post(proc, f"ev-{index}") == 201
            later = _events(lines, 2)  # and the rows committed while it is open
        events = [first, *later]
        assert [e["event"] for e in events] == ["decision"] * 3
        rows = [json.loads(e["data"]) for e in events]
        assert [r["decision_id"] for r in rows] == ["ev-0", "ev-1", "ev-2"]
        assert [int(e["id"]) for e in events] == [r["seq"] for r in rows]
        assert DecisionRequest.parse(json.dumps(rows[2]["request"])).decision_id == "ev-2"
        # A reconnecting client resumes after its Last-Event-ID.
        resume = {**headers, "Last-Event-ID": events[1]["id"]}
        with httpx.stream("GET", f"{proc.url}/v1/outbox", headers=resume, timeout=30) as stream:
            (again,) = _events(stream.iter_lines(), 1)
        assert json.loads(again["data"])["decision_id"] == "ev-2"
        bad = httpx.get(f"{proc.url}/v1/outbox", headers={**headers, "Last-Event-ID": "x"})
        assert bad.status_code == 422


def test_shutdown_ends_open_long_polls_and_streams(tmp_path: Path) -> None:
    proc = ServiceProcess(tmp_path, "--shutdown-grace-s", "5")
    outcomes: list[object] = []

    def hold_stream() -> None:
        headers = {"Accept": "text/event-stream"}
        try:
            with httpx.stream("GET", f"{proc.url}/v1/outbox", headers=headers, timeout=60) as s:
                outcomes.append(sum(1 for _ in s.iter_lines()))
        except httpx.HTTPError as error:
            outcomes.append(error)

    def hold_poll() -> None:
        got = httpx.get(f"{proc.url}/v1/outbox", params={"wait": 30}, timeout=60)
        outcomes.append(got.json()["entries"])

    threads = [threading.Thread(target=hold_stream), threading.Thread(target=hold_poll)]
    for thread in threads:
        thread.start()
    time.sleep(1)
    begun = time.monotonic()
    proc.terminate()
    assert proc.wait(30) == 0, proc.log_text()[-3000:]
    assert time.monotonic() - begun < 5  # not held up by the 30 s wait nor the stream
    for thread in threads:
        thread.join(10)
    proc.stop()
    assert [] in outcomes and len(outcomes) == 2, outcomes


def _metric(text: str, name: str, relay: str = "default") -> float:
    match = re.search(rf'^{name}{{relay="{relay}"}} (\S+)$', text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_serve_relay_to_delivers_through_an_outage_and_shows_its_lag(tmp_path: Path) -> None:
    receiver = WebhookReceiver().start()
    port = receiver.port
    with ServiceProcess(tmp_path, "--relay-to", receiver.url) as proc:
        for index in range(3):
            assert _post(proc, f"r-{index}") == 201
        wait_for(lambda: len(receiver.requests) == 3)
        # The cursor moves once the relay saves the batch, just after the sink accepted.
        wait_for(
            lambda: (
                _metric(httpx.get(f"{proc.url}/metrics").text, "flowdecision_relay_lag_rows") == 0
            )
        )
        metrics = httpx.get(f"{proc.url}/metrics").text
        assert _metric(metrics, "flowdecision_relay_delivered_rows") == 3
        assert _metric(metrics, "flowdecision_relay_leased") == 1
        receiver.stop()  # the engine goes down: POSTs are not affected
        for index in range(3, 6):
            assert _post(proc, f"r-{index}") == 201

        def lagging() -> bool:
            text = httpx.get(f"{proc.url}/metrics").text
            return _metric(text, "flowdecision_relay_lag_rows") == 3

        wait_for(lagging)
        # The status page shows the relay retrying (once the webhook sink's own tries are spent).
        wait_for(lambda: "retrying" in httpx.get(f"{proc.url}/").text, timeout=60)
        assert 'id="relays"' in httpx.get(f"{proc.url}/").text
        back = WebhookReceiver(port=port).start()
        try:
            wait_for(lambda: len(back.requests) == 3, timeout=60)

            def caught_up() -> bool:
                text = httpx.get(f"{proc.url}/metrics").text
                return _metric(text, "flowdecision_relay_lag_rows") == 0

            wait_for(caught_up)
        finally:
            back.stop()
        ids = [DecisionRequest.parse(body).decision_id for _, _, body in back.requests]
        assert ids == ["r-3", "r-4", "r-5"]
        assert proc.stop() == 0
    assert "relay holds its cursor" in proc.log_text()
