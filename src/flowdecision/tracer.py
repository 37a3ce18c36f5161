"""flowdecision's own tracer provider and OTLP encoder, what ``serve --otel`` registers.

Why not the SDK's: a span of the OpenTelemetry SDK costs ~25 µs to start and
end (each attribute value cleaned through ``BoundedAttributes``, a lock per
span, the processor chain) and its OTLP encoder ~45 µs to encode (a protobuf
object per attribute), all of it on the service's one interpreter. A traced
``POST`` paid more than its own untraced cost again (docs/BENCHMARKS.md,
"Tracing overhead"). This module implements the same API with the same
configuration and the same wire output, for less:

* :class:`LeanTracerProvider` is an ``opentelemetry.trace.TracerProvider``:
  every instrumentation in the process (flowdecision's, the user's) records
  through it. It takes the SDK's resource (``OTEL_SERVICE_NAME``,
  ``OTEL_RESOURCE_ATTRIBUTES``), sampler (``OTEL_TRACES_SAMPLER``,
  ``..._ARG``), span limits (``OTEL_SPAN_*_COUNT_LIMIT``...) and any SDK
  span processor (``serve --otel`` adds :class:`LeanBatchProcessor`, which
  honours ``OTEL_BSP_*``);
* :class:`LeanSpan` keeps what a span records in plain slots (attribute
  values of the common scalar types are stored as given, anything else is
  checked the way the API's rules say) and offers the fields of the SDK's
  ``ReadableSpan`` that exporters read, so the SDK's own exporters and
  encoder accept it too (the tests compare the two encoders' bytes);
* :func:`encode_spans` writes ``ExportTraceServiceRequest`` protobuf bytes by
  hand (resource and scope encoded once per batch, attribute keys once per
  process; a span in C where :mod:`flowdecision._otlp` was built, see
  :func:`c_encoder`), and :class:`LeanOTLPExporter` sends them through the SDK's
  OTLP/HTTP exporter (``OTEL_EXPORTER_OTLP_*``: endpoint, headers, timeout,
  compression, certificates; its retries), over :class:`LeanHTTPTransport`
  (``http.client``, a third of the CPU of the default ``requests`` per POST).

Imported only by :func:`flowdecision.tracing.start_sdk`, when the ``otel``
extra is installed.
"""

from __future__ import annotations

import collections
import functools
import http.client
import itertools
import logging
import operator
import os
import random
import ssl
import struct
import sys
import threading
import time
import traceback
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.exporter.http.transport._base import BaseHTTPResult, BaseHTTPTransport
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, sampling
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace.propagation import _SPAN_KEY as _span_key
from opentelemetry.util._decorator import _agnosticcontextmanager
from opentelemetry.util.types import Attributes, AttributeValue

from .errors import InvalidArgumentError
from .tracing import cache_traceparent_on, context_var

__all__ = [
    "LeanBatchProcessor",
    "LeanHTTPTransport",
    "LeanOTLPExporter",
    "LeanSpan",
    "LeanTracer",
    "LeanTracerProvider",
    "encode_spans",
    "lean_exporter_problem",
]

_logger = logging.getLogger(__name__)

#: The context key of the current span (the API's own), and the current context
#: (the runtime's ContextVar read directly when it is the default one: no frame).
_SPAN_KEY = _span_key
_var = context_var(context_api)
_current = _var.get if _var is not None else context_api.get_current

_new_context = tuple.__new__
_getrandbits = random.getrandbits
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_EMPTY_STATE = TraceState()
_UNSET = Status(StatusCode.UNSET)
_SCALARS = (str, bool, int, float)
_SCALAR_TYPES = frozenset(_SCALARS)
_TEXT = frozenset((str,))
_RECORD = sampling.Decision.RECORD_ONLY


class _Event:
    """A span event, as the SDK's ``Event`` reads to an exporter."""

    __slots__ = ("attributes", "name", "timestamp")

    dropped_attributes = 0

    def __init__(self, name: str, attributes: Mapping[str, Any], timestamp: int) -> None:
        self.name = name
        self.attributes = attributes
        self.timestamp = timestamp


class _Link:
    """A span link, as the API's ``Link`` reads to an exporter (plain slots, no
    property frames; the encoder reads every link of every span)."""

    __slots__ = ("attributes", "context")

    dropped_attributes = 0

    def __init__(self, context: SpanContext, attributes: Attributes) -> None:
        self.context = context
        self.attributes = attributes


def _clean(key: object, value: object) -> AttributeValue | None:
    """``value`` as the API's attribute rules allow it, or None (dropped, with a warning)."""
    if not isinstance(key, str) or not key:
        _logger.warning("invalid span attribute key %r: dropped", key)
        return None
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        kinds = {type(item) for item in value if item is not None}
        if len(kinds) <= 1 and kinds <= set(_SCALARS):
            return tuple(value)
    _logger.warning("invalid value for span attribute %r (%s): dropped", key, type(value).__name__)
    return None


class _Limits:
    """The count limits of :class:`SpanLimits` (``OTEL_SPAN_*_COUNT_LIMIT``), None as no limit."""

    __slots__ = ("attributes", "events", "links")

    def __init__(self, limits: SpanLimits) -> None:
        unlimited = sys.maxsize
        self.attributes: int = limits.max_span_attributes or unlimited
        self.events: int = limits.max_events or unlimited
        self.links: int = limits.max_links or unlimited


class LeanSpan(trace.Span):
    """A recorded span: the API's ``Span``, with the ``ReadableSpan`` fields exporters read."""

    __slots__ = (
        "_limits",
        "_tracer",
        "attributes",
        "context",
        "dropped_attributes",
        "dropped_events",
        "dropped_links",
        "end_time",
        "events",
        "kind",
        "links",
        "name",
        "parent",
        "start_time",
        "status",
        "w3c",
    )

    def __init__(
        self,
        tracer: LeanTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Attributes,
        links: Sequence[Link],
        start_time: int,
    ) -> None:
        self._tracer = tracer
        self._limits: _Limits = tracer.limits
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes: dict[str, AttributeValue] = {}
        self.dropped_attributes = self.dropped_events = self.dropped_links = 0
        self.events: list[_Event] = []
        self.links: list[Link] = list(links)
        if len(self.links) > self._limits.links:
            self.dropped_links = len(self.links) - self._limits.links
            del self.links[self._limits.links :]
        self.status: Status = _UNSET
        #: this span's W3C ``traceparent``, once :func:`flowdecision.tracing.traceparent_of`
        #: has written it (the dispatch span's is asked for twice per traced POST)
        self.w3c: str | None = None
        if attributes:
            self.set_attributes(attributes)

    # -- what exporters read (the SDK's ReadableSpan) -------------------------------

    @property
    def resource(self) -> Resource:
        """The provider's resource."""
        return self._tracer.resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        """The scope of the tracer that started this span."""
        return self._tracer.scope

    def get_span_context(self) -> SpanContext:
        """This span's context."""
        return self.context

    # -- the API -----------------------------------------------------------------------

    def is_recording(self) -> bool:
        """True until the span ends."""
        return self.end_time is None

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Set each attribute (invalid ones are dropped with a warning)."""
        if self.end_time is not None:
            return
        mine = self.attributes
        limit = self._limits.attributes
        # The common case checked in two passes of C: text keys, scalar values, room.
        if (
            _TEXT.issuperset(map(type, attributes))
            and _SCALAR_TYPES.issuperset(map(type, attributes.values()))
            and "" not in attributes
            and len(mine) + len(attributes) <= limit
        ):
            mine.update(attributes)
            return
        for key, value in attributes.items():
            if type(value) not in _SCALARS or type(key) is not str or not key:
                cleaned = _clean(key, value)
                if cleaned is None:
                    continue
                value = cleaned
            if key not in mine and len(mine) >= limit:
                self.dropped_attributes += 1
                continue
            mine[key] = value

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        """Set one attribute."""
        mine = self.attributes
        if (
            type(value) in _SCALAR_TYPES
            and type(key) is str
            and key
            and self.end_time is None
            and (key in mine or len(mine) < self._limits.attributes)
        ):
            mine[key] = value
        else:  # the checks, the warnings and the limit's count
            self.set_attributes({key: value})

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        """Record an event (over the event limit, it is counted as dropped)."""
        if self.end_time is not None:
            return
        if len(self.events) >= self._limits.events:
            self.dropped_events += 1
            return
        cleaned: dict[str, Any] = {}
        for key, value in (attributes or {}).items():
            value = _clean(key, value)
            if value is not None:
                cleaned[key] = value
        self.events.append(_Event(name, cleaned, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        """Link this span to ``context`` (invalid contexts without attributes are ignored)."""
        if self.end_time is not None or (not context[5] and not attributes):  # [5]: valid
            return
        if len(self.links) >= self._limits.links:
            self.dropped_links += 1
            return
        self.links.append(_Link(context, attributes))  # type: ignore[arg-type]

    def update_name(self, name: str) -> None:
        """Rename the span."""
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """Set the status (an OK status is final, as the API says)."""
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            self.status = status
        else:
            self.status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """Record ``exception`` as an ``exception`` event (its type, message and stack)."""
        stack = "".join(traceback.format_exception(exception))
        module, name = type(exception).__module__, type(exception).__qualname__
        event: dict[str, AttributeValue] = {
            "exception.type": f"{module}.{name}" if module and module != "builtins" else name,
            "exception.message": str(exception),
            "exception.stacktrace": stack,
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        """End the span and hand it to the provider's processors (once)."""
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        for processor in self._tracer.processors:
            processor.on_end(self)  # type: ignore[arg-type]


cache_traceparent_on(LeanSpan)


class LeanTracer(trace.Tracer):
    """Starts :class:`LeanSpan` objects (or non-recording spans the sampler drops)."""

    def __init__(self, provider: LeanTracerProvider, scope: InstrumentationScope) -> None:
        self.resource = provider.resource
        self.processors = provider.processors
        self.starters = provider.starters
        self.limits = provider.limits
        self.scope = scope
        self._sampler = provider.sampler
        # The default sampler and always_on decide without a call (the hot path).
        self._always = provider.sampler is sampling.ALWAYS_ON
        self._parent_based_on = provider.sampler is sampling.DEFAULT_ON

    def start_span(
        self,
        name: str,
        context: context_api.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        """Start a span (a child of ``context``'s current span, or of the current one)."""
        current: Any = (context if context is not None else _current()).get(_SPAN_KEY)
        # A SpanContext is a tuple (trace id, span id, remote, flags, state, valid),
        # read here by index rather than through its properties (a frame each).
        parent: SpanContext | None = None
        if current is not None:
            parent = current.context if type(current) is LeanSpan else current.get_span_context()
            if not parent[5]:
                parent = None
        if parent is not None:
            trace_id = parent[0]
            trace_state = parent[4]
        else:
            trace_id = _getrandbits(128) or _new_id(128)
            trace_state = _EMPTY_STATE
        span_id = _getrandbits(64) or _new_id(64)  # (0 is invalid: drawn again)
        extra: Attributes = None
        if self._always or (self._parent_based_on and (parent is None or parent[3] & 1)):
            recorded, flags = True, _SAMPLED
        elif self._parent_based_on:
            recorded, flags = False, _UNSAMPLED
        else:
            result = self._sampler.should_sample(context, trace_id, name, kind, attributes, links)
            recorded = result.decision is not sampling.Decision.DROP
            sampled = result.decision is sampling.Decision.RECORD_AND_SAMPLE
            flags = _SAMPLED if sampled else _UNSAMPLED
            trace_state = result.trace_state or trace_state
            if recorded:
                extra = result.attributes
        # What SpanContext(...) makes, without its range checks: both ids are valid
        # by construction (non-zero, in range), so the context is valid.
        span_context = _new_context(
            SpanContext, (trace_id, span_id, False, flags, trace_state, True)
        )
        if not recorded:
            return NonRecordingSpan(span_context)
        if extra:
            attributes = {**(attributes or {}), **extra}
        span = LeanSpan(
            self,
            name,
            span_context,
            parent,
            kind,
            attributes,
            links or (),
            start_time or time.time_ns(),
        )
        for processor in self.starters:
            processor.on_start(span, parent_context=context)  # type: ignore[arg-type]
        return span

    @_agnosticcontextmanager  # the API's own: a context manager and a decorator
    def start_as_current_span(
        self,
        name: str,
        context: context_api.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        """Start a span and make it current for the block."""
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


def _new_id(bits: int) -> int:
    value = random.getrandbits(bits)
    while not value:  # an all-zero id is invalid
        value = random.getrandbits(bits)
    return value


class LeanTracerProvider(trace.TracerProvider):
    """A tracer provider of :class:`LeanSpan` objects, configured like the SDK's."""

    def __init__(
        self,
        resource: Resource | None = None,
        sampler: sampling.Sampler | None = None,
        span_limits: SpanLimits | None = None,
    ) -> None:
        self.resource = resource if resource is not None else Resource.create()
        self.sampler = sampler if sampler is not None else sampling._get_from_env_or_default()
        self.limits = _Limits(span_limits if span_limits is not None else SpanLimits())
        self.processors: list[SpanProcessor] = []
        #: the processors whose ``on_start`` does something (called as a span starts)
        self.starters: list[SpanProcessor] = []
        self._tracers: dict[tuple[str, str | None, str | None], LeanTracer] = {}

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Add a processor: it gets every sampled span when it ends."""
        self.processors.append(processor)
        if type(processor).on_start is not LeanBatchProcessor.on_start:
            self.starters.append(processor)

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> trace.Tracer:
        """The tracer of one instrumentation scope (cached)."""
        key = (instrumenting_module_name, instrumenting_library_version, schema_url)
        tracer = self._tracers.get(key)
        if tracer is None:
            scope = InstrumentationScope(
                instrumenting_module_name, instrumenting_library_version, schema_url, attributes
            )
            tracer = self._tracers[key] = LeanTracer(self, scope)
        return tracer

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what the processors hold."""
        return all(processor.force_flush(timeout_millis) for processor in self.processors)

    def shutdown(self) -> None:
        """Flush and stop every processor."""
        for processor in self.processors:
            processor.shutdown()


# -- OTLP protobuf, by hand ------------------------------------------------------------

_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
_pack_i = struct.Struct("<I").pack
_SMALL = [bytes([n]) for n in range(128)]
_LOW64 = (1 << 64) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# A span's fixed fields, each group in one call with its tags: the trace id (in two
# halves) and span id, then a child's parent span id (big-endian bytes, as OTLP's ids
# are); the start and end times (fixed64, little-endian).
_pack_ids = struct.Struct(">HQQHQ").pack
_pack_child = struct.Struct(">HQQHQHQ").pack
_pack_times = struct.Struct("<BQBQ").pack
#: What comes between a short text attribute's key and its bytes: the ``value`` field
#: (tag, length) and its ``AnyValue``'s ``string_value`` (tag, length), by length.
_TEXT_HEADS = [bytes((0x12, size + 2, 0x0A, size)) for size in range(126)]


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value] if value >= 0 else _varint(value & 0xFFFFFFFFFFFFFFFF)
    out = bytearray()
    while value > 127:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the length, the bytes."""
    size = len(payload)
    if size < 128:
        return tag + _SMALL[size] + payload
    if size < 16384:  # a span's own length, most often: two bytes, no call
        return tag + bytes(((size & 127) | 128, size >> 7)) + payload
    return tag + _varint(size) + payload


def _utf8(value: str) -> bytes:
    try:
        return value.encode()
    except UnicodeEncodeError:  # a lone surrogate: replaced, as a receiver needs valid UTF-8
        return value.encode("utf-8", "replace")


def _text(tag: bytes, value: str) -> bytes:
    return _field(tag, _utf8(value))


_keys: dict[str, bytes] = {}


def _key(key: str) -> bytes:
    """The ``key`` field of a ``KeyValue`` (cached: a process has few attribute keys)."""
    encoded = _keys.get(key)
    if encoded is None:
        encoded = _text(b"\x0a", key)
        if len(_keys) < 4096:
            _keys[key] = encoded
    return encoded


def _any_value(value: object) -> bytes:
    """An ``AnyValue`` message (its oneof member, present even when it is the default)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _text(b"\x0a", value)
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:  # OTLP's int_value is an int64
            raise InvalidArgumentError(f"integer attribute value out of int64 range: {value}")
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(item)) for item in value))
    if isinstance(value, Mapping):
        return _field(b"\x32", _attributes(b"\x0a", value))
    raise InvalidArgumentError(f"invalid attribute value type {type(value).__name__}")


#: key -> {text value: its ``KeyValue``, length-prefixed} for keys whose values repeat
#: (a method, a route, a backend); None for a key seen with too many values (an id).
_pairs: dict[str, Any] = {}
_PAIRS_PER_KEY = 32


def _sized_key_value(key: str, value: object) -> bytes:
    """A ``KeyValue`` message, its length first (a field of it is ``tag`` + this)."""
    head = _keys.get(key) or _key(str(key))
    if type(value) is str:
        try:  # _utf8, in line (hot: every text attribute value not cached)
            raw = value.encode()
        except UnicodeEncodeError:
            raw = _utf8(value)
        size = len(raw)
        if size < 126:
            body = head + _TEXT_HEADS[size] + raw
        else:
            body = head + _field(b"\x12", _field(b"\x0a", raw))
    elif type(value) is int and 0 <= value < 128:
        body = head + b"\x12\x02\x18" + _SMALL[value]
    elif type(value) is int and 0 <= value < 16384:  # a status code, a size
        body = head + b"\x12\x03\x18" + bytes(((value & 127) | 128, value >> 7))
    else:
        body = head + _field(b"\x12", _any_value(value))
    size = len(body)
    return (_SMALL[size] if size < 128 else _varint(size)) + body


def _attributes(tag: bytes, attributes: Mapping[str, object] | None) -> bytes:
    """Repeated ``KeyValue`` fields under ``tag``.

    Hot (every attribute of every span): a text value seen before, for a key
    whose values repeat, is one look-up; a key that turns out to carry ids
    stops being cached (:data:`_PAIRS_PER_KEY` values).
    """
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():
        if type(value) is str:
            known = _pairs.get(key, _pairs)
            if known is _pairs:  # a key not seen yet: cache its values
                known = _pairs[key] = {} if len(_pairs) < 4096 else None
            if known is not None:
                cached = known.get(value)
                if cached is None:
                    cached = _sized_key_value(key, value)
                    if len(known) < _PAIRS_PER_KEY:
                        known[value] = cached
                    else:
                        _pairs[key] = None
                out.append(tag + cached)
                continue
            # An id (a key whose values do not repeat): _sized_key_value's text case in line.
            try:
                raw = value.encode()
            except UnicodeEncodeError:
                raw = _utf8(value)
            head = _keys.get(key) or _key(key)
            size = len(raw)
            whole = len(head) + 4 + size
            if whole < 128:
                out.append(tag + _SMALL[whole] + head + _TEXT_HEADS[size] + raw)
                continue
        elif type(value) is int and 0 <= value < 128:  # an attempt, a count: in line too
            head = _keys.get(key) or _key(key)
            if len(head) < 124:
                out.append(tag + _SMALL[len(head) + 4] + head + b"\x12\x02\x18" + _SMALL[value])
                continue
        try:
            out.append(tag + _sized_key_value(key, value))
        except Exception as error:  # as the SDK's encoder: this attribute left out, logged
            _logger.error("failed to encode span attribute %r: %s", key, error)
    return b"".join(out)


def _trace_state(state: TraceState | None) -> str:
    return ",".join(f"{key}={value}" for key, value in state.items()) if state else ""


_HAS_REMOTE = _pack_i(0x100)
_IS_REMOTE = _pack_i(0x300)
#: by ``id()`` of the enum member (members are singletons; hashing one runs Python)
_KINDS = {id(kind): b"\x30" + _SMALL[kind.value + 1] for kind in SpanKind}
_STATUS = {id(code): b"\x18" + _SMALL[code.value] if code.value else b"" for code in StatusCode}


def _span(span: Any) -> bytes:
    """One ``Span`` message, as the ``spans`` field of a ``ScopeSpans``."""
    # Span contexts read by index (trace id, span id, remote, flags, state, valid),
    # enums looked up by identity: no property or ``Enum.__hash__`` frames.
    ctx = span.context
    parent = span.parent
    high, low = ctx[0] >> 64, ctx[0] & _LOW64
    state = ctx[4]
    if parent is not None and (state is _EMPTY_STATE or not state):  # a child: one pack
        head = _pack_child(0x0A10, high, low, 0x1208, ctx[1], 0x2208, parent[1])
    else:
        head = _pack_ids(0x0A10, high, low, 0x1208, ctx[1])
        if state is not _EMPTY_STATE and state:
            head += _text(b"\x1a", _trace_state(state))
        if parent is not None:
            head += b"\x22\x08" + parent[1].to_bytes(8, "big")
    try:  # _utf8, in line (every span)
        name = span.name.encode()
    except UnicodeEncodeError:
        name = _utf8(span.name)
    size = len(name)
    parts = [
        head,
        (b"\x2a" + _SMALL[size] + name) if size < 128 else _field(b"\x2a", name),
        _KINDS[id(span.kind)],
        _pack_times(0x39, span.start_time, 0x41, span.end_time),
        _attributes(b"\x4a", span.attributes),
    ]
    if span.dropped_attributes:
        parts.append(b"\x50" + _varint(span.dropped_attributes))
    for event in span.events:
        body = b"\x09" + _pack_q(event.timestamp) + _text(b"\x12", event.name)
        body += _attributes(b"\x1a", event.attributes)
        if event.dropped_attributes:
            body += b"\x20" + _varint(event.dropped_attributes)
        parts.append(_field(b"\x5a", body))
    if span.dropped_events:
        parts.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        linked = link.context
        body = b"\x0a\x10" + linked[0].to_bytes(16, "big")
        body += b"\x12\x08" + linked[1].to_bytes(8, "big")
        if link.attributes:
            body += _attributes(b"\x22", link.attributes)
        if link.dropped_attributes:
            body += b"\x28" + _varint(link.dropped_attributes)
        body += b"\x35" + (_IS_REMOTE if linked[2] else _HAS_REMOTE)
        parts.append(_field(b"\x6a", body))
    if span.dropped_links:
        parts.append(b"\x70" + _varint(span.dropped_links))
    status = span.status
    if status is _UNSET:
        parts.append(b"\x7a\x00")
    else:
        code = _STATUS[id(status.status_code)]
        if status.description:
            parts.append(_field(b"\x7a", _text(b"\x12", status.description) + code))
        else:
            parts.append(b"\x7a" + _SMALL[len(code)] + code)
    # The SDK's encoder: "has is-remote" always, "is remote" for a remote parent.
    parts.append(b"\x85\x01" + (_IS_REMOTE if parent is not None and parent[2] else _HAS_REMOTE))
    return _field(b"\x12", b"".join(parts))


def _scope(scope: InstrumentationScope | None) -> bytes:
    if scope is None:
        return _field(b"\x0a", b"")
    body = _text(b"\x0a", scope.name) if scope.name else b""
    if scope.version:
        body += _text(b"\x12", scope.version)
    body += _attributes(b"\x1a", scope.attributes)
    return _field(b"\x0a", body)


#: What ``FLOWDECISION_OTEL_ENCODER`` may say: ``c`` (the default) encodes a span
#: with :mod:`flowdecision._otlp` where it was built, ``python`` with :func:`_span`.
ENCODERS = ("c", "python")


def c_encoder() -> Callable[[Any], bytes | None] | None:
    """The C span encoder, or None (not built, or ``FLOWDECISION_OTEL_ENCODER=python``).

    ``flowdecision._otlp.span(span)`` writes the bytes :func:`_span` writes, for
    the spans a service ends most (scalar attributes, links without attributes,
    no events, no trace state), and returns None for any other span, which
    :func:`_span` then encodes. Encoding in Python was two thirds of what
    tracing costs a traced ``POST`` (docs/BENCHMARKS.md, "Tracing overhead").
    """
    choice = os.environ.get("FLOWDECISION_OTEL_ENCODER", "c").strip().lower() or "c"
    if choice not in ENCODERS:
        raise InvalidArgumentError(
            f"FLOWDECISION_OTEL_ENCODER `{choice}` is not supported: use c or python"
        )
    return None if choice == "python" else _built_c_encoder()


@functools.cache
def _built_c_encoder() -> Callable[[Any], bytes | None] | None:
    # Imported and configured once per process, however often c_encoder() is asked.
    try:
        from . import _otlp
    except ImportError:  # built without a C compiler: the Python encoder does it all
        return None
    _otlp.configure(tuple(SpanKind), tuple(StatusCode), _UNSET, _EMPTY_STATE)
    return _otlp.span


def _encoded(fast: Callable[[Any], bytes | None] | None, span: Any) -> bytes:
    """``span`` encoded by ``fast`` (the C encoder) where it takes it, else by :func:`_span`."""
    encoded = fast(span) if fast is not None else None
    return _span(span) if encoded is None else encoded


def encode_spans(spans: Sequence[Any]) -> bytes:
    """An OTLP ``ExportTraceServiceRequest`` of ``spans``, serialized.

    The same message the SDK's ``encode_spans(...).SerializeToString()`` writes
    for the same spans (grouped by resource, then by instrumentation scope, in
    order of first appearance), for spans with the ``ReadableSpan`` fields.
    """
    fast = c_encoder()
    return _request(
        [(span.resource, span.instrumentation_scope, _encoded(fast, span)) for span in spans]
    )


def _request(encoded: Sequence[tuple[Resource, InstrumentationScope | None, bytes]]) -> bytes:
    """The request of spans already encoded, each with its resource and scope."""
    # Grouped by identity: a resource's hash is a JSON dump of its attributes, and
    # a process has one resource and a tracer (scope) per instrumentation.
    if not encoded:
        return b""
    # The common case first, in C: every span from one resource and one scope.
    resource, scope = encoded[0][0], encoded[0][1]
    if all(map(operator.is_, map(_first, encoded), itertools.repeat(resource))) and all(
        map(operator.is_, map(_second, encoded), itertools.repeat(scope))
    ):
        return _request_body(resource, [(scope, b"".join(map(_third, encoded)))])
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for resource, scope, span in encoded:
        group = groups.get(id(resource))
        if group is None:
            group = groups[id(resource)] = (resource, {})
        scope = scope or None
        entry = group[1].get(id(scope))
        if entry is None:
            entry = group[1][id(scope)] = (scope, [])
        entry[1].append(span)
    return b"".join(
        _request_body(resource, [(scope, b"".join(spans)) for scope, spans in scopes.values()])
        for resource, scopes in groups.values()
    )


_first, _second, _third = (operator.itemgetter(n) for n in range(3))


def _request_body(resource: Resource, scopes: Sequence[tuple[Any, bytes]]) -> bytes:
    """One ``ResourceSpans``: ``resource`` and its ``scopes`` (each with its spans, encoded).

    Joined once, lengths first: a batch's spans are hundreds of kilobytes, which each
    ``_field`` around them would copy again.
    """
    parts = [b"", _field(b"\x0a", _attributes(b"\x0a", resource.attributes))]
    for scope, spans in scopes:
        scope = scope or None
        head = _scope(scope)
        tail = _text(b"\x1a", scope.schema_url) if scope is not None and scope.schema_url else b""
        parts += (b"\x12" + _varint(len(head) + len(spans) + len(tail)), head, spans, tail)
    if resource.schema_url:
        parts.append(_text(b"\x1a", resource.schema_url))
    parts[0] = b"\x0a" + _varint(sum(map(len, parts)))
    return b"".join(parts)


def lean_exporter_problem() -> str | None:
    """Why :class:`LeanOTLPExporter` cannot send with the installed exporter (None: it can).

    It hands its bytes to the OTLP/HTTP exporter's client (``_client.export``,
    opentelemetry-exporter-otlp-proto-http 1.45) and replaces that client's
    transport (``_client._transport``): a version without them takes the SDK's
    own path instead (tests/test_tracer.py checks the one installed).
    """
    client = getattr(OTLPSpanExporter(), "_client", None)
    if client is None or not callable(getattr(client, "export", None)):
        return "the installed OTLP/HTTP exporter has no `_client.export`"
    if not isinstance(getattr(client, "_transport", None), BaseHTTPTransport):
        return "the installed OTLP/HTTP exporter's client has no `_transport`"
    return None


@dataclass(frozen=True, slots=True)
class _Answer(BaseHTTPResult):
    """What the collector answered (or the error that stopped the request)."""

    body: bytes = b""
    fields: Mapping[str, str] = field(default_factory=dict)

    def content(self) -> bytes:
        return self.body

    def headers(self) -> Mapping[str, str]:
        return self.fields


class LeanHTTPTransport(BaseHTTPTransport):
    """The OTLP exporter's HTTP transport on ``http.client``: one kept-alive
    connection per endpoint, reopened when the collector closes it.

    The SDK's default transport (``requests`` over ``urllib3``) spends ~3x the
    CPU per POST in Python frames, on a thread that shares the interpreter with
    the service's event loop. The exporter's client keeps what it does above
    the transport: compression, headers, timeout, retries with backoff.
    ``verify`` and ``cert`` are what the exporter resolved from
    ``OTEL_EXPORTER_OTLP_*CERTIFICATE`` and ``..._CLIENT_KEY``.
    """

    def __init__(
        self, *, verify: bool | str = True, cert: str | tuple[str, str] | None = None
    ) -> None:
        self.verify = verify
        self.cert = cert
        self._tls: ssl.SSLContext | None = None
        self._connections: dict[tuple[str, str, int], http.client.HTTPConnection] = {}

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            if self.verify is False:
                context = ssl._create_unverified_context()
            else:
                cafile = self.verify if isinstance(self.verify, str) else None
                context = ssl.create_default_context(cafile=cafile)
            if self.cert is not None:
                certfile, keyfile = self.cert if isinstance(self.cert, tuple) else (self.cert, None)
                context.load_cert_chain(certfile, keyfile)
            self._tls = context
        return self._tls

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        data: bytes | None = None,
    ) -> BaseHTTPResult:
        """Send one request on the endpoint's connection; an error is returned, not raised."""
        parts = urllib.parse.urlsplit(url)
        secure = parts.scheme == "https"
        key = (parts.scheme, parts.hostname or "", parts.port or (443 if secure else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection = self._connections.get(key)
        try:
            if connection is None:
                if secure:
                    connection = http.client.HTTPSConnection(
                        key[1], key[2], timeout=timeout, context=self._context()
                    )
                else:
                    connection = http.client.HTTPConnection(key[1], key[2], timeout=timeout)
                self._connections[key] = connection
            elif connection.sock is not None:
                connection.sock.settimeout(timeout)
            connection.timeout = timeout
            connection.request(method, target, body=data, headers=headers or {})
            response = connection.getresponse()
            body = response.read()
            if response.will_close:
                self._drop(key)
        except Exception as error:  # the client retries what is_connection_error says
            self._drop(key)
            return _Answer(error=error)
        # http.client's HTTPMessage: looked up without regard to case, as the API asks.
        fields = cast(Mapping[str, str], response.headers)
        return _Answer(response.status, response.reason, None, body, fields)

    def _drop(self, key: tuple[str, str, int]) -> None:
        connection = self._connections.pop(key, None)
        if connection is not None:
            connection.close()

    def is_connection_error(self, exception: Exception | None) -> bool:
        """Errors of the connection (not of the request): the client retries them."""
        return isinstance(exception, OSError | http.client.HTTPException)

    def close(self) -> None:
        """Close every connection."""
        for key in list(self._connections):
            self._drop(key)


def _lean_transport(transport: BaseHTTPTransport, endpoint: str) -> BaseHTTPTransport:
    """:class:`LeanHTTPTransport` in place of the SDK's default one, unless
    something set up needs ``requests``: a session from a credential provider
    (``OTEL_PYTHON_EXPORTER_OTLP_HTTP_*CREDENTIAL_PROVIDER``) or a proxy for the
    endpoint (``HTTP(S)_PROXY``, ``NO_PROXY``) keep the SDK's transport."""
    session = getattr(transport, "_session", None)
    if type(transport).__name__ != "RequestsHTTPTransport" or session is None:
        return transport
    if os.environ.get("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER") or os.environ.get(
        "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"
    ):
        return transport
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https"):
        return transport
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(
        parts.hostname or ""
    ):
        return transport
    transport.close()
    return LeanHTTPTransport(verify=session.verify, cert=session.cert)


class LeanOTLPExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter, its spans encoded by :func:`encode_spans`
    and posted by :class:`LeanHTTPTransport` (unless a credential provider or a
    proxy needs the SDK's ``requests`` transport).

    ``OTEL_EXPORTER_OTLP_*`` configure it as they do the SDK's (endpoint,
    headers, timeout, compression, certificates), and it keeps its retries.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        client = self._client
        client._transport = _lean_transport(client._transport, self._endpoint)

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        """Encode ``spans`` and send them."""
        try:
            data = encode_spans(spans)
        except Exception as error:  # a bad span must not stop the exporter's thread
            _logger.error("failed to encode %d spans: %s", len(spans), error)
            return SpanExportResult.FAILURE
        return self.send(data)

    def send(self, data: bytes) -> SpanExportResult:
        """Send one serialized ``ExportTraceServiceRequest``."""
        if self._shutdown:
            return SpanExportResult.FAILURE
        result = self._client.export(data)
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        parsed = int(value)
    except ValueError:
        _logger.warning("%s=%r is not a whole number: using %d", name, value, default)
        return default
    return parsed if parsed > 0 else default


class LeanBatchProcessor(SpanProcessor):
    """Encodes each sampled span as it ends; a thread sends them in batches.

    The SDK's batch processor keeps every span alive in its queue until its
    thread encodes the batch, and that thread then holds the interpreter for
    milliseconds at a time, which the service's event loop waits out. Here the
    thread that ends a span encodes it (:func:`c_encoder`, else :func:`_span`), and the
    sending thread only wraps the bytes and posts them. ``OTEL_BSP_SCHEDULE_DELAY``
    (ms, default 5000), ``OTEL_BSP_MAX_QUEUE_SIZE`` (2048; spans beyond it are
    dropped and counted in :attr:`dropped`), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``
    (512) hold as for the SDK's.
    """

    def __init__(self, exporter: LeanOTLPExporter) -> None:
        self.exporter = exporter
        self.delay_s = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.batch = min(_env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self.max_queue)
        self.dropped = 0
        self._fast = c_encoder()
        self._queue: collections.deque[tuple[Any, Any, bytes]] = collections.deque()
        self._wake = threading.Event()
        self._sending = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="flowdecision-otlp-exporter", daemon=True
        )
        self._thread.start()

    def on_start(self, span: Any, parent_context: context_api.Context | None = None) -> None:
        """Nothing: a span is only encoded once it ends."""

    def on_end(self, span: Any) -> None:
        """Encode ``span`` (if sampled) and queue it."""
        if not span.context[3] & 1 or self._stopped:  # [3]: flags; 1: sampled
            return
        queue = self._queue
        if len(queue) >= self.max_queue:
            self.dropped += 1
            return
        try:
            encoded = _encoded(self._fast, span)
        except Exception as error:  # an unencodable attribute must not fail the caller
            _logger.error("failed to encode span %r: %s", span.name, error)
            return
        if type(span) is LeanSpan:  # the tracer's, without the two properties' frames
            tracer = span._tracer
            queue.append((tracer.resource, tracer.scope, encoded))
        else:
            queue.append((span.resource, span.instrumentation_scope, encoded))
        if len(queue) >= self.batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._send_all()

    def _send_all(self) -> bool:
        ok = True
        with self._sending:
            queue = self._queue
            while queue:
                taken = [queue.popleft() for _ in range(min(self.batch, len(queue)))]
                try:
                    sent = self.exporter.send(_request(taken))
                except Exception as error:  # the exporter's thread must go on
                    _logger.error("failed to export %d spans: %s", len(taken), error)
                    sent = SpanExportResult.FAILURE
                ok = ok and sent is SpanExportResult.SUCCESS
        return ok

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Send every queued span now (from the calling thread)."""
        return self._send_all()

    def shutdown(self) -> None:
        """Send what is queued, stop the thread, shut the exporter down."""
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        self._thread.join(30)
        self._send_all()
        self.exporter.shutdown()  # type: ignore[no-untyped-call]
