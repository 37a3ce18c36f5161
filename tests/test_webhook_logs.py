"""What the webhook sink logs (issue 38, items 11 and 12): one warning per distinct
failure of a decision, not one per try; and no sink URL, whose query string can hold a
token, in any log line or error message (the HTTP library's loggers included)."""

from __future__ import annotations

import logging
import socket

import pytest

from flowdecision.sinks.webhook import WebhookError, WebhookSink
from tests.service_process import decision
from tests.webhook_receiver import WebhookReceiver

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.02}
RETRYING = "webhook delivery failed, retrying"
SECRET = "s3cret-in-the-query"


@pytest.fixture
def receiver() -> object:
    with WebhookReceiver() as server:
        yield server


def _retries(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and r.getMessage() == RETRYING]


async def test_a_repeated_failure_is_one_warning_and_each_new_one_another(
    receiver: WebhookReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.set_script([(503, {}), (503, {}), (503, {}), (500, {}), (500, {}), (201, {})])
    caplog.set_level(logging.DEBUG, logger="flowdecision.sinks.webhook")
    async with WebhookSink(receiver.url, max_attempts=10, **FAST) as sink:
        await sink.submit(decision("dec-noisy"), 1)
    assert len(receiver.requests) == 6
    warnings = _retries(caplog, logging.WARNING)
    assert [(w.problem, getattr(w, "try")) for w in warnings] == [("HTTP 503", 1), ("HTTP 500", 4)]  # type: ignore[attr-defined]
    # The repeats are still there for whoever asks for DEBUG, and the end is said once.
    assert [getattr(r, "try") for r in _retries(caplog, logging.DEBUG)] == [2, 3, 5]  # type: ignore[attr-defined]
    [recovered] = [r for r in caplog.records if r.levelno == logging.INFO]
    assert recovered.decision_id == "dec-noisy" and getattr(recovered, "try") == 6  # type: ignore[attr-defined]


async def test_a_decision_that_keeps_failing_across_calls_warns_once(
    receiver: WebhookReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    # A relay calls submit() again and again for a row whose engine is down: the
    # warning is not repeated on every call, but another decision gets its own.
    receiver.set_script([(503, {})])
    caplog.set_level(logging.WARNING, logger="flowdecision.sinks.webhook")
    async with WebhookSink(receiver.url, max_attempts=3, **FAST) as sink:
        for _ in range(4):
            with pytest.raises(WebhookError, match="HTTP 503"):
                await sink.submit(decision("dec-down"), 1)
        with pytest.raises(WebhookError):
            await sink.submit(decision("dec-other"), 1)
    assert len(receiver.requests) == 15
    assert [w.decision_id for w in _retries(caplog, logging.WARNING)] == ["dec-down", "dec-other"]  # type: ignore[attr-defined]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_no_log_line_or_error_names_the_sink_url_with_its_token(
    receiver: WebhookReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)  # every logger, the HTTP library's included
    receiver.set_script([(503, {}), (200, {})])
    async with WebhookSink(f"{receiver.url}?token={SECRET}", **FAST) as sink:
        await sink.submit(decision(), 1)
        await sink.submit(decision(), 1)
    assert [path.endswith(f"?token={SECRET}") for path, _h, _b in receiver.requests] == [True] * 3

    down = f"http://127.0.0.1:{_free_port()}/hooks?token={SECRET}"
    async with WebhookSink(down, max_attempts=2, **FAST) as sink:
        with pytest.raises(WebhookError) as refused:
            await sink.submit(decision(), 1)
    async with WebhookSink(f"http:///hooks?token={SECRET}", **FAST) as sink:
        with pytest.raises(Exception) as unsendable:
            await sink.submit(decision(), 1)

    assert caplog.records  # the retries were logged: the check below saw real lines
    for record in caplog.records:
        assert SECRET not in record.getMessage(), record.name
        assert SECRET not in str(vars(record)), record.name
    for error in (refused.value, unsendable.value):
        assert SECRET not in str(error) and SECRET not in repr(error)
    assert "?token=***" in str(unsendable.value)
