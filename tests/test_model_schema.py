"""The wire model's JSON Schema (model.json_schemas) against the parser's reference vectors.

Every valid vector in tests/data/hash_vectors.jsonl validates; every invalid one
whose text is JSON (without repeated keys) is refused, as the parser refuses it.
The rest (syntax errors, duplicate fields, lone surrogates, numbers that
overflow) are beyond what JSON Schema sees: it validates parsed JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from flowdecision import DecisionRequest, InvalidRequestError
from flowdecision.core.model import json_schemas

DATA = Path(__file__).parent / "data"


def _load(name: str) -> list[dict[str, Any]]:
    text = (DATA / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line]  # not splitlines: U+2028


VECTORS = _load("hash_vectors.jsonl")
VALID = [v for v in VECTORS if "serialized" in v]
INVALID = [v for v in VECTORS if "error" in v]


def _validator() -> jsonschema.Draft202012Validator:
    """A validator for DecisionRequest, its references resolved within the bundle."""
    schemas = json_schemas(ref_prefix="#/$defs/")
    schema = {"$defs": schemas, "$ref": "#/$defs/DecisionRequest"}
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


VALIDATOR = _validator()


def _strict_json(text: str) -> Any:
    """``text`` as JSON, or a ValueError where JSON Schema cannot judge it."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("repeated key")
        return dict(pairs)

    def finite(literal: str) -> float:
        number = float(literal)
        if not math.isfinite(number):
            raise ValueError(f"{literal} overflows a float")
        return number

    value = json.loads(text, object_pairs_hook=no_repeats, parse_float=finite)
    if "\\ud8" in text.lower() or "\\udc" in text.lower():
        raise ValueError("lone surrogate escape")
    return value


def test_vectors_cover_both_kinds() -> None:
    assert len(VALID) >= 50 and len(INVALID) >= 15


@pytest.mark.parametrize("vector", VALID, ids=[v["label"] for v in VALID])
def test_every_valid_vector_validates(vector: dict[str, Any]) -> None:
    errors = [error.message for error in VALIDATOR.iter_errors(json.loads(vector["input"]))]
    assert errors == []


def _judgeable(vector: dict[str, Any]) -> bool:
    try:
        _strict_json(vector["input"])
    except ValueError:
        return False
    return True


JUDGEABLE = [v for v in INVALID if _judgeable(v)]


def test_most_invalid_vectors_are_json_the_schema_can_judge() -> None:
    # Syntax errors, a repeated struct field, a lone surrogate and 1e400 are not.
    assert len(JUDGEABLE) >= 11, [v["label"] for v in JUDGEABLE]


@pytest.mark.parametrize("vector", JUDGEABLE, ids=[v["label"] for v in JUDGEABLE])
def test_every_judgeable_invalid_vector_is_refused(vector: dict[str, Any]) -> None:
    value = _strict_json(vector["input"])
    assert not VALIDATOR.is_valid(value), vector["error"]
    with pytest.raises(InvalidRequestError):  # and the parser agrees
        DecisionRequest.parse(vector["input"])


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("decision", "step", "retry", "max_attempts"), 1 << 32),  # u32
        (("decision", "step", "retry", "delay_ms"), 1 << 64),  # u64
        (("decision", "step", "retry", "delay_ms"), -1),
        (("decision", "step", "retry", "backoff"), "linear"),
        (("decision", "step", "retry", "on_exhausted"), "retry"),
        (("decision", "step", "step_id"), 7),
        (("decision", "type"), "pause"),
        (("run_id",), None),
    ],
)
def test_schema_and_parser_refuse_the_same_values(path: tuple[str, ...], value: Any) -> None:
    body: dict[str, Any] = {
        "decision_id": "d",
        "run_id": "r",
        "authority_branch_id": "production",
        "causation_event_id": "e",
        "decision": {
            "type": "schedule_step",
            "step": {"step_id": "s", "step_name": "n", "input": 1, "retry": {
                "max_attempts": 3, "delay_ms": 0}},
        },
    }  # fmt: skip
    assert VALIDATOR.is_valid(body)
    DecisionRequest.parse(json.dumps(body))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert not VALIDATOR.is_valid(body)
    with pytest.raises(InvalidRequestError):
        DecisionRequest.parse(json.dumps(body))
