"""Approval holds: which decisions wait for an operator before they reach the sink.

An :class:`ApprovalPolicy` names the decisions to hold -- by decision kind
(``schedule_step``, ``schedule_steps``, ``complete``, ``fail``), by step name
(an :mod:`fnmatch` glob matched against every step the decision schedules), by
run id, or, in the library, by a Python predicate -- and what becomes of a
hold: how long it lasts (``expire_ms``; an expired hold is rejected, audited)
and whether rejecting it closes its run (``reject_closes_run``).

The :class:`~flowdecision.core.dispatcher.Dispatcher` asks the policy about
every new decision; a held one is recorded ``held`` in the ledger with its
request (:class:`~flowdecision.ledger.machine.HoldTerms`), and nothing reaches
the sink until an operator approves it (docs/PROTOCOL.md, "Approval holds").
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..core.limits import U64_MAX
from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..ledger.machine import HoldTerms
from .bodies import ApprovalPolicyBody
from .model import Complete, DecisionRequest, Fail, ScheduleStep, ScheduleSteps

__all__ = ["DECISION_KINDS", "ApprovalPolicy", "decision_kind", "step_names"]

#: The decision kinds a policy can name (the wire's ``decision.type``).
DECISION_KINDS = ("schedule_step", "schedule_steps", "complete", "fail")

_KIND_OF = {
    ScheduleStep: "schedule_step",
    ScheduleSteps: "schedule_steps",
    Complete: "complete",
    Fail: "fail",
}


def decision_kind(request: DecisionRequest) -> str:
    """The decision's kind: its wire ``type``."""
    return _KIND_OF[type(request.decision)]


def step_names(request: DecisionRequest) -> tuple[str, ...]:
    """The names of the steps the decision schedules (none for ``complete``/``fail``)."""
    decision = request.decision
    if isinstance(decision, ScheduleStep):
        return (decision.step.step_name,)
    if isinstance(decision, ScheduleSteps):
        return tuple(step.step_name for step in decision.steps)
    return ()


def _texts(name: str, values: Iterable[str] | str) -> tuple[str, ...]:
    if isinstance(values, str):
        values = (values,)
    out = tuple(values)
    for value in out:
        if not isinstance(value, str):
            raise InvalidArgumentTypeError(
                f"approval policy `{name}` must hold strings, got {value!r}"
            )
        if not value.strip():
            raise InvalidArgumentError(f"approval policy `{name}` holds an empty value")
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True, slots=True)
class ApprovalPolicy:
    """Which decisions are held for approval, and what becomes of a hold.

    A decision is held when ANY rule matches it: its kind is in ``kinds``, one
    of its steps' names matches a glob of ``steps``, its run is in ``runs``, or
    ``predicate(request)`` is true (library only; it runs for every new
    decision, so keep it cheap, and it must not raise). A policy with no rule
    holds nothing.

    ``expire_ms``: a hold not acted on within this many milliseconds becomes
    rejected (audited as ``expire``); None, the hold lasts until an operator
    acts. ``reject_closes_run``: rejecting a hold closes its run (with the run
    invariants on: no new decision of the run is taken afterwards).
    """

    # Any sequence of strings (one string: itself alone); kept as a tuple.
    kinds: Sequence[str] = ()
    steps: Sequence[str] = ()
    runs: Sequence[str] = ()
    predicate: Callable[[DecisionRequest], bool] | None = field(default=None, compare=False)
    expire_ms: int | None = None
    reject_closes_run: bool = False

    def __post_init__(self) -> None:
        kinds = _texts("kinds", self.kinds)
        unknown = [kind for kind in kinds if kind not in DECISION_KINDS]
        if unknown:
            raise InvalidArgumentError(
                f"approval policy `kinds`: unknown decision kind `{unknown[0]}` "
                f"(known: {', '.join(DECISION_KINDS)})"
            )
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "steps", _texts("steps", self.steps))
        object.__setattr__(self, "runs", _texts("runs", self.runs))
        if self.predicate is not None and not callable(self.predicate):
            raise InvalidArgumentTypeError(
                f"approval policy `predicate` must be callable, got {type(self.predicate).__name__}"
            )
        expire = self.expire_ms
        if expire is not None and (
            isinstance(expire, bool) or not isinstance(expire, int) or not 1 <= expire <= U64_MAX
        ):
            raise InvalidArgumentError(
                f"approval policy `expire_ms` must be a positive integer (milliseconds) or "
                f"None, got {expire!r}"
            )
        object.__setattr__(self, "reject_closes_run", bool(self.reject_closes_run))

    @property
    def enabled(self) -> bool:
        """Whether any rule can hold a decision."""
        return bool(self.kinds or self.steps or self.runs or self.predicate is not None)

    def needs_approval(self, request: DecisionRequest) -> bool:
        """Whether ``request`` must wait for an operator's approval."""
        if self.kinds and decision_kind(request) in self.kinds:
            return True
        if self.runs and request.run_id in self.runs:
            return True
        if self.steps and any(
            fnmatch.fnmatchcase(name, glob) for name in step_names(request) for glob in self.steps
        ):
            return True
        return self.predicate is not None and bool(self.predicate(request))

    def hold_of(self, request: DecisionRequest) -> HoldTerms | None:
        """What the ledger keeps of ``request`` if it is held (None: not held)."""
        if not self.needs_approval(request):
            return None
        return HoldTerms(request.to_json().decode("utf-8"), self.expire_ms, self.reject_closes_run)

    def to_dict(self) -> ApprovalPolicyBody:
        """The JSON shape (``flowdecision serve``'s settings, the status page)."""
        predicate = self.predicate
        return {
            "kinds": list(self.kinds),
            "steps": list(self.steps),
            "runs": list(self.runs),
            "predicate": None
            if predicate is None
            else getattr(predicate, "__qualname__", type(predicate).__name__),
            "expire_ms": self.expire_ms,
            "reject_closes_run": self.reject_closes_run,
        }
