"""Every exception class of the library, in one place, under :class:`FlowDecisionError`.

Each has a stable ``code`` (metric label, HTTP error code, log field). The
modules that raise them re-export them under their old import paths
(``flowdecision.core.identity.DecisionTooLargeError`` is this module's). The HTTP
client's error family, one per answer of the service, lives with the client:
:mod:`flowdecision.client.errors`.

Messages follow the Rust seeds wherever the seeds define them, so operators see
the same text from a Python host and a Rust host sharing one ledger.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

__all__ = [
    "ActionRefusedError",
    "ConfigError",
    "DBOSSinkError",
    "DecisionBusyError",
    "DecisionConflictError",
    "DecisionRejectedError",
    "DecisionTooLargeError",
    "DeliveryError",
    "DispatchError",
    "DispatchLedgerCorruptError",
    "DispatchLedgerError",
    "DispatchLedgerSchemaError",
    "DispatchStoreFullError",
    "ExecutionContractError",
    "ExecutionIdentityError",
    "FlowDecisionError",
    "HarnessError",
    "InexactNumberError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidIdentifierError",
    "InvalidIdentityError",
    "InvalidRequestError",
    "InvalidSinkError",
    "JsonWireError",
    "LeaseLostError",
    "LedgerCorruptError",
    "LedgerError",
    "LedgerSchemaError",
    "LedgerUnavailableError",
    "MigrationError",
    "OutboxConflictError",
    "OutboxCursorLeasedError",
    "OutboxError",
    "OutboxMissingError",
    "OutboxSchemaError",
    "ProcrastinateConflictError",
    "ProcrastinateSinkError",
    "RelayError",
    "RestateSinkError",
    "ResultReceiptError",
    "RetryPolicyError",
    "RunClosedError",
    "SinkConfigError",
    "SinkConflictError",
    "SinkContentConflictError",
    "SinkError",
    "SinkRefusedError",
    "StoreFullError",
    "StoreMissingError",
    "TemporalRejectedError",
    "TemporalRunClosedError",
    "TemporalSinkError",
    "UnauthorizedBranchError",
    "UnknownDecisionError",
    "WalUnavailableError",
    "WebhookError",
    "WebhookRejectedError",
    "classified_code",
    "classify",
    "sink_refused",
]

T = TypeVar("T")


class FlowDecisionError(Exception):
    """Base class of every error raised by flowdecision."""

    #: Stable machine-readable code: metric label, HTTP error code, log field.
    code: ClassVar[str] = "error"

    def __init_subclass__(cls, *, code: str | None = None, **kwargs: Any) -> None:
        # A subclass names its code in its header: ``class X(Base, code="x")``;
        # without one it shares its parent's.
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code


class InvalidArgumentError(FlowDecisionError, ValueError, code="invalid_argument"):
    """An argument passed to a flowdecision function or constructor is out of range.

    It is a :class:`ValueError` too, so ``except ValueError`` keeps catching it.
    Nothing was started, sent or stored.
    """


class InvalidArgumentTypeError(FlowDecisionError, TypeError, code="invalid_argument_type"):
    """An argument passed to a flowdecision function has a type it does not take.

    It is a :class:`TypeError` too, so ``except TypeError`` keeps catching it.
    """


class HarnessError(FlowDecisionError, RuntimeError, code="harness_failed"):
    """The crash-test harness (:mod:`flowdecision.chaos`) cannot go on, e.g. a worker
    keeps crashing. It is a :class:`RuntimeError` too; no verdict was reached."""


class LedgerError(FlowDecisionError, code="ledger_error"):
    """A ledger operation failed: a rule was violated or the store misbehaved."""


class LedgerCorruptError(LedgerError, code="ledger_corrupt"):
    """The stored ledger data cannot be decoded or violates its invariants.

    The store is left untouched; an operator must inspect it.
    """


class LedgerSchemaError(LedgerError, code="ledger_schema"):
    """The store was written by a newer (or older, unmigrated) schema."""


class LedgerUnavailableError(LedgerError, code="ledger_unavailable"):
    """The store cannot be reached, opened or written (I/O, network, permissions)."""


class StoreFullError(LedgerUnavailableError, code="store_full"):
    """The store's disk (SQLite ``SQLITE_FULL``) or the database server's
    (PostgreSQL SQLSTATE 53100 ``disk_full``) is full: nothing was written.

    Transient: once space is freed the same request succeeds, with no restart.
    """


class ActionRefusedError(LedgerError, code="action_refused"):
    """An operator action (release, forget) does not apply to the decision's state,
    e.g. releasing a completed decision or forgetting a pending one. Nothing changed."""


class UnknownDecisionError(ActionRefusedError, code="not_found"):
    """An operator action named a decision the ledger holds no record of."""


class StoreMissingError(LedgerError, code="store_missing"):
    """The store does not exist (or holds no flowdecision data) and was opened with
    ``create=False``: nothing was created or changed."""


class DispatchError(FlowDecisionError, code="dispatch_failed"):
    """Base class of the errors :meth:`Dispatcher.dispatch` raises."""


class UnauthorizedBranchError(DispatchError, code="forbidden_branch"):
    """The request came from a branch other than the production branch (a fork)."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(
            "graph branch is not authorized for production Flow decisions: "
            f"expected `{expected}`, got `{actual}`"
        )
        self.expected = expected
        self.actual = actual


class InvalidIdentityError(DispatchError, code="invalid_request"):
    """`decision_id` or `causation_event_id` is empty after trimming.

    ``field`` names the empty one and ``problem`` says what is wrong; the
    message stays the seed's.
    """

    def __init__(self, field: str = "decision_id") -> None:
        super().__init__("decision_id and causation_event_id must be non-empty")
        self.field = field
        self.problem = "must be non-empty (after trimming whitespace)"


class InvalidIdentifierError(DispatchError, LedgerError, code="invalid_identifier"):
    """An identifier breaks the identifier rules (see :mod:`flowdecision.core.limits`).

    ``field`` names it (``decision_id``, ``run_id``, ``authority_branch_id``,
    ``causation_event_id``, ``owner_id``, ...); ``problem`` says what is wrong:
    over :data:`~flowdecision.core.limits.IDENTIFIER_MAX_BYTES` bytes of UTF-8, or a
    control character. The dispatcher raises it before claiming; the ledger
    raises the same error for direct calls, hence it is a :class:`LedgerError`
    too. Nothing was stored either way.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid identifier: `{field}` {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.problem))


class DecisionConflictError(DispatchError, code="conflict"):
    """The decision id is already bound to different content."""

    def __init__(self, decision_id: str) -> None:
        super().__init__(
            f"Flow decision `{decision_id}` reuses an existing decision id with different content"
        )
        self.decision_id = decision_id


class DecisionBusyError(DispatchError, code="busy"):
    """Another dispatcher holds a live lease on the decision."""

    def __init__(self, lease_expires_at_ms: int) -> None:
        super().__init__(
            f"Flow decision is owned by another dispatcher until {lease_expires_at_ms}"
        )
        self.lease_expires_at_ms = lease_expires_at_ms


class RunClosedError(DispatchError, code="run_closed"):
    """The decision's run takes no new decision (run invariants, docs/PROTOCOL.md "Runs").

    The run is ``closed`` (its terminal decision ``closed_by`` completed at
    ``closed_at_ms``), or, for a ``complete``/``fail`` decision, ``closing``:
    another terminal decision (``closed_by``) is claimed. Nothing was stored.
    """

    def __init__(
        self,
        decision_id: str,
        run_id: str,
        run_state: str,
        closed_by: str,
        closed_at_ms: int | None = None,
    ) -> None:
        if run_state == "closed":
            why = f"is closed: decision `{closed_by}` closed it at {closed_at_ms}"
        else:
            why = f"already has its terminal decision `{closed_by}` (not yet completed)"
        super().__init__(f"Flow decision `{decision_id}` refused: run `{run_id}` {why}")
        self.decision_id = decision_id
        self.run_id = run_id
        self.run_state = run_state
        self.closed_by = closed_by
        self.closed_at_ms = closed_at_ms

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.decision_id, self.run_id, self.run_state, self.closed_by, self.closed_at_ms),
        )


class DecisionRejectedError(DispatchError, code="decision_rejected"):
    """The decision was held for approval and rejected (by an operator, or its hold
    expired at ``rejected_at_ms``): it is never sent (docs/PROTOCOL.md, "Approval holds")."""

    def __init__(self, decision_id: str, rejected_at_ms: int | None = None) -> None:
        super().__init__(
            f"Flow decision `{decision_id}` was rejected at {rejected_at_ms}: it is never sent"
        )
        self.decision_id = decision_id
        self.rejected_at_ms = rejected_at_ms

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.decision_id, self.rejected_at_ms))


class LeaseLostError(DispatchError, code="lease_lost"):
    """The lease could not be renewed while the sink ran; the submission was cancelled."""

    def __init__(self, decision_id: str) -> None:
        super().__init__(f"Flow decision `{decision_id}` lost its lease while the sink was running")
        self.decision_id = decision_id


class DispatchLedgerError(DispatchError, code="ledger_unavailable"):
    """The ledger failed; the original :class:`LedgerError` is chained as ``__cause__``.

    This class itself means a transient failure (retrying may succeed); the
    permanent ones are its subclasses :class:`DispatchLedgerCorruptError` and
    :class:`DispatchLedgerSchemaError`. :meth:`wrap` picks the right one.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(f"Flow decision ledger failed: {detail}")
        self.detail = detail

    @staticmethod
    def wrap(error: BaseException) -> DispatchLedgerError:
        """The dispatch error for the ledger failure ``error``, chained to it.

        A corrupt store and a schema mismatch are permanent (an operator must
        act) and get their own subclass, hence their own ``code``.
        """
        kind: type[DispatchLedgerError] = DispatchLedgerError
        if isinstance(error, StoreFullError):
            kind = DispatchStoreFullError
        elif isinstance(error, LedgerCorruptError):
            kind = DispatchLedgerCorruptError
        elif isinstance(error, LedgerSchemaError):
            kind = DispatchLedgerSchemaError
        wrapped = kind(str(error) or type(error).__name__)
        wrapped.__cause__ = error
        return wrapped


class DispatchLedgerCorruptError(DispatchLedgerError, code="ledger_corrupt"):
    """The ledger's stored data is corrupt: permanent until an operator repairs it."""


class DispatchLedgerSchemaError(DispatchLedgerError, code="ledger_schema"):
    """The ledger's schema is newer (or older) than this version: permanent."""


class DispatchStoreFullError(DispatchLedgerError, code="store_full"):
    """The ledger's store is out of disk space (:class:`StoreFullError`): transient."""


class SinkError(DispatchError, code="sink_failed"):
    """The sink raised; its exception is chained as ``__cause__``."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"Flow decision sink failed: {detail}")
        self.detail = detail


class SinkConflictError(SinkError, code="sink_conflict"):
    """The sink holds different content under this decision id and refuses it: permanent.

    Raised by the dispatcher when the sink raised a
    :class:`SinkContentConflictError` (chained as ``__cause__``). Unlike other
    sink failures a retry can never succeed; the service answers 409
    ``sink_conflict`` without ``Retry-After``.
    """

    def __init__(self, decision_id: str, detail: str) -> None:
        DispatchError.__init__(
            self,
            f"decision `{decision_id}` reached the sink before with different content; "
            "the sink refuses it, so retrying cannot succeed",
        )
        self.decision_id = decision_id
        self.detail = detail


class SinkRefusedError(FlowDecisionError, code="sink_refused"):
    """The sink refuses this decision for good: retrying it cannot succeed.

    Every sink raises a subclass for its permanent failures (a webhook's 4xx, a
    closed Temporal run, an unknown Restate handler, a content conflict); a
    custom sink may raise it too. An outbox relay *parks* such a row instead of
    retrying it (see :mod:`flowdecision.sinks.relay`); any other exception is
    transient and retried with backoff.
    """


def sink_refused(error: BaseException) -> bool:
    """True when ``error`` (or an exception it was raised from) is a :class:`SinkRefusedError`."""
    seen: BaseException | None = error
    for _ in range(8):  # a cause chain is short; a cycle must not loop forever
        if seen is None:
            return False
        if isinstance(seen, SinkRefusedError):
            return True
        seen = seen.__cause__
    return False


class SinkContentConflictError(SinkRefusedError, code="sink_content_conflict"):
    """Base of a sink's own "this id already holds different content" refusal.

    The outbox's and procrastinate's conflicts derive from it; a custom sink may
    raise it too. The dispatcher reports it as :class:`SinkConflictError`
    (permanent), never as a retryable :class:`SinkError`.
    """

    #: What the sink did with the id before, as the message says it.
    held: ClassVar[str] = "sink already holds"

    def __init__(self, decision_id: str, stored_hash: str, offered_hash: str) -> None:
        super().__init__(
            f"{self.held} decision `{decision_id}` with request hash {stored_hash}; "
            f"refusing different content with hash {offered_hash}"
        )
        self.decision_id = decision_id
        self.stored_hash = stored_hash
        self.offered_hash = offered_hash


# -- the wire format and the request model -------------------------------------


class JsonWireError(FlowDecisionError, ValueError, code="invalid_json"):
    """JSON text or value that serde_json would reject (or could not produce).

    ``message`` is the bare problem; ``line``/``column`` (1-based) locate it in
    the input text when known.
    """

    def __init__(
        self,
        message: str,
        *,
        line: int | None = None,
        column: int | None = None,
        path: str | None = None,
    ):
        self.message = message
        self.line = line
        self.column = column
        #: Where in the parsed value the problem sits (``decision.step.input.n``), when known.
        self.path = path
        where = f" at line {line} column {column}" if line is not None else ""
        if path is not None:
            where += f" at `{path}`"
        super().__init__(f"{message}{where}")


class InexactNumberError(JsonWireError, code="inexact_number"):
    """``exact_numbers``: numbers that would not be kept exactly.

    ``path`` and the message name the first; :attr:`inexact` lists every one
    as ``(path, problem)`` in document order, so a caller that ignores parts
    of the document (unknown members) can tell whether any of them matters.
    """

    def __init__(self, problem: str, path: str | None, inexact: list[tuple[str, str]]) -> None:
        super().__init__(problem, path=path)
        self.inexact = inexact


class InvalidRequestError(FlowDecisionError, ValueError, code="invalid_request"):
    """A decision request that the Rust original would refuse to deserialize.

    ``field`` is a dotted path such as ``decision.steps[1].retry.max_attempts``
    (``""`` when the problem is the JSON text itself or the top-level value);
    ``problem`` describes what is wrong.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        where = f"field `{field}`: " if field else ""
        super().__init__(f"invalid decision request: {where}{problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.problem))


class RetryPolicyError(FlowDecisionError, ValueError, code="invalid_retry_policy"):
    """A retry policy that breaks A3S Flow's rules (see :meth:`RetryPolicy.validate`)."""


# -- execution identities and result receipts ----------------------------------


class ExecutionContractError(FlowDecisionError, ValueError, code="execution_contract"):
    """Base class of identity and receipt errors."""


class ExecutionIdentityError(ExecutionContractError, code="invalid_execution_identity"):
    """An execution identity that is malformed or cannot be derived."""


class ResultReceiptError(ExecutionContractError, code="invalid_result_receipt"):
    """A result receipt that is malformed or breaks the receipt rules."""


class DecisionTooLargeError(DispatchError, ValueError, code="decision_too_large"):
    """A decision whose JSON exceeds :data:`RESULT_RECEIPT_MAX_BYTES` (raised before claiming).

    The dispatcher raises it as it is: a client error, counted as rejected.
    """

    def __init__(self, decision_id: str, size: int, limit: int) -> None:
        self.decision_id = decision_id
        self.size = size
        self.limit = limit
        super().__init__(f"decision `{decision_id}` result exceeds {limit} bytes")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.decision_id, self.size, self.limit))


# -- stores --------------------------------------------------------------------


class MigrationError(FlowDecisionError, ValueError, code="migration_invalid"):
    """The shipped migrations are malformed (a packaging bug, not user data)."""


class WalUnavailableError(FlowDecisionError, sqlite3.OperationalError, code="wal_unavailable"):
    """The database refused WAL mode (e.g. an in-memory or read-only database).

    Still a :class:`sqlite3.OperationalError`, so callers translating SQLite
    errors into their own see it as one.
    """


# -- sinks ---------------------------------------------------------------------


class InvalidSinkError(FlowDecisionError, TypeError, code="invalid_sink"):
    """An object handed in as a sink has no ``async def submit(request, attempt)``."""


class OutboxError(FlowDecisionError, code="outbox_error"):
    """The outbox store failed (cannot open, read or write); the message names the store."""


class OutboxSchemaError(OutboxError, code="outbox_schema"):
    """The outbox store has a schema this version cannot use."""


class OutboxMissingError(OutboxError, StoreMissingError, code="outbox_missing"):
    """Opened with ``create=False``, the store does not exist or holds no outbox."""


class OutboxConflictError(OutboxError, SinkContentConflictError, code="outbox_conflict"):
    """A delivery reused a decision id whose stored row has different content."""

    held: ClassVar[str] = "outbox already holds"


class OutboxCursorLeasedError(OutboxError, code="outbox_cursor_leased"):
    """A relay cursor cannot be moved: a running relay holds its lease."""

    def __init__(self, name: str, owner: str) -> None:
        super().__init__(
            f"relay cursor `{name}` is leased by the running relay {owner}; stop it first"
        )
        self.name = name
        self.owner = owner


class RelayError(FlowDecisionError, code="relay_error"):
    """An outbox relay is misconfigured or was used after it closed."""


class SinkConfigError(FlowDecisionError, code="sink_config"):
    """The sink URL is malformed, names an unknown scheme, or loads something unusable."""


class WebhookError(FlowDecisionError, code="webhook_failed"):
    """The webhook did not accept the decision; ``tries`` says how many POSTs were made."""

    def __init__(self, message: str, *, status: int | None = None, tries: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.tries = tries


class WebhookRejectedError(WebhookError, SinkRefusedError, code="webhook_rejected"):
    """The receiver answered with a non-retryable status (3xx, or 4xx other than 408 and 429)."""


class DBOSSinkError(FlowDecisionError, code="dbos_sink"):
    """The DBOS sink is misconfigured, or DBOS refused to start the workflow."""


class ProcrastinateSinkError(FlowDecisionError, code="procrastinate_sink"):
    """The procrastinate sink is misconfigured or its database failed."""


class ProcrastinateConflictError(
    ProcrastinateSinkError, SinkContentConflictError, code="procrastinate_conflict"
):
    """A decision id that was deferred before came back with different content."""

    held: ClassVar[str] = "procrastinate sink already deferred"


class TemporalSinkError(FlowDecisionError, code="temporal_sink"):
    """Temporal did not take the decision (unreachable, no worker in time, the update
    was rejected or failed), or the sink is misconfigured."""


class TemporalRejectedError(TemporalSinkError, SinkRefusedError, code="temporal_rejected"):
    """Temporal refused the decision for good: its arguments are invalid, or the run's
    workflow rejected the update. Retrying does not help."""


class TemporalRunClosedError(TemporalRejectedError, code="temporal_run_closed"):
    """Run mode: a new decision for a run whose workflow has already closed.

    Temporal refuses to start the run's workflow id again (reuse policy
    reject-duplicate), so the decision is not delivered anywhere. Retrying does
    not help; the run is over.
    """


class RestateSinkError(FlowDecisionError, code="restate_sink"):
    """Restate's ingress answered something the sink cannot read as an acceptance."""


class DeliveryError(FlowDecisionError, code="invalid_delivery"):
    """A delivery payload that does not hold together (a field missing or mistyped,
    or a request whose hash or ids differ from the envelope's)."""


# -- the service ---------------------------------------------------------------


class ConfigError(FlowDecisionError, code="config_invalid"):
    """A setting is missing, malformed or inconsistent; the message names it."""


# -- classifying errors ---------------------------------------------------------


def classified_code(error: BaseException, table: Mapping[str, object]) -> str | None:
    """The code under which ``table`` classifies ``error``.

    That is ``error``'s own :attr:`~FlowDecisionError.code` when the table has
    a row for it, else its nearest base class's code that has one, so a new
    subclass is classified like its parent until it gets a row. None when
    nothing matches (e.g. an exception that is not a :class:`FlowDecisionError`).
    """
    for cls in type(error).__mro__:
        code = cls.__dict__.get("code")
        if isinstance(code, str) and code in table:
            return code
    return None


def classify(error: BaseException, table: Mapping[str, T]) -> T | None:
    """The row of ``table`` for ``error`` (see :func:`classified_code`), or None.

    Every classification of errors (health counters, HTTP answers) is a table
    keyed by ``code`` and looked up here.
    """
    code = classified_code(error, table)
    return None if code is None else table[code]
