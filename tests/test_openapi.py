"""The OpenAPI contract: committed == served, complete, and true of real answers.

The served document comes from a real ``flowdecision serve`` process (with a
token: the contract is public). Regenerate docs/openapi.json with
``make openapi`` (``python -m flowdecision.service.openapi > docs/openapi.json``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests
import schemathesis

from flowdecision.core.identity import (
    RESULT_RECEIPT_MAX_BYTES,
    ExecutionContractError,
    ResultOutcome,
    ResultReceipt,
    decision_receipt,
)
from flowdecision.ledger.states import Completed, Held, Pending, Rejected, Tombstoned, Unavailable
from flowdecision.service.errors import HTTP_ERRORS, SERVICE_ERRORS
from flowdecision.service.openapi import openapi_document, openapi_json

from .service_process import ROOT, ServiceProcess, decision

TOKEN = "openapi-test-token-0123456789abcdef"
COMMITTED = ROOT / "docs" / "openapi.json"
SERVICE_SOURCES = sorted((ROOT / "src" / "flowdecision" / "service").rglob("*.py"))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("openapi"), token=TOKEN) as proc:
        yield proc


def _validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for one component schema, references resolved in the document."""
    document = openapi_document()
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


def _assert_valid(body: Any, name: str) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in _validator(name).iter_errors(body)]
    assert errors == [], body


# -- committed == served --------------------------------------------------------


def test_the_committed_contract_is_the_served_one(service: ServiceProcess) -> None:
    response = requests.get(f"{service.url}/openapi.json", timeout=10)  # no token: public
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-request-id"]
    assert response.content == COMMITTED.read_bytes(), (
        "docs/openapi.json is stale: run `make openapi` and commit it"
    )


def test_the_regeneration_command_prints_the_committed_file() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "flowdecision.service.openapi"],
        capture_output=True,
        check=True,
        cwd=ROOT,
    )
    assert printed.stderr == b""
    assert printed.stdout == COMMITTED.read_bytes() == openapi_json()


# -- complete and well formed ---------------------------------------------------


def test_the_contract_is_openapi_3_1_that_schemathesis_loads() -> None:
    document = openapi_document()
    assert document["openapi"] == "3.1.0"
    for name, schema in document["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema, name
    loaded = schemathesis.openapi.from_dict(json.loads(openapi_json()))
    operations = {result.ok().label for result in loaded.get_all_operations()}
    assert operations == {
        "POST /v1/decisions",
        "GET /v1/decisions",
        "GET /v1/runs/{run_id}",
        "GET /v1/audit",
        "POST /v1/actions/release",
        "POST /v1/actions/forget",
        "POST /v1/actions/outbox-retry",
        "POST /v1/actions/outbox-skip",
        "POST /v1/actions/approve",
        "POST /v1/actions/reject",
        "GET /v1/decisions/{decision_id}",
        "GET /v1/outbox",
        "GET /v1/outbox/parked",
        "GET /healthz",
        "GET /metrics",
        "GET /",
        "GET /openapi.json",
    }


def test_every_ref_resolves() -> None:
    document = openapi_document()
    text = json.dumps(document)
    for ref in set(part.split('"')[0] for part in text.split('"$ref": "')[1:]):
        node: Any = document
        for key in ref.removeprefix("#/").split("/"):
            node = node[key]
        assert node, ref


def _literal_codes() -> list[tuple[str, int, str]]:
    """(file, status, code) of every error the service sends with literal arguments."""
    found = []
    for path in SERVICE_SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            args = node.args
            if node.func.id == "error_response" and len(args) >= 2:
                status, code = args[0], args[1]
            elif node.func.id == "edge_answer" and len(args) >= 2:
                status, code = args[0], args[1]
            else:
                continue
            if isinstance(status, ast.Constant) and isinstance(code, ast.Constant):
                found.append((path.name, status.value, code.value))
    return found


def test_every_code_the_service_sends_is_in_a_table_with_its_status() -> None:
    found = _literal_codes()
    # guards: 421, 403, 415; auth: 401; transport: 408, 503; handlers: 404, 413, 422, 503
    assert len(found) >= 11, found
    for where, status, code in found:
        row = SERVICE_ERRORS.get(code) or HTTP_ERRORS.get(code)
        assert row is not None, f"{where} sends `{code}`, which no table lists"
        assert row.status == status, f"{where} sends `{code}` as {status}, listed as {row.status}"
    # http_exception_handler's codes for Starlette's own 404 and 405
    assert SERVICE_ERRORS["not_found"].status == 404
    assert SERVICE_ERRORS["method_not_allowed"].status == 405


def test_every_code_has_a_schema_and_an_operation() -> None:
    document = openapi_document()
    text = json.dumps(document["paths"])
    for code in [*HTTP_ERRORS, *SERVICE_ERRORS]:
        name = "".join(part.title() for part in code.split("_"))
        name = name if name.endswith("Error") else name + "Error"
        assert name in document["components"]["schemas"], code
        if code != "method_not_allowed":  # answered for methods no operation has
            assert f"#/components/schemas/{name}" in text, code


def test_enumerations_follow_the_library() -> None:
    schemas = openapi_document()["components"]["schemas"]
    assert schemas["Receipt"]["properties"]["outcome"]["enum"] == [o.value for o in ResultOutcome]
    assert schemas["DecisionState"]["properties"]["state"]["enum"] == [
        state.kind for state in (Pending, Completed, Tombstoned, Held, Rejected, Unavailable)
    ]


def test_retry_after_is_declared_where_the_table_sends_it() -> None:
    post = openapi_document()["paths"]["/v1/decisions"]["post"]["responses"]
    assert "Retry-After" in post["409"]["headers"]  # busy
    assert "Retry-After" in post["503"]["headers"]  # ledger_unavailable, shutting_down...
    assert "Retry-After" not in post["422"]["headers"]
    assert "Preference-Applied" in post["200"]["headers"]
    assert post["201"]["links"]["GetDecision"]["operationId"] == "getDecision"


@pytest.mark.parametrize(
    ("change", "valid"),
    [
        ({}, True),
        ({"outcome": "failed"}, False),  # a failed outcome carries no digest
        ({"outcome": "failed", "result_digest": None, "result_bytes": 0}, True),
        ({"result_bytes": 0}, False),  # succeeded needs bytes
        ({"result_digest": None}, False),  # ... and a digest
        ({"schema": "other.v1"}, False),
        ({"evidence_digest": "sha256:XYZ"}, False),
        ({"result_bytes": RESULT_RECEIPT_MAX_BYTES + 1}, False),
    ],
)
def test_the_receipt_schema_states_the_receipt_rules(change: dict[str, Any], valid: bool) -> None:
    _identity, receipt = decision_receipt(decision())
    body: dict[str, Any] = {**receipt.to_dict(), **change}
    body = {key: value for key, value in body.items() if value is not None}
    assert _validator("Receipt").is_valid(body) is valid
    try:  # the library agrees
        ResultReceipt.from_dict(body).validate()
        accepted = True
    except ExecutionContractError:
        accepted = False
    assert accepted is valid


# -- true of real answers -------------------------------------------------------


def test_real_answers_validate_against_the_contract(service: ServiceProcess) -> None:
    url, headers = service.url, service.headers
    request = decision()
    body = request.to_json()
    created = requests.post(f"{url}/v1/decisions", data=body, headers=headers, timeout=10)
    assert created.status_code == 201
    _assert_valid(created.json(), "Outcome")
    again = requests.post(f"{url}/v1/decisions", data=body, headers=headers, timeout=10)
    assert again.status_code == 200
    _assert_valid(again.json(), "Outcome")
    state = requests.get(f"{url}/v1/decisions/{request.decision_id}", headers=headers, timeout=10)
    _assert_valid(state.json(), "DecisionState")
    page = requests.get(f"{url}/v1/outbox?after=0&limit=5", headers=headers, timeout=10)
    _assert_valid(page.json(), "OutboxPage")
    assert page.json()["entries"]
    health = requests.get(f"{url}/healthz", timeout=10)
    _assert_valid(health.json(), "Health")

    other = decision(request.decision_id, n=2)
    conflict = requests.post(f"{url}/v1/decisions", data=other.to_json(), headers=headers)
    assert conflict.status_code == 409
    _assert_valid(conflict.json(), "ConflictError")
    fork = decision(branch="fork")
    forbidden = requests.post(f"{url}/v1/decisions", data=fork.to_json(), headers=headers)
    _assert_valid(forbidden.json(), "ForbiddenBranchError")
    bad = requests.post(f"{url}/v1/decisions", data=b'{"decision_id":5}', headers=headers)
    _assert_valid(bad.json(), "InvalidRequestError")
    missing = requests.get(f"{url}/v1/decisions/nope-{uuid.uuid4().hex}", headers=headers)
    _assert_valid(missing.json(), "NotFoundError")
    no_token = requests.get(f"{url}/metrics", timeout=10)
    assert no_token.status_code == 401
    _assert_valid(no_token.json(), "UnauthorizedError")
    bad_limit = requests.get(f"{url}/v1/outbox?limit=0", headers=headers, timeout=10)
    _assert_valid(bad_limit.json(), "InvalidParameterError")


def test_the_docs_link_the_contract() -> None:
    assert "openapi.json" in (ROOT / "docs" / "SERVICE.md").read_text(encoding="utf-8")
    assert "openapi.json" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert Path(COMMITTED).is_file()
