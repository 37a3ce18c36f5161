"""Schemathesis against a real ``flowdecision serve`` (uvicorn on a socket, token auth on).

One bounded run of the ``st`` CLI over every operation of the served contract:
the examples, coverage, fuzzing (positive and negative data) and stateful
phases (``POST /v1/decisions`` then ``GET`` of the same id through the
contract's links), at most :data:`MAX_EXAMPLES` cases per operation, with a
fixed seed so a failure reproduces. tests/schemathesis_hooks.py sends half of
the generated decisions on the production branch, so the links are followed.

Below it, regression tests for what Schemathesis found (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from .service_process import ROOT, ServiceProcess, decision

#: The run of this module's own decisions: the fuzzer may close `run-1` with a
#: `complete` (the run invariants), after which a step of it is 409 `run_closed`.
OWN_RUN = "run-schemathesis-own"

TOKEN = "schemathesis-token-0123456789abcdef"
MAX_EXAMPLES = 50
SEED = 20261203
#: Each must hold for every response; see `st run --help` for what they check.
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "unsupported_method",
    "allow_header_conformance",
    "ignored_auth",
    "ensure_resource_availability",
    "use_after_free",
    "negative_data_rejection",
)
# Not `positive_data_acceptance`: JSON Schema calls `3.0` an integer, which the
# parser (like serde) refuses for a u32, and bounds identifiers in characters,
# not bytes; both are answered 422 as declared (docs/RELIABILITY.md).


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("schemathesis"), token=TOKEN) as proc:
        yield proc


def _st() -> str:
    return str(Path(sys.executable).with_name("st"))


def test_schemathesis_finds_nothing(service: ServiceProcess, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
    }
    run = subprocess.run(
        [
            _st(),
            "run",
            f"{service.url}/openapi.json",
            "--header",
            f"Authorization: Bearer {TOKEN}",
            "--checks",
            ",".join(CHECKS),
            "--max-examples",
            str(MAX_EXAMPLES),
            "--seed",
            str(SEED),
            # One worker: CPython 3.11's ast is not thread-safe (gh-106905,
            # "AST constructor recursion depth mismatch" from two workers' threads).
            "--workers",
            "1",
            "--request-timeout",
            "20",
            "--max-failures",
            "20",
            "--no-color",
            "--report",
            "json",
            "--report-json-path",
            str(report),
        ],
        cwd=tmp_path,  # st keeps a .schemathesis cache in its working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    summary = json.loads(report.read_text(encoding="utf-8"))
    cases = summary["test_cases"]
    print(f"schemathesis: {cases['generated']} cases, {summary['running_time']:.1f} s")
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert summary["failures"] == [] and summary["errors"] == []
    assert summary["operations"]["tested"] == summary["operations"]["total"] >= 6
    # Each phase ran and the stateful one followed the POST -> GET link.
    assert cases["generated"] >= 500, cases
    assert "Stateful" in run.stdout and "API Links:" in run.stdout, run.stdout[-3000:]
    assert "✅ Stateful" in run.stdout


# -- what Schemathesis found -------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("PUT", "/healthz"), ("POST", "/healthz"), ("PATCH", "/v1/decisions/x"), ("PUT", "/")],
)
def test_a_method_no_route_takes_is_405_not_415(
    service: ServiceProcess, method: str, path: str
) -> None:
    # Was 415 unsupported_media_type: the content-type guard ran before routing
    # for every body method on every path.
    answer = requests.request(
        method, f"{service.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    assert answer.status_code == 405, answer.text
    assert answer.json()["error"]["code"] == "method_not_allowed"
    assert "GET" in answer.headers["allow"]


def test_a_post_of_another_type_to_the_decisions_path_is_still_415(
    service: ServiceProcess,
) -> None:
    answer = requests.post(
        f"{service.url}/v1/decisions",
        data=decision(run_id=OWN_RUN).to_json(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "text/plain"},
        timeout=10,
    )
    assert answer.status_code == 415
    assert answer.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("query", ["limit=x&limit=&limit=", "after=1&after=2", "limit=5&limit=5"])
def test_a_repeated_query_parameter_is_refused(service: ServiceProcess, query: str) -> None:
    # Was 200: Starlette keeps the last value, so `limit=x&limit=` read as the default.
    answer = requests.get(f"{service.url}/v1/outbox?{query}", headers=service.headers, timeout=10)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_parameter"
    assert error["field"] == query.split("=")[0]
    assert "at most once" in error["problem"]


def test_a_huge_number_in_an_ignored_member_is_accepted(service: ServiceProcess) -> None:
    # Was 422: exact-number checking covered members the model ignores.
    body = json.loads(decision(run_id=OWN_RUN).to_json())
    body["extension"] = {"n": 11161103754368468910080}
    text = json.dumps(body)
    assert "11161103754368468910080" in text
    answer = requests.post(f"{service.url}/v1/decisions", data=text, headers=service.headers)
    assert answer.status_code == 201, answer.text
    state = requests.get(
        f"{service.url}/v1/decisions/{body['decision_id']}", headers=service.headers, timeout=10
    )
    assert state.json()["state"] == "completed"
