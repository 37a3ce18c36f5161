"""`flowdecision submit` against the real service (a `flowdecision serve` subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from flowdecision.cli import cli
from flowdecision.client import SyncDecisionClient
from flowdecision.core.model import DecisionRequest
from tests.service_process import ROOT, ServiceProcess, decision

TOKEN = "submit-test-token-9d0e"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("submit"), token=TOKEN) as proc:
        yield proc


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secrets") / "token"
    path.write_text(f"{TOKEN}\n")
    return path


def _submit(service: ServiceProcess, *args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(
        cli,
        ["submit", "--url", service.url, *args],
        input=stdin,
        env={"FLOWDECISION_TOKEN": TOKEN},
    )


def _lines(*requests: DecisionRequest) -> bytes:
    return b"".join(r.to_json() + b"\n" for r in requests)


def _known(service: ServiceProcess, decision_id: str) -> bool:
    with SyncDecisionClient(service.url, token=TOKEN) as client:
        return client.get(decision_id) is not None


def test_submit_one_pretty_printed_file_then_again(
    service: ServiceProcess, token_file: Path, tmp_path: Path
) -> None:
    request = decision()
    path = tmp_path / "decision.json"
    path.write_text(json.dumps(json.loads(request.to_json()), indent=2))  # spans many lines
    runner = CliRunner()
    args = ["submit", "--url", service.url, "--token-file", str(token_file), str(path)]
    first = runner.invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert first.stdout == f"submitted {request.decision_id} attempt 1\n"
    again = runner.invoke(cli, [*args, "--json"])
    assert again.exit_code == 0, again.output
    line = json.loads(again.stdout)
    assert line["outcome"] == "duplicate" and line["decision_id"] == request.decision_id
    assert line["attempt"] == 1 and line["line"] == 1
    assert line["receipt"]["schema"] == "a3s.code.execution-result-receipt.v1"
    assert line["request_id"]


def test_submit_a_json_lines_stream_on_stdin(service: ServiceProcess) -> None:
    first, second = decision(), decision(step=False)
    stream = _lines(first) + b"\n   \n" + _lines(second, first)  # blank lines are skipped
    result = _submit(service, "--json", "--progress", "-", stdin=stream)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(x["line"], x["decision_id"], x["outcome"]) for x in lines] == [
        (1, first.decision_id, "submitted"),
        (4, second.decision_id, "submitted"),
        (5, first.decision_id, "duplicate"),
    ]
    assert "submitting" in result.stderr  # the progress bar's label (stderr is no tty here)


def test_a_stream_from_a_real_pipe(service: ServiceProcess) -> None:
    requests = [decision() for _ in range(5)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FLOWDECISION_TOKEN": TOKEN}
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "submit", "--url", service.url, "-"],
        input=_lines(*requests),
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines() == [
        f"submitted {r.decision_id} attempt 1" for r in requests
    ]
    assert done.stderr == b""  # no progress bar: stderr is not a terminal


def test_the_first_failure_stops_the_stream_with_its_exit_code(service: ServiceProcess) -> None:
    ok, clash, never = decision(), decision(), decision()
    assert _submit(service, "-", stdin=_lines(clash)).exit_code == 0
    stream = _lines(ok, decision(clash.decision_id, n=99), never)
    result = _submit(service, "--json", "-", stdin=stream)
    assert result.exit_code == 3, result.output  # refused: a conflict
    submitted, failure = (json.loads(line) for line in result.stdout.splitlines())
    assert submitted["decision_id"] == ok.decision_id
    assert failure["line"] == 2
    assert failure["error"]["status"] == 409 and failure["error"]["code"] == "conflict"
    assert failure["error"]["decision_id"] == clash.decision_id
    assert "error: line 2:" in result.stderr
    assert not _known(service, never.decision_id)  # nothing after the failure was sent


@pytest.mark.parametrize(
    ("stdin", "code", "message"),
    [
        (_lines(decision(branch="fork")), 3, "forbidden_branch"),
        (b'{"decision_id":"d"}\n', 2, "422 invalid_request"),
        (b"{not json\n", 2, "not a JSON document nor JSON lines"),
        (b"\n\n", 2, "no decision in the input"),
    ],
)
def test_refused_and_invalid_input(
    service: ServiceProcess, stdin: bytes, code: int, message: str
) -> None:
    result = _submit(service, "-", stdin=stdin)
    assert result.exit_code == code, result.output
    assert message in result.stderr


def test_a_bad_line_mid_stream_is_reported_by_number(service: ServiceProcess) -> None:
    ok = decision()
    result = _submit(service, "-", stdin=_lines(ok) + b"oops\n")
    assert result.exit_code == 2
    assert result.stdout == f"submitted {ok.decision_id} attempt 1\n"
    assert "line 2 is not JSON" in result.stderr
    as_json = _submit(service, "--json", "-", stdin=_lines(ok) + b"oops\n")
    assert as_json.exit_code == 2
    duplicate, failure = (json.loads(line) for line in as_json.stdout.splitlines())
    assert duplicate["outcome"] == "duplicate"
    assert failure["error"]["code"] == "invalid_input"


def test_a_wrong_token_and_an_unreachable_service(service: ServiceProcess) -> None:
    runner = CliRunner()
    body = decision().to_json()
    wrong = runner.invoke(
        cli, ["submit", "--url", service.url, "-"], input=body, env={"FLOWDECISION_TOKEN": "nope"}
    )
    assert wrong.exit_code == 2 and "unauthorized" in wrong.stderr
    down = runner.invoke(
        cli, ["submit", "--url", "http://127.0.0.1:9", "--retries", "0", "-"], input=body
    )
    assert down.exit_code == 1 and "got no answer" in down.stderr
