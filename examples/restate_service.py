"""A Restate service that receives flowdecision's decisions (Python ``restate-sdk``).

Serve it with hypercorn and register it with the Restate server::

    hypercorn --bind 127.0.0.1:9080 examples.restate_service:app
    curl -X POST localhost:9070/deployments -H 'content-type: application/json' \\
         -d '{"uri": "http://127.0.0.1:9080"}'

Then point flowdecision at one of its two handlers:

* ``restate+http://127.0.0.1:8080/DecisionRun/{run_id}/apply`` -- the virtual
  object ``DecisionRun``, keyed by the run id: Restate runs one ``apply`` per
  run at a time, so a run's decisions are applied in order. The object keeps
  the ids it applied in its own durable state, so it also refuses a
  resubmission that arrives after Restate's idempotency retention (24 h by
  default) has forgotten the key.
* ``restate+http://127.0.0.1:8080/Decisions/handle`` -- a plain service:
  decisions of different runs run in parallel; the idempotency key alone
  deduplicates, for the retention window.

Both receive the :class:`~flowdecision.sinks.delivery.DecisionDelivery` JSON
(``decision_id``, ``run_id``, ``kind``, ``attempt``, ``request_hash``,
``request_json``). Here they only record what they got; a real service would
schedule the step (``ctx.service_send(...)``) or finish the run.

``FLOWDECISION_RESTATE_EFFECTS`` (optional) names a file to which ``handle``
appends one line per decision, from a journaled ``ctx.run`` (so a retried
invocation does not write it twice): the tests count those lines.
"""

from __future__ import annotations

import os
from typing import Any

import restate
from restate import Context, ObjectContext, ObjectSharedContext

from flowdecision.sinks.delivery import DecisionDelivery

decision_run = restate.VirtualObject("DecisionRun")
decisions = restate.Service("Decisions")


@decision_run.handler()
async def apply(ctx: ObjectContext, body: dict[str, Any]) -> dict[str, Any]:
    """Apply one decision of this run (the object key is the run id)."""
    delivery = DecisionDelivery.from_dict(body)
    request = delivery.request()  # the exact request: same ids, same hash
    applied: dict[str, Any] = await ctx.get("applied") or {}
    first = applied.get(delivery.decision_id)
    if first is not None:
        return {"decision_id": delivery.decision_id, "applied": False, "attempt": first["attempt"]}
    applied[delivery.decision_id] = {
        "attempt": delivery.attempt,
        "kind": delivery.kind,
        "order": len(applied),
        "run_id": request.run_id,
    }
    ctx.set("applied", applied)
    return {"decision_id": delivery.decision_id, "applied": True, "attempt": delivery.attempt}


@decision_run.handler(kind="shared")
async def applied(ctx: ObjectSharedContext) -> dict[str, Any]:
    """The decisions this run applied: decision id -> attempt, kind, order."""
    return await ctx.get("applied") or {}


def _record(line: str) -> None:
    path = os.environ.get("FLOWDECISION_RESTATE_EFFECTS")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


@decisions.handler()
async def handle(ctx: Context, body: dict[str, Any]) -> dict[str, Any]:
    """Handle one decision (no ordering between runs)."""
    delivery = DecisionDelivery.from_dict(body)
    delivery.request()
    line = f"{delivery.decision_id} {delivery.attempt} {delivery.kind}"
    # With tracing on, the sink sends the decision's W3C trace context (traceparent):
    # a traced handler continues that trace; this one records it.
    traceparent = ctx.request().headers.get("traceparent")
    if traceparent:
        line += f" traceparent={traceparent}"
    await ctx.run_typed("record", _record, restate.RunOptions(), line)
    return {"decision_id": delivery.decision_id, "attempt": delivery.attempt}


app = restate.app(services=[decision_run, decisions])
