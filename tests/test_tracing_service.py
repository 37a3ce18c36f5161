"""Traces of the real service (`flowdecision serve --otel`), exported over OTLP/HTTP to a
receiver this test runs on localhost: the wire path, the caller's traceparent honoured,
the request id in the span and the log line, and a duplicate's link to the submission
that counted across a restart and across two replicas of one store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.service_process import ServiceProcess, decision, wait_for

ROOT = Path(__file__).resolve().parent.parent
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SERVER_KIND = 2  # SPAN_KIND_SERVER in OTLP


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def _env(receiver: OtlpReceiver, name: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": name,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s (the default is 5 s)
    }


def _post(url: str, body: bytes, traceparent: str, request_id: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/decisions",
        content=body,
        headers={
            "Content-Type": "application/json",
            "traceparent": traceparent,
            "tracestate": "vendor=opaque",
            "X-Request-Id": request_id,
        },
        timeout=30,
    )


def _one(receiver: OtlpReceiver, name: str, trace_id: str) -> ReceivedSpan:
    """The one span ``name`` of trace ``trace_id``, once the receiver has it."""
    found: list[ReceivedSpan] = []

    def arrived() -> bool:
        found[:] = [s for s in receiver.named(name) if s.trace_id == trace_id]
        return bool(found)

    wait_for(arrived, timeout=30)
    assert len(found) == 1, found
    return found[0]


def test_a_post_traced_over_otlp_and_its_duplicate_after_a_restart(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    request = decision()
    with ServiceProcess(tmp_path, "--otel", env=_env(receiver, "fd-first")) as first:
        answer = _post(first.url, request.to_json(), f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "r-1")
        assert answer.status_code == 201, answer.text
        server = _one(receiver, "POST /v1/decisions", CALLER_TRACE)
        dispatch = _one(receiver, "flowdecision.dispatch", CALLER_TRACE)
        log = first.log_text()
    # The caller's span is the server span's parent; the tree hangs below it.
    assert server.parent_span_id == CALLER_SPAN
    assert server.kind == SERVER_KIND
    assert server.service_name == "fd-first"
    assert server.attributes["flowdecision.request_id"] == answer.headers["x-request-id"] == "r-1"
    assert server.attributes["http.response.status_code"] == 201
    assert server.attributes["http.route"] == "/v1/decisions"
    assert dispatch.parent_span_id == server.span_id
    assert dispatch.attributes["flowdecision.outcome"] == "submitted"
    assert dispatch.attributes["flowdecision.decision_id"] == request.decision_id
    assert dispatch.attributes["flowdecision.ledger.backend"] == "sqlite"
    # The request's whole trace: the server span and the dispatch span (the joint
    # transaction's one span), which links to its group-commit batch (a trace of its own).
    assert sorted(s.name for s in receiver.spans if s.trace_id == CALLER_TRACE) == [
        "POST /v1/decisions",
        "flowdecision.dispatch",
    ]
    [batch] = dispatch.links
    [commit] = [s for s in receiver.named("flowdecision.ledger.commit") if s.span_id == batch[1]]
    assert (commit.trace_id, commit.parent_span_id, commit.links) == (batch[0], "", [])
    # The JSON access-log line carries the ids of the request's server span.
    [line] = [
        json.loads(text)
        for text in log.splitlines()
        if text.startswith("{") and '"request_id": "r-1"' in text and "http_request" in text
    ]
    assert (line["trace_id"], line["span_id"]) == (CALLER_TRACE, server.span_id)

    # A new process on the same store: the retry links to the submission that counted.
    retry_trace = "0af7651916cd43dd8448eb211c80319c"
    with ServiceProcess(tmp_path, "--otel", env=_env(receiver, "fd-second")) as second:
        again = _post(second.url, request.to_json(), f"00-{retry_trace}-b7ad6b7169203331-01", "r-2")
        assert again.status_code == 200 and again.json()["outcome"] == "duplicate"
        duplicate = _one(receiver, "flowdecision.dispatch", retry_trace)
    assert duplicate.attributes["flowdecision.outcome"] == "duplicate"
    assert duplicate.service_name == "fd-second"
    assert (CALLER_TRACE, dispatch.span_id) in duplicate.links


def test_two_replicas_link_a_duplicate_and_a_conflict_to_the_original(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    request = decision()
    with (
        ServiceProcess(tmp_path, "--otel", env=_env(receiver, "replica-a")) as a,
        ServiceProcess(tmp_path, "--otel", env=_env(receiver, "replica-b")) as b,
    ):
        first_trace, dup_trace, conflict_trace = (f"{n:032x}" for n in (0xA1, 0xB2, 0xC3))
        assert _post(a.url, request.to_json(), f"00-{first_trace}-{1:016x}-01", "a").status_code
        original = _one(receiver, "flowdecision.dispatch", first_trace)
        dup = _post(b.url, request.to_json(), f"00-{dup_trace}-{2:016x}-01", "b")
        assert dup.status_code == 200
        changed = decision(request.decision_id, n=2).to_json()
        refused = _post(b.url, changed, f"00-{conflict_trace}-{3:016x}-01", "c")
        assert refused.status_code == 409
        duplicate = _one(receiver, "flowdecision.dispatch", dup_trace)
        conflict = _one(receiver, "flowdecision.dispatch", conflict_trace)
        server = _one(receiver, "POST /v1/decisions", conflict_trace)
    assert original.service_name == "replica-a"
    assert duplicate.service_name == conflict.service_name == "replica-b"
    assert (first_trace, original.span_id) in duplicate.links
    assert (first_trace, original.span_id) in conflict.links
    assert conflict.status_code == 2 and conflict.status_message == "conflict"
    assert "flowdecision.conflict" in conflict.events
    assert server.attributes["http.response.status_code"] == 409


def test_submit_trace_starts_a_root_span_that_the_service_continues(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    request = decision()
    source = tmp_path / "decision.json"
    source.write_bytes(request.to_json())
    with ServiceProcess(tmp_path, "--otel", env=_env(receiver, "fd-service")) as service:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")},
            **_env(receiver, "fd-agent"),
            "PYTHONPATH": str(ROOT / "src"),
        }
        done = subprocess.run(
            [sys.executable, "-m", "flowdecision.cli", "submit", "--trace",
             "--url", service.url, str(source)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        [trace_line] = [line for line in done.stderr.splitlines() if line.startswith("trace ")]
        trace_id = trace_line.split()[1]
        root = _one(receiver, "flowdecision submit", trace_id)
        server = _one(receiver, "POST /v1/decisions", trace_id)
    assert root.service_name == "fd-agent" and root.parent_span_id == ""
    assert server.service_name == "fd-service"
    assert server.parent_span_id == root.span_id


def test_otel_without_the_sdk_is_a_usage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'opentelemetry':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")},
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--otel", "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "pip install 'flowdecision[otel]'" in done.stderr


def test_the_standalone_relay_continues_each_rows_trace_with_otel(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    """``flowdecision relay --otel``: the webhook gets the row's trace, not ``null``."""
    from tests.webhook_receiver import WebhookReceiver

    with ServiceProcess(tmp_path, "--otel", env=_env(receiver, "fd-serve")) as proc:
        answer = _post(proc.url, decision().to_json(), f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "r")
        assert answer.status_code == 201, answer.text
    outbox = f"sqlite:///{tmp_path / '.flowdecision' / 'flowdecision.db'}"
    with WebhookReceiver() as hook:
        env = {**os.environ, **_env(receiver, "fd-relay")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        done = subprocess.run(
            [sys.executable, "-m", "flowdecision.cli", "relay", "--from", outbox,
             "--to", hook.url, "--once", "--otel"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        ((_, headers, _),) = hook.requests
    deliver = _one(receiver, "flowdecision.relay.deliver", CALLER_TRACE)
    assert deliver.service_name == "fd-relay"
    traceparent = {key.lower(): value for key, value in headers.items()}["traceparent"]
    assert traceparent.split("-")[1] == CALLER_TRACE  # the POST's trace reaches the engine
