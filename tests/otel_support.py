"""An in-memory OpenTelemetry SDK for tests, registered for one test and removed after.

The SDK's global tracer provider can be set once per process; tests put it in
place and take it away through the API's module globals, so tracing is on only
inside the tests that ask for it (every other test runs with tracing off).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowdecision.tracer import LeanTracerProvider


@pytest.fixture(name="spans", params=["sdk", "lean"])
def spans_fixture(request: pytest.FixtureRequest) -> Iterator[InMemorySpanExporter]:
    """Tracing on, every finished span kept in memory (``spans.get_finished_spans()``).

    Once with the SDK's tracer provider (what a user's own process registers),
    once with flowdecision's lean one (what ``serve --otel`` registers): the
    same span trees, events, links and statuses either way.
    """
    exporter = InMemorySpanExporter()
    provider: Any = TracerProvider() if request.param == "sdk" else LeanTracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    saved = trace._TRACER_PROVIDER
    trace._TRACER_PROVIDER = provider
    try:
        yield exporter
    finally:
        trace._TRACER_PROVIDER = saved
        provider.shutdown()


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def traceparent(span: ReadableSpan) -> str:
    trace_id, span_id = hex_ids(span)
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{trace_id}-{span_id}-{int(ctx.trace_flags):02x}"


def status(span: ReadableSpan) -> str:
    """``ok``/``unset`` or ``error:<description>``."""
    code = span.status.status_code.name.lower()
    return f"error:{span.status.description}" if code == "error" else code


def tree(finished: Sequence[ReadableSpan], *, commits: bool = False) -> list[Any]:
    """The span forest as nested ``(name, status, [events], [children])`` tuples.

    Children are in start order. Group-commit batch spans (roots named
    ``*.commit``) are left out unless ``commits``: they belong to no request.
    """
    by_parent: dict[int | None, list[ReadableSpan]] = {}
    ids = {s.get_span_context().span_id for s in finished}  # type: ignore[union-attr]
    for s in finished:
        parent = s.parent.span_id if s.parent is not None and s.parent.span_id in ids else None
        by_parent.setdefault(parent, []).append(s)

    def node(s: ReadableSpan) -> tuple[Any, ...]:
        children = sorted(
            by_parent.get(s.get_span_context().span_id, []),  # type: ignore[union-attr]
            key=lambda c: c.start_time or 0,
        )
        events = [e.name for e in s.events if e.name != "exception"]
        return (s.name, status(s), events, [node(c) for c in children])

    roots = sorted(by_parent.get(None, []), key=lambda s: s.start_time or 0)
    return [node(r) for r in roots if commits or not r.name.endswith(".commit")]


def named(finished: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def linked_to(span: ReadableSpan) -> set[tuple[str, str]]:
    """``(trace_id, span_id)`` of every span ``span`` links to."""
    return {
        (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in span.links
    }
