"""Execution identities, result receipts and domain-separated digests.

Ports A3S Code's ``ExecutionIdentityV1`` and ``ExecutionResultReceiptV1``.  The
newest dispatcher binds every ledger call to the identity derived from the whole
request and completes with a receipt over ``json(decision)``; see
:func:`decision_receipt`.

Errors: :class:`ExecutionIdentityError` and :class:`ResultReceiptError` share the
base :class:`ExecutionContractError` (a ``ValueError``), because validating a
receipt also validates its identity and reports identity problems with the
identity's own messages, as the Rust original does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Final, Self

from flowdecision.core.bodies import IdentityBody, ReceiptBody
from flowdecision.core.jsonwire import (
    Fragment,
    JsonWireError,
    duplicate_keys,
    encode_json,
    parse_json,
)
from flowdecision.core.limits import RESULT_RECEIPT_MAX_BYTES, U64_MAX
from flowdecision.core.model import DecisionRequest

from ..errors import (
    DecisionTooLargeError,
    ExecutionContractError,
    ExecutionIdentityError,
    ResultReceiptError,
)

__all__ = [
    "DECISION_IDENTITY_DOMAIN",
    "DIGEST_PATTERN",
    "DOMAIN_PATTERN",
    "EVIDENCE_DOMAIN",
    "IDENTITY_SCHEMA",
    "RECEIPT_SCHEMA",
    "RESULT_DOMAIN",
    "RESULT_RECEIPT_MAX_BYTES",
    "DecisionTooLargeError",
    "ExecutionContractError",
    "ExecutionIdentity",
    "ExecutionIdentityError",
    "ResultOutcome",
    "ResultReceipt",
    "ResultReceiptError",
    "decision_receipt",
    "digest_bytes",
    "is_valid_digest",
    "is_valid_domain",
]

IDENTITY_SCHEMA: Final = "a3s.code.execution-identity.v1"
RECEIPT_SCHEMA: Final = "a3s.code.execution-result-receipt.v1"
DECISION_IDENTITY_DOMAIN: Final = "a3s.code.flow-decision.identity.v1"
EVIDENCE_DOMAIN: Final = "a3s.code.flow-decision.evidence.v1"
RESULT_DOMAIN: Final = "a3s.code.flow-decision.result.v1"

_DOMAIN_INVALID: Final = "execution identity domain is empty or invalid"
_DIGEST_INVALID: Final = "execution identity digest is invalid"
_RECEIPT_TOO_LARGE: Final = "execution result receipt exceeds its byte limit"

#: What a valid domain and digest look like (matched whole; the OpenAPI
#: contract declares the same patterns). Explicit classes: non-empty, at most
#: 128 bytes (ASCII only), one line.
DOMAIN_PATTERN: Final = "[a-z0-9._-]{1,128}"
DIGEST_PATTERN: Final = "sha256:[0-9a-f]{64}"
_DOMAIN_RE: Final = re.compile(DOMAIN_PATTERN)
_DIGEST_RE: Final = re.compile(DIGEST_PATTERN)

_IDENTITY_FIELDS: Final = ("schema", "domain", "digest")
_RECEIPT_FIELDS: Final = (
    "schema",
    "identity",
    "evidence_digest",
    "outcome",
    "result_digest",
    "result_bytes",
)


def _receipt_field_invalid(name: str) -> ResultReceiptError:
    return ResultReceiptError(f"execution result receipt field `{name}` is invalid")


def is_valid_domain(domain: object) -> bool:
    """True for a non-empty, single-line domain of at most 128 bytes of ``[a-z0-9._-]``."""
    return isinstance(domain, str) and _DOMAIN_RE.fullmatch(domain) is not None


def is_valid_digest(digest: object) -> bool:
    """True for ``sha256:`` followed by exactly 64 lowercase hex digits."""
    return isinstance(digest, str) and _DIGEST_RE.fullmatch(digest) is not None


def digest_bytes(domain: str, data: bytes | bytearray | memoryview) -> str:
    """``"sha256:" + hex(SHA256(domain_utf8 || 0x00 || data))``.

    The NUL separator keeps distinct (domain, data) pairs from colliding.  The
    domain is not checked here (the Rust function does not check it either).
    """
    hasher = hashlib.sha256(domain.encode("utf-8"))
    hasher.update(b"\x00")
    hasher.update(data)
    return "sha256:" + hasher.hexdigest()


# -------------------------------------------------------------------- parse helpers


def _members(
    obj: object,
    what: str,
    fields: tuple[str, ...],
    error: type[ExecutionContractError],
) -> Mapping[str, Any]:
    """``obj`` as a JSON object holding no member but ``fields``, each at most once."""
    if not isinstance(obj, Mapping):
        raise error(f"invalid {what}: expected a JSON object, got {type(obj).__qualname__}")
    # Both Rust types use deny_unknown_fields.
    for key in obj:
        if key not in fields:
            expected = ", ".join(f"`{name}`" for name in fields)
            raise error(f"invalid {what}: unknown field `{key}`, expected one of {expected}")
    for key in sorted(duplicate_keys(obj)):
        raise error(f"invalid {what}: duplicate field `{key}`")
    return obj


def _field(obj: Mapping[str, Any], key: str, what: str, error: type[ExecutionContractError]) -> Any:
    if key not in obj:
        raise error(f"invalid {what}: missing field `{key}`")
    return obj[key]


def _string(value: object, key: str, what: str, error: type[ExecutionContractError]) -> str:
    if not isinstance(value, str):
        raise error(
            f"invalid {what}: field `{key}`: invalid type {type(value).__qualname__}, "
            "expected a string"
        )
    return str.__str__(value)


def _text(obj: Mapping[str, Any], key: str, what: str, error: type[ExecutionContractError]) -> str:
    """The string member ``key`` of ``obj`` (missing or not a string: ``error``)."""
    return _string(_field(obj, key, what, error), key, what, error)


class _JsonForm:
    """``to_json``/``from_json`` for a wire type with ``to_dict``/``from_dict``."""

    __slots__ = ()
    #: The type as error messages name it, and the error they raise.
    _what: ClassVar[str]
    _error: ClassVar[type[ExecutionContractError]]

    def to_dict(self) -> Mapping[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Self:
        raise NotImplementedError

    def to_json(self) -> bytes:
        """``serde_json::to_vec`` of the value."""
        return encode_json(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        """Parse JSON text, then :meth:`from_dict`."""
        try:
            value = parse_json(data)
        except JsonWireError as exc:
            raise cls._error(f"invalid {cls._what}: {exc}") from exc
        return cls.from_dict(value)


# ---------------------------------------------------------------- ExecutionIdentity


@dataclass(frozen=True, slots=True)
class ExecutionIdentity(_JsonForm):
    """``ExecutionIdentityV1``: what an execution is, as a domain-separated digest.

    Fields are in Rust order (``schema``, ``domain``, ``digest``); ``schema`` is
    keyword-only with the v1 default.  Construction only checks types; call
    :meth:`validate` to apply the rules (a deserialized identity may be invalid).
    """

    schema: str = field(default=IDENTITY_SCHEMA, kw_only=True)
    domain: str
    digest: str
    # Set once validate() has passed; the instance is immutable, so it stays valid.
    _valid: bool = field(default=False, init=False, repr=False, compare=False)
    # json_text(), once written (a POST writes it into its answer and its ledger row).
    _text: str | None = field(default=None, init=False, repr=False, compare=False)
    _what: ClassVar[str] = "execution identity"
    _error: ClassVar[type[ExecutionContractError]] = ExecutionIdentityError

    def __post_init__(self) -> None:
        for name in _IDENTITY_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ExecutionIdentityError(
                    f"invalid execution identity: field `{name}` must be a string, "
                    f"got {type(value).__qualname__}"
                )
            object.__setattr__(self, name, str.__str__(value))

    @classmethod
    def derive(cls, domain: str, value: Any) -> ExecutionIdentity:
        """Digest ``value`` under ``domain``.

        ``value`` may be a :class:`~flowdecision.core.model.DecisionRequest`, any
        object with ``to_dict()``, or plain JSON data.  It is encoded compactly
        with object keys sorted at every level (struct fields included; arrays
        keep their order), then ``digest = digest_bytes(domain, json)``.
        """
        if not is_valid_domain(domain):
            raise ExecutionIdentityError(_DOMAIN_INVALID)
        if isinstance(value, DecisionRequest):
            payload = value.canonical_json()  # reuses the request's cached encodings
        else:
            data = value.to_dict() if callable(getattr(value, "to_dict", None)) else value
            try:
                payload = encode_json(data, sort_keys=True)
            except JsonWireError as exc:
                raise ExecutionIdentityError(
                    f"execution identity value is not JSON: {exc}"
                ) from None
        return cls(domain=domain, digest=digest_bytes(domain, payload))

    def validate(self) -> None:
        """Raise :class:`ExecutionIdentityError` unless schema, domain and digest are valid.

        A wrong schema reports the domain message, as the Rust original does.
        """
        if self._valid:
            return
        if self.schema != IDENTITY_SCHEMA or not is_valid_domain(self.domain):
            raise ExecutionIdentityError(_DOMAIN_INVALID)
        if not is_valid_digest(self.digest):
            raise ExecutionIdentityError(_DIGEST_INVALID)
        object.__setattr__(self, "_valid", True)

    @property
    def key(self) -> str:
        """Stable string for indexing and comparison: ``"<domain>:<digest>"``.

        ``schema`` is left out because every valid identity has the v1 schema.
        """
        return f"{self.domain}:{self.digest}"

    def to_dict(self) -> IdentityBody:
        """Wire form in Rust field order."""
        return {"schema": self.schema, "domain": self.domain, "digest": self.digest}

    def json_text(self) -> str:
        """:meth:`to_dict` as compact JSON text, kept (receipts and stored records
        carry one)."""
        text = self._text
        if text is None:
            text = encode_json(self.to_dict()).decode()
            object.__setattr__(self, "_text", text)
        return text

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Self:
        """Deserialize (unknown or missing fields rejected); does not :meth:`validate`."""
        what, error = cls._what, cls._error
        m = _members(obj, what, _IDENTITY_FIELDS, error)
        schema, domain, digest = (_text(m, key, what, error) for key in _IDENTITY_FIELDS)
        return cls(schema=schema, domain=domain, digest=digest)


# -------------------------------------------------------------------- ResultReceipt


class ResultOutcome(StrEnum):
    """How an execution ended (a ``str`` enum: members compare equal to their wire values)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


_OUTCOMES: Final = {outcome.value: outcome for outcome in ResultOutcome}


def _outcome(value: object, what: str) -> ResultOutcome:
    if isinstance(value, ResultOutcome):
        return value
    if isinstance(value, str) and value in _OUTCOMES:
        return _OUTCOMES[value]
    expected = ", ".join(f"`{name}`" for name in _OUTCOMES)
    shown = f"`{value}`" if isinstance(value, str) else type(value).__qualname__
    raise ResultReceiptError(f"invalid {what}: unknown variant {shown}, expected one of {expected}")


@dataclass(frozen=True, slots=True)
class ResultReceipt(_JsonForm):
    """``ExecutionResultReceiptV1``: proof of how an identified execution ended.

    Fields are in Rust order.  Every instance is valid: construction checks
    types and then runs :meth:`validate`.  Use :meth:`new` to get the schema
    filled in.
    """

    schema: str
    identity: ExecutionIdentity
    evidence_digest: str
    outcome: ResultOutcome
    result_digest: str | None
    result_bytes: int
    # json_text(), once written (a POST writes it into its answer and its ledger row).
    _text: str | None = field(default=None, init=False, repr=False, compare=False)
    _what: ClassVar[str] = "execution result receipt"
    _error: ClassVar[type[ExecutionContractError]] = ResultReceiptError

    def __post_init__(self) -> None:
        what = "execution result receipt"
        if not isinstance(self.identity, ExecutionIdentity):
            raise ResultReceiptError(
                f"invalid {what}: field `identity` must be an ExecutionIdentity, "
                f"got {type(self.identity).__qualname__}"
            )
        for name in ("schema", "evidence_digest"):
            object.__setattr__(
                self, name, _string(getattr(self, name), name, what, ResultReceiptError)
            )
        if self.result_digest is not None:
            object.__setattr__(
                self,
                "result_digest",
                _string(self.result_digest, "result_digest", what, ResultReceiptError),
            )
        object.__setattr__(self, "outcome", _outcome(self.outcome, what))
        size = self.result_bytes
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= U64_MAX:
            raise ResultReceiptError(
                f"invalid {what}: field `result_bytes` must be an integer in 0..=2^64-1, "
                f"got {size!r}"
            )
        object.__setattr__(self, "result_bytes", int(size))
        self.validate()

    @classmethod
    def new(
        cls,
        identity: ExecutionIdentity,
        evidence_digest: str,
        outcome: ResultOutcome | str,
        result_digest: str | None,
        result_bytes: int,
    ) -> ResultReceipt:
        """Build and validate a v1 receipt (the Rust ``new``)."""
        return cls(
            RECEIPT_SCHEMA,
            identity,
            evidence_digest,
            outcome,  # type: ignore[arg-type]  # coerced in __post_init__
            result_digest,
            result_bytes,
        )

    @classmethod
    def _trusted(
        cls,
        identity: ExecutionIdentity,
        evidence_digest: str,
        outcome: ResultOutcome,
        result_digest: str | None,
        result_bytes: int,
    ) -> ResultReceipt:
        """Build a receipt from values the caller guarantees valid, without checks."""
        receipt = object.__new__(cls)
        put = object.__setattr__  # every slot, one call each (a POST builds one)
        put(receipt, "schema", RECEIPT_SCHEMA)
        put(receipt, "identity", identity)
        put(receipt, "evidence_digest", evidence_digest)
        put(receipt, "outcome", outcome)
        put(receipt, "result_digest", result_digest)
        put(receipt, "result_bytes", result_bytes)
        put(receipt, "_text", None)
        return receipt

    def validate(self) -> None:
        """Check the receipt rules in the Rust order, raising the first failure.

        Schema; the identity (identity messages); ``evidence_digest``; the 1 MiB
        byte limit; then a succeeded receipt needs a valid ``result_digest`` and
        non-zero ``result_bytes``, while any other outcome needs neither (a
        mismatch between outcome and digest/bytes reports field ``outcome``).
        """
        if self.schema != RECEIPT_SCHEMA:
            raise _receipt_field_invalid("schema")
        self.identity.validate()
        if not is_valid_digest(self.evidence_digest):
            raise _receipt_field_invalid("evidence_digest")
        if self.result_bytes > RESULT_RECEIPT_MAX_BYTES:
            raise ResultReceiptError(_RECEIPT_TOO_LARGE)
        if self.outcome is ResultOutcome.SUCCEEDED:
            if self.result_digest is None:
                raise _receipt_field_invalid("outcome")
            if not is_valid_digest(self.result_digest):
                raise _receipt_field_invalid("result_digest")
            if self.result_bytes == 0:
                raise _receipt_field_invalid("result_bytes")
        elif self.result_digest is not None or self.result_bytes != 0:
            raise _receipt_field_invalid("outcome")

    def to_dict(self) -> ReceiptBody:
        """Wire form in Rust field order; ``result_digest`` omitted when ``None``."""
        if self.result_digest is None:
            return {
                "schema": self.schema,
                "identity": self.identity.to_dict(),
                "evidence_digest": self.evidence_digest,
                "outcome": self.outcome.value,
                "result_bytes": self.result_bytes,
            }
        return {
            "schema": self.schema,
            "identity": self.identity.to_dict(),
            "evidence_digest": self.evidence_digest,
            "outcome": self.outcome.value,
            "result_digest": self.result_digest,
            "result_bytes": self.result_bytes,
        }

    def json_text(self) -> str:
        """:meth:`to_dict` as compact JSON text, kept (a ``POST``'s answer carries one)."""
        text = self._text
        if text is None:
            body: dict[str, Any] = {
                "schema": self.schema,
                "identity": Fragment(self.identity.json_text()),
                "evidence_digest": self.evidence_digest,
                "outcome": self.outcome._value_,  # (``.value`` is two Python calls)
            }
            if self.result_digest is not None:
                body["result_digest"] = self.result_digest
            body["result_bytes"] = self.result_bytes
            text = encode_json(body).decode()
            object.__setattr__(self, "_text", text)
        return text

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Self:
        """Deserialize and validate; unknown fields are rejected, ``result_digest`` may be null."""
        what = cls._what
        m = _members(obj, what, _RECEIPT_FIELDS, ResultReceiptError)
        schema = _text(m, "schema", what, ResultReceiptError)
        identity = ExecutionIdentity.from_dict(_field(m, "identity", what, ResultReceiptError))
        evidence = _text(m, "evidence_digest", what, ResultReceiptError)
        outcome = _outcome(_field(m, "outcome", what, ResultReceiptError), what)
        result_digest = m.get("result_digest")
        if result_digest is not None:
            result_digest = _string(result_digest, "result_digest", what, ResultReceiptError)
        size = _field(m, "result_bytes", what, ResultReceiptError)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= U64_MAX:
            raise ResultReceiptError(
                f"invalid {what}: field `result_bytes`: expected u64, got {size!r}"
            )
        return cls(schema, identity, evidence, outcome, result_digest, size)


# ---------------------------------------------------------------- dispatcher helper


def decision_receipt(request: DecisionRequest) -> tuple[ExecutionIdentity, ResultReceipt]:
    """Identity and success receipt the newest dispatcher prepares before claiming.

    * identity: derived from the whole request under
      :data:`DECISION_IDENTITY_DOMAIN`;
    * ``evidence_digest``: ``digest_bytes(EVIDENCE_DOMAIN, causation_event_id)``;
    * ``result_digest``/``result_bytes``: over ``json(decision)``
      (:meth:`DecisionRequest.decision_json`), outcome ``succeeded``.

    Raises :class:`DecisionTooLargeError` if that JSON exceeds 1 MiB.
    """
    result = request.decision_json()
    if len(result) > RESULT_RECEIPT_MAX_BYTES:
        raise DecisionTooLargeError(request.decision_id, len(result), RESULT_RECEIPT_MAX_BYTES)
    digests = request._digests  # the C decoder's, when it read the request
    if digests is None:
        digests = (
            digest_bytes(DECISION_IDENTITY_DOMAIN, request.canonical_json()),
            digest_bytes(EVIDENCE_DOMAIN, request.causation_event_id.encode("utf-8")),
            digest_bytes(RESULT_DOMAIN, result),
        )
    # What ExecutionIdentity.derive(DECISION_IDENTITY_DOMAIN, request) returns, built
    # directly and marked valid: the domain is a valid constant and the digest fresh.
    identity = object.__new__(ExecutionIdentity)
    put = object.__setattr__
    put(identity, "schema", IDENTITY_SCHEMA)
    put(identity, "domain", DECISION_IDENTITY_DOMAIN)
    put(identity, "digest", digests[0])
    put(identity, "_valid", True)
    put(identity, "_text", None)
    # Every field is valid by construction (a derived identity, fresh digests, a
    # size within the limit), so skip the per-field checks on this hot path.
    receipt = ResultReceipt._trusted(
        identity, digests[1], ResultOutcome.SUCCEEDED, digests[2], len(result)
    )
    return identity, receipt


try:  # the C decoder of model.py digests the requests it reads as decision_receipt does
    from .. import _fastreq
except ImportError:  # pragma: no cover - the tests run with the extension built
    pass
else:
    _fastreq.configure_digests(
        hashlib.sha256, DECISION_IDENTITY_DOMAIN, EVIDENCE_DOMAIN, RESULT_DOMAIN
    )
