"""The decision wire model and the serde_json-compatible JSON layer."""

from __future__ import annotations

import enum
import json
import math
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowdecision.core.jsonwire import (
    MAX_DEPTH,
    DuplicateKeyDict,
    JsonWireError,
    canonicalize,
    duplicate_keys,
    encode_json,
    format_float,
    parse_json,
)
from flowdecision.core.model import (
    DEFAULT_RETRY_POLICY,
    U32_MAX,
    U64_MAX,
    Complete,
    DecisionRequest,
    DecisionStep,
    Fail,
    InvalidRequestError,
    RetryPolicy,
    RetryPolicyError,
    ScheduleStep,
    ScheduleSteps,
    request_hash,
)


def _request(decision: dict[str, Any]) -> dict[str, Any]:
    return {
        "decision_id": "dec-1",
        "run_id": "run-1",
        "authority_branch_id": "production",
        "causation_event_id": "evt-1",
        "decision": decision,
    }


def _steps_request(*steps: dict[str, Any]) -> dict[str, Any]:
    return _request({"type": "schedule_steps", "steps": list(steps)})


def _step(**overrides: Any) -> dict[str, Any]:
    step: dict[str, Any] = {"step_id": "s", "step_name": "n", "input": None}
    step.update(overrides)
    return step


HEAD = (
    '{"decision_id":"dec-1","run_id":"run-1","authority_branch_id":"production",'
    '"causation_event_id":"evt-1","decision":'
)

# ------------------------------------------------------------------ error field paths

TEXT_ERRORS = [
    (
        HEAD + '{"type":"pause"}}',
        "decision.type",
        "unknown variant `pause`, expected one of "
        "`schedule_step`, `schedule_steps`, `complete`, `fail`",
    ),
    (HEAD + '{"type":5,"error":"x"}}', "decision.type", "invalid type: integer `5`"),
    (HEAD + '"fail"}', "decision", 'invalid type: string "fail", expected struct FlowDecision'),
    (
        HEAD + '{"type":"complete","output":1,"type":"fail"}}',
        "decision.type",
        "duplicate field `type`",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_id":"b","step_name":"n",'
        '"input":1}}}',
        "decision.step.step_id",
        "duplicate field `step_id`",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_name":"n","input":1,'
        '"retry":{"max_attempts":4294967296,"delay_ms":0}}}}',
        "decision.step.retry.max_attempts",
        "invalid value: integer `4294967296`, expected u32",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_name":"n","input":1,'
        '"retry":{"max_attempts":true,"delay_ms":0}}}}',
        "decision.step.retry.max_attempts",
        "invalid type: boolean `true`, expected u32",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_name":"n","input":1,'
        '"retry":{"max_attempts":1,"delay_ms":18446744073709551616}}}}',
        "decision.step.retry.delay_ms",
        "invalid type: floating point `1.8446744073709552e19`, expected u64",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_name":"n","input":1,'
        '"retry":{"max_attempts":1,"delay_ms":-0}}}}',
        "decision.step.retry.delay_ms",
        "invalid type: floating point `-0.0`, expected u64",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_name":"n","input":1,'
        '"retry":{"max_attempts":1,"delay_ms":0,"max_delay_ms":1.0}}}}',
        "decision.step.retry.max_delay_ms",
        "invalid type: floating point `1.0`, expected u64",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_name":"n","input":1,'
        '"retry":{"max_attempts":1,"delay_ms":0,"on_exhausted":"never"}}}}',
        "decision.step.retry.on_exhausted",
        "unknown variant `never`, expected `fail_run` or `continue_workflow`",
    ),
    (
        HEAD + '{"type":"schedule_step","step":{"step_id":"a","step_name":"n","input":1,'
        '"retry":null}}}',
        "decision.step.retry",
        "invalid type: null, expected struct RetryPolicy",
    ),
    (
        HEAD + '{"type":"schedule_steps","steps":[{"step_id":"a","step_name":"n","input":1},'
        '{"step_id":"b","step_name":7,"input":1}]}}',
        "decision.steps[1].step_name",
        "invalid type: integer `7`, expected a string",
    ),
    (
        HEAD + '{"type":"schedule_steps","steps":[{"step_id":"a","step_name":"n","input":1},'
        '["b","n",1]]}}',
        "decision.steps[1]",
        "structs given as JSON arrays are not supported",
    ),
    (
        HEAD + '{"type":"fail","error":null}}',
        "decision.error",
        "invalid type: null, expected a string",
    ),
    ('{"decision_id":"d"', "", "EOF while parsing a value at line 1 column 19"),
    (HEAD + '{"type":"complete","output":NaN}}', "", "`NaN` is not a valid JSON value"),
    (HEAD + '{"type":"complete","output":[1,]}}', "", "trailing comma"),
    (HEAD + '{"type":"complete","output":"\\udc00"}}', "", "lone surrogate escape `\\udc00`"),
    ("7", "", "invalid type: integer `7`, expected struct FlowDecisionRequest"),
]


@pytest.mark.parametrize(("text", "field", "problem"), TEXT_ERRORS)
def test_text_error_paths(text: str, field: str, problem: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        DecisionRequest.parse(text)
    error = caught.value
    assert error.field == field
    assert problem in error.problem
    where = f"field `{field}`: " if field else ""
    assert str(error) == f"invalid decision request: {where}{error.problem}"


class _Opaque:
    pass


DICT_ERRORS = [
    (
        _request({"type": "complete", "output": {"a": [1, {"b": _Opaque()}]}}),
        "decision.output.a[1].b",
        "expected a JSON value",
    ),
    (
        _request({"type": "complete", "output": {"x y": {1: 2}}}),
        'decision.output["x y"]',
        "object key 1 is not a string",
    ),
    (
        _request({"type": "complete", "output": [math.nan]}),
        "decision.output[0]",
        "non-finite float",
    ),
    (
        _request({"type": "complete", "output": [math.inf]}),
        "decision.output[0]",
        "non-finite float",
    ),
    (
        _request({"type": "complete", "output": 1 << 64}),
        "decision.output",
        "outside the i64/u64 range",
    ),
    (
        _request({"type": "complete", "output": -(1 << 63) - 1}),
        "decision.output",
        "outside the i64/u64 range",
    ),
    (
        _request({"type": "complete", "output": {"k": "\ud800"}}),
        "decision.output.k",
        "lone surrogate",
    ),
    (_request({"type": "complete", "output": {1, 2}}), "decision.output", "invalid type"),
    (_steps_request(_step(), _step(input=b"bytes")), "decision.steps[1].input", "invalid type"),
    (
        _steps_request(_step(retry={"max_attempts": -1, "delay_ms": 0})),
        "decision.steps[0].retry.max_attempts",
        "invalid value: integer `-1`, expected u32",
    ),
    (
        _steps_request(_step(retry={"max_attempts": 1, "delay_ms": 1 << 64})),
        "decision.steps[0].retry.delay_ms",
        "expected u64",
    ),
    (
        _steps_request(_step(retry={"max_attempts": 1, "delay_ms": False})),
        "decision.steps[0].retry.delay_ms",
        "invalid type: boolean `false`, expected u64",
    ),
    (
        _request({"type": "schedule_steps", "steps": {"a": 1}}),
        "decision.steps",
        "invalid type: map, expected a sequence",
    ),
    (_request({"type": "schedule_step"}), "decision.step", "missing field `step`"),
    (
        {**_request({"type": "fail", "error": "x"}), "run_id": None},
        "run_id",
        "invalid type: null, expected a string",
    ),
    (
        {**_request({"type": "fail", "error": "x"}), "decision_id": "\udfff"},
        "decision_id",
        "lone surrogate",
    ),
]


@pytest.mark.parametrize(("obj", "field", "problem"), DICT_ERRORS)
def test_mapping_error_paths(obj: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        DecisionRequest.parse(obj)
    assert caught.value.field == field
    assert problem in caught.value.problem


def test_missing_fields_name_the_field() -> None:
    obj = _request({"type": "fail", "error": "x"})
    for key in list(obj):
        partial = {k: v for k, v in obj.items() if k != key}
        with pytest.raises(InvalidRequestError) as caught:
            DecisionRequest.from_dict(partial)
        assert caught.value.field == key
        assert caught.value.problem == f"missing field `{key}`"


def test_parse_rejects_other_argument_types() -> None:
    with pytest.raises(TypeError):
        DecisionRequest.parse(42)  # type: ignore[arg-type]


# ----------------------------------------------------------------- accepted inputs

SAMPLE = (
    HEAD + '{"type":"schedule_steps","steps":[{"step_id":"s1","step_name":"one",'
    '"input":{"b":[1,2.5,-0],"a":{"z":null,"y":true}}},{"step_id":"s2","step_name":"two",'
    '"input":"x","retry":{"max_attempts":9,"delay_ms":100,"backoff":"exponential",'
    '"max_delay_ms":800,"on_exhausted":"continue_workflow"}}]}}'
)


def test_parse_from_bytes_str_buffers_and_dict_agree() -> None:
    from_str = DecisionRequest.parse(SAMPLE)
    data = SAMPLE.encode("utf-8")
    variants = [
        DecisionRequest.parse(data),
        DecisionRequest.parse(bytearray(data)),
        DecisionRequest.parse(memoryview(data)),
        DecisionRequest.parse(parse_json(SAMPLE)),  # json.loads would read -0 as 0
        DecisionRequest.from_dict(from_str.to_dict()),
    ]
    for other in variants:
        assert other == from_str
        assert other.to_json() == from_str.to_json()
    assert from_str.to_json() == (
        HEAD + '{"type":"schedule_steps","steps":[{"step_id":"s1","step_name":"one",'
        '"input":{"a":{"y":true,"z":null},"b":[1,2.5,-0.0]},'
        '"retry":{"max_attempts":3,"delay_ms":0}},{"step_id":"s2","step_name":"two",'
        '"input":"x","retry":{"max_attempts":9,"delay_ms":100,"backoff":"exponential",'
        '"max_delay_ms":800,"on_exhausted":"continue_workflow"}}]}}'
    ).encode("utf-8")


def test_dict_input_is_copied_and_normalised() -> None:
    class Colour(str, enum.Enum):  # noqa: UP042  (str() of this is 'Colour.RED')
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    output: dict[str, Any] = {"t": (1, 2), "c": Colour.RED, "n": Level.HIGH, "z": [{"k": 1.5}]}
    source = _request({"type": "complete", "output": output})
    request = DecisionRequest.from_dict(source)
    before = request.to_json()
    output["z"][0]["k"] = 99
    output["new"] = 1
    assert isinstance(request.decision, Complete)
    assert request.decision.output == {"t": [1, 2], "c": "red", "n": 3, "z": [{"k": 1.5}]}
    assert type(request.decision.output["c"]) is str
    assert type(request.decision.output["n"]) is int
    assert DecisionRequest.from_dict(source).to_json() != before
    assert request.to_json() == before


def test_unknown_fields_ignored_and_duplicate_unknowns_allowed() -> None:
    text = (
        '{"zz":1,"zz":2,"decision_id":"d","run_id":"r","authority_branch_id":"b",'
        '"causation_event_id":"e","decision":{"type":"fail","error":"x","output":1,"output":2}}'
    )
    request = DecisionRequest.parse(text)
    assert request.to_json() == (
        b'{"decision_id":"d","run_id":"r","authority_branch_id":"b","causation_event_id":"e",'
        b'"decision":{"type":"fail","error":"x"}}'
    )


def test_duplicate_free_form_keys_keep_last() -> None:
    request = DecisionRequest.parse(HEAD + '{"type":"complete","output":{"a":1,"a":{"b":2}}}}')
    assert isinstance(request.decision, Complete)
    assert request.decision.output == {"a": {"b": 2}}


def test_to_json_is_cached_and_decision_json_is_its_tail() -> None:
    request = DecisionRequest.parse(SAMPLE)
    assert request.to_json() is request.to_json()
    assert request.decision_json() is request.decision_json()
    assert request.to_json().endswith(request.decision_json() + b"}")
    assert request_hash(request) == request_hash(DecisionRequest.parse(request.to_json()))


def test_equality_is_by_wire_bytes() -> None:
    one, one_float, true = Complete(1), Complete(1.0), Complete(True)
    assert len({one, one_float, true}) == 3
    assert one != one_float != true
    assert Complete({"a": 1, "b": 2}) == Complete({"b": 2, "a": 1})
    assert hash(Complete({"a": 1, "b": 2})) == hash(Complete({"b": 2, "a": 1}))
    base = DecisionRequest.parse(SAMPLE)
    assert {base: 1}[DecisionRequest.parse(SAMPLE)] == 1


def test_direct_construction_validates() -> None:
    step = DecisionStep("s", "n", {"b": (1, 2)})
    assert step.input == {"b": [1, 2]}
    assert step.retry is DEFAULT_RETRY_POLICY
    steps = ScheduleSteps([step, step])  # type: ignore[arg-type]
    assert isinstance(steps.steps, tuple)
    request = DecisionRequest("d", "r", "b", "e", steps)
    assert DecisionRequest.parse(request.to_json()) == request
    with pytest.raises(InvalidRequestError) as caught:
        DecisionStep("s", "n", {"x": _Opaque()})
    assert caught.value.field == "input.x"
    with pytest.raises(InvalidRequestError):
        DecisionStep("s", 5, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        ScheduleStep("not a step")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        Fail(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as caught:
        DecisionRequest("d", "r", "b", "e", {"type": "fail"})  # type: ignore[arg-type]
    assert caught.value.field == "decision"


def test_to_dict_wire_form() -> None:
    request = DecisionRequest.parse(SAMPLE)
    wire = request.to_dict()
    assert list(wire) == [
        "decision_id",
        "run_id",
        "authority_branch_id",
        "causation_event_id",
        "decision",
    ]
    assert encode_json(wire) == request.to_json()
    first = wire["decision"]["steps"][0]
    assert list(first) == ["step_id", "step_name", "input", "retry"]
    assert list(first["input"]) == ["a", "b"]
    assert first["retry"] == {"max_attempts": 3, "delay_ms": 0}


# --------------------------------------------------------------------- RetryPolicy


def test_retry_policy_defaults_and_omission() -> None:
    assert RetryPolicy() == DEFAULT_RETRY_POLICY
    assert DEFAULT_RETRY_POLICY.to_dict() == {"max_attempts": 3, "delay_ms": 0}
    full = RetryPolicy(5, 250, "exponential", 10_000, "continue_workflow")
    assert list(full.to_dict()) == [
        "max_attempts",
        "delay_ms",
        "backoff",
        "max_delay_ms",
        "on_exhausted",
    ]
    assert RetryPolicy.from_dict(full.to_dict()) == full
    assert RetryPolicy(max_attempts=U32_MAX, delay_ms=U64_MAX).to_dict()["delay_ms"] == U64_MAX


@pytest.mark.parametrize(
    "policy",
    [
        RetryPolicy(),
        RetryPolicy(1, 500),
        RetryPolicy(4, 1, "exponential", 1),
        RetryPolicy(4, 10, "exponential", 20, "continue_workflow"),
    ],
)
def test_retry_policy_validate_accepts(policy: RetryPolicy) -> None:
    policy.validate()


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (RetryPolicy(2, 1, "fixed", 9), "fixed retry policy cannot define max_delay_ms"),
        (
            RetryPolicy(2, 0, "exponential", 10),
            "exponential retry delays must satisfy 1 <= delay_ms <= max_delay_ms",
        ),
        (
            RetryPolicy(2, 11, "exponential", 10),
            "exponential retry delays must satisfy 1 <= delay_ms <= max_delay_ms",
        ),
        (
            RetryPolicy(2, 5, "exponential"),
            "exponential retry delays must satisfy 1 <= delay_ms <= max_delay_ms",
        ),
    ],
)
def test_retry_policy_validate_rejects(policy: RetryPolicy, message: str) -> None:
    with pytest.raises(RetryPolicyError) as caught:
        policy.validate()
    assert str(caught.value) == message


def test_parse_does_not_apply_retry_rules() -> None:
    # Mirrors the vector "schedule_step max_delay_ms without backoff".
    request = DecisionRequest.parse(
        HEAD + '{"type":"schedule_step","step":{"step_id":"s1","step_name":"fetch",'
        '"input":null,"retry":{"max_attempts":2,"delay_ms":1,"max_delay_ms":9}}}}'
    )
    assert isinstance(request.decision, ScheduleStep)
    with pytest.raises(RetryPolicyError):
        request.decision.step.retry.validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": True},
        {"max_attempts": -1},
        {"max_attempts": U32_MAX + 1},
        {"delay_ms": U64_MAX + 1},
        {"delay_ms": 1.0},
        {"backoff": "linear"},
        {"on_exhausted": "stop"},
    ],
)
def test_retry_policy_constructor_checks_types(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        RetryPolicy(**kwargs)


# ------------------------------------------------------------------------ jsonwire

FLOATS = [
    (1.0, "1.0"),
    (100.0, "100.0"),
    (-3.0, "-3.0"),
    (0.1, "0.1"),
    (-0.0125, "-0.0125"),
    (0.0001, "0.0001"),
    (1e-5, "0.00001"),
    (1.5e-5, "0.000015"),
    (-9.99e-5, "-0.0000999"),
    (1e-6, "1e-6"),
    (1e-7, "1e-7"),
    (1.5e-10, "1.5e-10"),
    (1e15, "1000000000000000.0"),
    (9999999999999998.0, "9999999999999998.0"),
    (1e16, "1e16"),
    (1e17, "1e17"),
    (1e20, "1e20"),
    (1e23, "1e23"),
    (1.2345678901234568e29, "1.2345678901234568e29"),
    (5e-324, "5e-324"),
    (2.2250738585072014e-308, "2.2250738585072014e-308"),
    (1.7976931348623157e308, "1.7976931348623157e308"),
    (-1.7976931348623157e308, "-1.7976931348623157e308"),
    (0.0, "0.0"),
    (-0.0, "-0.0"),
    (0.30000000000000004, "0.30000000000000004"),
]


@pytest.mark.parametrize(("value", "expected"), FLOATS)
def test_float_formatting(value: float, expected: str) -> None:
    assert format_float(value) == expected
    assert encode_json([value, {"k": value}]) == f'[{expected},{{"k":{expected}}}]'.encode()
    assert parse_json(expected) == value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_rejected(value: float) -> None:
    with pytest.raises(JsonWireError):
        encode_json([value])
    with pytest.raises(JsonWireError):
        format_float(value)


STRINGS = [
    ('"', '"\\""'),
    ("\\", '"\\\\"'),
    ("/", '"/"'),
    ("\x00", '"\\u0000"'),
    ("\x07", '"\\u0007"'),
    ("\b\f\n\r\t", '"\\b\\f\\n\\r\\t"'),
    ("\x0b", '"\\u000b"'),
    ("\x1f", '"\\u001f"'),
    ("\x7f", '"\x7f"'),
    ("\x80\xa0", '"\x80\xa0"'),
    ("\u2028\u2029", '"\u2028\u2029"'),
    ("é中😀", '"é中😀"'),
    ('1e+05 \\"2e-06"', '"1e+05 \\\\\\"2e-06\\""'),
]


@pytest.mark.parametrize(("value", "expected"), STRINGS)
def test_string_escaping(value: str, expected: str) -> None:
    assert encode_json(value) == expected.encode("utf-8")
    assert encode_json({value: value}) == f"{{{expected}:{expected}}}".encode()
    assert parse_json(expected.encode("utf-8")) == value


def test_encode_rejects_unencodable_values() -> None:
    for value in ["\ud800", [object()], {1: 2, "a": 3}]:
        with pytest.raises(JsonWireError):
            encode_json(value, sort_keys=True)


PARSES = [
    ("[-0,0,-0.0]", [-0.0, 0, -0.0]),
    (
        "[9223372036854775807,-9223372036854775808,18446744073709551615]",
        [9223372036854775807, -9223372036854775808, 18446744073709551615],
    ),
    ("[18446744073709551616,-9223372036854775809]", [1.8446744073709552e19, -9.223372036854776e18]),
    ("[1e-400,-1e-400]", [0.0, -0.0]),
    ('"\\ud83d\\ude00"', "😀"),
    ('"\\\\ud800"', "\\ud800"),
    (' \t\r\n{"a" : [ 1 ] } \n', {"a": [1]}),
    ("[" * MAX_DEPTH + "]" * MAX_DEPTH, json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)),
    ('["' + "[" * 300 + '"]', ["[" * 300]),
]


@pytest.mark.parametrize(("text", "expected"), PARSES)
def test_parse_json_accepts(text: str, expected: Any) -> None:
    value = parse_json(text)
    assert value == expected
    assert json.dumps(value) == json.dumps(expected)  # distinguishes -0.0 and int/float


REJECTS = [
    "",
    " ",
    "[1,2,]",
    '{"a":1,}',
    "[1] x",
    "NaN",
    "[Infinity]",
    "[-Infinity]",
    "1e400",
    "-1e400",
    "1" * 400,
    '"\\ud800"',
    '"\\udc00\\ud800"',
    '"\\\\\\ud800"',
    '{"\\ud800":1}',
    "[01]",
    "[1.]",
    "[.5]",
    "[+1]",
    '"\t"',
    "\ufeff1",
    "'a'",
    "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
    "[" + '{"a":' * MAX_DEPTH + "1" + "}" * MAX_DEPTH + "]",
]


@pytest.mark.parametrize("text", REJECTS)
def test_parse_json_rejects(text: str) -> None:
    with pytest.raises(JsonWireError):
        parse_json(text)


def test_parse_json_rejects_invalid_utf8_and_raw_surrogates() -> None:
    with pytest.raises(JsonWireError):
        parse_json(b'"\xff"')
    with pytest.raises(JsonWireError):
        parse_json(b'"\xed\xa0\x80"')  # UTF-8-encoded surrogate
    with pytest.raises(JsonWireError):
        parse_json('"\ud800"')


def test_parse_json_error_positions() -> None:
    with pytest.raises(JsonWireError) as caught:
        parse_json('{\n  "a": "\\ud800"}')
    assert (caught.value.line, caught.value.column) == (2, 9)
    with pytest.raises(JsonWireError) as caught:
        parse_json("[1] x")
    assert str(caught.value) == "trailing characters at line 1 column 5"


def test_duplicate_keys_are_recorded() -> None:
    value = parse_json('{"a":1,"b":2,"a":3,"b":4,"c":5}')
    assert isinstance(value, DuplicateKeyDict)
    assert value == {"a": 3, "b": 4, "c": 5}
    assert duplicate_keys(value) == {"a", "b"}
    assert duplicate_keys(parse_json('{"a":1}')) == frozenset()


def test_canonicalize_sorts_recursively_by_code_point() -> None:
    value = {"b": [{"d": 1, "c": (2,)}], "\U0001f600": 0, "\uffff": 1, "Z": 2, "a": {}}
    result = canonicalize(value)
    assert list(result) == ["Z", "a", "b", "\uffff", "\U0001f600"]
    assert list(result["b"][0]) == ["c", "d"]
    assert result["b"][0]["c"] == [2]
    assert encode_json(result) == encode_json(value, sort_keys=True)


# ---------------------------------------------------------------------- properties


def _reference_float(value: float) -> str:
    """Ryu's layout written out independently, with repr()'s shortest digits."""
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    _, digit_tuple, exponent = Decimal(repr(abs(value))).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).lstrip("0")
    stripped = digits.rstrip("0")
    exponent += len(digits) - len(stripped)
    digits = stripped
    point = len(digits) + exponent  # 10^(point-1) <= |value| < 10^point
    if 0 <= exponent and point <= 16:
        return f"{sign}{digits}{'0' * exponent}.0"
    if 0 < point <= 16:
        return f"{sign}{digits[:point]}.{digits[point:]}"
    if -5 < point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    mantissa = digits if len(digits) == 1 else f"{digits[0]}.{digits[1:]}"
    return f"{sign}{mantissa}e{point - 1}"


_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def _reference_str(value: str) -> str:
    out = []
    for char in value:
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif ord(char) < 0x20:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _reference_encode(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _reference_float(value)
    if isinstance(value, str):
        return _reference_str(value)
    if isinstance(value, list):
        return "[" + ",".join(_reference_encode(item) for item in value) + "]"
    return (
        "{"
        + ",".join(
            f"{_reference_str(key)}:{_reference_encode(value[key])}" for key in sorted(value)
        )
        + "}"
    )


tricky_text = st.text(
    alphabet=st.sampled_from(list('ab"\\/\x00\x01\x1f\x7f\u2028é😀e+-0159.{}[]:, \n\t')),
    max_size=12,
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=U64_MAX)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
    | tricky_text
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=6) | tricky_text, children, max_size=4)
    ),
    max_leaves=20,
)
retry_policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(min_value=0, max_value=U32_MAX),
    delay_ms=st.integers(min_value=0, max_value=U64_MAX),
    backoff=st.sampled_from(["fixed", "exponential"]),
    max_delay_ms=st.integers(min_value=0, max_value=U64_MAX),
    on_exhausted=st.sampled_from(["fail_run", "continue_workflow"]),
)
steps = st.builds(
    DecisionStep,
    step_id=tricky_text,
    step_name=st.text(max_size=8),
    input=json_values,
    retry=retry_policies | st.just(DEFAULT_RETRY_POLICY),
)
decisions = (
    st.builds(ScheduleStep, step=steps)
    | st.builds(ScheduleSteps, steps=st.lists(steps, max_size=3).map(tuple))
    | st.builds(Complete, output=json_values)
    | st.builds(Fail, error=tricky_text)
)
requests = st.builds(
    DecisionRequest,
    decision_id=st.text(max_size=8),
    run_id=tricky_text,
    authority_branch_id=st.sampled_from(["production", "fork"]),
    causation_event_id=st.text(max_size=8),
    decision=decisions,
)


@settings(max_examples=300, deadline=None)
@given(requests)
def test_round_trip_property(request: DecisionRequest) -> None:
    wire = request.to_json()
    again = DecisionRequest.parse(wire)
    assert again == request
    assert again.to_json() == wire
    assert DecisionRequest.parse(wire).to_json() == wire  # stable across parses
    assert DecisionRequest.from_dict(request.to_dict()) == request
    assert encode_json(request.to_dict()) == wire
    assert request_hash(again) == request_hash(request)
    # Struct-order bytes and fully sorted bytes describe the same JSON value.
    assert json.loads(request.canonical_json()) == json.loads(wire)
    assert request.canonical_json() == encode_json(request.to_dict(), sort_keys=True)


@settings(max_examples=500, deadline=None)
@given(json_values)
def test_encoder_matches_reference(value: Any) -> None:
    expected = _reference_encode(value)
    assert encode_json(value, sort_keys=True) == expected.encode("utf-8")
    assert parse_json(expected) == value
    # == cannot tell -0.0 from 0.0 or 1 from 1.0; the bytes can.
    assert encode_json(parse_json(expected), sort_keys=True) == expected.encode("utf-8")


@settings(max_examples=1000, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_float_format_property(value: float) -> None:
    text = format_float(value)
    assert text == _reference_float(value)
    assert float(text) == value
    assert "+" not in text
