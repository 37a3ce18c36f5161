"""Exception hierarchy shared by the ledger, the dispatcher and the sinks.

Messages follow the Rust seeds wherever the seeds define them, so operators see
the same text from a Python host and a Rust host sharing one ledger.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "DecisionBusyError",
    "DecisionConflictError",
    "DispatchError",
    "DispatchLedgerError",
    "FlowDecisionError",
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
]


class FlowDecisionError(Exception):
    """Base class of every error raised by flowdecision."""

    #: Stable machine-readable code: metric label, HTTP error code, log field.
    code: ClassVar[str] = "error"


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
    """`decision_id` or `causation_event_id` is empty after trimming."""

    code: ClassVar[str] = "invalid_request"

    def __init__(self) -> None:
        super().__init__("decision_id and causation_event_id must be non-empty")


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
    """The ledger failed; the original :class:`LedgerError` is chained as ``__cause__``."""

    code: ClassVar[str] = "ledger_unavailable"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Flow decision ledger failed: {detail}")
        self.detail = detail


class SinkError(DispatchError):
    """The sink raised; its exception is chained as ``__cause__``."""

    code: ClassVar[str] = "sink_failed"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Flow decision sink failed: {detail}")
        self.detail = detail
