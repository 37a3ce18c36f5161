"""The spans flowdecision records, through the public OpenTelemetry API only.

Everything here costs nothing while tracing is off:

* flowdecision never imports an ``opentelemetry`` module unless one is
  already loaded: a provider can only have been registered by importing
  ``opentelemetry.trace``, so :func:`active` first looks in ``sys.modules``.
  Without the extra installed, or with it installed but unused, no
  OpenTelemetry module is loaded at all;
* with the API but no SDK (or an SDK nobody registered), :func:`active` is
  False: callers check it once per request or dispatch and take their plain
  path, so no span object, context or header is made.

A span is recorded only when an application (``serve --otel``, or the user's
own process) registered a real tracer provider. Names and attributes follow
the semantic-convention style (``flowdecision.decision_id``, ...); the span
tree is drawn in ``docs/OBSERVABILITY.md``.

Trace context crosses process boundaries as a W3C ``traceparent`` header
value (``00-<trace id>-<span id>-<flags>``): stored in the ledger's side data
and in the outbox row, sent to every sink in the engine's own way, and read
back by :func:`link_to` (a duplicate's link to the submission that counted)
and :func:`context_of` (a relay continuing the trace).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Link, Span
    from opentelemetry.util.types import AttributeValue

#: The attribute namespace (``flowdecision.decision_id``, ``flowdecision.outcome``, ...).
PREFIX = "flowdecision."
_VERSION = "0.1.0"

#: The request headers :func:`extract` reads a parent context from.
CONTEXT_HEADERS: frozenset[bytes] = frozenset({b"traceparent", b"tracestate", b"baggage"})

#: Span kinds for :class:`SpanScope`'s ``kind`` (the API's ``SpanKind`` member of that
#: name; plain names, so that naming one imports nothing).
SERVER = "SERVER"
CLIENT = "CLIENT"
PRODUCER = "PRODUCER"
CONSUMER = "CONSUMER"

# The API's modules and what is read from them, bound when tracing first turns out
# to be active (:func:`_bind`): until then nothing of OpenTelemetry is imported.
_trace: Any = None
_context: Any = None
_propagate: Any = None
_kinds: dict[str | None, Any] = {}
_NOOP: tuple[type, ...] = ()
#: (the provider seen last, whether it records); (its tracer of flowdecision's scope)
_seen: tuple[object, bool] = (None, False)
_tracer_cache: tuple[object, Any] | None = None


def active() -> bool:
    """True when spans are recorded: a real tracer provider is registered.

    Cheap: a ``sys.modules`` look-up, then the API's ``get_tracer_provider()``
    compared with the provider seen last time. Nobody can have registered a
    provider without importing ``opentelemetry.trace``, so until someone did,
    flowdecision imports no OpenTelemetry module at all. Called once per
    request and per dispatch (and by the steps that may run outside either).
    """
    module = sys.modules.get("opentelemetry.trace")
    if module is None:
        return False
    provider = module.get_tracer_provider()
    seen = _seen
    if seen[0] is provider:
        return seen[1]
    return _see(module, provider)


def _see(module: Any, provider: object) -> bool:
    global _seen
    if _trace is None:
        _bind(module)
    recording = not isinstance(provider, _NOOP)
    _seen = (provider, recording)
    return recording


def _bind(module: Any) -> None:
    """Bind the API's modules once (the first time a provider could be there)."""
    global _trace, _context, _propagate, _NOOP
    from opentelemetry import context, propagate

    _context, _propagate = context, propagate
    _NOOP = (module.ProxyTracerProvider, module.NoOpTracerProvider)
    _kinds.update({name: module.SpanKind[name] for name in (SERVER, CLIENT, PRODUCER, CONSUMER)})
    _kinds[None] = module.SpanKind.INTERNAL
    _trace = module


def _tracer() -> Any:
    global _tracer_cache
    provider: Any = _seen[0] if _seen[1] else _trace.get_tracer_provider()
    cached = _tracer_cache
    if cached is None or cached[0] is not provider:
        cached = _tracer_cache = (provider, provider.get_tracer("flowdecision", _VERSION))
    return cached[1]


class SpanScope:
    """A span made current for a ``with`` block, or from :meth:`open` to :meth:`close`.

    The span is started with all its attributes at once, made current by the
    API's ``context.attach`` on entry and detached before it ends. Create one
    only when :func:`active` (a class, not a function returning one: a frame
    less per span).

    An exception leaving the block sets the span's status to ERROR with the
    error's ``code`` (a :class:`~flowdecision.errors.FlowDecisionError`'s) as
    its description and ``error.type`` attribute, and is recorded as an event.
    ``kind`` is :data:`SERVER`, :data:`CLIENT`, :data:`PRODUCER`, :data:`CONSUMER`
    or None (internal). ``parent`` is a context from :func:`extract` or
    :func:`context_of` (None: the current one).
    """

    __slots__ = ("_token", "span")

    def __init__(
        self,
        name: str,
        *,
        kind: str | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[Link] = (),
        parent: Any = None,
    ) -> None:
        cached = _tracer_cache  # _tracer(), its common case in line (every span)
        tracer = cached[1] if cached is not None and cached[0] is _seen[0] else _tracer()
        self.span: Span = tracer.start_span(name, parent, _kinds[kind], attributes, links)
        self._token: object = None

    def open(self) -> Span:
        """Make the span current (until :meth:`close`); returns it."""
        self._token = _context.attach(_trace.set_span_in_context(self.span))
        return self.span

    def close(self, error: BaseException | None = None) -> None:
        """Fail the span with ``error`` (if any), make it not current and end it."""
        try:
            if error is not None:
                fail(self.span, error)
        finally:
            # (a token from another context is logged by the API, not raised)
            _context.detach(self._token)
            self.span.end()

    __enter__ = open  # (no frame of its own: entered on every traced dispatch)

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        self.close(error)


def fail(target: Span, error: BaseException) -> None:
    """Mark ``target`` failed by ``error``: status ERROR with the error's ``code``."""
    code = getattr(error, "code", None) or type(error).__name__
    if not isinstance(code, str):
        code = type(error).__name__
    fail_status(target, code)
    target.record_exception(error, attributes={"flowdecision.error.code": code})


def fail_status(target: Span, code: str) -> None:
    """Set ``target``'s status to ERROR with ``code`` (also its ``error.type``)."""
    target.set_attribute("error.type", code)
    target.set_status(_trace.Status(_trace.StatusCode.ERROR, code))


@contextlib.contextmanager
def batch_span(component: str, system: str, size: int, traced: Sequence[Any]) -> Iterator[Span]:
    """The span of one group-committed batch of ``size`` operations (a root span).

    A batch serves many traces, so it belongs to none. Each traced operation
    in it (``traced``: objects with a ``batch`` attribute) gets the batch's
    span context in ``batch``, for its caller's span to link to once answered
    (the link goes from each decision's span to the batch). Call only when
    :func:`active`.
    """
    with SpanScope(
        f"flowdecision.{component}.commit",
        parent=_context.Context(),  # an empty context: no parent
        attributes={"db.system.name": system, "flowdecision.batch.size": size},
    ) as current:
        ctx = current.get_span_context()
        for item in traced:
            item.batch = ctx
        yield current


def event(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """Add an event to the current span (call only when :func:`active`)."""
    current_span().add_event(name, attributes or {})


def current_span() -> Span:
    """The current span (a non-recording one outside any; call only when :func:`active`)."""
    current: Span = _trace.get_current_span()
    return current


def recording_span() -> Span | None:
    """The current span if it records (a traced operation's), else None."""
    current = current_span()
    return current if current.is_recording() else None


def inject(carrier: MutableMapping[str, str]) -> None:
    """Add the current trace context to ``carrier`` (``traceparent``, ``tracestate``).

    Uses the globally configured propagator (``OTEL_PROPAGATORS``; W3C trace
    context and baggage by default). A no-op when nothing is active.
    """
    if active():
        _propagate.inject(carrier)


def current_traceparent() -> str | None:
    """The current span's W3C ``traceparent`` value, or None (no active, valid span)."""
    if not active():
        return None
    return traceparent_of(current_span())


def traceparent_of(target: Span) -> str | None:
    """``target``'s W3C ``traceparent`` value, or None when its context is invalid."""
    ctx = target.get_span_context()
    if not ctx.is_valid:
        return None
    # printf-style: half the cost of the same format specs in an f-string
    return "00-%032x-%016x-%02x" % (ctx.trace_id, ctx.span_id, ctx.trace_flags)  # noqa: UP031


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, flags)`` of a version-00 ``traceparent``, or None if malformed."""
    if not value or len(value) != 55:
        return None
    parts = value.split("-")
    if len(parts) != 4:
        return None
    version, trace_id, span_id, flags = parts
    if version != "00" or len(trace_id) != 32 or len(span_id) != 16 or len(flags) != 2:
        return None
    try:
        parsed = int(trace_id, 16), int(span_id, 16), int(flags, 16)
    except ValueError:
        return None
    if parsed[0] == 0 or parsed[1] == 0:
        return None
    return parsed


def _span_context(traceparent: str | None, tracestate: str | None = None) -> Any:
    parsed = parse_traceparent(traceparent)
    if parsed is None or not active():
        return None
    state = _trace.TraceState()
    if tracestate:
        with contextlib.suppress(Exception):  # a malformed tracestate is dropped, not fatal
            state = _trace.TraceState.from_header([tracestate])
    return _trace.SpanContext(
        trace_id=parsed[0],
        span_id=parsed[1],
        is_remote=True,
        trace_flags=_trace.TraceFlags(parsed[2]),
        trace_state=state,
    )


def link_to(traceparent: str | None, **attributes: AttributeValue) -> Link | None:
    """A span link to the span ``traceparent`` names (None when it is missing or malformed)."""
    ctx = _span_context(traceparent)
    if ctx is None:
        return None
    link: Link = _trace.Link(ctx, {PREFIX + key: value for key, value in attributes.items()})
    return link


def add_link(target: Span, traceparent: str | None, **attributes: AttributeValue) -> None:
    """Link ``target`` to the span ``traceparent`` names, if it is well formed."""
    link = link_to(traceparent, **attributes)
    if link is not None:
        target.add_link(link.context, link.attributes)


def context_of(traceparent: str | None, tracestate: str | None = None) -> Any:
    """A parent context continuing the trace ``traceparent`` names (None: start a new trace).

    For consumers of stored trace context: the outbox relay, an engine worker.
    """
    ctx = _span_context(traceparent, tracestate)
    if ctx is None:
        return None
    return _trace.set_span_in_context(_trace.NonRecordingSpan(ctx))


def extract(headers: Sequence[tuple[bytes, bytes]]) -> Any:
    """The parent context an incoming request's ASGI ``headers`` carry (``traceparent``...).

    Uses the global propagator, so ``tracestate`` and baggage come along.
    """
    carrier: dict[str, str] = {}
    for name, value in headers:
        if name in CONTEXT_HEADERS:
            carrier[name.decode("latin-1")] = value.decode("latin-1")
    if not carrier:
        return None
    return _propagate.extract(carrier)


def current_ids() -> tuple[str, str] | None:
    """``(trace_id, span_id)`` in hex of the current span, for log lines (when :func:`active`)."""
    value = traceparent_of(current_span())
    return None if value is None else (value[3:35], value[36:52])
