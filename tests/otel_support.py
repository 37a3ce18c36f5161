"""An in-memory OpenTelemetry SDK for tests, on for one test and off after.

A process registers its global tracer provider once (the API's
``set_tracer_provider``), so the tests register one for the whole process, a
:class:`Switch`, that hands each tracer call to the SDK provider a test put in
place, or to the API's no-op tracer between such tests. Only public names of
OpenTelemetry are used. Once the switch is registered,
:func:`flowdecision.observability.tracing.active`
is True for the rest of the process; with no provider in place every span is
the API's invalid, non-recording one, so nothing is recorded, stored or sent,
as with tracing off (tests/test_tracing.py checks that;
tests/test_tracing_absent.py checks a process with no provider at all).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class Switch(trace.TracerProvider):
    """The process's tracer provider in tests: ``target``'s tracers, or no-op ones."""

    def __init__(self) -> None:
        self.target: TracerProvider | None = None

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _SwitchedTracer(self, args, kwargs)


class _SwitchedTracer(trace.Tracer):
    """A tracer that asks its :class:`Switch` for the real one at each span."""

    def __init__(self, switch: Switch, args: Any, kwargs: Any) -> None:
        self._switch, self._args, self._kwargs = switch, args, kwargs

    def _now(self) -> trace.Tracer:
        target = self._switch.target
        if target is None:
            return trace.NoOpTracer()
        return target.get_tracer(*self._args, **self._kwargs)

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._now().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._now().start_as_current_span(*args, **kwargs)


def switch() -> Switch:
    """The process's :class:`Switch`, registered the first time it is asked for."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, Switch):
        trace.set_tracer_provider(Switch())
        provider = trace.get_tracer_provider()
        assert isinstance(provider, Switch), f"a provider was registered already: {provider!r}"
    return provider


@pytest.fixture(name="spans")
def spans_fixture() -> Iterator[InMemorySpanExporter]:
    """Tracing on (the SDK's tracer provider), every finished span kept in memory
    (``spans.get_finished_spans()``)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    switched = switch()
    switched.target = provider
    try:
        yield exporter
    finally:
        switched.target = None
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
