"""Exception hierarchy shared by the ledger, the dispatcher and the sinks.

Messages follow the Rust seeds wherever the seeds define them, so operators see
the same text from a Python host and a Rust host sharing one ledger.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

__all__ = [
    "DecisionBusyError",
    "DecisionConflictError",
    "DispatchError",
    "DispatchLedgerCorruptError",
    "DispatchLedgerError",
    "DispatchLedgerSchemaError",
    "FlowDecisionError",
    "HarnessError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidIdentifierError",
    "InvalidIdentityError",
    "LeaseLostError",
    "LedgerCorruptError",
    "LedgerError",
    "LedgerSchemaError",
    "LedgerUnavailableError",
    "SinkError",
    "StoreMissingError",
    "UnauthorizedBranchError",
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
        if isinstance(error, LedgerCorruptError):
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


class SinkError(DispatchError):
    """The sink raised; its exception is chained as ``__cause__``."""

    code: ClassVar[str] = "sink_failed"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Flow decision sink failed: {detail}")
        self.detail = detail


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
