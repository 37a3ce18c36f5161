"""Answers into results: each decoder checks the documented shape of one answer
and raises :class:`~.errors.UnexpectedResponseError` naming what is wrong;
members it does not know are ignored (a newer service keeps working)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from ..connections.transport import ResponseLike
from ..core.identity import ExecutionIdentity, ResultReceipt
from ..core.model import DecisionRequest
from ..ledger.states import AuditEntry
from .errors import unexpected_answer
from .results import (
    ApprovalResult,
    BulkActionResult,
    DecisionState,
    OutboxItem,
    OutboxPage,
    Outcome,
    ServiceHealth,
    SubmitResult,
)

__all__ = [
    "approval_result",
    "bulk_result",
    "decision_state",
    "outbox_page",
    "service_health",
    "submit_result",
]

T = TypeVar("T")


def _json_object(response: ResponseLike) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError as error:
        raise unexpected_answer(response, f"not JSON ({error})") from error
    if not isinstance(body, dict):
        raise unexpected_answer(response, "not a JSON object")
    return body


def _member(response: ResponseLike, body: Mapping[str, Any], name: str, kind: type[T]) -> T:
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise unexpected_answer(response, f"member `{name}` is missing or not {kind.__name__}")
    return value


def _optional_int(response: ResponseLike, body: Mapping[str, Any], name: str) -> int | None:
    if body.get(name) is None:
        return None
    return _member(response, body, name, int)


def _optional_str(response: ResponseLike, body: Mapping[str, Any], name: str) -> str | None:
    if body.get(name) is None:
        return None
    return _member(response, body, name, str)


def _receipt(response: ResponseLike, value: object) -> ResultReceipt | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise unexpected_answer(response, "member `receipt` is not an object")
    try:
        return ResultReceipt.from_dict(value)
    except (ValueError, TypeError) as error:
        raise unexpected_answer(response, f"invalid receipt: {error}") from error


def submit_result(response: ResponseLike, tries: int) -> SubmitResult:
    return _submitted(response, _json_object(response), tries)


def _submitted(response: ResponseLike, body: Mapping[str, Any], tries: int) -> SubmitResult:
    """A :class:`SubmitResult` from an outcome body (a POST's answer, or an approval's)."""
    raw = _member(response, body, "outcome", str)
    try:
        outcome = Outcome(raw)
    except ValueError:
        raise unexpected_answer(response, f"unknown outcome `{raw}`") from None
    return SubmitResult(
        outcome=outcome,
        decision_id=_member(response, body, "decision_id", str),
        attempt=_optional_int(response, body, "attempt"),
        receipt=_receipt(response, body.get("receipt")),
        request_id=response.headers.get("x-request-id"),
        tries=tries,
        hold_expires_at_ms=_optional_int(response, body, "hold_expires_at_ms"),
    )


def approval_result(response: ResponseLike, tries: int) -> ApprovalResult:
    """``POST /v1/actions/approve``'s answer: the dispatch's outcome and the audit entry."""
    return _approval(response, _json_object(response), tries)


def _approval(response: ResponseLike, body: Mapping[str, Any], tries: int) -> ApprovalResult:
    audit = body.get("audit")
    return ApprovalResult(
        _submitted(response, body, tries), None if audit is None else _entry(response, audit)
    )


def _entry(response: ResponseLike, value: object) -> AuditEntry:
    try:
        return AuditEntry.from_dict(value)
    except (KeyError, TypeError, ValueError) as error:
        raise unexpected_answer(response, f"invalid audit entry: {error}") from error


def bulk_result(response: ResponseLike, tries: int) -> BulkActionResult:
    """A bulk action's answer (``run_id``): entries written, refusals, approvals' outcomes."""
    body = _json_object(response)
    refused = _member(response, body, "refused", list)
    if not all(isinstance(item, dict) for item in refused):
        raise unexpected_answer(response, "member `refused` holds a non-object")
    outcomes = body.get("outcomes") or []
    if not isinstance(outcomes, list) or not all(isinstance(item, dict) for item in outcomes):
        raise unexpected_answer(response, "member `outcomes` is not a list of objects")
    return BulkActionResult(
        action=_member(response, body, "action", str),
        audit=tuple(_entry(response, item) for item in _member(response, body, "audit", list)),
        refused=tuple((str(item.get("decision_id")), str(item.get("error"))) for item in refused),
        outcomes=tuple(_approval(response, item, tries) for item in outcomes),
        request_id=response.headers.get("x-request-id"),
    )


def decision_state(response: ResponseLike) -> DecisionState:
    body = _json_object(response)
    identity = body.get("execution_identity")
    try:
        parsed_identity = None if identity is None else ExecutionIdentity.from_dict(identity)
    except (ValueError, TypeError) as error:
        raise unexpected_answer(response, f"invalid execution_identity: {error}") from error
    return DecisionState(
        decision_id=_member(response, body, "decision_id", str),
        state=_member(response, body, "state", str),
        attempts=_member(response, body, "attempts", int),
        request_hash=_member(response, body, "request_hash", str),
        lease_expires_at_ms=_optional_int(response, body, "lease_expires_at_ms"),
        completed_at_ms=_optional_int(response, body, "completed_at_ms"),
        execution_identity=parsed_identity,
        receipt=_receipt(response, body.get("receipt")),
        request_id=response.headers.get("x-request-id"),
        hold_expires_at_ms=_optional_int(response, body, "hold_expires_at_ms"),
        rejected_at_ms=_optional_int(response, body, "rejected_at_ms"),
    )


def outbox_page(response: ResponseLike) -> OutboxPage:
    body = _json_object(response)
    raw_entries = _member(response, body, "entries", list)
    entries = []
    for raw in raw_entries:
        if not isinstance(raw, dict):
            raise unexpected_answer(response, "an outbox entry is not an object")
        try:
            request = DecisionRequest.from_dict(_member(response, raw, "request", dict))
        except ValueError as error:
            raise unexpected_answer(response, f"invalid outbox request: {error}") from error
        entries.append(
            OutboxItem(
                seq=_member(response, raw, "seq", int),
                decision_id=_member(response, raw, "decision_id", str),
                request_hash=_member(response, raw, "request_hash", str),
                first_attempt=_member(response, raw, "first_attempt", int),
                highest_attempt=_member(response, raw, "highest_attempt", int),
                accepted_at_ms=_member(response, raw, "accepted_at_ms", int),
                request=request,
                traceparent=_optional_str(response, raw, "traceparent"),
            )
        )
    return OutboxPage(
        entries=tuple(entries),
        next_after=_member(response, body, "next_after", int),
        has_more=_member(response, body, "has_more", bool),
        request_id=response.headers.get("x-request-id"),
    )


def service_health(response: ResponseLike) -> ServiceHealth:
    body = response.json()
    return ServiceHealth(
        status=body["status"],
        snapshot=body,
        request_id=response.headers.get("x-request-id"),
    )
