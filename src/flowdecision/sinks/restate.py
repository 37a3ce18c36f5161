"""The Restate sink: each accepted decision becomes one Restate invocation, keyed by its id.

Needs ``aiohttp`` (the ``restate`` extra; the webhook sink's transport,
:class:`~flowdecision.connections.transport.HttpPool`); Restate's own SDK is needed only by
the service that handles the decisions, not here. One sink is safe to call from
many tasks at once; its pool keeps ``max_connections`` connections (64 by default).

URL forms (``flowdecision serve --sink …``)::

    restate+http://ingress:8080/Service/handler          # a service handler
    restate+http://ingress:8080/Object/{run_id}/handler  # a virtual object keyed by run_id

The second form calls the virtual object whose key is the decision's
``run_id``: Restate runs an object's exclusive handler for one key at a time,
so the decisions of one run are applied one after the other, in the order
Restate accepted them.

Each submission is ``POST <ingress>/<Service>/<handler>/send`` (or
``/<Object>/<run_id>/<handler>/send``) with

* body: the :class:`~flowdecision.sinks.delivery.DecisionDelivery` as JSON
  (decision and run ids, kind, attempt, request hash, exact wire JSON);
* ``idempotency-key: <decision_id>`` -- Restate attaches a repeated key to the
  first invocation instead of starting another;
* ``x-flow-attempt: <attempt>``.

``/send`` returns once Restate has durably accepted the invocation (it does not
wait for the handler). Restate answers ``{"status": "Accepted"}`` for a new
key and ``{"status": "PreviouslyAccepted"}`` for a key it has seen: the
latter is an absorbed duplicate, reported by :meth:`RestateSink.deliver`.
Transport failures, 5xx and 429 are retried like the webhook sink's; any other
4xx (an unknown service, a bad handler) fails at once.

Restate remembers an idempotency key for the service's idempotency retention
(24 h by default); the ledger remembers completed decisions for as long as
it keeps them (docs/SINKS.md#restate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import quote, urlsplit, urlunsplit

from ..core.defaults import HTTP_POOL_CONNECTIONS
from ..core.jsonwire import encode_json
from ..core.model import DecisionRequest
from ..errors import RestateSinkError, SinkConfigError
from .delivery import DecisionDelivery, EngineAnswer
from .webhook import WebhookSink

__all__ = [
    "RUN_ID_KEY",
    "RestateSink",
    "RestateSinkError",
    "RestateTarget",
    "open_restate_url",
    "parse_restate_url",
]

#: The placeholder that makes a Restate URL address a virtual object keyed by run id.
RUN_ID_KEY = "{run_id}"


@dataclass(frozen=True, slots=True)
class RestateTarget:
    """A parsed Restate sink URL: the ingress, the service (or object) and the handler."""

    ingress: str
    service: str
    handler: str
    keyed_by_run: bool

    def send_url(self, run_id: str) -> str:
        """The ingress URL that enqueues one invocation for ``run_id``'s decision."""
        if self.keyed_by_run:
            key = quote(run_id, safe="")
            return f"{self.ingress}/{self.service}/{key}/{self.handler}/send"
        return f"{self.ingress}/{self.service}/{self.handler}/send"


def parse_restate_url(url: str) -> RestateTarget:
    """Split ``restate+http(s)://ingress/Service/handler`` or ``…/Object/{run_id}/handler``."""
    if not url.lower().startswith("restate+"):
        raise SinkConfigError(f"`{url}` is not a restate+http(s):// sink URL")
    parts = urlsplit(url[len("restate+") :])
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise SinkConfigError(
            f"Restate sink URL `{url}` must look like restate+http://ingress:8080/Service/handler"
        )
    if parts.query or parts.fragment:
        raise SinkConfigError(f"Restate sink URL `{url}` takes no query or fragment")
    segments = [segment for segment in parts.path.split("/") if segment]
    keyed = len(segments) == 3 and segments[1] == RUN_ID_KEY
    if not (len(segments) == 2 or keyed) or RUN_ID_KEY in (segments[0], segments[-1]):
        raise SinkConfigError(
            f"Restate sink URL `{url}`: the path must be /Service/handler or "
            f"/Object/{RUN_ID_KEY}/handler"
        )
    ingress = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    return RestateTarget(ingress, segments[0], segments[-1], keyed)


class RestateSink(WebhookSink):
    """A :class:`~flowdecision.sinks.Sink` sending each decision to Restate's ingress."""

    name: ClassVar[str] = "Restate"

    def __init__(
        self,
        target: RestateTarget | str,
        *,
        timeout_s: float = 10.0,
        max_attempts: int = 4,
        token: str | None = None,
        max_connections: int = HTTP_POOL_CONNECTIONS,
    ) -> None:
        self.target = parse_restate_url(target) if isinstance(target, str) else target
        super().__init__(
            self.target.ingress,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            token=token,
            max_connections=max_connections,
        )

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Enqueue the invocation; return once Restate accepted it (or already had it)."""
        await self.deliver(request, attempt)

    async def deliver(self, request: DecisionRequest, attempt: int) -> EngineAnswer:
        """Like :meth:`submit`, and say whether Restate already had this decision."""
        delivery = DecisionDelivery.of(request, attempt)
        headers = {
            "Content-Type": "application/json",
            "idempotency-key": delivery.decision_id,
            "x-flow-attempt": str(attempt),
        }
        body = encode_json(delivery.to_dict())
        response = await self.post(
            self.target.send_url(delivery.run_id), body, headers, delivery.decision_id
        )
        try:
            answer = response.json()
            status, invocation = answer["status"], answer["invocationId"]
        except (ValueError, KeyError, TypeError) as error:
            raise RestateSinkError(
                f"Restate's answer to decision `{delivery.decision_id}` is not an "
                f"acceptance: HTTP {response.status_code} {response.text[:200]!r}"
            ) from error
        if status not in ("Accepted", "PreviouslyAccepted"):
            raise RestateSinkError(
                f"Restate answered decision `{delivery.decision_id}` with status {status!r}"
            )
        return EngineAnswer(str(invocation), absorbed=status == "PreviouslyAccepted")

    async def probe(self) -> None:
        """Raise unless the ingress answers ``GET /restate/health`` (``/healthz``)."""
        try:
            response = await self._send("GET", f"{self.target.ingress}/restate/health")
        except Exception as error:
            raise RestateSinkError(f"Restate ingress is unreachable: {error}") from error
        if response.status_code != 200:
            raise RestateSinkError(f"Restate ingress health is HTTP {response.status_code}")


async def open_restate_url(url: str, *, timeout_s: float = 10.0) -> RestateSink:
    """A sink for the Restate URL (nothing is contacted until the first decision)."""
    sink = RestateSink(parse_restate_url(url), timeout_s=timeout_s)
    return await sink.open()
