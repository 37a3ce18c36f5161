"""OpenTelemetry traces, when the optional ``otel`` extra is installed and switched on.

Everything here costs nothing when it is off:

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
import contextvars
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from opentelemetry.trace import Link, Span, SpanKind
    from opentelemetry.util.types import AttributeValue

__all__ = [
    "PREFIX",
    "SpanScope",
    "active",
    "add_link",
    "api_installed",
    "batch_span",
    "context_of",
    "context_var",
    "current_ids",
    "current_traceparent",
    "event",
    "extract",
    "inject",
    "link_to",
    "parse_traceparent",
    "sdk_problem",
    "span",
    "start_sdk",
    "traceparent_of",
]

#: The attribute namespace (``flowdecision.decision_id``, ``flowdecision.outcome``, ...).
PREFIX = "flowdecision."
_VERSION = "0.1.0"

_tracer_cache: tuple[object, Any] | None = None
#: The span class with a ``w3c`` slot where :func:`traceparent_of` keeps the value
#: it formats (the lean provider's, which registers it with :func:`cache_traceparent_on`).
_w3c_cache: type | None = None


def cache_traceparent_on(kind: type) -> None:
    """Let :func:`traceparent_of` keep each ``kind`` span's value in its ``w3c`` slot."""
    global _w3c_cache
    _w3c_cache = kind


#: The request headers :func:`extract` reads a parent context from.
CONTEXT_HEADERS: frozenset[bytes] = frozenset({b"traceparent", b"tracestate", b"baggage"})
#: Span kinds, bound when tracing first turns out to be active (None until then).
SERVER: Any = None
CLIENT: Any = None
PRODUCER: Any = None
_INTERNAL: Any = None
CONSUMER: Any = None
_trace: Any = None
_context: Any = None
_propagate: Any = None
_NOOP: tuple[type, ...] = ()
_SPAN = ""
_Context: Any = None
#: The current context's get, set (returns a token) and reset (takes it).
_get_context: Any = None
_set_context: Any = None
_reset_context: Any = None


def context_var(context: Any) -> contextvars.ContextVar[Any] | None:
    """The ContextVar that holds the current context under the API's default
    runtime context (``context`` is ``opentelemetry.context``); None under another."""
    var = getattr(getattr(context, "_RUNTIME_CONTEXT", None), "_current_context", None)
    return var if isinstance(var, contextvars.ContextVar) else None


def _detach(token: Any) -> None:
    """Undo an attach (``_reset_context``); as the API's detach, a token made in
    another context is logged, not raised."""
    try:
        _reset_context(token)
    except ValueError:  # only the ContextVar's own reset raises
        logging.getLogger(__name__).exception("Failed to detach context")


def api_installed() -> bool:
    """Whether ``opentelemetry-api`` is importable (looked up, not imported)."""
    return importlib.util.find_spec("opentelemetry") is not None


def active() -> bool:
    """True when spans are recorded: a real tracer provider is registered.

    Cheap: a ``sys.modules`` look-up, then a global read compared with the
    provider seen last time. Nobody can have registered a provider without
    importing ``opentelemetry.trace``, so until someone did, flowdecision
    imports no OpenTelemetry module at all. Called once per request and per
    dispatch (and by the steps that may run outside either).
    """
    module = sys.modules.get("opentelemetry.trace")
    if module is None:
        return False
    # The API's global, read without get_tracer_provider()'s call (it is set once,
    # by set_tracer_provider); before that, the API's own look-up (which may load
    # a provider named by OTEL_PYTHON_TRACER_PROVIDER).
    provider = getattr(module, "_TRACER_PROVIDER", None) or module.get_tracer_provider()
    seen = _seen
    if seen[0] is provider:
        return seen[1]
    return _see(module, provider)


_seen: tuple[object, bool] = (None, False)


def _see(module: Any, provider: object) -> bool:
    global _seen
    if _trace is None:
        _bind(module)
    recording = not isinstance(provider, _NOOP)
    _seen = (provider, recording)
    return recording


def _bind(module: Any) -> None:
    """Bind the API's modules once (the first time a provider could be there)."""
    global _trace, _context, _propagate, _NOOP, SERVER, CLIENT, PRODUCER, CONSUMER, _INTERNAL
    from opentelemetry import context, propagate
    from opentelemetry.trace.propagation import _SPAN_KEY

    global _SPAN, _get_context, _set_context, _reset_context, _Context
    _context, _propagate = context, propagate
    _SPAN, _Context = _SPAN_KEY, context.Context
    # The API's default runtime context keeps the current context in one
    # ContextVar: its own methods, bound here, get and set it with no Python
    # frame (the API's get_current/attach/detach are two frames deep each, and
    # a traced request calls them about ten times). Another runtime
    # (OTEL_PYTHON_CONTEXT) goes through the API.
    var = context_var(context)
    if var is not None:
        _get_context, _set_context, _reset_context = var.get, var.set, var.reset
    else:
        _get_context, _set_context, _reset_context = (
            context.get_current,
            context.attach,
            context.detach,
        )
    _NOOP = (module.ProxyTracerProvider, module.NoOpTracerProvider)
    SERVER, CLIENT = module.SpanKind.SERVER, module.SpanKind.CLIENT
    _INTERNAL = module.SpanKind.INTERNAL
    PRODUCER, CONSUMER = module.SpanKind.PRODUCER, module.SpanKind.CONSUMER
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

    Cheaper than the API's ``start_as_current_span`` (three nested generator
    context managers): one object, the span started with all its attributes
    at once, its context attached on entry and detached before it ends.
    Call only when :func:`active`; :data:`span` is this class.

    An exception leaving the block sets the span's status to ERROR with the
    error's ``code`` (a :class:`~flowdecision.errors.FlowDecisionError`'s) as
    its description and ``error.type`` attribute, and is recorded as an event.
    ``parent`` is a context from :func:`extract` or :func:`context_of` (None:
    the current one).
    """

    __slots__ = ("_token", "span")

    def __init__(
        self,
        name: str,
        *,
        kind: SpanKind | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[Link] = (),
        parent: Any = None,
    ) -> None:
        cached = _tracer_cache  # _tracer(), its common case in line (every span)
        tracer = cached[1] if cached is not None and cached[0] is _seen[0] else _tracer()
        # (record_exception and set_status_on_exception are left at their defaults:
        # the span is never used as a context manager, close() does their job.)
        self.span: Span = tracer.start_span(
            name, parent, kind if kind is not None else _INTERNAL, attributes, links
        )
        self._token: object = None

    def open(self) -> Span:
        """Make the span current (until :meth:`close`); returns it."""
        # The API's set_span_in_context, without its frames: a copy of the current
        # context with the span under the span key.
        values = dict(_get_context())
        values[_SPAN] = self.span
        self._token = _set_context(_Context(values))
        return self.span

    def close(self, error: BaseException | None = None) -> None:
        """Fail the span with ``error`` (if any), make it not current and end it."""
        try:
            if error is not None:
                fail(self.span, error)
        finally:
            _detach(self._token)
            self.span.end()

    __enter__ = open  # (no frame of its own: entered on every traced dispatch)

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        self.close(error)


#: ``span(name, *, kind=None, attributes=None, links=(), parent=None)``: a span made
#: current for the block (call only when :func:`active`); the class itself, not a
#: function returning one (a frame less per span). See :class:`SpanScope`.
span = SpanScope


def fail(target: Span, error: BaseException) -> None:
    """Mark ``target`` failed by ``error``: status ERROR with the error's ``code``."""
    code = getattr(error, "code", None) or type(error).__name__
    if not isinstance(code, str):
        code = type(error).__name__
    fail_status(target, code)
    target.record_exception(error, attributes={"flowdecision.error.code": code})


@contextlib.contextmanager
def batch_span(component: str, system: str, size: int, traced: Sequence[Any]) -> Iterator[Span]:
    """The span of one group-committed batch of ``size`` operations (a root span).

    A batch serves many traces, so it belongs to none. Each traced operation
    in it (``traced``: objects with a ``batch`` attribute) gets the batch's
    span context in ``batch``, for its caller's span to link to once answered
    (the link goes from each decision's span to the batch). Call only when
    :func:`active`.
    """
    with span(
        f"flowdecision.{component}.commit",
        parent=_context.Context(),
        attributes={"db.system.name": system, "flowdecision.batch.size": size},
    ) as current:
        ctx = current.get_span_context()
        for item in traced:
            item.batch = ctx
        yield current


def fail_status(target: Span, code: str) -> None:
    """Set ``target``'s status to ERROR with ``code`` (also its ``error.type``)."""
    target.set_attribute("error.type", code)
    target.set_status(_trace.Status(_trace.StatusCode.ERROR, code))


def event(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """Add an event to the current span (call only when :func:`active`)."""
    current_span().add_event(name, attributes or {})


def current_span() -> Span:
    """The current span (a non-recording one outside any).

    The API's ``get_current_span`` without its checks: the context's span
    key only ever holds a span (hot: several times per traced request).
    """
    current: Span | None = _get_context().get(_SPAN)
    return current if current is not None else _trace.INVALID_SPAN


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
    # A SpanContext is a tuple (trace id, span id, remote, flags, state, valid):
    # indexed, not through its properties (a frame each). A span with a
    # ``context`` attribute (the SDK's and the lean provider's) is read directly.
    # The lean provider's span keeps the value in its ``w3c`` slot: a traced POST
    # asks for its dispatch span's twice (the ledger's side data, the outbox row).
    cached: str | None = getattr(target, "w3c", None)
    if cached is not None:
        return cached
    ctx: Any = getattr(target, "context", None)
    if _trace is None or type(ctx) is not _trace.SpanContext:
        ctx = target.get_span_context()
    if not ctx[5]:
        return None
    # printf-style: half the cost of the same format specs in an f-string
    value = "00-%032x-%016x-%02x" % (ctx[0], ctx[1], ctx[3])  # noqa: UP031
    if type(target) is _w3c_cache:
        target.w3c = value  # type: ignore[attr-defined]  # the lean span's slot
    return value


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


def attach(parent: Any) -> object:
    """Make ``parent`` (a context) current; returns the token for :func:`detach`."""
    return _set_context(parent)


def detach(token: object) -> None:
    """Undo :func:`attach`."""
    _detach(token)


# -- the SDK (``serve --otel``) ---------------------------------------------------------

_EXTRA_HINT = "install the `otel` extra: pip install 'flowdecision[otel]'"


def sdk_problem() -> str | None:
    """Why :func:`start_sdk` cannot run here (None: it can)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as error:
        return f"--otel needs the OpenTelemetry SDK and OTLP exporter ({error.name}): {_EXTRA_HINT}"
    return None


def start_sdk() -> Callable[[], None]:
    """Register a tracer provider with a batch OTLP exporter; returns its shutdown.

    The provider is flowdecision's lean one (:mod:`flowdecision.tracer`: the
    same API, configuration and OTLP bytes as the SDK's, for a fraction of
    the CPU per span) unless ``FLOWDECISION_OTEL_PROVIDER=sdk`` asks for the
    SDK's own, or an exporter only the SDK's path has (``console``) is named.
    Configured by the standard variables: ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` (the resource; the service name defaults to
    ``flowdecision``), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``
    (the sampler), ``OTEL_SPAN_*_LIMIT`` (span limits), ``OTEL_TRACES_EXPORTER``
    (``otlp``, the default; ``console``; ``none``), ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` and ``..._HEADERS`` (where OTLP/HTTP
    goes), ``OTEL_BSP_*`` (the batch processor). Does nothing (and returns a
    no-op) when a real provider is registered already.
    """
    import os

    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if active():
        return lambda: None
    attributes = {}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = "flowdecision"
    resource = Resource.create(attributes)

    class _Resource(Resource):
        """The same resource, hashed once: the SDK's OTLP encoder hashes the resource of
        every span it encodes (a JSON dump of its attributes each time, about a tenth of
        the export's CPU), and a resource never changes."""

        def __hash__(self) -> int:
            cached: int | None = self.__dict__.get("_hash")
            if cached is None:
                cached = self.__dict__["_hash"] = super().__hash__()
            return cached

    exporters = [
        name.strip()
        for name in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
        if name.strip()
    ]
    for name in exporters:
        if name not in ("otlp", "console", "none"):
            raise InvalidArgumentError(
                f"OTEL_TRACES_EXPORTER `{name}` is not supported here: use otlp, console or none"
            )
    choice = os.environ.get("FLOWDECISION_OTEL_PROVIDER", "lean").strip().lower()
    if choice not in ("lean", "sdk"):
        raise InvalidArgumentError(
            f"FLOWDECISION_OTEL_PROVIDER `{choice}` is not supported: use lean or sdk"
        )
    provider: Any
    lean = choice == "lean" and "console" not in exporters
    if lean:
        from .tracer import (
            LeanBatchProcessor,
            LeanOTLPExporter,
            LeanTracerProvider,
            lean_exporter_problem,
        )

        problem = lean_exporter_problem() if "otlp" in exporters else None
        if problem is not None:
            logging.getLogger(__name__).warning("%s: using the SDK's tracer provider", problem)
            lean = False
    sdk_resource = _Resource(resource.attributes, resource.schema_url)
    if lean:
        provider = LeanTracerProvider(resource=sdk_resource)
        if "otlp" in exporters:
            provider.add_span_processor(LeanBatchProcessor(LeanOTLPExporter()))
    else:
        provider = TracerProvider(resource=sdk_resource)
        for name in exporters:
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            elif name == "console":
                provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    active()  # binds the API's modules for the callers that follow
    shutdown: Callable[[], None] = provider.shutdown
    return shutdown
