"""The service's OpenAPI 3.1 contract, generated from the code that answers.

Nothing here is a hand-kept copy of a body or a status:

* request: :func:`flowdecision.core.model.json_schemas`, built from the parser's own
  field, variant and range constants (and checked against the reference vectors);
* response bodies: the TypedDicts of :mod:`flowdecision.core.bodies`, which the
  handlers and ``to_dict`` methods are annotated to return (so mypy checks
  them), and the ``HealthSnapshot`` dataclass;
* errors: one schema per code, from :data:`.errors.HTTP_ERRORS` (status,
  ``Retry-After``, and the return type of its ``details`` function) and
  :data:`.errors.SERVICE_ERRORS` (the codes the guards, transport and handlers
  answer themselves).

Served at ``GET /openapi.json`` (public, like ``/healthz``: it holds nothing a
caller could not read in the repository) and committed as docs/openapi.json.
Regenerate that file with ``python -m flowdecision.service.openapi >
docs/openapi.json`` (or ``make openapi``); tests/test_openapi.py fails when it
and the served document differ.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.metadata
import inspect
import json
import sys
import types
from collections.abc import Callable, Iterable
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,
    Required,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

from starlette.requests import Request
from starlette.responses import Response

from ..core import bodies
from ..core.identity import (
    DIGEST_PATTERN,
    DOMAIN_PATTERN,
    IDENTITY_SCHEMA,
    RECEIPT_SCHEMA,
    RESULT_RECEIPT_MAX_BYTES,
    ResultOutcome,
)
from ..core.limits import I64_MAX, IDENTIFIER_MAX_BYTES, U64_MAX
from ..core.model import json_schemas
from ..errors import FlowDecisionError, InvalidArgumentTypeError, LedgerError, OutboxError
from ..ledger.query import MAX_PAGE_LIMIT, TimeField
from ..ledger.states import DecisionState
from ..observability.health import HealthSnapshot
from .errors import HTTP_ERRORS, SERVICE_ERRORS, RetryAfter
from .handlers import MAX_WAIT_S, OUTBOX_MAX_LIMIT
from .routing import Route

__all__ = ["OPENAPI_PATH", "openapi_document", "openapi_json", "openapi_route"]

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/"
_JSON = "application/json"
#: Codes any request can get: from the edge (service/edge/) and the browser guard.
_CAN_ANSWER_ANY_REQUEST = (
    "bad_request",
    "origin_not_allowed",
    "host_not_allowed",
    "request_timeout",
    "expectation_failed",
    "request_head_too_large",
)
_AUTH: list[dict[str, list[str]]] = [{"bearerAuth": []}, {"basicAuth": []}]


class _Schemas:
    """JSON Schemas of Python types; TypedDicts and dataclasses become components."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def of(self, tp: Any) -> dict[str, Any]:
        origin = get_origin(tp)
        if origin is Annotated:
            base, *metadata = get_args(tp)
            extra: dict[str, Any] = {}
            for item in metadata:
                if isinstance(item, bodies.Schema):  # tuples (hashable) become JSON arrays
                    extra.update(
                        (key, list(value) if isinstance(value, tuple) else value)
                        for key, value in item.keywords().items()
                    )
            if "ref" in extra:
                return _ref(str(extra["ref"]))
            return {**self.of(base), **extra}
        if origin in (NotRequired, Required):
            return self.of(get_args(tp)[0])
        if tp is Any:
            return {}
        if tp is None or tp is type(None):
            return {"type": "null"}
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        if tp in simple:
            return {"type": simple[tp]}
        if origin is Literal:
            values = list(get_args(tp))
            return {"const": values[0]} if len(values) == 1 else {"enum": values}
        if origin in (Union, types.UnionType):
            return {"anyOf": [self.of(arg) for arg in get_args(tp)]}
        if origin in (list, tuple):
            return {"type": "array", "items": self.of(get_args(tp)[0])}
        if origin is dict:
            return {"type": "object", "additionalProperties": self.of(get_args(tp)[1])}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return {"enum": [member.value for member in tp]}
        if is_typeddict(tp):
            return self.named(tp.__name__.removesuffix("Body"), lambda: self._typeddict(tp))
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.named(tp.__name__, lambda: self._dataclass(tp))
        raise InvalidArgumentTypeError(f"no JSON Schema for {tp!r}")

    def named(self, name: str, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if name not in self.components:
            self.components[name] = {}  # placeholder: a type may refer to itself
            self.components[name] = build()
        return {"$ref": _REF + name}

    def properties(self, tp: Any) -> tuple[dict[str, Any], list[str]]:
        """The properties and required names of a TypedDict, in declaration order."""
        hints = get_type_hints(tp, include_extras=True)
        required = [name for name in hints if name in tp.__required_keys__]
        return {name: self.of(hint) for name, hint in hints.items()}, required

    def _typeddict(self, tp: Any) -> dict[str, Any]:
        properties, required = self.properties(tp)
        return _object(properties, required, _doc(tp))

    def _dataclass(self, tp: Any) -> dict[str, Any]:
        hints = get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        return _object({name: self.of(hints[name]) for name in names}, names, _doc(tp))


def _object(
    properties: dict[str, Any], required: list[str], description: str | None = None
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    if description:
        schema["description"] = description
    schema.update(properties=properties, required=required, additionalProperties=False)
    return schema


def _doc(tp: Any) -> str | None:
    return inspect.cleandoc(tp.__doc__) if tp.__doc__ else None


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF + name}


# -- errors -----------------------------------------------------------------------


def _error_rows() -> dict[str, tuple[int, RetryAfter, Any, str]]:
    """code -> (status, Retry-After policy, details type or None, description)."""
    rows: dict[str, tuple[int, RetryAfter, Any, str]] = {}
    for code, row in HTTP_ERRORS.items():
        details = get_type_hints(row.details)["return"] if row.details is not None else None
        what = row.message or "the message says what is wrong with the request"
        rows[code] = (row.status, row.retry_after, details, what)
    for code, other in SERVICE_ERRORS.items():
        rows[code] = (
            other.status,
            other.retry_after,
            other.details,
            f"sent by service/{other.where}.py",
        )
    return rows


def _error_schema_name(code: str) -> str:
    name = "".join(part.title() for part in code.split("_"))
    return name if name.endswith("Error") else name + "Error"


def _error_schemas(schemas: _Schemas) -> None:
    members, required = schemas.properties(bodies.ErrorMembers)
    for code, (status, _retry, details, what) in _error_rows().items():
        props = {**members, "code": {"const": code}}
        needed = list(required)
        if details is not None:
            extra, extra_required = schemas.properties(details)
            props.update(extra)
            needed += extra_required
        description = f"`{code}` ({status}): {what}."
        schemas.components[_error_schema_name(code)] = {
            "type": "object",
            "description": description,
            "properties": {"error": _object(props, needed)},
            "required": ["error"],
            "additionalProperties": False,
        }


# -- operations -------------------------------------------------------------------


def _header(description: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"description": description, "required": required, "schema": schema}


def _action(
    operation_id: str,
    summary: str,
    description: str,
    body: dict[str, Any],
    answer: dict[str, Any],
    *,
    missing: Iterable[str] = ("not_found",),
    store: Iterable[str] = (),
) -> dict[str, Any]:
    """An operator action: a ``POST`` with an admin token and a JSON body, ``answer``
    its 200; ``missing`` its 404 codes, ``store`` its store's failures."""
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "description": description,
            "security": [{"bearerAuth": []}],
            "parameters": [{"$ref": "#/components/parameters/X-Request-Id"}],
            "requestBody": {"required": True, "content": {_JSON: {"schema": body}}},
            "responses": _responses(
                [
                    *_common(True),
                    "admin_disabled",
                    "forbidden",
                    *missing,
                    "payload_too_large",
                    "action_refused",
                    "invalid_action",
                    "unsupported_media_type",
                    *store,
                ],
                {"200": answer},
            ),
        }
    }


def _text_page(
    operation_id: str,
    summary: str,
    media_type: str,
    answer: str,
    *,
    description: str | None = None,
    headers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``GET`` for a submit token answering text (metrics, the status page)."""
    success: dict[str, Any] = {"description": answer}
    if headers is not None:
        success["headers"] = headers
    success["content"] = {media_type: {"schema": {"type": "string"}}}
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary}
    if description is not None:
        operation["description"] = description
    operation["security"] = _AUTH
    operation["parameters"] = [{"$ref": "#/components/parameters/X-Request-Id"}]
    operation["responses"] = _responses(_common(True, submit_only=True), {"200": success})
    return {"get": operation}


def _responses(
    codes: Iterable[str],
    success: dict[str, dict[str, Any]],
    *,
    extra_headers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The responses of one operation: its successes, and its error codes grouped by status."""
    rows = _error_rows()
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(rows[code][0], []).append(code)
    responses: dict[str, Any] = {}
    for name, answer in success.items():
        answer_headers: dict[str, Any] = {
            "X-Request-Id": {"$ref": "#/components/headers/X-Request-Id"},
            **answer.pop("headers", {}),
            **(extra_headers or {}),
        }
        responses[name] = {**answer, "headers": answer_headers}
    for status in sorted(by_status):
        group = by_status[status]
        headers: dict[str, Any] = {"X-Request-Id": {"$ref": "#/components/headers/X-Request-Id"}}
        retrying = [code for code in group if rows[code][1] is not RetryAfter.NEVER]
        if retrying:
            headers["Retry-After"] = _header(
                "Seconds to wait before retrying; sent with "
                + ", ".join(f"`{c}`" for c in retrying)
                + " (never with the permanent ones).",
                {"type": "string", "pattern": "^[0-9]+$"},
            )
        if status == 401:
            headers["WWW-Authenticate"] = _header(
                "`Bearer` and `Basic` challenges.", {"type": "string"}, True
            )
        headers.update(extra_headers or {})
        schemas = [_ref(_error_schema_name(code)) for code in group]
        existing = responses.get(str(status))
        if existing is not None:  # e.g. /healthz's 503 is a health body or `overloaded`
            body = existing["content"][_JSON]["schema"]
            existing["content"][_JSON]["schema"] = {"oneOf": [body, *schemas]}
            existing["headers"]["X-Request-Id"] = headers["X-Request-Id"]
            existing["headers"].update({k: v for k, v in headers.items() if k != "X-Request-Id"})
            continue
        responses[str(status)] = {
            "description": "; ".join(f"`{code}`" for code in group),
            "headers": headers,
            "content": {_JSON: {"schema": schemas[0] if len(schemas) == 1 else {"oneOf": schemas}}},
        }
    return dict(sorted(responses.items()))


def _codes_of(base: type[FlowDecisionError]) -> list[str]:
    """The codes of ``base`` and its subclasses that :data:`HTTP_ERRORS` answers, in table order."""
    classes, pending = set(), [base]
    while pending:
        cls = pending.pop()
        classes.add(cls)
        pending.extend(cls.__subclasses__())
    codes = {cls.code for cls in classes}
    return [code for code in HTTP_ERRORS if code in codes]


def _json_answer(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema}}}


def _common(protected: bool, *, submit_only: bool = False) -> list[str]:
    """The codes any route may answer; ``submit_only``: a route an admin token does not
    open (403 ``forbidden`` with one)."""
    return [
        *(["unauthorized"] if protected else []),
        *(["forbidden"] if submit_only else []),
        *_CAN_ANSWER_ANY_REQUEST,
        "overloaded",
        "internal",
    ]


_EXAMPLE = {
    "decision_id": "dec-1",
    "run_id": "run-1",
    "authority_branch_id": "production",
    "causation_event_id": "evt-1",
    "decision": {
        "type": "schedule_step",
        "step": {"step_id": "s1", "step_name": "fetch", "input": {"n": 1}},
    },
}


def _query_param(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "description": description, "schema": schema}


def _operation_paths(schemas: _Schemas, paths: dict[str, Any]) -> None:
    """The operator routes (service/operations.py): queries, the audit trail, actions."""
    page = schemas.of(bodies.DecisionPageBody)
    run_page = schemas.of(bodies.RunPageBody)
    audit = schemas.of(bodies.AuditPageBody)
    entry = schemas.of(bodies.AuditEntryBody)
    action = schemas.of(bodies.ActionBody)
    ledger_codes = _codes_of(LedgerError)
    time = {"type": "integer", "minimum": 0, "maximum": U64_MAX}
    cursor = _query_param("cursor", "The `next_cursor` of the previous page.", {"type": "string"})
    limit = _query_param(
        "limit",
        "Decisions per page.",
        {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_LIMIT, "default": 100},
    )
    common = [
        _query_param(
            "state",
            "Only decisions in this state (a released claim is `pending_expired`).",
            {"type": "string", "enum": [state.value for state in DecisionState]},
        ),
        _query_param(
            "after", "At or after this time (Unix ms): first claimed, or completed (`by`).", time
        ),
        _query_param("before", "Before this time (Unix ms): first claimed, or completed.", time),
        _query_param(
            "by",
            "Which time `after`/`before` filter on and pages are ordered by: `claimed` (first "
            "claimed, the default) or `completed` (only completed and tombstoned decisions; a "
            "pending `state` is refused).",
            {"type": "string", "enum": [field.value for field in TimeField], "default": "claimed"},
        ),
        cursor,
        limit,
        _query_param(
            "count",
            "`true`: also count every decision the filters select.",
            {"type": "string", "enum": ["true", "false"]},
        ),
        {"$ref": "#/components/parameters/X-Request-Id"},
    ]
    read_codes = [*_common(True), "invalid_parameter", *ledger_codes]

    def read(
        operation_id: str,
        summary: str,
        parameters: list[dict[str, Any]],
        page: dict[str, Any],
        description: str | None = None,
    ) -> dict[str, Any]:
        """A query's GET: its parameters, one page as the answer, the read error codes."""
        operation: dict[str, Any] = {"operationId": operation_id, "summary": summary}
        if description is not None:
            operation["description"] = description
        operation["security"] = _AUTH
        operation["parameters"] = parameters
        operation["responses"] = _responses(read_codes, {"200": _json_answer("A page.", page)})
        return operation

    paths["/v1/decisions"]["get"] = read(
        "listDecisions",
        "Decisions by run, state and age, a keyset page at a time",
        [_query_param("run_id", "Only this run's decisions.", {"type": "string"}), *common],
        page,
        "In the order the decisions were first claimed (with `by=completed`: completed), then "
        "by id. The cursor is a position, never an offset: decisions inserted while paging "
        "neither repeat nor shift what is still to come.",
    )
    run_id = {
        "name": "run_id",
        "in": "path",
        "required": True,
        "description": "The run id (may hold `/`).",
        "schema": {"type": "string", "minLength": 1},
    }
    paths["/v1/runs/{run_id}"] = {
        "get": read(
            "getRun",
            "One run's state and its decisions, in the order they were first claimed",
            [run_id, *common],
            run_page,
            "`run` is the run's state under the run invariants: `open`, `closing` (its "
            "`complete`/`fail` decision is claimed, not completed) or `closed` (`closed_by`, "
            "`closed_at_ms`). A run the ledger knows nothing of is `open`.",
        )
    }
    paths["/v1/audit"] = {
        "get": read(
            "getAudit",
            "The audit trail of operator actions, oldest first",
            [
                _query_param("decision_id", "Only this decision's entries.", {"type": "string"}),
                _query_param("after", "At or after this time (Unix ms).", time),
                _query_param("before", "Before this time (Unix ms).", time),
                cursor,
                limit,
                {"$ref": "#/components/parameters/X-Request-Id"},
            ],
            audit,
        )
    }
    on_ledger: dict[str, Any] = {
        "description": "Needs an admin token (never the submit token): 401 without one, 403 "
        "`forbidden` with another, 403 `admin_disabled` on a service that has none. Written "
        "to the audit trail in the action's transaction. The body is at most 64 KiB (and "
        "`max_body_bytes`): 413 above it, before it is read whole; a field given twice is a "
        "422.",
        "body": action,
        "answer": _json_answer("The audit entry written.", entry),
        "store": ledger_codes,
    }
    outbox_codes = _codes_of(OutboxError)
    on_outbox: dict[str, Any] = {
        "description": "A relay parks a row its sink refused for good, and holds its run's "
        'later rows behind it (docs/OPERATIONS.md, "Parked rows"). Needs an admin token, as '
        "the other actions; refused (409 `action_refused`) unless the row is parked, 404 "
        "when the relay parked no row of that decision. Written to the outbox's audit trail "
        "in the action's transaction.",
        "body": schemas.of(bodies.OutboxActionBody),
        "answer": _json_answer(
            "The outbox audit entry written.", schemas.of(bodies.OutboxAuditEntryBody)
        ),
        "missing": ("not_found", "no_outbox"),
        "store": outbox_codes,
    }
    for name, operation_id, summary, kind in (
        (
            "release",
            "releaseDecision",
            "Release a pending claim, fenced: the old owner can never complete",
            on_ledger,
        ),
        (
            "forget",
            "forgetDecision",
            "Forget a completed decision or tombstone, so its id can be used again",
            on_ledger,
        ),
        (
            "outbox-retry",
            "retryParkedRow",
            "Deliver a parked outbox row again, next in its run",
            on_outbox,
        ),
        (
            "outbox-skip",
            "skipParkedRow",
            "Drop a parked outbox row: its run goes on with its next row",
            on_outbox,
        ),
    ):
        paths[f"/v1/actions/{name}"] = _action(operation_id, summary, **kind)
    bulk = schemas.of(bodies.BulkActionBody)
    for name, operation_id, summary, one in (
        (
            "approve",
            "approveDecision",
            "Approve a held decision (or a run's): it is dispatched exactly once",
            schemas.of(bodies.ApprovalBody),
        ),
        (
            "reject",
            "rejectDecision",
            "Reject a held decision (or a run's): it is never sent",
            entry,
        ),
    ):
        paths[f"/v1/actions/{name}"] = _action(
            operation_id,
            summary,
            "Approval holds (docs/PROTOCOL.md). Needs an admin token, as the other actions. "
            "With `decision_id`: that held decision (409 `action_refused` unless held; an "
            "approved decision an earlier approval delivered answers `duplicate` with a null "
            "`audit`). With `run_id`: every held decision of the run, each in its own "
            "transaction; the answer lists what was done and what was refused. Audited in "
            "the action's transaction (on the default layout an approval's claim, outbox row "
            "and audit entry are one transaction).",
            schemas.of(bodies.HoldActionBody),
            _json_answer("One decision's answer, or a run's (bulk).", {"oneOf": [one, bulk]}),
            store=[*ledger_codes, "run_closed", "decision_rejected", "busy", "sink_failed"],
        )
    paths["/v1/outbox/parked"] = {
        "get": {
            "operationId": "listParkedRows",
            "summary": "Rows relays parked (their sinks refused them) and rows held behind them",
            "security": _AUTH,
            "parameters": [
                _query_param("relay", "Only this relay's rows.", {"type": "string"}),
                {"$ref": "#/components/parameters/X-Request-Id"},
            ],
            "responses": _responses(
                [*_common(True), "invalid_parameter", *outbox_codes],
                {
                    "200": _json_answer(
                        "Every parked and held row.", schemas.of(bodies.ParkedPageBody)
                    )
                },
            ),
        }
    }


def _paths(schemas: _Schemas) -> dict[str, Any]:
    outcome = schemas.of(bodies.OutcomeBody)
    state = schemas.of(bodies.DecisionStateBody)
    page = schemas.of(bodies.OutboxPageBody)
    health = _ref("Health")
    link = {
        "GetDecision": {
            "operationId": "getDecision",
            "parameters": {"decision_id": "$response.body#/decision_id"},
            "description": "The claim record of the decision just answered.",
        }
    }
    submit_codes = [
        *_common(True, submit_only=True),
        "payload_too_large",
        "too_many_values",
        "unsupported_media_type",
        *(code for code in HTTP_ERRORS if code != "internal"),
    ]
    preference = {
        "Preference-Applied": _header(
            "`wait=N` (N as capped) when the request sent `Prefer: wait=N`.",
            {"type": "string", "pattern": "^wait=[0-9]+$"},
        )
    }
    # What a ledger read can raise: LedgerError and its subclasses (the table's rows).
    ledger_codes = _codes_of(LedgerError)
    return {
        "/v1/decisions": {
            "post": {
                "operationId": "submitDecision",
                "summary": "Submit a decision exactly once",
                "description": (
                    "201 `submitted` when this call delivered it, 200 `duplicate` when it "
                    "was already completed (treat both alike: the decision is in). Retry "
                    "409 `busy`, 502 and 503 with the same body after `Retry-After`; never "
                    "retry 403, 409 `conflict`/`run_closed`, 413 or 422 unchanged. A client that "
                    "disconnects while sending its body gets nothing; the service logs and "
                    "counts it as 499, a status it never sends."
                ),
                "security": _AUTH,
                "parameters": [
                    {"$ref": "#/components/parameters/Prefer"},
                    {"$ref": "#/components/parameters/X-Request-Id"},
                ],
                "requestBody": {
                    "required": True,
                    "description": (
                        "A DecisionRequest, at most `max_body_bytes` (2 MiB by default), "
                        "its decision's JSON at most 1 MiB. Identifiers: at most "
                        f"{IDENTIFIER_MAX_BYTES} bytes of UTF-8 (JSON Schema can only bound "
                        "characters), no control characters; `decision_id` and "
                        "`causation_event_id` not blank."
                    ),
                    "content": {
                        _JSON: {
                            "schema": {
                                "allOf": [_ref("DecisionRequest"), _ref("SubmittedIdentifiers")]
                            },
                            "example": _EXAMPLE,
                        }
                    },
                },
                "responses": _responses(
                    submit_codes,
                    {
                        "201": {**_json_answer("`submitted`", outcome), "links": link},
                        "200": {**_json_answer("`duplicate`", outcome), "links": link},
                        "202": {
                            **_json_answer(
                                "`held`: the approval policy holds it for an operator "
                                "(recorded, nothing sent); the same POST again answers the "
                                "same until an operator acts.",
                                outcome,
                            ),
                            "links": link,
                        },
                    },
                    extra_headers=preference,
                ),
            }
        },
        "/v1/decisions/{decision_id}": {
            "get": {
                "operationId": "getDecision",
                "summary": "The claim record of one decision",
                "security": _AUTH,
                "parameters": [
                    {
                        "name": "decision_id",
                        "in": "path",
                        "required": True,
                        "description": "The decision id (may hold `/`); the identifier "
                        "rules of the request body apply (422 `invalid_identifier`).",
                        "schema": {**_identifier(False), "minLength": 1},
                    },
                    {
                        "name": "wait",
                        "in": "query",
                        "required": False,
                        "description": "Seconds (at most 30) to wait while the decision is "
                        "`held`: the answer comes once it leaves that state (approved, "
                        "rejected, expired) or the time passes (a long-poll; counted in "
                        "`max_streams`, past it 503 `too_many_streams`).",
                        "schema": {"type": "integer", "minimum": 0, "maximum": 30},
                    },
                    {"$ref": "#/components/parameters/X-Request-Id"},
                ],
                "responses": _responses(
                    [
                        *_common(True),
                        "not_found",
                        "invalid_parameter",
                        "too_many_streams",
                        *ledger_codes,
                    ],
                    {"200": _json_answer("The claim record (never the owner).", state)},
                ),
            }
        },
        "/v1/outbox": {
            "get": {
                "operationId": "getOutbox",
                "summary": "Accepted decisions in commit order (outbox sinks)",
                "description": "A page of rows after `after`. With `wait=S` and no row yet, "
                "the answer waits up to S seconds for one (a long-poll: woken by the commit, "
                "not by polling). With `Accept: text/event-stream` the answer is a stream of "
                "server-sent events instead: one `decision` event per row, its `id` the "
                "row's `seq` and its `data` the row as in a page; a reconnecting client "
                "resumes after its `Last-Event-ID` header (a `seq`; it overrides `after`, "
                "and anything but digits is 422). An idle stream sends a comment every "
                "15 s; it ends when the service shuts down. A page holds at most `limit` "
                "rows and 1 MiB of them (at least one row): `has_more` says when it was "
                "cut. Event streams and waiting long-polls are bounded per replica "
                "(`max_streams`): past it, 503 `too_many_streams`.",
                "security": _AUTH,
                "parameters": [
                    {
                        "name": "after",
                        "in": "query",
                        "description": "The last `seq` processed.",
                        "schema": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": I64_MAX,
                            "default": 0,
                        },
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "description": "Decisions per page, at most (a page also stops "
                        "at 1 MiB of rows).",
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": OUTBOX_MAX_LIMIT,
                            "default": 100,
                        },
                    },
                    {
                        "name": "wait",
                        "in": "query",
                        "description": "Seconds to wait for a row when there is none after "
                        "`after` yet (0: answer at once).",
                        "schema": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": MAX_WAIT_S,
                            "default": 0,
                        },
                    },
                    {"$ref": "#/components/parameters/X-Request-Id"},
                ],
                "responses": _responses(
                    [
                        *_common(True, submit_only=True),
                        "no_outbox",
                        "invalid_parameter",
                        "outbox_unavailable",
                        "too_many_streams",
                    ],
                    {
                        "200": {
                            "description": "A page of the outbox, or (`Accept: "
                            "text/event-stream`) a stream of its rows as they commit.",
                            "content": {
                                _JSON: {"schema": page},
                                "text/event-stream": {
                                    "schema": {
                                        "type": "string",
                                        "description": "`id: <seq>`, `event: decision`, "
                                        "`data: <entry JSON>` per row",
                                    }
                                },
                            },
                        }
                    },
                ),
            }
        },
        "/healthz": {
            "get": {
                "operationId": "getHealth",
                "summary": "Health: 200 healthy, 503 degraded",
                "description": "Public unless the service runs with `auth_healthz`.",
                "security": [{}, *_AUTH],
                "parameters": [{"$ref": "#/components/parameters/X-Request-Id"}],
                "responses": _responses(
                    _common(False),
                    {
                        "200": _json_answer("`healthy`", health),
                        "503": _json_answer("`degraded`; `reason` names the failed check", health),
                    },
                ),
            }
        },
        "/metrics": _text_page(
            "getMetrics", "Prometheus exposition", "text/plain", "Prometheus text format."
        ),
        "/": _text_page(
            "getStatusPage",
            "The HTML status page",
            "text/html",
            "The status page.",
            description="Basic auth works too: any user name, the token as password.",
            headers={"Cache-Control": _header("`no-store`", {"const": "no-store"}, True)},
        ),
        OPENAPI_PATH: {
            "get": {
                "operationId": "getOpenApi",
                "summary": "This contract (public)",
                "security": [{}],
                "parameters": [{"$ref": "#/components/parameters/X-Request-Id"}],
                "responses": _responses(
                    _common(False),
                    {"200": _json_answer("The OpenAPI 3.1 document.", {"type": "object"})},
                ),
            }
        },
    }


def _refine_receipts(components: dict[str, Any]) -> None:
    """The identity and receipt rules of :mod:`flowdecision.core.identity`, which a
    TypedDict cannot state: fixed schema names, patterns, and what each outcome
    carries (``ResultReceipt.validate``)."""
    digest = {"type": "string", "pattern": f"^{DIGEST_PATTERN}$"}
    identity = components["Identity"]["properties"]
    identity["schema"] = {"const": IDENTITY_SCHEMA}
    identity["domain"] = {"type": "string", "pattern": f"^{DOMAIN_PATTERN}$"}
    identity["digest"] = digest
    receipt = components["Receipt"]
    fields = receipt["properties"]
    fields["schema"] = {"const": RECEIPT_SCHEMA}
    fields["evidence_digest"] = digest
    fields["outcome"] = {"enum": [outcome.value for outcome in ResultOutcome]}
    fields["result_digest"] = digest
    fields["result_bytes"]["maximum"] = RESULT_RECEIPT_MAX_BYTES
    receipt["if"] = {"properties": {"outcome": {"const": ResultOutcome.SUCCEEDED.value}}}
    receipt["then"] = {
        "required": ["result_digest"],
        "properties": {"result_bytes": {"minimum": 1}},
    }
    receipt["else"] = {
        "not": {"required": ["result_digest"]},
        "properties": {"result_bytes": {"const": 0}},
    }


def _identifier(non_blank: bool) -> dict[str, Any]:
    # C0, DEL and C1 controls are refused (flowdecision.core.limits); blank means
    # nothing but whitespace, which JSON Schema's \S approximates.
    plain = "[^\\u0000-\\u001f\\u007f-\\u009f]"
    pattern = (
        f"^{plain}*$"
        if not non_blank
        else f"^{plain}*[^\\s\\u0000-\\u001f\\u007f-\\u009f]{plain}*$"
    )
    return {"type": "string", "maxLength": IDENTIFIER_MAX_BYTES, "pattern": pattern}


def _version() -> str:
    try:
        return importlib.metadata.version("flowdecision")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "0.0.0"


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The contract as a JSON-ready dict (built once)."""
    schemas = _Schemas()
    schemas.components.update(json_schemas(_REF))
    schemas.components["SubmittedIdentifiers"] = {
        "type": "object",
        "description": "The service's identifier rules, on top of the wire model.",
        "properties": {
            "decision_id": _identifier(True),
            "run_id": _identifier(False),
            "authority_branch_id": _identifier(False),
            "causation_event_id": _identifier(True),
        },
    }
    snapshot = schemas.of(HealthSnapshot)
    extras, _ = schemas.properties(bodies.HealthExtras)
    base = schemas.components[snapshot["$ref"].removeprefix(_REF)]
    schemas.components["Health"] = _object(
        {**base["properties"], **extras},
        [*base["required"], *extras],
        "The dispatcher's counters, `status` the service's verdict, and the checks behind it.",
    )
    del schemas.components[snapshot["$ref"].removeprefix(_REF)]
    _error_schemas(schemas)
    paths = _paths(schemas)
    _operation_paths(schemas, paths)
    _refine_receipts(schemas.components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "flowdecision decision service",
            "version": _version(),
            "description": (
                "Submit workflow decisions exactly once. Every error is "
                '`{"error": {"code", "message", "request_id", ...}}`; `code` is stable. '
                "Every response carries `X-Request-Id`. See docs/SERVICE.md."
            ),
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "security": _AUTH,
        "paths": paths,
        "components": {
            "schemas": dict(sorted(schemas.components.items())),
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A submit token (`token`, `token_file`): every route but "
                    "the actions. An admin token (`admin_token`, `admin_token_file`): the "
                    "actions and the operator's reads only (403 `forbidden` elsewhere). None "
                    "needed when the service runs without a submit token (loopback only, or "
                    "`allow_no_auth`).",
                },
                "basicAuth": {
                    "type": "http",
                    "scheme": "basic",
                    "description": "For browsers: any user name, the token as password.",
                },
            },
            "parameters": {
                "Prefer": {
                    "name": "Prefer",
                    "in": "header",
                    "description": (
                        "RFC 7240. `wait=N`: while another owner holds the decision, wait up "
                        f"to N seconds (capped at {MAX_WAIT_S}) for its answer instead of "
                        "409 `busy`. Malformed or zero values are ignored."
                    ),
                    "schema": {"type": "string"},
                    "example": "wait=10",
                },
                "X-Request-Id": {
                    "name": "X-Request-Id",
                    "in": "header",
                    "description": "Your id for this request: echoed back when it is 1 to 64 "
                    "ASCII letters, digits, `-`, `_` or `.`; any other value is replaced by a "
                    "new id.",
                    # Any value is accepted (never refused), so the schema is any string.
                    "schema": {"type": "string"},
                },
            },
            "headers": {
                "X-Request-Id": _header(
                    "The request id (yours if plain, else a new one); error bodies repeat it.",
                    {"type": "string", "minLength": 1},
                    True,
                )
            },
        },
    }


@functools.cache
def openapi_json() -> bytes:
    """The contract as the bytes served and committed: indented, keys in the order
    built (paths as in docs/SERVICE.md, schemas by name), ending in a newline."""
    return (json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n").encode()


async def _serve(request: Request) -> Response:
    return Response(openapi_json(), media_type=_JSON)


def openapi_route() -> Route:
    """``GET /openapi.json``."""
    return Route(OPENAPI_PATH, _serve, methods=["GET"])


if __name__ == "__main__":
    sys.stdout.buffer.write(openapi_json())
