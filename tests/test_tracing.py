"""OpenTelemetry spans of a dispatch, on SQLite and PostgreSQL (in-memory exporter).

Each test asserts the exact span tree of one outcome (submitted, duplicate,
conflict, busy, lease lost, sink failure, takeover), the attributes, the span
links (a duplicate to the dispatch that completed the original; a decision's
span to its group-commit batch) and the trace context stored as
side data in the ledger and the outbox row.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowdecision import Dispatcher
from flowdecision.core.model import Complete, DecisionRequest, request_hash
from flowdecision.errors import (
    DecisionBusyError,
    DecisionConflictError,
    LeaseLostError,
    SinkError,
)
from flowdecision.ledger import DelegatingLedger, Ledger, PostgresLedger, SqliteLedger
from flowdecision.observability import tracing
from flowdecision.sinks import OutboxSink
from tests import otel_support
from tests.helpers import request
from tests.ledger_fixtures import _create_database
from tests.otel_support import (
    hex_ids,
    linked_to,
    named,
    spans_fixture,  # noqa: F401 (the `spans` fixture)
    traceparent,
    tree,
)

T = TypeVar("T")
KINDS = ["sqlite", "postgresql"]
#: A group-commit batch in a span forest: a root span of its own, no children.
COMMIT = ("flowdecision.ledger.commit", "unset", [], [])


class Store:
    """One store (SQLite file or PostgreSQL database) holding the ledger and the outbox."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        self.url = url
        self.ledgers: list[Ledger] = []
        self.outboxes: list[OutboxSink] = []

    async def ledger(self) -> Ledger:
        if self.kind == "sqlite":
            ledger: Ledger = await SqliteLedger.open(self.url.removeprefix("sqlite:///"))
        else:
            ledger = await PostgresLedger.connect(self.url)
        self.ledgers.append(ledger)
        return ledger

    async def outbox(self) -> OutboxSink:
        sink = await OutboxSink(self.url).open()
        self.outboxes.append(sink)
        return sink

    async def close(self) -> None:
        for closable in [*self.outboxes, *self.ledgers]:
            await closable.close()


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'flowdecision.db'}"
    else:
        server = request.getfixturevalue("pg_server_url")
        url = await _create_database(server, f"flowdecision_tracing_{uuid.uuid4().hex[:12]}")
        migrating = PostgresLedger(url)
        await migrating.migrate()
        await migrating.close()
        await OutboxSink(url).migrate()
    held = Store(request.param, url)
    try:
        yield held
    finally:
        await held.close()


class RecordingSink:
    """Accepts every decision and records the trace context it was submitted in."""

    def __init__(self, *, fail: bool = False, delay_s: float = 0.0) -> None:
        self.fail = fail
        self.delay_s = delay_s
        self.seen: list[str | None] = []

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        self.seen.append(tracing.current_traceparent())
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("engine refused the decision")


class NoRenewals(DelegatingLedger):
    """A real ledger whose lease renewals are refused: the lease is lost mid-sink."""

    async def intercept(self, operation: str, call: Awaitable[T]) -> T:
        if operation == "renew":
            await call  # the real renewal runs; its answer is replaced
            return False  # type: ignore[return-value]
        return await call


def _attributes(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


async def _stored_traceparent(store: Store, decision_id: str) -> str | None:
    ledger = store.ledgers[0]
    record = await ledger.read_record(decision_id)
    assert record is not None
    assert "traceparent" not in json.dumps(record.to_dict())  # side data only
    return record.traceparent


# -- submitted ---------------------------------------------------------------------------


async def test_submitted_on_the_default_layout_is_one_dispatch_span(
    store: Store, spans: InMemorySpanExporter
) -> None:
    ledger = await store.ledger()
    outbox = await store.outbox()
    dispatcher = Dispatcher("production", outbox, ledger)
    assert dispatcher.joint

    assert (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted

    finished = spans.get_finished_spans()
    # The whole forest: the dispatch span is the joint transaction's one span; the
    # group-commit batch is a root span of its own.
    assert tree(finished, commits=True) == [("flowdecision.dispatch", "unset", [], []), COMMIT]
    assert tree(finished) == [("flowdecision.dispatch", "unset", [], [])]
    [dispatch] = named(finished, "flowdecision.dispatch")
    assert _attributes(dispatch) == {
        "flowdecision.decision_id": "dec-1",
        "flowdecision.run_id": "run-1",
        "flowdecision.ledger.backend": store.kind,
        "flowdecision.sink.kind": "outbox",
        "flowdecision.outcome": "submitted",
        "flowdecision.attempt": 1,
    }
    # Side data: the ledger and the outbox row both keep the dispatch's context.
    assert await _stored_traceparent(store, "dec-1") == traceparent(dispatch)
    entry = await outbox.get("dec-1")
    assert entry is not None and entry.traceparent == traceparent(dispatch)
    assert entry.to_dict()["traceparent"] == traceparent(dispatch)
    # The group-commit batch: its own root span, linked from the decision's span.
    [commit] = named(finished, "flowdecision.ledger.commit")
    assert commit.parent is None and not commit.links
    assert linked_to(dispatch) == {hex_ids(commit)}
    assert _attributes(commit) == {"db.system.name": store.kind, "flowdecision.batch.size": 1}
    if isinstance(ledger, SqliteLedger):
        # A lone commit ran inline on the event loop, traced like a batch of one.
        assert ledger.inline_commits == 1


async def test_submitted_with_a_separate_sink_is_claim_submit_complete(
    store: Store, spans: InMemorySpanExporter
) -> None:
    ledger = await store.ledger()
    sink = RecordingSink()
    dispatcher = Dispatcher("production", sink, ledger)

    assert (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted

    finished = spans.get_finished_spans()
    assert tree(finished) == [
        (
            "flowdecision.dispatch",
            "unset",
            [],
            [
                ("flowdecision.claim", "unset", [], []),
                ("flowdecision.sink.submit", "unset", [], []),
                ("flowdecision.complete", "unset", [], []),
            ],
        )
    ]
    [dispatch] = named(finished, "flowdecision.dispatch")
    assert _attributes(dispatch)["flowdecision.sink.kind"] == "recording"
    # The sink ran inside its span: an engine receives that span's context.
    [submit] = named(finished, "flowdecision.sink.submit")
    assert sink.seen == [traceparent(submit)]
    assert _attributes(submit)["flowdecision.attempt"] == 1
    assert await _stored_traceparent(store, "dec-1") == traceparent(dispatch)
    # One batch span per group commit (claim, then complete), each linked from its step.
    first, second = sorted(
        named(finished, "flowdecision.ledger.commit"), key=lambda c: c.start_time or 0
    )
    assert tree(finished, commits=True)[1:] == [COMMIT, COMMIT]
    [claim] = named(finished, "flowdecision.claim")
    [complete] = named(finished, "flowdecision.complete")
    assert linked_to(claim) == {hex_ids(first)}
    assert linked_to(complete) == {hex_ids(second)}
    assert not first.links and not second.links


# -- duplicate and conflict: linked to the submission that counted ------------------------


async def test_a_duplicate_links_to_the_dispatch_that_completed_the_original(
    store: Store, spans: InMemorySpanExporter
) -> None:
    dispatcher = Dispatcher("production", await store.outbox(), await store.ledger())
    await dispatcher.dispatch(request(decision_id="dec-1"))
    [original] = named(spans.get_finished_spans(), "flowdecision.dispatch")
    spans.clear()

    outcome = await dispatcher.dispatch(request(decision_id="dec-1"))

    assert not outcome.submitted
    finished = spans.get_finished_spans()
    assert tree(finished, commits=True) == [
        ("flowdecision.dispatch", "unset", [], []),
        COMMIT,
    ]
    [duplicate] = named(finished, "flowdecision.dispatch")
    assert _attributes(duplicate)["flowdecision.outcome"] == "duplicate"
    # Two links: to the dispatch that completed the original, and to this claim's batch.
    [commit] = named(finished, "flowdecision.ledger.commit")
    assert linked_to(duplicate) == {hex_ids(original), hex_ids(commit)}
    [link] = [x for x in duplicate.links if x.context.span_id == original.context.span_id]
    assert dict(link.attributes or {}) == {"flowdecision.link": "completed_original"}


async def test_a_sampled_duplicate_links_to_an_original_that_was_sampled_out(
    store: Store, spans: InMemorySpanExporter
) -> None:
    # A parent-based sampler: the original ran under a caller's unsampled context, so
    # nothing of it was recorded, yet its context was stored; the duplicate, in a
    # sampled trace, still links to it.
    dispatcher = Dispatcher("production", await store.outbox(), await store.ledger())
    unsampled = tracing.context_of("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")
    token = context.attach(unsampled)
    try:
        await dispatcher.dispatch(request(decision_id="dec-1"))
    finally:
        context.detach(token)
    assert spans.get_finished_spans() == ()
    stored = await _stored_traceparent(store, "dec-1")
    assert stored is not None and stored.startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert stored.endswith("-00")

    assert not (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted

    [duplicate] = named(spans.get_finished_spans(), "flowdecision.dispatch")
    [link] = [x for x in duplicate.links if (x.attributes or {}).get("flowdecision.link")]
    assert f"00-{link.context.trace_id:032x}-{link.context.span_id:016x}-00" == stored
    assert dict(link.attributes or {}) == {"flowdecision.link": "completed_original"}


async def test_a_conflict_is_an_error_event_and_links_to_the_original(
    store: Store, spans: InMemorySpanExporter
) -> None:
    dispatcher = Dispatcher("production", await store.outbox(), await store.ledger())
    await dispatcher.dispatch(request(decision_id="dec-1"))
    [original] = named(spans.get_finished_spans(), "flowdecision.dispatch")
    spans.clear()

    other = request(decision_id="dec-1", decision=Complete(output={"different": True}))
    with pytest.raises(DecisionConflictError):
        await dispatcher.dispatch(other)

    finished = spans.get_finished_spans()
    assert tree(finished, commits=True) == [
        ("flowdecision.dispatch", "error:conflict", ["flowdecision.conflict"], []),
        COMMIT,
    ]
    [conflict] = named(finished, "flowdecision.dispatch")
    assert _attributes(conflict)["flowdecision.outcome"] == "conflict"
    assert _attributes(conflict)["error.type"] == "conflict"
    [commit] = named(finished, "flowdecision.ledger.commit")
    assert linked_to(conflict) == {hex_ids(original), hex_ids(commit)}


# -- busy, takeover ---------------------------------------------------------------------


async def test_busy_is_an_error_with_an_event(store: Store, spans: InMemorySpanExporter) -> None:
    ledger = await store.ledger()
    decision = request(decision_id="dec-1")
    await ledger.claim("dec-1", request_hash(decision), "other-owner", lease_ms=60_000)
    dispatcher = Dispatcher("production", await store.outbox(), ledger)

    with pytest.raises(DecisionBusyError):
        await dispatcher.dispatch(decision)

    finished = spans.get_finished_spans()
    assert tree(finished, commits=True) == [
        ("flowdecision.dispatch", "error:busy", ["flowdecision.busy"], []),
        COMMIT,
    ]
    [dispatch] = named(finished, "flowdecision.dispatch")
    [event] = [e for e in dispatch.events if e.name == "flowdecision.busy"]
    assert dict(event.attributes or {})["flowdecision.decision_id"] == "dec-1"
    assert dict(event.attributes or {})["flowdecision.lease_expires_at_ms"] > 0


async def test_a_takeover_is_an_event_with_the_new_attempt(
    store: Store, spans: InMemorySpanExporter
) -> None:
    ledger = await store.ledger()
    decision = request(decision_id="dec-1")
    await ledger.claim("dec-1", request_hash(decision), "crashed-owner", lease_ms=50)
    await asyncio.sleep(0.2)  # the crashed owner's lease expires
    dispatcher = Dispatcher("production", await store.outbox(), ledger)

    outcome = await dispatcher.dispatch(decision)

    assert outcome.submitted and outcome.attempt == 2
    finished = spans.get_finished_spans()
    assert tree(finished, commits=True) == [
        ("flowdecision.dispatch", "unset", ["flowdecision.takeover"], []),
        COMMIT,
    ]
    [dispatch] = named(finished, "flowdecision.dispatch")
    assert _attributes(dispatch)["flowdecision.attempt"] == 2
    assert dict(dispatch.events[0].attributes or {}) == {"flowdecision.attempt": 2}


# -- failures on the lease path (a separate sink) -----------------------------------------


async def test_a_lost_lease_fails_the_sink_span_and_the_dispatch(
    store: Store, spans: InMemorySpanExporter
) -> None:
    ledger = NoRenewals(await store.ledger())
    sink = RecordingSink(delay_s=1.0)
    dispatcher = Dispatcher("production", sink, ledger, lease_ms=300)

    with pytest.raises(LeaseLostError):
        await dispatcher.dispatch(request(decision_id="dec-1"))

    finished = spans.get_finished_spans()
    assert tree(finished) == [
        (
            "flowdecision.dispatch",
            "error:lease_lost",
            ["flowdecision.lease_lost"],
            [
                ("flowdecision.claim", "unset", [], []),
                ("flowdecision.sink.submit", "error:lease_lost", [], []),
            ],
        )
    ]


async def test_heartbeat_renewals_are_events_on_the_sink_span(
    store: Store, spans: InMemorySpanExporter
) -> None:
    # The lease is long enough that a renewal on a busy CI machine is never late
    # (a late one loses the lease), and the sink outlasts two renewal periods (400 ms).
    sink = RecordingSink(delay_s=1.0)
    dispatcher = Dispatcher("production", sink, await store.ledger(), lease_ms=1200)

    assert (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted

    [submit] = named(spans.get_finished_spans(), "flowdecision.sink.submit")
    renewals = [e.name for e in submit.events]
    assert renewals and set(renewals) == {"flowdecision.lease_renewed"}
    assert len(renewals) == dispatcher.metrics.lease_renewals


async def test_a_sink_failure_sets_the_error_code(
    store: Store, spans: InMemorySpanExporter
) -> None:
    dispatcher = Dispatcher("production", RecordingSink(fail=True), await store.ledger())

    with pytest.raises(SinkError):
        await dispatcher.dispatch(request(decision_id="dec-1"))

    finished = spans.get_finished_spans()
    assert tree(finished) == [
        (
            "flowdecision.dispatch",
            "error:sink_failed",
            [],
            [
                ("flowdecision.claim", "unset", [], []),
                ("flowdecision.sink.submit", "error:sink_failed", [], []),
            ],
        )
    ]
    [submit] = named(finished, "flowdecision.sink.submit")
    [exception] = [e for e in submit.events if e.name == "exception"]
    assert "engine refused the decision" in str(dict(exception.attributes or {}))


# -- off ----------------------------------------------------------------------------------


async def test_with_no_recording_provider_nothing_is_recorded_or_stored(store: Store) -> None:
    # The tests' switch with no SDK provider in place: flowdecision takes its traced
    # path, every span is the API's invalid one, and nothing reaches the store.
    otel_support.switch().target = None
    assert tracing.active()
    outbox = await store.outbox()
    dispatcher = Dispatcher("production", outbox, await store.ledger())
    assert (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted
    assert await _stored_traceparent(store, "dec-1") is None
    entry = await outbox.get("dec-1")
    assert entry is not None and entry.traceparent is None


def test_a_span_closed_in_another_context_is_logged_not_raised(
    spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing a span scope where its token is not valid (another context) logs, as the
    API's detach does, and still ends the span."""
    import contextvars

    assert tracing.active()
    scope = tracing.SpanScope("opened here")
    opened = contextvars.copy_context()  # (the test's own context is left as it was)
    opened.run(scope.open)
    assert opened.run(trace.get_current_span) is scope.span  # the API sees it
    contextvars.copy_context().run(scope.close)  # another context: its token is foreign
    assert "Failed to detach context" in caplog.text
    assert [span.name for span in spans.get_finished_spans()] == ["opened here"]


def test_traceparent_of_needs_no_active_provider() -> None:
    """``traceparent_of`` is public: it formats any span's context, also in a process
    where no tracer provider was ever registered (nothing bound yet)."""
    import subprocess
    import sys

    code = (
        "from opentelemetry import trace\n"
        "from flowdecision.observability import tracing\n"
        "span = trace.NonRecordingSpan(trace.SpanContext(1, 2, False, trace.TraceFlags(1)))\n"
        "print(tracing.traceparent_of(span), tracing.traceparent_of(trace.INVALID_SPAN))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == [
        "00-00000000000000000000000000000001-0000000000000002-01",
        "None",
    ]
