"""The C decoder of the common request body (``flowdecision._fastreq``, built by
``pip install``) against the Python parser: for every body it takes, the same
fields, values and texts (wire bytes, decision JSON, canonical JSON, digests);
None (Python's turn, and Python's error) for every body it does not."""

from __future__ import annotations

import gc
import hashlib
import json
import random
import sys
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowdecision.core import model
from flowdecision.core.identity import decision_receipt
from flowdecision.core.model import (
    DEFAULT_RETRY_POLICY,
    DecisionRequest,
    ScheduleStep,
    request_hash,
)
from flowdecision.errors import InvalidRequestError

BASE: dict[str, Any] = {
    "decision_id": "d-1",
    "run_id": "run-1",
    "authority_branch_id": "production",
    "causation_event_id": "event-1",
    "decision": {
        "type": "schedule_step",
        "step": {"step_id": "s-1", "step_name": "fetch", "input": {"n": 1}},
    },
}


@pytest.fixture(scope="module")
def decode() -> Any:
    # make test builds the extension (setup.py): the C decoder is the one in use
    assert model._fast_decode is not None
    assert model._fast_decode.__module__ == "flowdecision._fastreq"
    return model._fast_decode


@contextmanager
def python_only() -> Iterator[None]:
    saved = model._fast_decode
    model._fast_decode = None
    try:
        yield
    finally:
        model._fast_decode = saved


def python_parse(body: bytes, exact: bool) -> DecisionRequest | InvalidRequestError:
    with python_only():
        try:
            return DecisionRequest.parse(body, exact_numbers=exact)
        except InvalidRequestError as error:
            return error


def typed(value: Any) -> Any:
    """``value`` with every type and every dict's key order visible to ``==``."""
    if isinstance(value, dict):
        return ("dict", [(key, typed(item)) for key, item in value.items()])
    if isinstance(value, list):
        return ("list", [typed(item) for item in value])
    return (type(value).__name__, value)


def assert_same(fast: DecisionRequest, slow: DecisionRequest) -> None:
    assert type(fast.decision) is type(slow.decision) is ScheduleStep
    for name in ("decision_id", "run_id", "authority_branch_id", "causation_event_id"):
        assert getattr(fast, name) == getattr(slow, name)
    fast_step, slow_step = fast.decision.step, slow.decision.step
    assert (fast_step.step_id, fast_step.step_name) == (slow_step.step_id, slow_step.step_name)
    assert typed(fast_step.input) == typed(slow_step.input)
    assert fast_step.retry is slow_step.retry is DEFAULT_RETRY_POLICY
    assert fast.to_json() == slow.to_json()
    assert fast.decision_json() == slow.decision_json()
    assert fast.canonical_json() == slow.canonical_json()
    assert fast_step._input_json() == slow_step._input_json()
    assert request_hash(fast) == request_hash(slow)
    fast_identity, fast_receipt = decision_receipt(fast)
    slow_identity, slow_receipt = decision_receipt(slow)
    assert fast_identity == slow_identity
    assert fast_receipt.to_dict() == slow_receipt.to_dict()
    assert fast == slow


def check(decode: Any, body: bytes) -> bool:
    """Compare the two parsers on ``body``; whether the C decoder took it."""
    fields = decode(body)
    for exact in (True, False):
        slow = python_parse(body, exact)
        try:
            public: DecisionRequest | InvalidRequestError = DecisionRequest.parse(
                body, exact_numbers=exact
            )
        except InvalidRequestError as error:
            public = error
        if fields is not None:
            assert isinstance(slow, DecisionRequest), (body, slow)
            assert isinstance(public, DecisionRequest)
            assert_same(public, slow)
        elif isinstance(slow, InvalidRequestError):
            assert isinstance(public, InvalidRequestError)
            assert (public.field, str(public)) == (slow.field, str(slow))
        else:
            assert isinstance(public, DecisionRequest)
            assert public.to_json() == slow.to_json()
    return fields is not None


def body_of(document: dict[str, Any], **dumps: Any) -> bytes:
    return json.dumps(document, **dumps).encode()


def with_step(**changes: Any) -> dict[str, Any]:
    document = json.loads(json.dumps(BASE))
    document["decision"]["step"].update(changes)
    return document


# -- what it takes ------------------------------------------------------------------


ACCEPTED = [
    BASE,
    with_step(input={}),
    with_step(input=[]),
    with_step(input=None),
    with_step(input=True),
    with_step(input=-5),
    with_step(input="text"),
    with_step(input=""),
    with_step(input={"b": [1, {"z": None, "a": False}], "a": {"y": "", "x": 0}, "": -1}),
    with_step(input={"ab": 1, "a": 2, "b": 3, "aa": 4}),  # a prefix sorts first
    with_step(input=999999999999999999),  # 18 digits
    with_step(input=-999999999999999999),
    with_step(retry={"max_attempts": 3, "delay_ms": 0}),
    with_step(retry={"delay_ms": 0, "max_attempts": 3}),
    with_step(step_id="", step_name=" !#$%&'()*+,-./:;<=>?@[]^_`{|}~"),
    {**BASE, "decision_id": "a/b c", "causation_event_id": ""},
    {key: BASE[key] for key in reversed(list(BASE))},  # any field order
    with_step(input=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),  # 32 deep
]


@pytest.mark.parametrize("document", ACCEPTED)
def test_takes_the_common_shape(decode: Any, document: dict[str, Any]) -> None:
    for dumps in ({}, {"separators": (",", ":")}, {"indent": 2}, {"indent": "\t"}):
        assert check(decode, body_of(document, **dumps)), dumps


def test_takes_what_the_benchmarks_and_the_client_send(decode: Any) -> None:
    request = DecisionRequest.parse(body_of(BASE))
    assert check(decode, request.to_json())
    assert check(decode, b" \r\n\t" + request.to_json() + b" \n")


# -- what it leaves to Python -------------------------------------------------------

NOT_TAKEN = {
    "repeated top field": b'{"decision_id":"a","decision_id":"b","run_id":"r",'
    b'"authority_branch_id":"p","causation_event_id":"c","decision":'
    b'{"type":"schedule_step","step":{"step_id":"s","step_name":"n","input":1}}}',
    "repeated input key": body_of(with_step(input={"a": 1})).replace(b'{"a": 1}', b'{"a":1,"a":2}'),
    "repeated step field": body_of(BASE).replace(
        b'"step_id": "s-1"', b'"step_id":"x","step_id":"y"'
    ),
    "unknown field": body_of({**BASE, "extra": 1}),
    "unknown step field": body_of(with_step(extra=1)),
    "float": body_of(with_step(input=1.5)),
    "exponent": body_of(BASE).replace(b'"n": 1', b'"n": 1e3'),
    "minus zero": body_of(BASE).replace(b'"n": 1', b'"n": -0'),
    "19 digits": body_of(with_step(input=1000000000000000000)),
    "leading zero": body_of(BASE).replace(b'"n": 1', b'"n": 01'),
    "escape": body_of({**BASE, "run_id": 'a"b'}),
    "escaped slash": body_of(BASE).replace(b'"run-1"', b'"run\\/1"'),
    "control character": body_of(BASE).replace(b'"run-1"', b'"run\x011"'),
    "delete": body_of(BASE).replace(b'"run-1"', b'"run\x7f1"'),
    "non-ascii": body_of({**BASE, "run_id": "r\u00e9"}, ensure_ascii=False),
    "non-ascii escaped": body_of({**BASE, "run_id": "r\u00e9"}),
    "lone surrogate": body_of(BASE).replace(b'"run-1"', b'"\\ud800"'),
    "trailing characters": body_of(BASE) + b"x",
    "trailing comma": body_of(BASE)[:-1] + b",}",
    "byte order mark": b"\xef\xbb\xbf" + body_of(BASE),
    "complete": body_of({**BASE, "decision": {"type": "complete", "output": 1}}),
    "fail": body_of({**BASE, "decision": {"type": "fail", "error": "x"}}),
    "schedule_steps": body_of({**BASE, "decision": {"type": "schedule_steps", "steps": []}}),
    "custom retry": body_of(with_step(retry={"max_attempts": 4, "delay_ms": 0})),
    "retry with backoff": body_of(
        with_step(retry={"max_attempts": 3, "delay_ms": 0, "backoff": "fixed"})
    ),
    "retry 30": body_of(with_step(retry={"max_attempts": 30, "delay_ms": 0})),
    "retry 3.0": body_of(BASE).replace(
        b'"input"', b'"retry":{"max_attempts":3.0,"delay_ms":0},"input"'
    ),
    "missing field": body_of({k: v for k, v in BASE.items() if k != "run_id"}),
    "missing input": body_of(with_step(input=None)).replace(b', "input": null', b""),
    "id not a string": body_of({**BASE, "run_id": 7}),
    "33 deep": body_of(with_step(input=json.loads("[" * 33 + "]" * 33))),
    "not an object": b"[]",
    "empty": b"",
    "truncated": body_of(BASE)[:-2],
    "NaN": body_of(BASE).replace(b'"n": 1', b'"n": NaN'),
    "utf-16": body_of(BASE).decode().encode("utf-16"),
}


@pytest.mark.parametrize("name", sorted(NOT_TAKEN))
def test_leaves_every_other_body_to_python(decode: Any, name: str) -> None:
    body = NOT_TAKEN[name]
    assert decode(body) is None
    check(decode, body)  # and the public parse answers as Python alone does


def test_leaves_other_types_to_python(decode: Any) -> None:
    body = body_of(BASE)
    for data in (bytearray(body), memoryview(body), body.decode()):
        assert decode(data) is None
    assert DecisionRequest.parse(bytearray(body)) == DecisionRequest.parse(body)


# -- generated bodies ---------------------------------------------------------------

printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
strings = st.one_of(printable, st.text(max_size=6))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**18), max_value=10**18),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    strings,
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4),
    max_leaves=16,
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    ids=st.lists(strings, min_size=6, max_size=6),
    value=values,
    retry=st.sampled_from([None, (3, 0), (0, 3), (4, 0), (3, 1)]),
    order=st.randoms(use_true_random=False),
    spacing=st.sampled_from([None, 0, 1, "\t"]),
)
def test_agrees_with_python_on_generated_bodies(
    decode: Any,
    ids: list[str],
    value: Any,
    retry: tuple[int, int] | None,
    order: random.Random,
    spacing: int | str | None,
) -> None:
    step: dict[str, Any] = {"step_id": ids[4], "step_name": ids[5], "input": value}
    if retry is not None:
        step["retry"] = {"max_attempts": retry[0], "delay_ms": retry[1]}
    document: dict[str, Any] = {
        "decision_id": ids[0],
        "run_id": ids[1],
        "authority_branch_id": ids[2],
        "causation_event_id": ids[3],
        "decision": {"type": "schedule_step", "step": step},
    }

    def shuffled(node: Any) -> Any:
        if isinstance(node, dict):
            keys = list(node)
            order.shuffle(keys)
            return {key: shuffled(node[key]) for key in keys}
        if isinstance(node, list):
            return [shuffled(item) for item in node]
        return node

    body = body_of(shuffled(document), indent=spacing, ensure_ascii=order.random() < 0.5)
    taken = check(decode, body)
    plain = all(i.isascii() and i.isprintable() and '"' not in i and "\\" not in i for i in ids)
    if taken:
        assert plain and retry in (None, (3, 0))


MUTATION_ALPHABET = b'{}[]",:0123456789-. \\aeflnrstu\x00\x7f\xc3'


def mutated(rng: random.Random, seeds: list[bytes]) -> bytes:
    """One of ``seeds`` with one to three bytes replaced, deleted or inserted."""
    body = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(body))
        kind = rng.random()
        if kind < 0.4:
            body[at] = rng.choice(MUTATION_ALPHABET)
        elif kind < 0.7:
            del body[at]
        else:
            body.insert(at, rng.choice(MUTATION_ALPHABET))
    return bytes(body)


def test_mutated_bodies_never_disagree(decode: Any) -> None:
    """Bytes changed at random in bodies it takes: whatever it still takes, Python
    takes the same way; whatever it refuses, Python answers alone."""
    rng = random.Random(18)
    seeds = [body_of(document) for document in ACCEPTED]
    taken = sum(check(decode, mutated(rng, seeds)) for _ in range(3_000))
    assert taken > 100  # the mutations that keep the shape are still taken


def test_many_mutated_and_truncated_bodies(decode: Any) -> None:
    """The C side alone over many more bodies (make test also runs this under ASan
    and UBSan, tests/c_check.sh): every cut of a body is left to Python, and
    whatever it takes of 60,000 mutated bodies it takes back from its own wire
    bytes as the same request."""
    seeds = [body_of(document, **dumps) for document in ACCEPTED for dumps in ({}, {"indent": 1})]
    for seed in seeds:
        assert decode(seed) is not None
        assert all(decode(seed[:cut]) is None for cut in range(len(seed)))
    rng = random.Random(39)
    taken = 0
    for _ in range(60_000):
        request = decode(mutated(rng, seeds))
        if request is not None:
            taken += 1
            assert decode(request.to_json()) == request
    assert taken > 2_000


def test_no_reference_or_memory_is_leaked(decode: Any) -> None:
    bodies = [body_of(document) for document in ACCEPTED] + list(NOT_TAKEN.values())
    bodies.append(body_of(with_step(input=[True, False, None, {"a": [True, None]}])) + b"!")
    watched = [True, False, None]

    def decode_all(rounds: int) -> list[int]:
        for _ in range(rounds):
            for body in bodies:
                decode(body)
        gc.collect()
        return [sys.getrefcount(item) for item in watched]

    before = decode_all(1)
    tracemalloc.start()
    try:
        decode_all(1)
        start = tracemalloc.get_traced_memory()[0]
        after = decode_all(2_000)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert after == before
    assert grown < 64 * 1024, grown


def test_builds_only_the_classes_it_was_shown(decode: Any) -> None:
    """It fills a class's slots directly, so a class whose slots are not exactly the
    ones it knows is refused when configured (none is ever left unset)."""
    from dataclasses import dataclass

    from flowdecision import _fastreq
    from flowdecision.core.model import DecisionStep

    @dataclass(frozen=True, slots=True)
    class Grown:
        step: Any
        extra: Any = None

    with pytest.raises(TypeError, match="slots are not the ones"):
        _fastreq.configure_types(DecisionRequest, Grown, DecisionStep, DEFAULT_RETRY_POLICY)
    with pytest.raises(TypeError, match="takes classes"):
        _fastreq.configure_types(DecisionRequest, ScheduleStep, object(), DEFAULT_RETRY_POLICY)
    _fastreq.configure_types(DecisionRequest, ScheduleStep, DecisionStep, DEFAULT_RETRY_POLICY)
    request = decode(body_of(BASE))
    assert type(request) is DecisionRequest and type(request.decision) is ScheduleStep
    assert type(request.decision.step) is DecisionStep


# -- failure paths ------------------------------------------------------------------


class _FailingHash:
    """A digest whose ``hexdigest`` fails as hashlib's would out of memory."""

    def __init__(self, data: bytes) -> None:
        pass

    def hexdigest(self) -> str:
        raise MemoryError("hexdigest")


@pytest.mark.parametrize("where", ["constructor", "hexdigest"])
@pytest.mark.parametrize("failing", range(4))
def test_a_failing_digest_ends_decode_with_its_own_error(
    decode: Any, where: str, failing: int
) -> None:
    """Out of memory in any of the four digests (the request hash, then the receipt's
    three) -- a hash constructor configured to fail at that call -- ends decode() at
    once with that MemoryError: not a SystemError from calling on with it pending, no
    later digest, nothing leaked."""
    from flowdecision import _fastreq
    from flowdecision.core.identity import DECISION_IDENTITY_DOMAIN, EVIDENCE_DOMAIN, RESULT_DOMAIN

    calls: list[bytes] = []

    def sha256(data: bytes) -> Any:
        calls.append(data)
        if len(calls) - 1 != failing:
            return hashlib.sha256(data)
        if where == "constructor":
            raise MemoryError("constructor")
        return _FailingHash(data)

    def configure(constructor: Any) -> None:
        _fastreq.configure_digests(
            constructor, DECISION_IDENTITY_DOMAIN, EVIDENCE_DOMAIN, RESULT_DOMAIN
        )

    body = body_of(with_step(input={"b": [1, {"a": None}], "text": "x" * 200}))
    configure(sha256)
    try:
        with pytest.raises(MemoryError, match=rf"^{where}$") as raised:
            decode(body)
        assert raised.value.__context__ is None  # raised with nothing pending before it
        assert len(calls) == failing + 1
        decode(body)  # warm up: first-call allocations are not a leak
        tracemalloc.start()
        try:
            gc.collect()  # an exception and its traceback make cycles: count only leaks
            start = tracemalloc.get_traced_memory()[0]
            for _ in range(2_000):
                calls.clear()
                with pytest.raises(MemoryError):
                    decode(body)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - start
        finally:
            tracemalloc.stop()
        assert grown < 64 * 1024, grown
    finally:
        configure(hashlib.sha256)
    assert check(decode, body)  # the digests configured back are hashlib's again
