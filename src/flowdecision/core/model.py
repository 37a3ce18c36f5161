"""The decision wire model: what a flow graph proposes, as serde would (de)serialize it.

Mirrors the Rust types ``FlowDecisionRequest``, ``FlowDecision`` (internally
tagged by ``"type"``), ``FlowDecisionStep`` and A3S Flow's ``RetryPolicy``.

Wire rules (see ``tests/data/VECTORS.md``):

* struct fields serialize in declaration order; free-form values (``input``,
  ``output``) serialize with object keys sorted by code point;
* unknown fields are ignored on input at every level and never written back;
* a missing ``retry`` means :data:`DEFAULT_RETRY_POLICY`, and ``retry`` is always
  written;
* missing or mistyped fields, unknown variants, a struct field given twice,
  integers outside u32/u64, and structs given as JSON arrays (which serde
  happens to accept) are rejected with :class:`InvalidRequestError`.

Retry-policy *rules* (:meth:`RetryPolicy.validate`) are not applied while
parsing: the reference vectors accept a fixed policy with ``max_delay_ms``.

Instances are immutable and own copies of the free-form values they were given;
treat ``input``/``output`` as read-only (mutating them would desynchronise the
cached :meth:`DecisionRequest.to_json`).  Equality (and hashing) compares wire
bytes, so ``1``, ``1.0`` and ``true`` are different values, as in Rust.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias, TypeVar

from flowdecision.core.jsonwire import (
    Fragment,
    InexactNumberError,
    JsonWireError,
    canonicalize,
    duplicate_keys,
    encode_json,
    encode_json_text,
    encode_str,
    format_float,
    key_segment,
    parse_json,
)
from flowdecision.core.limits import I64_MIN, U32_MAX, U64_MAX
from flowdecision.errors import InvalidArgumentTypeError

from ..errors import InvalidRequestError, RetryPolicyError

_fast_decode: Callable[[object], DecisionRequest | None] | None
try:  # built by pip where a C compiler is at hand (setup.py); else parse does it all
    from .._fastreq import decode as _fast_decode
except ImportError:  # pragma: no cover - the tests run with the extension built
    _fast_decode = None

__all__ = [
    "DEFAULT_RETRY_POLICY",
    "U32_MAX",
    "U64_MAX",
    "Backoff",
    "Complete",
    "Decision",
    "DecisionRequest",
    "DecisionStep",
    "Fail",
    "InvalidRequestError",
    "OnExhausted",
    "RetryPolicy",
    "RetryPolicyError",
    "ScheduleStep",
    "ScheduleSteps",
    "json_schemas",
    "request_hash",
]

Backoff: TypeAlias = Literal["fixed", "exponential"]
OnExhausted: TypeAlias = Literal["fail_run", "continue_workflow"]

_T = TypeVar("_T")
_MISSING: Final = object()


# ------------------------------------------------------------------ validation helpers


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _describe(value: object) -> str:
    """Name a value the way serde's `invalid type` errors do."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{int(value)}`"
    if isinstance(value, float):
        try:
            return f"floating point `{format_float(value)}`"
        except JsonWireError:
            return f"floating point `{value!r}`"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"string {encode_str(shown)}"
    if isinstance(value, (list, tuple)):
        return "sequence"
    if isinstance(value, Mapping):
        return "map"
    return f"Python object of type `{type(value).__qualname__}`"


def _struct(obj: object, path: str, name: str) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    if isinstance(obj, (list, tuple)):
        # serde also accepts a struct as an array of its fields in order; that
        # is an accident of serde_json, not part of the contract.
        raise InvalidRequestError(
            path,
            f"invalid type: sequence, expected struct {name} as a JSON object "
            "(structs given as JSON arrays are not supported)",
        )
    raise InvalidRequestError(path, f"invalid type: {_describe(obj)}, expected struct {name}")


def _reject_duplicates(obj: Mapping[str, Any], path: str, known: tuple[str, ...]) -> None:
    repeated = duplicate_keys(obj)
    if repeated:
        # serde only notices repeats of fields it knows; unknown ones are skipped.
        for key in known:
            if key in repeated:
                raise InvalidRequestError(_join(path, key), f"duplicate field `{key}`")


def _required(obj: Mapping[str, Any], key: str, path: str) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        raise InvalidRequestError(_join(path, key), f"missing field `{key}`")
    return value


def _check_unicode(value: str, path: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(path, "string holds a lone surrogate") from None
    return value


def _as_str(value: object, path: str) -> str:
    if type(value) is str:
        return _check_unicode(value, path)
    if isinstance(value, str):
        return _check_unicode(str.__str__(value), path)
    raise InvalidRequestError(path, f"invalid type: {_describe(value)}, expected a string")


def _as_uint(value: object, path: str, maximum: int, kind: str) -> int:
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequestError(path, f"invalid type: {_describe(value)}, expected {kind}")
        value = int(value)
    if value < 0 or value > maximum:
        raise InvalidRequestError(path, f"invalid value: integer `{value}`, expected {kind}")
    return value


def _as_variant(value: object, path: str, variants: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(
            path, f"invalid type: {_describe(value)}, expected a variant name (string)"
        )
    if value in variants:
        return str.__str__(value)
    if len(variants) == 2:
        expected = f"`{variants[0]}` or `{variants[1]}`"
    else:
        expected = "one of " + ", ".join(f"`{v}`" for v in variants)
    raise InvalidRequestError(path, f"unknown variant `{value}`, expected {expected}")


class _ValueProblem(Exception):
    """Internal: a non-JSON value; ``segments`` is the path, innermost first."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.segments: list[str] = []


def _copy_value(value: object) -> Any:
    """Validate that ``value`` is JSON data serde can hold and return a private copy."""
    kind = type(value)
    if kind is str:
        assert isinstance(value, str)
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _ValueProblem("string holds a lone surrogate") from None
        return value
    if value is None or kind is bool:
        return value
    if kind is int:
        assert isinstance(value, int)
        if not I64_MIN <= value <= U64_MAX:
            raise _ValueProblem(f"integer `{value}` is outside the i64/u64 range JSON values hold")
        return value
    if kind is float:
        assert isinstance(value, float)
        if not math.isfinite(value):
            raise _ValueProblem(f"non-finite float `{value!r}` is not valid JSON")
        return value
    if isinstance(value, Mapping):
        copied: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _ValueProblem(f"object key {key!r} is not a string")
            key = str.__str__(key)
            try:
                copied[key] = _copy_value(item)
            except _ValueProblem as problem:
                problem.segments.append(key_segment(key))
                raise
        return copied
    if isinstance(value, (list, tuple)):
        items: list[Any] = []
        for index, item in enumerate(value):
            try:
                items.append(_copy_value(item))
            except _ValueProblem as problem:
                problem.segments.append(f"[{index}]")
                raise
        return items
    # Subclasses of the scalar types (str enums, IntEnum, ...) become plain values.
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return _copy_value(str.__str__(value))
    if isinstance(value, int):
        return _copy_value(int(value))
    if isinstance(value, float):
        return _copy_value(float(value))
    raise _ValueProblem(
        f"invalid type: {_describe(value)}, expected a JSON value "
        "(None, bool, int, float, str, list, tuple or dict with str keys)"
    )


def _json_value(value: object, path: str) -> Any:
    try:
        return _copy_value(value)
    except _ValueProblem as problem:
        full_path = path + "".join(reversed(problem.segments))
        raise InvalidRequestError(full_path, problem.problem) from None
    except RecursionError:
        raise InvalidRequestError(path, "value is nested too deeply") from None


def _build(cls: type[_T], **values: Any) -> _T:
    """Create an instance from already-validated values, skipping ``__post_init__``."""
    obj = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


def _freeform_text(value: Any) -> str:
    # serde_json's default Map is a BTreeMap, so free-form keys come out sorted.
    return encode_json_text(value, sort_keys=True)


# ------------------------------------------------------------------------ RetryPolicy

_RETRY_FIELDS: Final = ("max_attempts", "delay_ms", "backoff", "max_delay_ms", "on_exhausted")
_BACKOFFS: Final = ("fixed", "exponential")
_ON_EXHAUSTED: Final = ("fail_run", "continue_workflow")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """A3S Flow's retry policy for a scheduled step (fields in wire order).

    Construction checks types and integer ranges (``max_attempts`` is u32, the
    delays are u64); the scheduling rules are checked by :meth:`validate`.
    """

    max_attempts: int = 3
    delay_ms: int = 0
    backoff: Backoff = "fixed"
    max_delay_ms: int = 0
    on_exhausted: OnExhausted = "fail_run"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "max_attempts", _as_uint(self.max_attempts, "max_attempts", U32_MAX, "u32"))
        set_(self, "delay_ms", _as_uint(self.delay_ms, "delay_ms", U64_MAX, "u64"))
        set_(self, "backoff", _as_variant(self.backoff, "backoff", _BACKOFFS))
        set_(self, "max_delay_ms", _as_uint(self.max_delay_ms, "max_delay_ms", U64_MAX, "u64"))
        set_(self, "on_exhausted", _as_variant(self.on_exhausted, "on_exhausted", _ON_EXHAUSTED))

    def validate(self) -> None:
        """Apply A3S Flow's rules for a policy that is about to be used.

        Raises :class:`RetryPolicyError` if a fixed policy sets ``max_delay_ms``
        or an exponential one breaks ``1 <= delay_ms <= max_delay_ms``.
        """
        if self.backoff == "fixed":
            if self.max_delay_ms != 0:
                raise RetryPolicyError("fixed retry policy cannot define max_delay_ms")
        elif not 1 <= self.delay_ms <= self.max_delay_ms:
            raise RetryPolicyError(
                "exponential retry delays must satisfy 1 <= delay_ms <= max_delay_ms"
            )

    def to_dict(self) -> dict[str, Any]:
        """Wire form: defaults for ``backoff``/``max_delay_ms``/``on_exhausted`` are omitted."""
        out: dict[str, Any] = {"max_attempts": self.max_attempts, "delay_ms": self.delay_ms}
        if self.backoff != "fixed":
            out["backoff"] = self.backoff
        if self.max_delay_ms != 0:
            out["max_delay_ms"] = self.max_delay_ms
        if self.on_exhausted != "fail_run":
            out["on_exhausted"] = self.on_exhausted
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> RetryPolicy:
        """Deserialize a policy; raises :class:`InvalidRequestError` (paths relative)."""
        return _parse_retry(obj, "")

    def _wire(self) -> dict[str, Any]:
        return self.to_dict()


#: The policy a step gets when ``retry`` is missing: 3 attempts, no delay.
DEFAULT_RETRY_POLICY: Final = RetryPolicy()


def _parse_retry(obj: object, path: str) -> RetryPolicy:
    m = _struct(obj, path, "RetryPolicy")
    _reject_duplicates(m, path, _RETRY_FIELDS)
    max_attempts = _as_uint(
        _required(m, "max_attempts", path), _join(path, "max_attempts"), U32_MAX, "u32"
    )
    delay_ms = _as_uint(_required(m, "delay_ms", path), _join(path, "delay_ms"), U64_MAX, "u64")
    backoff = m.get("backoff", _MISSING)
    backoff = (
        "fixed" if backoff is _MISSING else _as_variant(backoff, _join(path, "backoff"), _BACKOFFS)
    )
    max_delay = m.get("max_delay_ms", _MISSING)
    max_delay_ms = (
        0
        if max_delay is _MISSING
        else _as_uint(max_delay, _join(path, "max_delay_ms"), U64_MAX, "u64")
    )
    exhausted = m.get("on_exhausted", _MISSING)
    on_exhausted = (
        "fail_run"
        if exhausted is _MISSING
        else _as_variant(exhausted, _join(path, "on_exhausted"), _ON_EXHAUSTED)
    )
    if (
        max_attempts == 3
        and delay_ms == 0
        and backoff == "fixed"
        and max_delay_ms == 0
        and on_exhausted == "fail_run"
    ):
        return DEFAULT_RETRY_POLICY  # share the common case
    return _build(
        RetryPolicy,
        max_attempts=max_attempts,
        delay_ms=delay_ms,
        backoff=backoff,
        max_delay_ms=max_delay_ms,
        on_exhausted=on_exhausted,
    )


# ----------------------------------------------------------------------- DecisionStep

_STEP_FIELDS: Final = ("step_id", "step_name", "input", "retry")


class _WireEq:
    """Equality and hashing by wire text, so ``1``, ``1.0`` and ``true`` differ as in Rust."""

    __slots__ = ()

    def _wire(self) -> dict[str, Any]:
        """The wire form, free-form values already encoded (:data:`Fragment`)."""
        raise NotImplementedError

    def _wire_text(self) -> bytes:
        return encode_json(self._wire())

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _WireEq)
        return self._wire_text() == other._wire_text()

    def __hash__(self) -> int:
        return hash(self._wire_text())


@dataclass(frozen=True, slots=True, eq=False)
class DecisionStep(_WireEq):
    """One step to schedule: ``input`` is any JSON value; ``retry`` defaults to 3 attempts."""

    step_id: str
    step_name: str
    input: Any
    retry: RetryPolicy = DEFAULT_RETRY_POLICY
    _input_text: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_id", _as_str(self.step_id, "step_id"))
        object.__setattr__(self, "step_name", _as_str(self.step_name, "step_name"))
        object.__setattr__(self, "input", _json_value(self.input, "input"))
        if not isinstance(self.retry, RetryPolicy):
            raise InvalidRequestError(
                "retry", f"invalid type: {_describe(self.retry)}, expected RetryPolicy"
            )

    def to_dict(self) -> dict[str, Any]:
        """Wire form (``input`` keys sorted; ``retry`` always present)."""
        return {
            "step_id": self.step_id,
            "step_name": self.step_name,
            "input": canonicalize(self.input),
            "retry": self.retry.to_dict(),
        }

    def _input_json(self) -> str:
        cached = self._input_text
        if cached is None:
            cached = _freeform_text(self.input)
            object.__setattr__(self, "_input_text", cached)
        return cached

    def _wire(self) -> dict[str, Any]:
        return {
            "step_id": self.step_id,
            "step_name": self.step_name,
            "input": Fragment(self._input_json()),
            "retry": self.retry.to_dict(),
        }


def _parse_step(obj: object, path: str, trusted: bool) -> DecisionStep:
    if trusted and type(obj) is dict:
        # Straight from parse_json (no repeated keys, no lone surrogates: see
        # _parse_request): a step whose fields are all there and typed is read
        # directly; anything else takes the checks below, which name the problem.
        step_id, step_name = obj.get("step_id"), obj.get("step_name")
        value = obj.get("input", _MISSING)
        if type(step_id) is str and type(step_name) is str and value is not _MISSING:
            retry_obj = obj.get("retry", _MISSING)
            return _build(
                DecisionStep,
                step_id=step_id,
                step_name=step_name,
                input=value,
                retry=DEFAULT_RETRY_POLICY
                if retry_obj is _MISSING
                else _parse_retry(retry_obj, _join(path, "retry")),
                _input_text=None,
            )
    m = _struct(obj, path, "FlowDecisionStep")
    _reject_duplicates(m, path, _STEP_FIELDS)
    step_id = _as_str(_required(m, "step_id", path), _join(path, "step_id"))
    step_name = _as_str(_required(m, "step_name", path), _join(path, "step_name"))
    value = _required(m, "input", path)
    if not trusted:
        value = _json_value(value, _join(path, "input"))
    retry_obj = m.get("retry", _MISSING)
    retry = (
        DEFAULT_RETRY_POLICY
        if retry_obj is _MISSING
        else _parse_retry(retry_obj, _join(path, "retry"))
    )
    return _build(
        DecisionStep,
        step_id=step_id,
        step_name=step_name,
        input=value,
        retry=retry,
        _input_text=None,
    )


# -------------------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True, eq=False)
class ScheduleStep(_WireEq):
    """Schedule one step: ``{"type":"schedule_step","step":{...}}``."""

    step: DecisionStep

    def __post_init__(self) -> None:
        if not isinstance(self.step, DecisionStep):
            raise InvalidRequestError(
                "step", f"invalid type: {_describe(self.step)}, expected DecisionStep"
            )

    def to_dict(self) -> dict[str, Any]:
        """Wire form."""
        return {"type": "schedule_step", "step": self.step.to_dict()}

    def _wire(self) -> dict[str, Any]:
        return {"type": "schedule_step", "step": self.step._wire()}


@dataclass(frozen=True, slots=True, eq=False)
class ScheduleSteps(_WireEq):
    """Schedule several steps (possibly none): ``{"type":"schedule_steps","steps":[...]}``."""

    steps: tuple[DecisionStep, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.steps, (list, tuple)):
            raise InvalidRequestError(
                "steps", f"invalid type: {_describe(self.steps)}, expected a sequence"
            )
        steps = tuple(self.steps)
        for index, step in enumerate(steps):
            if not isinstance(step, DecisionStep):
                raise InvalidRequestError(
                    f"steps[{index}]", f"invalid type: {_describe(step)}, expected DecisionStep"
                )
        object.__setattr__(self, "steps", steps)

    def to_dict(self) -> dict[str, Any]:
        """Wire form."""
        return {"type": "schedule_steps", "steps": [step.to_dict() for step in self.steps]}

    def _wire(self) -> dict[str, Any]:
        return {"type": "schedule_steps", "steps": [step._wire() for step in self.steps]}


@dataclass(frozen=True, slots=True, eq=False)
class Complete(_WireEq):
    """Complete the run with ``output`` (any JSON value): ``{"type":"complete",...}``."""

    output: Any
    _output_text: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", _json_value(self.output, "output"))

    def to_dict(self) -> dict[str, Any]:
        """Wire form (``output`` keys sorted)."""
        return {"type": "complete", "output": canonicalize(self.output)}

    def _output_json(self) -> str:
        cached = self._output_text
        if cached is None:
            cached = _freeform_text(self.output)
            object.__setattr__(self, "_output_text", cached)
        return cached

    def _wire(self) -> dict[str, Any]:
        return {"type": "complete", "output": Fragment(self._output_json())}


@dataclass(frozen=True, slots=True, eq=False)
class Fail(_WireEq):
    """Fail the run with a message: ``{"type":"fail","error":"..."}``."""

    error: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "error", _as_str(self.error, "error"))

    def to_dict(self) -> dict[str, Any]:
        """Wire form."""
        return {"type": "fail", "error": self.error}

    def _wire(self) -> dict[str, Any]:
        return {"type": "fail", "error": self.error}


Decision: TypeAlias = ScheduleStep | ScheduleSteps | Complete | Fail
_DECISION_TYPES: Final = (ScheduleStep, ScheduleSteps, Complete, Fail)
_VARIANTS: Final = ("schedule_step", "schedule_steps", "complete", "fail")


def _parse_decision(obj: object, path: str, trusted: bool) -> Decision:
    if trusted and type(obj) is dict and obj.get("type") == "schedule_step":
        step = obj.get("step", _MISSING)  # the common variant, read directly (see _parse_step)
        if step is not _MISSING:
            return _build(ScheduleStep, step=_parse_step(step, _join(path, "step"), trusted))
    m = _struct(obj, path, "FlowDecision")
    _reject_duplicates(m, path, ("type",))
    tag = _as_variant(_required(m, "type", path), _join(path, "type"), _VARIANTS)
    if tag == "complete":
        _reject_duplicates(m, path, ("output",))
        output = _required(m, "output", path)
        if not trusted:
            output = _json_value(output, _join(path, "output"))
        return _build(Complete, output=output, _output_text=None)
    if tag == "fail":
        _reject_duplicates(m, path, ("error",))
        return _build(Fail, error=_as_str(_required(m, "error", path), _join(path, "error")))
    if tag == "schedule_step":
        _reject_duplicates(m, path, ("step",))
        step_path = _join(path, "step")
        return _build(
            ScheduleStep, step=_parse_step(_required(m, "step", path), step_path, trusted)
        )
    _reject_duplicates(m, path, ("steps",))
    raw_steps = _required(m, "steps", path)
    steps_path = _join(path, "steps")
    if not isinstance(raw_steps, (list, tuple)):
        raise InvalidRequestError(
            steps_path, f"invalid type: {_describe(raw_steps)}, expected a sequence"
        )
    steps = tuple(
        _parse_step(item, f"{steps_path}[{index}]", trusted) for index, item in enumerate(raw_steps)
    )
    return _build(ScheduleSteps, steps=steps)


# -------------------------------------------------------------------- DecisionRequest

_REQUEST_FIELDS: Final = (
    "decision_id",
    "run_id",
    "authority_branch_id",
    "causation_event_id",
    "decision",
)


@dataclass(frozen=True, slots=True, eq=False)
class DecisionRequest:
    """A graph proposal submitted through a host-owned Flow boundary.

    Build one with :meth:`parse` (JSON text or a mapping) or directly.  Its wire
    bytes (:meth:`to_json`) are computed once and cached.
    """

    decision_id: str
    run_id: str
    authority_branch_id: str
    causation_event_id: str
    decision: Decision
    _json: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _decision_json: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _hash: str | None = field(default=None, init=False, repr=False, compare=False)
    _canonical: bytes | None = field(default=None, init=False, repr=False, compare=False)
    #: The receipt's digests (identity, evidence, result) when the C decoder computed
    #: them (identity.decision_receipt's; None: computed there).
    _digests: tuple[str, str, str] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in _REQUEST_FIELDS[:4]:
            object.__setattr__(self, name, _as_str(getattr(self, name), name))
        if not isinstance(self.decision, _DECISION_TYPES):
            raise InvalidRequestError(
                "decision",
                f"invalid type: {_describe(self.decision)}, "
                "expected ScheduleStep, ScheduleSteps, Complete or Fail",
            )

    # ---- construction

    @classmethod
    def parse(
        cls,
        data: bytes | bytearray | memoryview | str | Mapping[str, Any],
        *,
        exact_numbers: bool = False,
    ) -> DecisionRequest:
        """Parse JSON text (as ``serde_json::from_slice`` would) or validate a mapping.

        Raises :class:`InvalidRequestError` for JSON syntax errors (``field`` is
        ``""``) and for anything the Rust types would refuse.

        ``exact_numbers=True`` is stricter than the Rust original: a number in
        the text that the model cannot keep exactly (an integer outside
        i64/u64, which serde_json turns into a float, or a decimal no 64-bit
        float holds as written) is an :class:`InvalidRequestError` naming its
        path, instead of being rounded. A mapping holds Python numbers, which
        are kept exactly or refused anyway.
        """
        if isinstance(data, Mapping):
            return cls.from_dict(data)
        if type(data) is bytes and _fast_decode is not None:
            # The common body, decoded in C with its texts and digests (_fastreq.c);
            # None for any other, parsed (and refused, naming why) below.
            fast = _fast_decode(data)
            if fast is not None:
                return fast
        if not isinstance(data, (bytes, bytearray, memoryview, str)):
            raise InvalidArgumentTypeError(
                f"expected JSON text or a mapping, got {type(data).__qualname__}"
            )
        try:
            value = parse_json(data, exact_numbers=exact_numbers)
        except InexactNumberError as exc:
            return _parse_ignoring_unkept(data, exc)
        except JsonWireError as exc:
            if exc.path is not None:
                raise InvalidRequestError(exc.path, exc.message) from exc
            raise InvalidRequestError("", str(exc)) from exc
        # Values straight from parse_json are already valid JSON data that
        # nothing else references, so they are adopted without a copy.
        return _parse_request(value, trusted=True)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> DecisionRequest:
        """Validate a mapping in wire shape (as :meth:`to_dict` returns) and copy it.

        Free-form values must be JSON data: ``None``, ``bool``, ``int`` within
        i64/u64, finite ``float``, ``str``, ``list``/``tuple`` and mappings with
        ``str`` keys.
        """
        return _parse_request(obj, trusted=False)

    # ---- serialization

    def to_dict(self) -> dict[str, Any]:
        """Wire form: struct fields in declaration order, free-form keys sorted."""
        return {
            "decision_id": self.decision_id,
            "run_id": self.run_id,
            "authority_branch_id": self.authority_branch_id,
            "causation_event_id": self.causation_event_id,
            "decision": self.decision.to_dict(),
        }

    def decision_json(self) -> bytes:
        """``serde_json::to_vec(&request.decision)``: the bytes a receipt digests."""
        cached = self._decision_json
        if cached is None:
            cached = self.decision._wire_text()
            object.__setattr__(self, "_decision_json", cached)
        return cached

    def to_json(self) -> bytes:
        """``serde_json::to_vec(&request)``: exact wire bytes (cached)."""
        cached = self._json
        if cached is None:
            cached = encode_json(
                {
                    "decision_id": self.decision_id,
                    "run_id": self.run_id,
                    "authority_branch_id": self.authority_branch_id,
                    "causation_event_id": self.causation_event_id,
                    "decision": Fragment(self.decision_json()),
                }
            )
            object.__setattr__(self, "_json", cached)
        return cached

    def canonical_json(self) -> bytes:
        """The request as JSON with object keys sorted at every level, struct fields too.

        This is what ``ExecutionIdentityV1::derive`` digests (compact, arrays in
        order).  Built from the same cached free-form encodings as
        :meth:`to_json`, so the (possibly large) values are encoded only once.
        """
        cached = self._canonical
        if cached is not None:
            return cached
        cached = encode_json(
            {
                "decision_id": self.decision_id,
                "run_id": self.run_id,
                "authority_branch_id": self.authority_branch_id,
                "causation_event_id": self.causation_event_id,
                "decision": self.decision._wire(),
            },
            sort_keys=True,
        )
        object.__setattr__(self, "_canonical", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        if type(other) is not DecisionRequest:
            return NotImplemented
        assert isinstance(other, DecisionRequest)
        return self is other or self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(self.to_json())


def _kept_values(decision: Decision) -> tuple[str, ...]:
    """The paths of the free-form values a request keeps (its other numbers are typed)."""
    if isinstance(decision, Complete):
        return ("decision.output",)
    if isinstance(decision, ScheduleStep):
        return ("decision.step.input",)
    if isinstance(decision, ScheduleSteps):
        return tuple(f"decision.steps[{index}].input" for index in range(len(decision.steps)))
    return ()


def _parse_ignoring_unkept(
    data: bytes | bytearray | memoryview | str, error: InexactNumberError
) -> DecisionRequest:
    """``exact_numbers``: refuse an inexact number only where the request keeps it.

    Unknown members are ignored (as serde does), so a number in one cannot be
    lost; refusing it would turn away a request that nothing in it changes
    (found by Schemathesis). Parsed again with rounding, the request's own
    errors come first; then any inexact number inside ``input`` or ``output``
    is refused, naming its path. Typed fields (retry counts) refuse a rounded
    number by type anyway.
    """
    try:
        request = _parse_request(parse_json(data), trusted=True)
    except JsonWireError as exc:  # pragma: no cover - the exact parse got further
        raise InvalidRequestError(exc.path or "", exc.message) from exc
    kept = _kept_values(request.decision)
    for path, problem in error.inexact:  # in document order: the first kept one is named
        for prefix in kept:
            if path == prefix or (path.startswith(prefix) and path[len(prefix)] in ".["):
                raise InvalidRequestError(path, problem) from error
    return request


def _parse_request(obj: object, *, trusted: bool) -> DecisionRequest:
    if trusted and type(obj) is dict:
        # Values straight from parse_json: a plain dict repeated no key (those are
        # DuplicateKeyDicts) and no string holds a lone surrogate (parse_json
        # refuses them), so four ids that are strings need no further check.
        # Anything else takes the checks below, which name the problem.
        decision_id, run_id = obj.get("decision_id"), obj.get("run_id")
        branch, cause = obj.get("authority_branch_id"), obj.get("causation_event_id")
        if (
            type(decision_id) is str
            and type(run_id) is str
            and type(branch) is str
            and type(cause) is str
        ):
            return _build(
                DecisionRequest,
                decision_id=decision_id,
                run_id=run_id,
                authority_branch_id=branch,
                causation_event_id=cause,
                decision=_parse_decision(_required(obj, "decision", ""), "decision", trusted),
                _json=None,
                _decision_json=None,
                _hash=None,
                _canonical=None,
                _digests=None,
            )
    m = _struct(obj, "", "FlowDecisionRequest")
    _reject_duplicates(m, "", _REQUEST_FIELDS)
    return _build(
        DecisionRequest,
        decision_id=_as_str(_required(m, "decision_id", ""), "decision_id"),
        run_id=_as_str(_required(m, "run_id", ""), "run_id"),
        authority_branch_id=_as_str(_required(m, "authority_branch_id", ""), "authority_branch_id"),
        causation_event_id=_as_str(_required(m, "causation_event_id", ""), "causation_event_id"),
        decision=_parse_decision(_required(m, "decision", ""), "decision", trusted),
        _json=None,
        _decision_json=None,
        _hash=None,
        _canonical=None,
        _digests=None,
    )


def request_hash(request: DecisionRequest) -> str:
    """Legacy ledger key: lowercase hex SHA-256 of :meth:`DecisionRequest.to_json`
    (cached: the dispatcher and the outbox row both need it)."""
    cached = request._hash
    if cached is None:
        cached = hashlib.sha256(request.to_json()).hexdigest()
        object.__setattr__(request, "_hash", cached)
    return cached


# ------------------------------------------------------------------------ JSON Schema

_SCHEMA_REF: Final = "#/components/schemas/"


def json_schemas(ref_prefix: str = _SCHEMA_REF) -> dict[str, dict[str, Any]]:
    """JSON Schemas (draft 2020-12) of the wire model, by name, referring to each
    other as ``{ref_prefix}{name}``; ``DecisionRequest`` is the request.

    Built from the same field, variant and range constants the parser above
    uses, so the two cannot drift apart; tests/test_model_schema.py replays
    tests/data/hash_vectors.jsonl against it. What JSON Schema cannot say is
    left to the parser: JSON syntax, duplicate struct fields, lone surrogates,
    and that an ``integer`` must be written without a fraction (``1.0``).
    Unknown members are ignored on input, so every object admits them.
    """

    def ref(name: str) -> dict[str, Any]:
        return {"$ref": ref_prefix + name}

    def struct(
        description: str, properties: dict[str, Any], optional: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        return {
            "type": "object",
            "description": description,
            "properties": properties,
            "required": [name for name in properties if name not in optional],
        }

    def uint(maximum: int) -> dict[str, Any]:
        return {"type": "integer", "minimum": 0, "maximum": maximum}

    def variant(tag: str, description: str, **members: Any) -> dict[str, Any]:
        return struct(description, {"type": {"const": tag}, **members})

    any_json: dict[str, Any] = {"description": "any JSON value"}
    string: dict[str, Any] = {"type": "string"}
    retry_types = dict(
        zip(
            _RETRY_FIELDS,
            (
                uint(U32_MAX),
                uint(U64_MAX),
                {"enum": list(_BACKOFFS)},
                uint(U64_MAX),
                {"enum": list(_ON_EXHAUSTED)},
            ),
            strict=True,
        )
    )
    variants = dict(
        zip(
            _VARIANTS,
            (
                variant("schedule_step", "Schedule one step.", step=ref("DecisionStep")),
                variant(
                    "schedule_steps",
                    "Schedule several steps (possibly none).",
                    steps={"type": "array", "items": ref("DecisionStep")},
                ),
                variant("complete", "Complete the run with `output`.", output=any_json),
                variant("fail", "Fail the run with a message.", error=string),
            ),
            strict=True,
        )
    )
    names = {tag: "".join(part.title() for part in tag.split("_")) for tag in _VARIANTS}
    return {
        "DecisionRequest": struct(
            "A decision a flow graph proposes (the wire format of tests/data/VECTORS.md).",
            dict(zip(_REQUEST_FIELDS, (string,) * 4 + (ref("Decision"),), strict=True)),
        ),
        "Decision": {
            "description": "What the run does next, tagged by `type`.",
            "oneOf": [ref(names[tag]) for tag in _VARIANTS],
            "discriminator": {
                "propertyName": "type",
                "mapping": {tag: ref_prefix + names[tag] for tag in _VARIANTS},
            },
        },
        **{names[tag]: schema for tag, schema in variants.items()},
        "DecisionStep": struct(
            "One step to schedule; `input` is any JSON value, `retry` defaults to "
            "3 attempts without delay.",
            dict(zip(_STEP_FIELDS, (string, string, any_json, ref("RetryPolicy")), strict=True)),
            optional=("retry",),
        ),
        "RetryPolicy": struct(
            "A3S Flow's retry policy (its rules are not checked on input).",
            retry_types,
            optional=("backoff", "max_delay_ms", "on_exhausted"),
        ),
    }


if _fast_decode is not None:
    from .._fastreq import configure_types

    configure_types(DecisionRequest, ScheduleStep, DecisionStep, DEFAULT_RETRY_POLICY)
