"""The JSON bodies of the decision service, as typed dictionaries.

One definition serves three readers: the code that builds a body (its
``to_dict`` or handler is annotated with the type here, so mypy checks that it
builds what is declared), the client that parses it, and the OpenAPI contract
(``flowdecision.service.openapi`` derives the JSON Schemas from these types,
see docs/openapi.json).

This module uses run-time annotations (no ``from __future__ import
annotations``): the schema generator reads :class:`typing.NotRequired` from
``__required_keys__``, which needs them evaluated.
"""

from typing import Annotated, Any, Literal, NotRequired, TypedDict

__all__ = [
    "ActionBody",
    "ApprovalBody",
    "ApprovalPolicyBody",
    "AuditEntryBody",
    "AuditPageBody",
    "BranchDetails",
    "BulkActionBody",
    "BusyDetails",
    "CheckBody",
    "ConflictDetails",
    "DecisionPageBody",
    "DecisionRowBody",
    "DecisionStateBody",
    "ErrorBody",
    "ErrorMembers",
    "ErrorRateCheckBody",
    "FieldDetails",
    "FieldProblem",
    "HealthChecksBody",
    "HealthExtras",
    "HoldActionBody",
    "IdentityBody",
    "LimitDetails",
    "NotFoundDetails",
    "OutboxActionBody",
    "OutboxAuditEntryBody",
    "OutboxEntryBody",
    "OutboxPageBody",
    "OutcomeBody",
    "ParameterDetails",
    "ParkedPageBody",
    "ParkedRowBody",
    "ReceiptBody",
    "RefusedBody",
    "RejectedDetails",
    "RunClosedDetails",
    "RunPageBody",
    "RunStateBody",
    "Schema",
    "TooLargeDetails",
    "ValuesLimitDetails",
    "outbox_entry_body",
]


class Schema:
    """:data:`typing.Annotated` metadata: extra JSON Schema keywords for a member.

    ``ref="Name"`` stands for the component schema of that name. Hashable, as
    ``Annotated`` metadata in a union must be.
    """

    __slots__ = ("_items",)

    def __init__(self, **keywords: object) -> None:
        self._items = tuple(keywords.items())

    def keywords(self) -> dict[str, object]:
        """The keywords, as given."""
        return dict(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and other._items == self._items

    def __hash__(self) -> int:
        return hash(self._items)


NonNegative = Annotated[int, Schema(minimum=0)]
Positive = Annotated[int, Schema(minimum=1)]
RequestHash = Annotated[str, Schema(pattern="^[0-9a-f]{64}$")]


class IdentityBody(TypedDict):
    """An execution identity (``ExecutionIdentityV1``), in Rust field order.

    (Its constants and patterns come from :mod:`flowdecision.core.identity`, which
    the contract generator applies.)
    """

    schema: str
    domain: str
    digest: str


class ReceiptBody(TypedDict):
    """A result receipt (``ExecutionResultReceiptV1``).

    ``succeeded`` carries ``result_digest`` and ``result_bytes`` above 0; the
    other outcomes carry no digest and 0 bytes.
    """

    schema: str
    identity: IdentityBody
    evidence_digest: str
    outcome: str
    result_digest: NotRequired[str]
    result_bytes: NonNegative


class OutcomeBody(TypedDict):
    """``POST /v1/decisions`` succeeded: 201 ``submitted``, 200 ``duplicate`` or 202
    ``held`` (approval holds: recorded, nothing sent; ``state`` is ``held`` and
    ``hold_expires_at_ms`` when the hold expires, null for never).

    ``receipt_digest`` is present only for a duplicate of a decision pruned to
    a tombstone: ``receipt`` is then null and this is the digest the tombstone
    kept of it.
    """

    outcome: Literal["submitted", "duplicate", "held"]
    decision_id: str
    attempt: Positive | None
    receipt: ReceiptBody | None
    receipt_digest: NotRequired[Annotated[str, Schema(pattern="^sha256:[0-9a-f]{64}$")]]
    state: NotRequired[Literal["held"]]
    hold_expires_at_ms: NotRequired[NonNegative | None]


class DecisionStateBody(TypedDict):
    """``GET /v1/decisions/{decision_id}``: the claim record (never the owner).

    ``lease_expires_at_ms`` is present while ``pending``, ``completed_at_ms``
    once ``completed`` or ``tombstoned`` (null for records written before it was
    kept). ``tombstoned``: completed, then pruned with ``keep_tombstones`` (no
    identity or receipt is left). ``held``: waiting for an operator's approval
    (``hold_expires_at_ms``: when the hold expires, null for never);
    ``rejected``: an operator rejected it, or its hold expired
    (``rejected_at_ms``). ``unavailable`` is the state a custom ledger
    without inspection reports.
    """

    decision_id: str
    state: Annotated[
        str,
        Schema(enum=("pending", "completed", "tombstoned", "held", "rejected", "unavailable")),
    ]
    attempts: NonNegative
    request_hash: RequestHash
    lease_expires_at_ms: NotRequired[int]
    completed_at_ms: NotRequired[int | None]
    hold_expires_at_ms: NotRequired[int | None]
    rejected_at_ms: NotRequired[int | None]
    execution_identity: IdentityBody | None
    receipt: ReceiptBody | None


class OutboxEntryBody(TypedDict):
    """One accepted decision in the outbox; ``request`` is the stored wire JSON verbatim."""

    seq: Positive
    decision_id: str
    request_hash: RequestHash
    first_attempt: Positive
    highest_attempt: Positive
    accepted_at_ms: int
    #: W3C trace context of the dispatch that wrote the row (null when tracing was off).
    traceparent: str | None
    request: Annotated[dict[str, Any], Schema(ref="DecisionRequest")]


def outbox_entry_body(entry: Any, request: dict[str, Any]) -> OutboxEntryBody:
    """The body of an outbox entry from anything with its fields (the library's
    ``OutboxEntry``, the client's ``OutboxItem``) and its request, parsed."""
    return {
        "seq": entry.seq,
        "decision_id": entry.decision_id,
        "request_hash": entry.request_hash,
        "first_attempt": entry.first_attempt,
        "highest_attempt": entry.highest_attempt,
        "accepted_at_ms": entry.accepted_at_ms,
        "traceparent": entry.traceparent,
        "request": request,
    }


class OutboxPageBody(TypedDict):
    """``GET /v1/outbox``: entries in commit order; ask again with ``after=next_after``."""

    entries: list[OutboxEntryBody]
    next_after: NonNegative
    has_more: bool


QueryState = Literal[
    "pending_live", "pending_expired", "completed", "tombstoned", "held", "rejected"
]


class DecisionRowBody(TypedDict):
    """One listed decision (``GET /v1/decisions``, ``GET /v1/runs/{run_id}``): never the owner.

    ``created_at_ms`` is when it was first claimed (the page order);
    ``lease_expires_at_ms`` is set while pending; ``receipt_digest`` for tombstones;
    ``hold_expires_at_ms`` while held (null: the hold never expires).
    """

    decision_id: str
    state: QueryState
    request_hash: str
    attempts: NonNegative
    created_at_ms: NonNegative
    lease_expires_at_ms: NonNegative | None
    completed_at_ms: NonNegative | None
    run_id: str | None
    causation_event_id: str | None
    receipt_digest: str | None
    hold_expires_at_ms: NotRequired[NonNegative | None]


class DecisionPageBody(TypedDict):
    """A keyset page of decisions; ask again with ``cursor=next_cursor`` (null: the last).

    ``count`` (with ``count=true``): how many decisions the filters select.
    """

    decisions: list[DecisionRowBody]
    next_cursor: str | None
    count: NotRequired[NonNegative]


class RunStateBody(TypedDict):
    """A run's state under the run invariants (``GET /v1/runs/{run_id}``'s ``run``).

    ``open``: no terminal decision yet. ``closing``: a ``complete`` or ``fail``
    decision (``terminal_decision_id``) is claimed but not yet completed; another
    terminal decision is refused. ``closed``: it completed at ``closed_at_ms``;
    every new decision of the run is refused (``409 run_closed``).
    """

    run_id: str
    state: Literal["open", "closing", "closed"]
    terminal_decision_id: str | None
    terminal_kind: Literal["complete", "fail"] | None
    closed_by: str | None
    closed_at_ms: NonNegative | None


class RunPageBody(DecisionPageBody):
    """``GET /v1/runs/{run_id}``: the run's state and a keyset page of its decisions."""

    run: RunStateBody


class RunClosedDetails(TypedDict):
    """``run_closed``: the run, its state and the decision that closed it (or is closing it)."""

    decision_id: str
    run_id: str
    run_state: Literal["closing", "closed"]
    closed_by: str
    closed_at_ms: NonNegative | None


class RejectedDetails(TypedDict):
    """``decision_rejected``: the decision was held for approval and rejected (by an
    operator, or its hold expired) at ``rejected_at_ms``; it is never sent."""

    decision_id: str
    rejected_at_ms: NonNegative | None


#: A link of an audit trail's hash chain (null on rows from before the chain).
ChainHash = Annotated[str, Schema(pattern="^sha256:[0-9a-f]{64}$")] | None


class AuditEntryBody(TypedDict):
    """One operator action in the append-only audit trail.

    ``prev_hash`` is the previous entry's ``row_hash`` (``sha256:`` and 64 zeros
    for the first), ``row_hash`` SHA-256 over it and this entry's content: the
    trail's hash chain (``flowdecision audit --verify``).
    """

    seq: Positive
    at_ms: NonNegative
    action: Literal["release", "forget", "approve", "reject", "expire"]
    decision_id: str
    actor: str
    reason: str
    state_before: QueryState
    attempts: NonNegative
    prev_hash: ChainHash
    row_hash: ChainHash


class AuditPageBody(TypedDict):
    """A page of the audit trail, oldest first; ask again with ``cursor=next_cursor``."""

    entries: list[AuditEntryBody]
    next_cursor: str | None


class ApprovalBody(OutcomeBody):
    """``POST /v1/actions/approve``: the approved decision's dispatch (``submitted``, or
    ``duplicate`` when an earlier approval delivered it) and the audit entry written
    (null when nothing was done)."""

    audit: AuditEntryBody | None


class ApprovalPolicyBody(TypedDict):
    """The approval policy in force (``ApprovalPolicy.to_dict()``): which decisions are
    held for approval, and what becomes of holds."""

    kinds: list[str]
    steps: list[str]
    runs: list[str]
    predicate: str | None
    expire_ms: NonNegative | None
    reject_closes_run: bool


class HoldActionBody(TypedDict):
    """``POST /v1/actions/approve`` and ``/v1/actions/reject``: one held decision
    (``decision_id``), or every held decision a query selects (``run_id``; ``after``
    and ``before``: first held at or after, before this Unix ms), who acts, and why."""

    decision_id: NotRequired[str]
    run_id: NotRequired[str]
    after: NotRequired[NonNegative]
    before: NotRequired[NonNegative]
    actor: Annotated[str, Schema(minLength=1, maxLength=200)]
    reason: Annotated[str, Schema(minLength=1, maxLength=2000)]


class RefusedBody(TypedDict):
    """One decision a bulk action did not act on, and why."""

    decision_id: str
    error: str


class BulkActionBody(TypedDict):
    """A bulk action's answer (``run_id``; ``flowdecision approve|reject --run --json``
    too): the audit entries written, the decisions refused, and for ``approve`` each
    approved decision's dispatch (``outcomes``)."""

    action: Literal["approve", "reject", "release", "forget"]
    audit: list[AuditEntryBody]
    refused: list[RefusedBody]
    outcomes: NotRequired[list[ApprovalBody]]


class ActionBody(TypedDict):
    """``POST /v1/actions/release`` and ``/v1/actions/forget``: who acts on what, and why."""

    decision_id: str
    actor: Annotated[str, Schema(minLength=1, maxLength=200)]
    reason: Annotated[str, Schema(minLength=1, maxLength=2000)]


class OutboxActionBody(TypedDict):
    """``POST /v1/actions/outbox-retry`` and ``/v1/actions/outbox-skip``: which relay's
    parked row (``relay``, default ``default``), who acts, and why."""

    decision_id: str
    actor: Annotated[str, Schema(minLength=1, maxLength=200)]
    reason: Annotated[str, Schema(minLength=1, maxLength=2000)]
    relay: NotRequired[Annotated[str, Schema(minLength=1, maxLength=200)]]


class OutboxAuditEntryBody(TypedDict):
    """One operator action on a parked row, in the outbox's append-only audit trail
    (``prev_hash``, ``row_hash``: its hash chain, as an audit entry's)."""

    seq: Positive
    at_ms: NonNegative
    relay: str
    action: Literal["retry", "skip"]
    decision_id: str
    actor: str
    reason: str
    state_before: Literal["parked"]
    attempts: NonNegative
    prev_hash: ChainHash
    row_hash: ChainHash


class ParkedRowBody(TypedDict):
    """A row a relay parked (its sink refused it for good: ``error``) or holds behind a
    parked row of the same run (``held``: delivered once that row is retried or skipped)."""

    relay: str
    seq: Positive
    decision_id: str
    run_id: str
    state: Literal["parked", "held"]
    error: str | None
    attempts: NonNegative
    parked_at_ms: NonNegative
    updated_at_ms: NonNegative


class ParkedPageBody(TypedDict):
    """``GET /v1/outbox/parked``: every parked and held row, by relay and seq."""

    parked: list[ParkedRowBody]


class CheckBody(TypedDict):
    """One health check: ``code`` says why it failed (or ``not_probed``)."""

    status: Literal["ok", "failed"]
    code: str | None


class ErrorRateCheckBody(TypedDict):
    """The error-rate check over the last ``window_s`` seconds."""

    status: Literal["ok", "failed"]
    window_s: Positive
    dispatches: NonNegative
    failures: NonNegative
    rate: Annotated[float, Schema(minimum=0, maximum=1)]
    threshold: float
    min_dispatches: NonNegative


class HealthChecksBody(TypedDict):
    """The checks behind the service's health verdict."""

    ledger: CheckBody
    sink: CheckBody
    error_rate: ErrorRateCheckBody


class HealthExtras(TypedDict):
    """What ``/healthz`` adds to the dispatcher's ``HealthSnapshot`` counters."""

    reason: str | None
    checks: HealthChecksBody


# -- errors -----------------------------------------------------------------------


class ErrorMembers(TypedDict):
    """The members every error carries; each code may add its details.

    ``request_id`` is absent only from the few answers sent before a request
    exists (``request_timeout``, ``overloaded``).
    """

    code: str
    message: str
    request_id: NotRequired[str]


class ErrorBody(TypedDict):
    """Every error answer: ``{"error": {...}}``."""

    error: ErrorMembers


class BranchDetails(TypedDict):
    """``forbidden_branch``: the branch sent and the one that may commit."""

    expected_branch: str
    branch: str


class ConflictDetails(TypedDict):
    """``conflict``: the id bound to other content."""

    decision_id: str


class BusyDetails(TypedDict):
    """``busy``: when the owner's lease expires, and how long to wait (``Retry-After``)."""

    lease_expires_at_ms: int
    retry_after_s: Positive


class TooLargeDetails(TypedDict):
    """``decision_too_large``: the decision's JSON size and the receipt limit."""

    size_bytes: NonNegative
    limit_bytes: NonNegative


class FieldProblem(TypedDict):
    """One field of a refused request (a dotted path; ``""`` for the whole body)."""

    field: str
    problem: str


class FieldDetails(TypedDict):
    """``invalid_request``, ``invalid_identifier``: what is wrong, and where."""

    field: str
    problem: str
    fields: list[FieldProblem]


class LimitDetails(TypedDict):
    """``payload_too_large``: the body limit."""

    limit_bytes: NonNegative


class ValuesLimitDetails(TypedDict):
    """``too_many_values``: the most JSON values and containers a body may hold."""

    limit_values: NonNegative


class ParameterDetails(TypedDict):
    """``invalid_parameter``: the query parameter and what is wrong with it."""

    field: str
    problem: str


class NotFoundDetails(TypedDict):
    """``not_found``: ``decision_id`` is present when the path was right but the id unknown."""

    decision_id: NotRequired[str]
