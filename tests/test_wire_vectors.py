"""Replay the Rust reference vectors in tests/data/hash_vectors*.jsonl byte for byte."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from flowdecision.core.identity import (
    DECISION_IDENTITY_DOMAIN,
    EVIDENCE_DOMAIN,
    ExecutionIdentity,
    ResultOutcome,
    decision_receipt,
    digest_bytes,
)
from flowdecision.core.model import Complete, DecisionRequest, InvalidRequestError, request_hash

DATA = Path(__file__).parent / "data"


def _load(name: str) -> list[dict[str, Any]]:
    # Split on "\n" only: some lines hold raw U+2028/U+2029, which
    # str.splitlines() would also treat as line breaks.
    text = (DATA / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line]


VECTORS = _load("hash_vectors.jsonl")
VALID = [v for v in VECTORS if "serialized" in v]
INVALID = [v for v in VECTORS if "error" in v]
QUIRKS = {v["label"]: v for v in _load("hash_vectors.quirks.jsonl")}


def _ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["label"] for v in vectors]


def test_vector_file_shape() -> None:
    assert len(VECTORS) == 72
    assert len(VALID) + len(INVALID) == len(VECTORS)
    assert len(set(_ids(VECTORS))) == len(VECTORS), "labels must be unique test ids"


@pytest.mark.parametrize("vector", VALID, ids=_ids(VALID))
def test_valid_vector(vector: dict[str, Any]) -> None:
    request = DecisionRequest.parse(vector["input"].encode("utf-8"))
    expected = vector["serialized"].encode("utf-8")

    assert request.to_json() == expected
    assert request_hash(request) == vector["request_hash"]
    assert hashlib.sha256(expected).hexdigest() == vector["request_hash"]

    identity, receipt = decision_receipt(request)
    assert identity.to_dict() == vector["identity"]
    assert identity == ExecutionIdentity.derive(DECISION_IDENTITY_DOMAIN, request)
    assert receipt.identity == identity
    assert receipt.outcome is ResultOutcome.SUCCEEDED
    assert receipt.evidence_digest == vector["evidence_digest"]
    assert receipt.evidence_digest == digest_bytes(
        EVIDENCE_DOMAIN, request.causation_event_id.encode("utf-8")
    )
    assert receipt.result_digest == vector["result_digest"]
    assert receipt.result_bytes == vector["result_bytes"]
    assert receipt.result_bytes == len(request.decision_json())

    # Text input, re-parsing our own output and the mapping form all agree.
    assert DecisionRequest.parse(vector["input"]) == request
    again = DecisionRequest.parse(request.to_json())
    assert again == request
    assert again.to_json() == expected
    assert DecisionRequest.from_dict(request.to_dict()).to_json() == expected


@pytest.mark.parametrize("vector", INVALID, ids=_ids(INVALID))
def test_invalid_vector(vector: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        DecisionRequest.parse(vector["input"].encode("utf-8"))
    assert str(caught.value).startswith("invalid decision request: ")
    with pytest.raises(InvalidRequestError):
        DecisionRequest.parse(vector["input"])


@pytest.mark.parametrize(
    ("label", "field"),
    [
        ("request given as a JSON array", ""),
        ("step and retry given as JSON arrays", "decision.steps[0]"),
    ],
)
def test_quirk_struct_arrays_are_rejected(label: str, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        DecisionRequest.parse(QUIRKS[label]["input"])
    assert caught.value.field == field
    assert "structs given as JSON arrays are not supported" in str(caught.value)


def test_quirk_float_rounding_is_correctly_rounded() -> None:
    vector = QUIRKS["float rounding: default serde_json parser is not correctly rounded"]
    request = DecisionRequest.parse(vector["input"])
    assert isinstance(request.decision, Complete)
    literals = vector["input"].split('"output":[')[1].rstrip("]}").split(",")
    # Python's correctly rounded parse is kept on purpose, so the bytes differ
    # from the (mis-rounded) Rust output while everything else matches.
    assert request.decision.output == [float(literal) for literal in literals]
    assert request.to_json() != vector["serialized"].encode("utf-8")
    assert decision_receipt(request)[1].evidence_digest == vector["evidence_digest"]
