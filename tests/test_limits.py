"""Library limits (issue 9): one identifier limit on every backend, exact numbers on
request, sinks that must be async, oversized decisions, and one error root."""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil
import re
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowdecision
from flowdecision import (
    DecisionRequest,
    DecisionTooLargeError,
    Dispatcher,
    DispatchError,
    FlowDecisionError,
    InvalidIdentifierError,
    InvalidIdentityError,
    InvalidRequestError,
    LedgerError,
    UnauthorizedBranchError,
)
from flowdecision.core.identity import decision_receipt
from flowdecision.core.jsonwire import JsonWireError, parse_json
from flowdecision.core.limits import (
    IDENTIFIER_FIELDS,
    IDENTIFIER_MAX_BYTES,
    REQUEST_IDENTIFIER_FIELDS,
    RESULT_RECEIPT_MAX_BYTES,
    identifier_problem,
    plain_identifiers,
)
from flowdecision.core.model import Complete, request_hash
from flowdecision.sinks.base import InvalidSinkError

from .helpers import RecordingSink, identity, receipt, request
from .ledger_stores import LedgerStore

#: Exactly the limit in UTF-8 bytes, with multi-byte characters ("€" is 3 bytes).
AT_LIMIT = "€" * 341 + "a"
assert len(AT_LIMIT.encode("utf-8")) == IDENTIFIER_MAX_BYTES
OVER_LIMIT = AT_LIMIT + "a"
BAD_IDS = {
    "one megabyte": "d" * 1_000_000,
    "limit + 1": OVER_LIMIT,
    "NUL": "dec\u0000-1",
    "newline": "dec-1\n",
    "DEL": "dec\x7f",
    "C1 control": "dec\u0085",
}


# -- the rule ------------------------------------------------------------------------


def test_the_rule_counts_utf8_bytes_and_refuses_every_control_character() -> None:
    assert IDENTIFIER_MAX_BYTES == 1024
    assert identifier_problem(AT_LIMIT) is None
    assert identifier_problem("a" * IDENTIFIER_MAX_BYTES) is None
    assert identifier_problem("") is None  # blankness is the dispatcher's own rule
    over = identifier_problem(OVER_LIMIT)
    assert over == "is 1025 bytes of UTF-8, over the limit of 1024 bytes"
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]:
        problem = identifier_problem(f"a{chr(code)}b")
        assert problem == f"must not contain control characters: U+{code:04X} at character 1"
    assert identifier_problem("tab-free ünïcödé 🙂 \u00a0") is None


# -- every backend -------------------------------------------------------------------


@pytest.mark.parametrize("field", ["decision_id", "owner_id"])
@pytest.mark.parametrize("label", list(BAD_IDS))
async def test_every_ledger_refuses_a_bad_identifier_and_stores_nothing(
    backend: LedgerStore, field: str, label: str
) -> None:
    ledger = await backend()
    args = {"decision_id": "dec-ok", "owner_id": "owner-ok"}
    args[field] = BAD_IDS[label]
    ident = identity("limits")
    with pytest.raises(InvalidIdentifierError) as caught:
        await ledger.claim(
            args["decision_id"], "hash", args["owner_id"], lease_ms=1000, identity=ident
        )
    error = caught.value
    assert error.field == field and error.code == "invalid_identifier"
    assert isinstance(error, LedgerError) and isinstance(error, DispatchError)
    assert f"`{field}`" in str(error) and len(str(error)) < 200
    # Nothing reached the store, and the store still works.
    assert await ledger.lookup("dec-ok") is None
    with pytest.raises(InvalidIdentifierError):
        await ledger.complete(
            args["decision_id"], "hash", args["owner_id"], identity=ident, receipt=receipt(ident)
        )
    if field == "decision_id":
        with pytest.raises(InvalidIdentifierError):
            await ledger.lookup(args["decision_id"])
    assert await ledger.claim("dec-ok", "hash", "owner-ok", lease_ms=1000, identity=ident)


async def test_every_ledger_round_trips_identifiers_of_exactly_the_limit(
    backend: LedgerStore,
) -> None:
    ledger = await backend()
    decision_id, owner_id = "d" + AT_LIMIT[1:], "o" + AT_LIMIT[1:]
    ident = identity("at-limit")
    stored = receipt(ident)
    claimed = await ledger.claim(decision_id, "hash", owner_id, lease_ms=60_000, identity=ident)
    assert claimed.attempt == 1  # type: ignore[union-attr]
    assert await ledger.complete(decision_id, "hash", owner_id, identity=ident, receipt=stored)
    reader = await backend()  # a fresh instance: what the store kept, not a cache
    entry = await reader.lookup(decision_id)
    assert entry is not None
    assert entry.decision_id == decision_id
    assert entry.state.kind == "completed"
    assert entry.result_receipt == stored
    assert await reader.completed_receipt(decision_id) == stored


async def test_the_dispatcher_refuses_bad_request_identifiers_before_the_claim(
    backend: LedgerStore,
) -> None:
    ledger = await backend()
    sink = RecordingSink()
    dispatcher = Dispatcher("production", sink, ledger)
    for field in REQUEST_IDENTIFIER_FIELDS:
        for label, bad in BAD_IDS.items():
            values = {
                "decision_id": "dec-bad-run",
                "run_id": "run-1",
                "authority_branch_id": "production",
                "causation_event_id": "event-1",
                field: bad,
            }
            with pytest.raises(InvalidIdentifierError) as caught:
                await dispatcher.dispatch(DecisionRequest(**values, decision=Complete(output=None)))
            assert caught.value.field == field, (field, label)
    assert sink.calls == []
    assert await ledger.lookup("dec-bad-run") is None
    health = dispatcher.health()
    assert health.rejected == 4 * len(BAD_IDS)
    assert (health.ledger_failures, health.failures, health.status.value) == (0, 0, "healthy")
    # An id of exactly the limit goes through, and a repeat is a duplicate.
    ok = request(decision_id=AT_LIMIT, run_id=AT_LIMIT, causation_event_id=AT_LIMIT)
    assert (await dispatcher.dispatch(ok)).submitted is True
    assert (await dispatcher.dispatch(ok)).submitted is False
    entry = await ledger.lookup(AT_LIMIT)
    assert entry is not None and entry.result_receipt == decision_receipt(ok)[1]


async def test_the_seed_checks_still_answer_first() -> None:
    dispatcher = Dispatcher("production", RecordingSink())
    # A valid fork branch is a branch error even when other ids are bad.
    with pytest.raises(UnauthorizedBranchError):
        await dispatcher.dispatch(request(branch="fork", run_id=OVER_LIMIT))
    # A blank id with control characters is the seed's blank-id error.
    with pytest.raises(InvalidIdentityError):
        await dispatcher.dispatch(request(causation_event_id="\t\n"))
    # A branch that breaks the rules is refused as such, never echoed in a 403.
    with pytest.raises(InvalidIdentifierError, match="authority_branch_id"):
        await dispatcher.dispatch(request(branch="x" * 1_000_000))


def test_the_dispatcher_refuses_a_bad_owner_or_production_branch() -> None:
    with pytest.raises(InvalidIdentifierError) as caught:
        Dispatcher("production", RecordingSink(), owner_id=OVER_LIMIT)
    assert caught.value.field == "owner_id"
    with pytest.raises(InvalidIdentifierError) as caught:
        Dispatcher("prod\u0000", RecordingSink())
    assert caught.value.field == "production_branch_id"
    Dispatcher("production", RecordingSink(), owner_id=AT_LIMIT)


def test_identifier_fields_are_the_documented_five() -> None:
    assert IDENTIFIER_FIELDS == (
        "decision_id",
        "run_id",
        "authority_branch_id",
        "causation_event_id",
        "owner_id",
    )


# -- sinks must be async ---------------------------------------------------------------


class PlainSink:
    """The pitfall: a plain ``def submit`` runs its side effect before anyone awaits it."""

    def __init__(self) -> None:
        self.calls = 0

    def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.calls += 1


class CallableSubmit:
    async def __call__(self, request: DecisionRequest, attempt: int) -> None:
        return None


class CallableSubmitSink:
    def __init__(self) -> None:
        self.submit = CallableSubmit()


def test_a_sink_without_async_submit_is_refused_when_the_dispatcher_is_built() -> None:
    sink = PlainSink()
    with pytest.raises(TypeError, match=r"sink `PlainSink` must define `async def submit"):
        Dispatcher("production", sink)  # type: ignore[arg-type]
    assert sink.calls == 0
    with pytest.raises(InvalidSinkError, match=r"`object`.*missing") as caught:
        Dispatcher("production", object())  # type: ignore[arg-type]
    assert isinstance(caught.value, FlowDecisionError) and caught.value.code == "invalid_sink"
    Dispatcher("production", CallableSubmitSink())  # type: ignore[arg-type]


# -- oversized decisions -----------------------------------------------------------------


def test_decision_too_large_is_a_dispatch_error_and_a_value_error() -> None:
    error = DecisionTooLargeError("d", 2_000_000, RESULT_RECEIPT_MAX_BYTES)
    assert isinstance(error, DispatchError) and isinstance(error, ValueError)
    assert error.code == "decision_too_large"
    huge = request(decision=Complete(output="x" * (1 << 20)))
    with pytest.raises(DecisionTooLargeError):
        decision_receipt(huge)


async def test_an_oversized_decision_is_rejected_on_every_ledger_without_a_claim(
    backend: LedgerStore,
) -> None:
    ledger = await backend()
    dispatcher = Dispatcher("production", RecordingSink(), ledger)
    huge = request(decision=Complete(output="x" * (1 << 20)))
    with pytest.raises(DecisionTooLargeError):
        await dispatcher.dispatch(huge)
    assert await ledger.lookup(huge.decision_id) is None
    assert dispatcher.health().status.value == "healthy"
    assert dispatcher.health().rejected == 1
    assert request_hash(huge)  # the request itself is fine; only its size is refused


# -- exact numbers -----------------------------------------------------------------------

HEAD = (
    '{"decision_id":"d","run_id":"r","authority_branch_id":"production",'
    '"causation_event_id":"e","decision":'
)


@pytest.mark.parametrize(
    ("decision", "path", "problem"),
    [
        (
            f'{{"type":"complete","output":{{"n":{2**70}}}}}}}',
            "decision.output.n",
            "integer `1180591620717411303424` is outside the 64-bit range",
        ),
        (
            f'{{"type":"complete","output":[1,{-(2**63 + 1)}]}}}}',
            "decision.output[1]",
            "is outside the 64-bit range",
        ),
        (
            '{"type":"schedule_step","step":{"step_id":"s","step_name":"n",'
            '"input":{"a b":{"x":0.10000000000000000001}}}}}',
            'decision.step.input["a b"].x',
            "cannot be held exactly by a 64-bit float (it would become `0.1`)",
        ),
        ('{"type":"complete","output":1e-400}}', "decision.output", "would become `0.0`"),
        (
            '{"type":"complete","output":9007199254740993.0}}',
            "decision.output",
            "would become `9007199254740992.0`",
        ),
    ],
)
def test_exact_numbers_refuse_what_serde_would_round(
    decision: str, path: str, problem: str
) -> None:
    text = HEAD + decision
    lossy = DecisionRequest.parse(text)  # the default keeps serde_json's semantics
    assert lossy.to_json()
    with pytest.raises(InvalidRequestError) as caught:
        DecisionRequest.parse(text, exact_numbers=True)
    assert caught.value.field == path
    assert problem in caught.value.problem
    with pytest.raises(JsonWireError) as wire:
        parse_json(text, exact_numbers=True)
    assert wire.value.path == path


def test_exact_numbers_ignore_numbers_in_members_the_model_drops() -> None:
    # Found by Schemathesis: unknown members are ignored (as serde does), so a
    # number in one is never kept and cannot be rounded away; it is no reason
    # to refuse the request. One inside a kept value still is, after it.
    text = (
        '{"decision_id":"d","run_id":"r","authority_branch_id":"production",'
        '"causation_event_id":"e","extra":[11161103754368468910080,0.10000000000000000001],'
        '"decision":{"type":"schedule_steps","z":1e-400,"steps":[{"step_id":"s",'
        '"step_name":"n","unknown":18446744073709551616,"input":{"n":%s}}]}}'
    )
    kept = DecisionRequest.parse(text % "1", exact_numbers=True)
    assert kept == DecisionRequest.parse(text % "1")
    assert b"extra" not in kept.to_json() and b"unknown" not in kept.to_json()
    with pytest.raises(InvalidRequestError) as caught:
        DecisionRequest.parse(text % "[1,18446744073709551616]", exact_numbers=True)
    assert caught.value.field == "decision.steps[0].input.n[1]"


@pytest.mark.parametrize(
    "number",
    [
        "0",
        "-0",
        "18446744073709551615",
        "-9223372036854775808",
        "0.1",
        "1.50",
        "1e3",
        "1E+22",
        "-0.0",
        "5e-324",
        "1.7976931348623157e308",
        "12345678.912345678e-8",
    ],
)
def test_exact_numbers_keep_everything_that_round_trips(number: str) -> None:
    text = HEAD + f'{{"type":"complete","output":[{number}]}}}}'
    assert DecisionRequest.parse(text, exact_numbers=True) == DecisionRequest.parse(text)


@settings(max_examples=2000, deadline=None)
@given(
    sign=st.sampled_from(["", "-"]),
    digits=st.text("0123456789", min_size=1, max_size=25),
    point=st.integers(min_value=0, max_value=25),
    exponent=st.one_of(st.none(), st.integers(min_value=-330, max_value=310)),
)
def test_exact_floats_are_kept_iff_they_print_back_as_written(
    sign: str, digits: str, point: int, exponent: int | None
) -> None:
    mantissa = digits[: min(point, len(digits))] or "0"
    fraction = digits[min(point, len(digits)) :] or "0"
    mantissa = mantissa.lstrip("0") or "0"  # JSON forbids leading zeros
    text = f"{sign}{mantissa}.{fraction}" + ("" if exponent is None else f"e{exponent}")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        return  # an overflow is an error in both modes
    kept = Decimal(text) == Decimal(repr(value))
    try:
        assert parse_json(text, exact_numbers=True) == value
        assert kept, text
    except JsonWireError:
        assert not kept, text


def test_the_lossy_default_matches_serde() -> None:
    parsed = DecisionRequest.parse(HEAD + f'{{"type":"complete","output":{2**70}}}}}')
    assert parsed.decision.to_dict()["output"] == float(2**70)


# -- one error root ----------------------------------------------------------------------


def _package_modules() -> list[str]:
    names = [flowdecision.__name__]
    for info in pkgutil.walk_packages(flowdecision.__path__, prefix="flowdecision."):
        if not info.name.endswith(".__main__"):  # importing it would run the CLI
            names.append(info.name)
    return names


def test_every_public_exception_class_derives_from_flowdecision_error() -> None:
    found: dict[str, type[BaseException]] = {}
    for name in _package_modules():
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not attribute.startswith("_")
            ):
                found[f"{name}.{attribute}"] = value
    assert len(found) >= 30, sorted(found)  # the walk really reached the package
    outside = [name for name, cls in found.items() if not issubclass(cls, FlowDecisionError)]
    assert outside == []
    misnamed = [name for name in found if not name.endswith("Error")]
    assert misnamed == []
    no_code = [name for name, cls in found.items() if "code" not in vars(cls)]
    assert no_code == []


def test_the_mixins_callers_rely_on_are_kept() -> None:
    import sqlite3

    from flowdecision.core.identity import ExecutionContractError
    from flowdecision.core.model import RetryPolicyError
    from flowdecision.store.migrations import MigrationError
    from flowdecision.store.sqlite import WalUnavailableError

    for cls in (
        InvalidRequestError,
        RetryPolicyError,
        JsonWireError,
        ExecutionContractError,
        DecisionTooLargeError,
        MigrationError,
    ):
        assert issubclass(cls, ValueError), cls
    assert issubclass(WalUnavailableError, sqlite3.OperationalError)
    assert issubclass(InvalidSinkError, TypeError)


def test_readme_names_only_true_errors() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    paragraph = readme[readme.index("Errors are exceptions") :].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+Error)`", paragraph)) - set(dir(builtins))  # ValueError
    assert {"FlowDecisionError", "DispatchError", "InvalidIdentifierError"} <= named
    for name in named:
        cls = getattr(flowdecision, name)
        assert issubclass(cls, FlowDecisionError), name


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(st.text(max_size=8), st.sampled_from(["", "x" * 1024, "x" * 1025])), max_size=4
    )
)
def test_plain_identifiers_only_vouches_for_ids_each_check_accepts(values: list[str]) -> None:
    """The one-pass check of several ids says True only where every id passes on its
    own; where it says False, the per-id check decides (and names the problem)."""
    if plain_identifiers(*values):
        assert all(identifier_problem(value) is None for value in values)
    elif all(value.isascii() for value in values):
        # For plain ASCII the two agree exactly.
        assert any(identifier_problem(value) is not None for value in values)


def test_plain_identifiers_refuses_what_is_not_plain() -> None:
    assert plain_identifiers("decision-1", "run-1", "") and plain_identifiers()
    for odd in ("a\x00b", "tab\t", "\x85", "é", "\ud800", "x" * 1025):
        assert not plain_identifiers("ok", odd)
    assert not plain_identifiers("ok", 5) and not plain_identifiers(None)  # type: ignore[arg-type]
