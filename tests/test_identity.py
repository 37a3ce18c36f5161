"""Execution identities, result receipts and the dispatcher's receipt helper."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import pytest

from flowdecision.core.identity import (
    DECISION_IDENTITY_DOMAIN,
    EVIDENCE_DOMAIN,
    IDENTITY_SCHEMA,
    RECEIPT_SCHEMA,
    RESULT_DOMAIN,
    RESULT_RECEIPT_MAX_BYTES,
    DecisionTooLargeError,
    ExecutionContractError,
    ExecutionIdentity,
    ExecutionIdentityError,
    ResultOutcome,
    ResultReceipt,
    ResultReceiptError,
    decision_receipt,
    digest_bytes,
)
from flowdecision.core.jsonwire import encode_json
from flowdecision.core.model import Complete, DecisionRequest

DIGEST_A = "sha256:" + "ab" * 32
DIGEST_B = "sha256:" + "0123456789abcdef" * 4
DOMAIN_MSG = "execution identity domain is empty or invalid"
DIGEST_MSG = "execution identity digest is invalid"


def _identity() -> ExecutionIdentity:
    return ExecutionIdentity(DECISION_IDENTITY_DOMAIN, DIGEST_B)


def _request(output: Any = None) -> DecisionRequest:
    return DecisionRequest("dec-1", "run-1", "production", "evt-1", Complete(output))


# ------------------------------------------------------------------------ digests


def test_digest_bytes_is_domain_separated() -> None:
    expected = hashlib.sha256(b"a3s.test\x00payload").hexdigest()
    assert digest_bytes("a3s.test", b"payload") == "sha256:" + expected
    assert digest_bytes("a3s.test", b"x") != digest_bytes("a3s.tes", b"tx")
    assert digest_bytes("d", bytearray(b"x")) == digest_bytes("d", memoryview(b"x"))


# ----------------------------------------------------------------------- identity


def test_identity_field_order_and_defaults() -> None:
    identity = _identity()
    assert identity.schema == IDENTITY_SCHEMA
    assert list(identity.to_dict()) == ["schema", "domain", "digest"]
    assert (
        identity.to_json()
        == (
            f'{{"schema":"{IDENTITY_SCHEMA}","domain":"{DECISION_IDENTITY_DOMAIN}",'
            f'"digest":"{DIGEST_B}"}}'
        ).encode()
    )
    assert ExecutionIdentity.from_json(identity.to_json()) == identity
    assert identity.key == f"{DECISION_IDENTITY_DOMAIN}:{DIGEST_B}"
    identity.validate()


@pytest.mark.parametrize(
    "domain",
    ["", "A", "a b", "a/b", "dömain", "a\nb", "a\x00b", "a" * 129, "a\n"],
)
def test_invalid_domains(domain: str) -> None:
    with pytest.raises(ExecutionIdentityError) as caught:
        ExecutionIdentity.derive(domain, {"k": 1})
    assert str(caught.value) == DOMAIN_MSG
    with pytest.raises(ExecutionIdentityError) as caught:
        ExecutionIdentity(domain, DIGEST_A).validate()
    assert str(caught.value) == DOMAIN_MSG


@pytest.mark.parametrize("domain", ["a", "a" * 128, "._-0123456789", "a3s.code.x-y_z"])
def test_valid_domains(domain: str) -> None:
    ExecutionIdentity.derive(domain, None).validate()


def test_wrong_schema_reports_the_domain_message() -> None:
    identity = ExecutionIdentity(DECISION_IDENTITY_DOMAIN, DIGEST_A, schema="v2")
    with pytest.raises(ExecutionIdentityError) as caught:
        identity.validate()
    assert str(caught.value) == DOMAIN_MSG


@pytest.mark.parametrize(
    "digest",
    [
        "",
        "sha256:",
        "ab" * 32,
        "sha256:" + "AB" * 32,
        "sha256:" + "a" * 63,
        "sha256:" + "a" * 65,
        "sha512:" + "a" * 64,
        "sha256:" + "g" * 64,
        "sha256:" + "a" * 64 + "\n",
    ],
)
def test_invalid_digests(digest: str) -> None:
    with pytest.raises(ExecutionIdentityError) as caught:
        ExecutionIdentity(DECISION_IDENTITY_DOMAIN, digest).validate()
    assert str(caught.value) == DIGEST_MSG


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"schema": IDENTITY_SCHEMA, "domain": "a"}, "missing field `digest`"),
        ({"domain": "a", "digest": DIGEST_A}, "missing field `schema`"),
        (
            {"schema": IDENTITY_SCHEMA, "domain": "a", "digest": DIGEST_A, "x": 1},
            "unknown field `x`, expected one of `schema`, `domain`, `digest`",
        ),
        ({"schema": IDENTITY_SCHEMA, "domain": 5, "digest": DIGEST_A}, "field `domain`"),
        (["a"], "expected a JSON object"),
    ],
)
def test_identity_from_dict_rejects(obj: Any, message: str) -> None:
    with pytest.raises(ExecutionIdentityError) as caught:
        ExecutionIdentity.from_dict(obj)
    assert message in str(caught.value)


def test_identity_from_json_rejects_duplicate_fields() -> None:
    text = f'{{"schema":"{IDENTITY_SCHEMA}","domain":"a","domain":"b","digest":"{DIGEST_A}"}}'
    with pytest.raises(ExecutionIdentityError, match="duplicate field `domain`"):
        ExecutionIdentity.from_json(text)


def test_derive_sorts_keys_and_encodes_compactly() -> None:
    value = {"b": {"d": 1, "c": [{"f": 0, "e": 1.0}]}, "a": []}
    payload = b'{"a":[],"b":{"c":[{"e":1.0,"f":0}],"d":1}}'
    identity = ExecutionIdentity.derive("a3s.test", value)
    assert identity.digest == digest_bytes("a3s.test", payload)
    assert identity.domain == "a3s.test"


def test_derive_from_request_equals_derive_from_its_dict() -> None:
    request = DecisionRequest.parse(
        '{"decision_id":"d","run_id":"r","authority_branch_id":"production",'
        '"causation_event_id":"e","decision":{"type":"schedule_steps","steps":['
        '{"step_id":"s","step_name":"n","input":{"z":[1.5e-5,-0],"a":"\\u2028"},'
        '"retry":{"max_attempts":2,"delay_ms":1,"backoff":"exponential","max_delay_ms":4,'
        '"on_exhausted":"continue_workflow"}}]}}'
    )
    from_request = ExecutionIdentity.derive(DECISION_IDENTITY_DOMAIN, request)
    from_dict = ExecutionIdentity.derive(DECISION_IDENTITY_DOMAIN, request.to_dict())
    assert from_request == from_dict
    assert from_request.digest == digest_bytes(
        DECISION_IDENTITY_DOMAIN, encode_json(request.to_dict(), sort_keys=True)
    )
    assert from_request.digest == digest_bytes(DECISION_IDENTITY_DOMAIN, request.canonical_json())


def test_derive_rejects_values_that_are_not_json() -> None:
    with pytest.raises(ExecutionIdentityError, match="not JSON"):
        ExecutionIdentity.derive("a3s.test", [float("nan")])


# ------------------------------------------------------------------------ receipts


def _receipt(**overrides: Any) -> ResultReceipt:
    fields: dict[str, Any] = {
        "identity": _identity(),
        "evidence_digest": DIGEST_A,
        "outcome": ResultOutcome.SUCCEEDED,
        "result_digest": DIGEST_A,
        "result_bytes": 6,
    }
    fields.update(overrides)
    return ResultReceipt.new(**fields)


def test_receipt_json_round_trip_in_rust_field_order() -> None:
    receipt = _receipt()
    assert receipt.schema == RECEIPT_SCHEMA
    assert list(receipt.to_dict()) == [
        "schema",
        "identity",
        "evidence_digest",
        "outcome",
        "result_digest",
        "result_bytes",
    ]
    assert (
        receipt.to_json()
        == (
            f'{{"schema":"{RECEIPT_SCHEMA}","identity":{_identity().to_json().decode()},'
            f'"evidence_digest":"{DIGEST_A}","outcome":"succeeded","result_digest":"{DIGEST_A}",'
            '"result_bytes":6}'
        ).encode()
    )
    assert ResultReceipt.from_json(receipt.to_json()) == receipt
    assert pickle.loads(pickle.dumps(receipt)) == receipt


def test_receipt_without_digest_omits_the_field() -> None:
    receipt = _receipt(outcome="failed", result_digest=None, result_bytes=0)
    assert receipt.outcome is ResultOutcome.FAILED
    assert "result_digest" not in receipt.to_dict()
    assert list(receipt.to_dict())[-1] == "result_bytes"
    assert ResultReceipt.from_json(receipt.to_json()) == receipt


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"evidence_digest": "sha256:"},
            "execution result receipt field `evidence_digest` is invalid",
        ),
        (
            {"result_digest": "sha256:ABC"},
            "execution result receipt field `result_digest` is invalid",
        ),
        ({"result_bytes": 0}, "execution result receipt field `result_bytes` is invalid"),
        ({"result_digest": None}, "execution result receipt field `outcome` is invalid"),
        (
            {"result_bytes": RESULT_RECEIPT_MAX_BYTES + 1},
            "execution result receipt exceeds its byte limit",
        ),
        (
            {"outcome": "failed", "result_digest": None, "result_bytes": 1},
            "execution result receipt field `outcome` is invalid",
        ),
        (
            {"outcome": "cancelled", "result_bytes": 0},
            "execution result receipt field `outcome` is invalid",
        ),
        (
            {
                "outcome": "timed_out",
                "result_digest": None,
                "result_bytes": RESULT_RECEIPT_MAX_BYTES + 1,
            },
            "execution result receipt exceeds its byte limit",
        ),
        (
            {"identity": ExecutionIdentity("a", "x"), "evidence_digest": "bad"},
            DIGEST_MSG,
        ),
        (
            {"identity": ExecutionIdentity("A", DIGEST_A)},
            DOMAIN_MSG,
        ),
    ],
)
def test_receipt_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ExecutionContractError) as caught:
        _receipt(**overrides)
    assert str(caught.value) == message


def test_receipt_schema_checked_first() -> None:
    with pytest.raises(ResultReceiptError) as caught:
        ResultReceipt("x", ExecutionIdentity("a", "x"), "bad", ResultOutcome.SUCCEEDED, None, 0)
    assert str(caught.value) == "execution result receipt field `schema` is invalid"


def test_receipt_at_byte_limit_is_valid() -> None:
    assert _receipt(result_bytes=RESULT_RECEIPT_MAX_BYTES).result_bytes == RESULT_RECEIPT_MAX_BYTES


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"extra": True}, "unknown field `extra`"),
        ({"outcome": "skipped"}, "unknown variant `skipped`"),
        ({"result_bytes": -1}, "field `result_bytes`"),
        ({"result_bytes": True}, "field `result_bytes`"),
    ],
)
def test_receipt_from_dict_rejects(change: dict[str, Any], message: str) -> None:
    obj = {**_receipt().to_dict(), **change}
    with pytest.raises(ResultReceiptError) as caught:
        ResultReceipt.from_dict(obj)
    assert message in str(caught.value)


def test_receipt_from_dict_requires_fields_but_not_result_digest() -> None:
    obj = _receipt(outcome="failed", result_digest=None, result_bytes=0).to_dict()
    assert ResultReceipt.from_dict({**obj, "result_digest": None}).result_digest is None
    for key in ["schema", "identity", "evidence_digest", "outcome", "result_bytes"]:
        with pytest.raises(ResultReceiptError, match=f"missing field `{key}`"):
            ResultReceipt.from_dict({k: v for k, v in obj.items() if k != key})


def test_outcome_values() -> None:
    assert [outcome.value for outcome in ResultOutcome] == [
        "succeeded",
        "failed",
        "cancelled",
        "timed_out",
    ]
    assert ResultOutcome("timed_out") is ResultOutcome.TIMED_OUT
    assert isinstance(ResultOutcome.CANCELLED, str)
    assert str(ResultOutcome.CANCELLED) == "cancelled"


# -------------------------------------------------------------- decision_receipt


def test_decision_receipt_binds_request_and_decision() -> None:
    request = _request({"b": 1, "a": [True, None]})
    identity, receipt = decision_receipt(request)
    decision_json = b'{"type":"complete","output":{"a":[true,null],"b":1}}'
    assert request.decision_json() == decision_json
    assert identity == ExecutionIdentity.derive(DECISION_IDENTITY_DOMAIN, request)
    assert receipt.identity == identity
    assert receipt.outcome is ResultOutcome.SUCCEEDED
    assert receipt.evidence_digest == digest_bytes(EVIDENCE_DOMAIN, b"evt-1")
    assert receipt.result_digest == digest_bytes(RESULT_DOMAIN, decision_json)
    assert receipt.result_bytes == len(decision_json)


def test_decision_receipt_too_large() -> None:
    overhead = len(b'{"type":"complete","output":""}')
    at_limit = _request("x" * (RESULT_RECEIPT_MAX_BYTES - overhead))
    assert decision_receipt(at_limit)[1].result_bytes == RESULT_RECEIPT_MAX_BYTES

    too_large = _request("x" * (RESULT_RECEIPT_MAX_BYTES - overhead + 1))
    with pytest.raises(DecisionTooLargeError) as caught:
        decision_receipt(too_large)
    assert str(caught.value) == "decision `dec-1` result exceeds 1048576 bytes"
    assert caught.value.size == RESULT_RECEIPT_MAX_BYTES + 1
    assert isinstance(caught.value, ValueError)
    assert pickle.loads(pickle.dumps(caught.value)).decision_id == "dec-1"


def test_decision_receipt_is_a_valid_receipt_equal_to_the_checked_constructor() -> None:
    from flowdecision.core.identity import (
        EVIDENCE_DOMAIN,
        RESULT_DOMAIN,
        ResultOutcome,
        ResultReceipt,
        decision_receipt,
        digest_bytes,
    )
    from flowdecision.core.model import DecisionRequest

    req = DecisionRequest.parse(
        b'{"decision_id":"d","run_id":"r","authority_branch_id":"production",'
        b'"causation_event_id":"e","decision":{"type":"fail","error":"x"}}'
    )
    identity, receipt = decision_receipt(req)
    identity.validate()
    receipt.validate()
    # Built directly and marked valid: what derive returns, and it passes the rules afresh.
    derived = ExecutionIdentity.derive(DECISION_IDENTITY_DOMAIN, req)
    assert identity == derived and repr(identity) == repr(derived)
    ExecutionIdentity(domain=identity.domain, digest=identity.digest).validate()
    checked = ResultReceipt.new(
        identity,
        digest_bytes(EVIDENCE_DOMAIN, b"e"),
        ResultOutcome.SUCCEEDED,
        digest_bytes(RESULT_DOMAIN, req.decision_json()),
        len(req.decision_json()),
    )
    assert receipt == checked and receipt.to_json() == checked.to_json()
