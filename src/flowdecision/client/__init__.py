"""A typed HTTP client for the decision service (``pip install flowdecision[client]``).

:class:`DecisionClient` (async) and :class:`SyncDecisionClient` speak the
contract of ``docs/SERVICE.md``: they read only the status and ``error.code`` of
an answer and ignore members they do not know, so a newer service keeps working.

Results are frozen dataclasses: :class:`SubmitResult` (``submitted``,
``duplicate`` or ``held``, the attempt, the parsed :class:`~flowdecision.ResultReceipt`),
:class:`DecisionState`, :class:`ServiceHealth`, :class:`OutboxPage`,
:class:`ApprovalResult`. Approval holds: ``approve``, ``reject`` (admin token)
and ``wait(decision_id, timeout)``, a long-poll until a held decision is approved,
rejected or expired.

Errors mirror the library's :class:`~flowdecision.DispatchError` family: each
error answer becomes a subclass of the exception the library would raise for
the same thing *and* of :class:`ServiceError`, so ``except
DecisionConflictError`` works for a local :class:`~flowdecision.Dispatcher` and
for the service alike:

===========================  =====================================  ===============================
``error.code`` (status)      raised                                 also an instance of
===========================  =====================================  ===============================
``forbidden_branch`` (403)   :class:`ServiceBranchError`            ``UnauthorizedBranchError``
``conflict`` (409)           :class:`ServiceConflictError`          ``DecisionConflictError``
``busy`` (409)               :class:`ServiceBusyError`              ``DecisionBusyError``
``run_closed`` (409)         :class:`ServiceRunClosedError`         ``RunClosedError``
``decision_rejected`` (409)  :class:`ServiceDecisionRejectedError`  ``DecisionRejectedError``
``sink_failed`` (502)        :class:`ServiceSinkError`              ``SinkError``
``lease_lost`` (503)         :class:`ServiceLeaseLostError`         ``LeaseLostError``
``ledger_*`` (503)           :class:`ServiceLedgerError`            ``DispatchLedgerError``
``invalid_*`` (422)          :class:`ServiceInvalidRequestError`    --
``*_too_large`` (413)        :class:`ServiceTooLargeError`          --
``unauthorized`` (401)       :class:`ServiceAuthError`              --
``shutting_down``, other 503 :class:`ServiceUnavailableError`       --
anything else                :class:`ServiceError`                  --
===========================  =====================================  ===============================

All of them derive from :class:`ServiceError`, which carries ``status``,
``error_code`` (the wire code, verbatim, also for codes this client does not
know), ``request_id``, ``details`` (the other members of ``error``) and
``retry_after_s``. A request that never got an HTTP answer raises
:class:`ServiceConnectionError`; an answer that is not the documented shape
raises :class:`UnexpectedResponseError`. Everything derives from
:class:`~flowdecision.FlowDecisionError`.

Retries (:class:`RetryOptions`) use exponential backoff with full jitter and
honour ``Retry-After`` (never sooner; a ``Retry-After`` above
``max_retry_after_s`` or past the deadline ends the retries at once). Retried:

* ``409 busy``, any ``503`` except the permanent ``ledger_corrupt`` and
  ``ledger_schema``, and ``429`` (from a proxy) -- the service did nothing;
* transport failures *before* the request was sent (connection refused or
  timed out, no pooled connection free): the service never saw it;
* transport failures *after* it may have been sent (read timeout, connection
  dropped mid-answer): for reads always; for ``submit`` only with
  ``resend_after_ambiguous=True``. By default ``submit`` raises
  :class:`ServiceConnectionError` with ``request_sent=True`` instead, so the
  caller decides. Opting in is safe: a resent decision has the same id and
  content, so the ledger turns it into ``duplicate`` (the first send got
  through), ``busy`` (it is still running on another replica, and is retried)
  or a fresh claim (it never arrived); the sink can never run twice for it. The
  one visible difference: after such a resend, ``duplicate`` may mean *this*
  call's first send submitted it. Treat ``submitted`` and ``duplicate`` alike:
  the decision is in.

Not retried: ``sink_failed`` (502; the sink applies its own retry policy, and
its claim was released, so a later resubmission is safe and becomes attempt
n+1), 4xx answers (a resend would get the same answer) and ``ledger_corrupt``
/ ``ledger_schema`` (an operator must act).

The package is split the way httpx and the OpenAI client split theirs; every
name is importable from ``flowdecision.client`` as before:

==================  ================================================================
``results.py``      what calls return (:class:`SubmitResult`, :class:`DecisionState`, ...)
``errors.py``       :class:`ServiceError` and its family, :func:`error_from_response`
``decode.py``       answers into results (shape checks)
``retry.py``        :class:`RetryOptions`, :class:`RetryEvent`
``protocol.py``     the sans-I/O core: requests, answers, the retry loop
``base.py``         what both clients share (the step loop); :func:`read_token_file`
``async_client.py`` :class:`DecisionClient`: each call, written once
``sync_client.py``  :class:`SyncDecisionClient`: the same calls, run blocking
==================  ================================================================
"""

from .async_client import DecisionClient
from .base import DEFAULT_URL, read_token_file
from .errors import (
    PERMANENT_CODES,
    ErrorAnswer,
    ServiceAuthError,
    ServiceBranchError,
    ServiceBusyError,
    ServiceConflictError,
    ServiceConnectionError,
    ServiceDecisionRejectedError,
    ServiceError,
    ServiceInvalidRequestError,
    ServiceLeaseLostError,
    ServiceLedgerError,
    ServiceRunClosedError,
    ServiceSinkError,
    ServiceTooLargeError,
    ServiceUnavailableError,
    UnexpectedResponseError,
    error_from_response,
)
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
from .retry import RetryEvent, RetryOptions
from .sync_client import SyncDecisionClient

__all__ = [
    "DEFAULT_URL",
    "PERMANENT_CODES",
    "ApprovalResult",
    "BulkActionResult",
    "DecisionClient",
    "DecisionState",
    "ErrorAnswer",
    "OutboxItem",
    "OutboxPage",
    "Outcome",
    "RetryEvent",
    "RetryOptions",
    "ServiceAuthError",
    "ServiceBranchError",
    "ServiceBusyError",
    "ServiceConflictError",
    "ServiceConnectionError",
    "ServiceDecisionRejectedError",
    "ServiceError",
    "ServiceHealth",
    "ServiceInvalidRequestError",
    "ServiceLeaseLostError",
    "ServiceLedgerError",
    "ServiceRunClosedError",
    "ServiceSinkError",
    "ServiceTooLargeError",
    "ServiceUnavailableError",
    "SubmitResult",
    "SyncDecisionClient",
    "UnexpectedResponseError",
    "error_from_response",
    "read_token_file",
]
