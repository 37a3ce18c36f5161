"""Every exception class of the library, in one place, under :class:`FlowDecisionError`.

Each has a stable ``code`` (metric label, HTTP error code, log field). The
modules that raise them re-export them under their old import paths
(``flowdecision.identity.DecisionTooLargeError`` is this module's). The HTTP
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
    "SinkConfigError",
    "SinkConflictError",
    "SinkContentConflictError",
    "SinkError",
    "StoreFullError",
    "StoreMissingError",
    "TemporalRunClosedError",
    "TemporalSinkError",
    "UnauthorizedBranchError",
    "UnknownDecisionError",
    "WalUnavailableError",
    "WebhookError",
    "WebhookRejectedError",
    "classified_code",
    "classify",
]

T = TypeVar("T")


class FlowDecisionError(Exception):
    """Base class of every error raised by flowdecision."""

    #: Stable machine-readable code: metric label, HTTP error code, log field.
    code: ClassVar[str] = "error"


class InvalidArgumentError(FlowDecisionError, ValueError):
    """An argument passed to a flowdecision function or constructor is out of range.

    It is a :class:`ValueError` too, so ``except ValueError`` keeps catching it.
    Nothing was started, sent or stored.
    """

    code: ClassVar[str] = "invalid_argument"


class InvalidArgumentTypeError(FlowDecisionError, TypeError):
    """An argument passed to a flowdecision function has a type it does not take.

    It is a :class:`TypeError` too, so ``except TypeError`` keeps catching it.
    """

    code: ClassVar[str] = "invalid_argument_type"


class HarnessError(FlowDecisionError, RuntimeError):
    """The crash-test harness (:mod:`flowdecision.chaos`) cannot go on, e.g. a worker
    keeps crashing. It is a :class:`RuntimeError` too; no verdict was reached."""

    code: ClassVar[str] = "harness_failed"


class LedgerError(FlowDecisionError):
    """A ledger operation failed: a rule was violated or the store misbehaved."""

    code: ClassVar[str] = "ledger_error"


class LedgerCorruptError(LedgerError):
    """The stored ledger data cannot be decoded or violates its invariants.

    The store is left untouched; an operator must inspect it.
    """

    code: ClassVar[str] = "ledger_corrupt"


class LedgerSchemaError(LedgerError):
    """The store was written by a newer (or older, unmigrated) schema."""

    code: ClassVar[str] = "ledger_schema"


class LedgerUnavailableError(LedgerError):
    """The store cannot be reached, opened or written (I/O, network, permissions)."""

    code: ClassVar[str] = "ledger_unavailable"


class StoreFullError(LedgerUnavailableError):
    """The store's disk (SQLite ``SQLITE_FULL``) or the database server's
    (PostgreSQL SQLSTATE 53100 ``disk_full``) is full: nothing was written.

    Transient: once space is freed the same request succeeds, with no restart.
    """

    code: ClassVar[str] = "store_full"


class ActionRefusedError(LedgerError):
    """An operator action (release, forget) does not apply to the decision's state,
    e.g. releasing a completed decision or forgetting a pending one. Nothing changed."""

    code: ClassVar[str] = "action_refused"


class UnknownDecisionError(ActionRefusedError):
    """An operator action named a decision the ledger holds no record of."""

    code: ClassVar[str] = "not_found"


class StoreMissingError(LedgerError):
    """The store does not exist (or holds no flowdecision data) and was opened with
    ``create=False``: nothing was created or changed."""

    code: ClassVar[str] = "store_missing"


class DispatchError(FlowDecisionError):
    """Base class of the errors :meth:`Dispatcher.dispatch` raises."""

    code: ClassVar[str] = "dispatch_failed"


class UnauthorizedBranchError(DispatchError):
    """The request came from a branch other than the production branch (a fork)."""

    code: ClassVar[str] = "forbidden_branch"

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(
            "graph branch is not authorized for production Flow decisions: "
            f"expected `{expected}`, got `{actual}`"
        )
        self.expected = expected
        self.actual = actual


class InvalidIdentityError(DispatchError):
    """`decision_id` or `causation_event_id` is empty after trimming.

    ``field`` names the empty one and ``problem`` says what is wrong; the
    message stays the seed's.
    """

    code: ClassVar[str] = "invalid_request"

    def __init__(self, field: str = "decision_id") -> None:
        super().__init__("decision_id and causation_event_id must be non-empty")
        self.field = field
        self.problem = "must be non-empty (after trimming whitespace)"


class InvalidIdentifierError(DispatchError, LedgerError):
    """An identifier breaks the identifier rules (see :mod:`flowdecision.limits`).

    ``field`` names it (``decision_id``, ``run_id``, ``authority_branch_id``,
    ``causation_event_id``, ``owner_id``, ...); ``problem`` says what is wrong:
    over :data:`~flowdecision.limits.IDENTIFIER_MAX_BYTES` bytes of UTF-8, or a
    control character. The dispatcher raises it before claiming; the ledger
    raises the same error for direct calls, hence it is a :class:`LedgerError`
    too. Nothing was stored either way.
    """

    code: ClassVar[str] = "invalid_identifier"

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid identifier: `{field}` {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.problem))


class DecisionConflictError(DispatchError):
    """The decision id is already bound to different content."""

    code: ClassVar[str] = "conflict"

    def __init__(self, decision_id: str) -> None:
        super().__init__(
            f"Flow decision `{decision_id}` reuses an existing decision id with different content"
        )
        self.decision_id = decision_id


class DecisionBusyError(DispatchError):
    """Another dispatcher holds a live lease on the decision."""

    code: ClassVar[str] = "busy"

    def __init__(self, lease_expires_at_ms: int) -> None:
        super().__init__(
            f"Flow decision is owned by another dispatcher until {lease_expires_at_ms}"
        )
        self.lease_expires_at_ms = lease_expires_at_ms


class LeaseLostError(DispatchError):
    """The lease could not be renewed while the sink ran; the submission was cancelled."""

    code: ClassVar[str] = "lease_lost"

    def __init__(self, decision_id: str) -> None:
        super().__init__(f"Flow decision `{decision_id}` lost its lease while the sink was running")
        self.decision_id = decision_id


class DispatchLedgerError(DispatchError):
    """The ledger failed; the original :class:`LedgerError` is chained as ``__cause__``.

    This class itself means a transient failure (retrying may succeed); the
    permanent ones are its subclasses :class:`DispatchLedgerCorruptError` and
    :class:`DispatchLedgerSchemaError`. :meth:`wrap` picks the right one.
    """

    code: ClassVar[str] = "ledger_unavailable"

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


class DispatchLedgerCorruptError(DispatchLedgerError):
    """The ledger's stored data is corrupt: permanent until an operator repairs it."""

    code: ClassVar[str] = "ledger_corrupt"


class DispatchLedgerSchemaError(DispatchLedgerError):
    """The ledger's schema is newer (or older) than this version: permanent."""

    code: ClassVar[str] = "ledger_schema"


class DispatchStoreFullError(DispatchLedgerError):
    """The ledger's store is out of disk space (:class:`StoreFullError`): transient."""

    code: ClassVar[str] = "store_full"


class SinkError(DispatchError):
    """The sink raised; its exception is chained as ``__cause__``."""

    code: ClassVar[str] = "sink_failed"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Flow decision sink failed: {detail}")
        self.detail = detail


class SinkConflictError(SinkError):
    """The sink holds different content under this decision id and refuses it: permanent.

    Raised by the dispatcher when the sink raised a
    :class:`SinkContentConflictError` (chained as ``__cause__``). Unlike other
    sink failures a retry can never succeed; the service answers 409
    ``sink_conflict`` without ``Retry-After``.
    """

    code: ClassVar[str] = "sink_conflict"

    def __init__(self, decision_id: str, detail: str) -> None:
        DispatchError.__init__(
            self,
            f"decision `{decision_id}` reached the sink before with different content; "
            "the sink refuses it, so retrying cannot succeed",
        )
        self.decision_id = decision_id
        self.detail = detail


class SinkContentConflictError(FlowDecisionError):
    """Base of a sink's own "this id already holds different content" refusal.

    The outbox's and procrastinate's conflicts derive from it; a custom sink may
    raise it too. The dispatcher reports it as :class:`SinkConflictError`
    (permanent), never as a retryable :class:`SinkError`.
    """

    code: ClassVar[str] = "sink_content_conflict"
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


class JsonWireError(FlowDecisionError, ValueError):
    """JSON text or value that serde_json would reject (or could not produce).

    ``message`` is the bare problem; ``line``/``column`` (1-based) locate it in
    the input text when known.
    """

    code: ClassVar[str] = "invalid_json"

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


class InexactNumberError(JsonWireError):
    """``exact_numbers``: numbers that would not be kept exactly.

    ``path`` and the message name the first; :attr:`inexact` lists every one
    as ``(path, problem)`` in document order, so a caller that ignores parts
    of the document (unknown members) can tell whether any of them matters.
    """

    code: ClassVar[str] = "inexact_number"

    def __init__(self, problem: str, path: str | None, inexact: list[tuple[str, str]]) -> None:
        super().__init__(problem, path=path)
        self.inexact = inexact


class InvalidRequestError(FlowDecisionError, ValueError):
    """A decision request that the Rust original would refuse to deserialize.

    ``field`` is a dotted path such as ``decision.steps[1].retry.max_attempts``
    (``""`` when the problem is the JSON text itself or the top-level value);
    ``problem`` describes what is wrong.
    """

    code: ClassVar[str] = "invalid_request"

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        where = f"field `{field}`: " if field else ""
        super().__init__(f"invalid decision request: {where}{problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.problem))


class RetryPolicyError(FlowDecisionError, ValueError):
    """A retry policy that breaks A3S Flow's rules (see :meth:`RetryPolicy.validate`)."""

    code: ClassVar[str] = "invalid_retry_policy"


# -- execution identities and result receipts ----------------------------------


class ExecutionContractError(FlowDecisionError, ValueError):
    """Base class of identity and receipt errors."""

    code: ClassVar[str] = "execution_contract"


class ExecutionIdentityError(ExecutionContractError):
    """An execution identity that is malformed or cannot be derived."""

    code: ClassVar[str] = "invalid_execution_identity"


class ResultReceiptError(ExecutionContractError):
    """A result receipt that is malformed or breaks the receipt rules."""

    code: ClassVar[str] = "invalid_result_receipt"


class DecisionTooLargeError(DispatchError, ValueError):
    """A decision whose JSON exceeds :data:`RESULT_RECEIPT_MAX_BYTES` (raised before claiming).

    The dispatcher raises it as it is: a client error, counted as rejected.
    """

    code: ClassVar[str] = "decision_too_large"

    def __init__(self, decision_id: str, size: int, limit: int | None = None) -> None:
        if limit is None:
            # limits.py imports this module: its constant is read when raised.
            from .limits import RESULT_RECEIPT_MAX_BYTES

            limit = RESULT_RECEIPT_MAX_BYTES
        self.decision_id = decision_id
        self.size = size
        self.limit = limit
        super().__init__(f"decision `{decision_id}` result exceeds {limit} bytes")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.decision_id, self.size, self.limit))


# -- stores --------------------------------------------------------------------


class MigrationError(FlowDecisionError, ValueError):
    """The shipped migrations are malformed (a packaging bug, not user data)."""

    code: ClassVar[str] = "migration_invalid"


class WalUnavailableError(FlowDecisionError, sqlite3.OperationalError):
    """The database refused WAL mode (e.g. an in-memory or read-only database).

    Still a :class:`sqlite3.OperationalError`, so callers translating SQLite
    errors into their own see it as one.
    """

    code: ClassVar[str] = "wal_unavailable"


# -- sinks ---------------------------------------------------------------------


class InvalidSinkError(FlowDecisionError, TypeError):
    """An object handed in as a sink has no ``async def submit(request, attempt)``."""

    code: ClassVar[str] = "invalid_sink"


class OutboxError(FlowDecisionError):
    """The outbox store failed (cannot open, read or write); the message names the store."""

    code: ClassVar[str] = "outbox_error"


class OutboxSchemaError(OutboxError):
    """The outbox store has a schema this version cannot use."""

    code: ClassVar[str] = "outbox_schema"


class OutboxMissingError(OutboxError, StoreMissingError):
    """Opened with ``create=False``, the store does not exist or holds no outbox."""

    code: ClassVar[str] = "outbox_missing"


class OutboxConflictError(OutboxError, SinkContentConflictError):
    """A delivery reused a decision id whose stored row has different content."""

    code: ClassVar[str] = "outbox_conflict"
    held: ClassVar[str] = "outbox already holds"


class OutboxCursorLeasedError(OutboxError):
    """A relay cursor cannot be moved: a running relay holds its lease."""

    code: ClassVar[str] = "outbox_cursor_leased"

    def __init__(self, name: str, owner: str) -> None:
        super().__init__(
            f"relay cursor `{name}` is leased by the running relay {owner}; stop it first"
        )
        self.name = name
        self.owner = owner


class RelayError(FlowDecisionError):
    """An outbox relay is misconfigured or was used after it closed."""

    code: ClassVar[str] = "relay_error"


class SinkConfigError(FlowDecisionError):
    """The sink URL is malformed, names an unknown scheme, or loads something unusable."""

    code: ClassVar[str] = "sink_config"


class WebhookError(FlowDecisionError):
    """The webhook did not accept the decision; ``tries`` says how many POSTs were made."""

    code: ClassVar[str] = "webhook_failed"

    def __init__(self, message: str, *, status: int | None = None, tries: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.tries = tries


class WebhookRejectedError(WebhookError):
    """The receiver answered with a non-retryable status (3xx or 4xx other than 429)."""

    code: ClassVar[str] = "webhook_rejected"


class DBOSSinkError(FlowDecisionError):
    """The DBOS sink is misconfigured, or DBOS refused to start the workflow."""

    code: ClassVar[str] = "dbos_sink"


class ProcrastinateSinkError(FlowDecisionError):
    """The procrastinate sink is misconfigured or its database failed."""

    code: ClassVar[str] = "procrastinate_sink"


class ProcrastinateConflictError(ProcrastinateSinkError, SinkContentConflictError):
    """A decision id that was deferred before came back with different content."""

    code: ClassVar[str] = "procrastinate_conflict"
    held: ClassVar[str] = "procrastinate sink already deferred"


class TemporalSinkError(FlowDecisionError):
    """Temporal did not take the decision (unreachable, no worker in time, the update
    was rejected or failed), or the sink is misconfigured."""

    code: ClassVar[str] = "temporal_sink"


class TemporalRunClosedError(TemporalSinkError):
    """Run mode: a new decision for a run whose workflow has already closed.

    Temporal refuses to start the run's workflow id again (reuse policy
    reject-duplicate), so the decision is not delivered anywhere. Retrying does
    not help; the run is over.
    """

    code: ClassVar[str] = "temporal_run_closed"


class RestateSinkError(FlowDecisionError):
    """Restate's ingress answered something the sink cannot read as an acceptance."""

    code: ClassVar[str] = "restate_sink"


class DeliveryError(FlowDecisionError):
    """A delivery payload that does not hold together (a field missing or mistyped,
    or a request whose hash or ids differ from the envelope's)."""

    code: ClassVar[str] = "invalid_delivery"


# -- the service ---------------------------------------------------------------


class ConfigError(FlowDecisionError):
    """A setting is missing, malformed or inconsistent; the message names it."""

    code: ClassVar[str] = "config_invalid"


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
