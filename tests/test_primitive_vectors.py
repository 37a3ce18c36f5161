"""Replay tests/data/primitive_vectors.jsonl: identity, receipt and digest primitives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowdecision.core.identity import (
    ExecutionContractError,
    ExecutionIdentity,
    ExecutionIdentityError,
    ResultReceipt,
    ResultReceiptError,
    digest_bytes,
)
from flowdecision.core.jsonwire import parse_json

DATA = Path(__file__).parent / "data"
VECTORS: list[dict[str, Any]] = [
    json.loads(line)
    for line in (DATA / "primitive_vectors.jsonl").read_text(encoding="utf-8").split("\n")
    if line
]
IDS = [f"{index:02d}-{v['cmd']}-{v['label']}" for index, v in enumerate(VECTORS)]

IDENTITY_ORDER = ["schema", "domain", "digest"]
RECEIPT_ORDER = [
    "schema",
    "identity",
    "evidence_digest",
    "outcome",
    "result_digest",
    "result_bytes",
]


def _identity(vector_input: dict[str, Any], output: dict[str, Any]) -> None:
    if "validate" in vector_input:
        if "parse_error" in output:
            with pytest.raises(ExecutionIdentityError) as caught:
                ExecutionIdentity.from_dict(vector_input["validate"])
            assert output["parse_error"] in str(caught.value)
            return
        identity = ExecutionIdentity.from_dict(vector_input["validate"])
        if "err" in output:
            with pytest.raises(ExecutionIdentityError) as caught:
                identity.validate()
            assert str(caught.value) == output["err"]
        else:
            assert output == {"ok": None}
            identity.validate()
        return
    if "err" in output:
        with pytest.raises(ExecutionIdentityError) as caught:
            ExecutionIdentity.derive(vector_input["domain"], vector_input["value"])
        assert str(caught.value) == output["err"]
        return
    identity = ExecutionIdentity.derive(vector_input["domain"], vector_input["value"])
    identity.validate()
    assert identity.to_dict() == output["ok"]
    assert list(identity.to_dict()) == IDENTITY_ORDER


def _receipt(vector_input: dict[str, Any], output: dict[str, Any]) -> None:
    if "validate" in vector_input:
        if "parse_error" in output:
            with pytest.raises(ResultReceiptError) as caught:
                ResultReceipt.from_dict(vector_input["validate"])
            assert output["parse_error"] in str(caught.value)
        elif "err" in output:
            with pytest.raises(ExecutionContractError) as failed:
                ResultReceipt.from_dict(vector_input["validate"])
            assert str(failed.value) == output["err"]
        else:
            assert output == {"ok": None}
            receipt = ResultReceipt.from_dict(vector_input["validate"])
            receipt.validate()
            assert receipt.to_dict() == vector_input["validate"]
        return

    def construct() -> ResultReceipt:
        return ResultReceipt.new(
            ExecutionIdentity.from_dict(vector_input["identity"]),
            vector_input["evidence_digest"],
            vector_input["outcome"],
            vector_input.get("result_digest"),
            vector_input["result_bytes"],
        )

    if "err" in output:
        with pytest.raises(ExecutionContractError) as failed:
            construct()
        assert str(failed.value) == output["err"]
        return
    receipt = construct()
    assert receipt.to_dict() == output["ok"]
    expected_order = [key for key in RECEIPT_ORDER if key in output["ok"]]
    assert list(receipt.to_dict()) == expected_order
    assert ResultReceipt.from_json(receipt.to_json()) == receipt


def _digest(vector_input: dict[str, Any], output: dict[str, Any]) -> None:
    if "utf8" in vector_input:
        data = vector_input["utf8"].encode("utf-8")
    else:
        data = bytes.fromhex(vector_input["hex"])
    assert digest_bytes(vector_input["domain"], data) == output["ok"]


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_primitive_vector(vector: dict[str, Any]) -> None:
    # Inputs are JSON texts; parse them as serde_json would (1e+20, -0.0, u64 max).
    vector_input = parse_json(vector["input"])
    handler = {"identity": _identity, "receipt": _receipt, "digest": _digest}[vector["cmd"]]
    handler(vector_input, vector["output"])


def test_every_command_kind_is_covered() -> None:
    assert {v["cmd"] for v in VECTORS} == {"identity", "receipt", "digest"}
    kinds = {next(iter(v["output"])) for v in VECTORS}
    assert kinds == {"ok", "err", "parse_error"}
