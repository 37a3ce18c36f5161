"""What an engine sink hands the engine: one :class:`DecisionDelivery` per submission.

The Temporal and Restate sinks send the same shape (``to_dict()``), so a
workflow or a service can tell a resubmission without asking flowdecision:

* ``decision_id``, ``run_id`` -- the keys the engine deduplicates and orders on;
* ``kind`` -- ``schedule_step``, ``schedule_steps``, ``complete`` or ``fail``;
* ``attempt`` -- the claim's attempt (a fencing token: a takeover after a crash
  submits again with a higher one);
* ``request_hash`` -- lowercase hex SHA-256 of the request's wire JSON (the
  ledger's conflict key: the same decision id with another hash is a conflict);
* ``request_json`` -- the request's exact wire JSON, as a string: key order and
  numbers survive the engine's own JSON converter, and
  :meth:`DecisionDelivery.request` rebuilds the very same request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.model import Decision, DecisionRequest, request_hash
from ..errors import DeliveryError
from .base import check_attempt

__all__ = ["DecisionDelivery", "DeliveryError", "EngineAnswer"]


_FIELDS = ("decision_id", "run_id", "kind", "attempt", "request_hash", "request_json")


#: The wire ``type`` of each decision class, learnt from its first ``to_dict()``: a
#: class has one ``type``, and building the whole dict on every delivery just to read it
#: cost more than the rest of the envelope.
_KINDS: dict[type, str] = {}


def _kind(decision: Decision) -> str:
    kind = _KINDS.get(type(decision))
    if kind is None:
        kind = _KINDS[type(decision)] = decision.to_dict()["type"]
    return kind


@dataclass(frozen=True, slots=True)
class DecisionDelivery:
    """One submission of one decision to an engine (see the module docstring)."""

    decision_id: str
    run_id: str
    kind: str
    attempt: int
    request_hash: str
    request_json: str

    @classmethod
    def of(cls, request: DecisionRequest, attempt: int) -> DecisionDelivery:
        """The delivery of ``request`` under claim attempt ``attempt``."""
        return cls(
            decision_id=request.decision_id,
            run_id=request.run_id,
            kind=_kind(request.decision),
            attempt=check_attempt(attempt),
            request_hash=request_hash(request),
            request_json=request.to_json().decode("utf-8"),
        )

    def request(self) -> DecisionRequest:
        """The request, parsed from ``request_json``; :class:`DeliveryError` if it
        does not match the envelope's ids or hash."""
        request = DecisionRequest.parse(self.request_json)
        if (request.decision_id, request.run_id) != (self.decision_id, self.run_id):
            raise DeliveryError(
                f"delivery of `{self.decision_id}` (run `{self.run_id}`) carries the request "
                f"of `{request.decision_id}` (run `{request.run_id}`)"
            )
        if request_hash(request) != self.request_hash:
            raise DeliveryError(f"delivery of `{self.decision_id}`: request_hash does not match")
        return request

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape engines receive (field order as declared)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> DecisionDelivery:
        """Read :meth:`to_dict`'s shape back; :class:`DeliveryError` names a bad field."""
        values: dict[str, Any] = {}
        for name in _FIELDS:
            value = obj.get(name)
            wanted: type = int if name == "attempt" else str
            if isinstance(value, bool) or not isinstance(value, wanted):
                raise DeliveryError(
                    f"delivery field `{name}` must be a {wanted.__name__}, got {value!r}"
                )
            values[name] = value
        return cls(**values)


@dataclass(frozen=True, slots=True)
class EngineAnswer:
    """What an engine said to one submission.

    ``target`` names what the decision reached (a workflow id, a Restate
    invocation id); ``absorbed`` is True when the engine said it already had
    this decision (nothing new happened), False when it took it as new, and
    None when the engine does not say (Temporal's run mode waiting only for
    acceptance).
    """

    target: str
    absorbed: bool | None

    def to_dict(self) -> dict[str, Any]:
        """``{"target": …, "absorbed": …}``."""
        return {"target": self.target, "absorbed": self.absorbed}
