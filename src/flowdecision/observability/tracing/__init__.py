"""OpenTelemetry traces, when the optional ``otel`` extra is installed and switched on.

Two modules, one direction (``sdk`` uses ``spans``, never the other way):

* :mod:`flowdecision.observability.tracing.spans`: what the library records (spans, events,
  links, the W3C ``traceparent`` it stores and hands to sinks), through the
  OpenTelemetry **API** only, and at no cost while no tracer provider is
  registered (no OpenTelemetry module is imported until one can be);
* :mod:`flowdecision.observability.tracing.sdk`: what ``serve --otel``, ``relay --otel`` and
  ``submit --trace`` register: the SDK's tracer provider with its batch span
  processor and the official OTLP/HTTP exporter, configured by the standard
  ``OTEL_*`` variables.

Both use public OpenTelemetry names only (``tests/test_layout.py`` checks that no
project file imports a private one). The span tree is drawn in
``docs/OBSERVABILITY.md``.
"""

from .sdk import sdk_problem, start_sdk
from .spans import (
    CLIENT,
    CONSUMER,
    CONTEXT_HEADERS,
    PREFIX,
    PRODUCER,
    SERVER,
    SpanScope,
    active,
    add_link,
    batch_span,
    context_of,
    current_ids,
    current_span,
    current_traceparent,
    event,
    extract,
    fail,
    fail_status,
    inject,
    link_to,
    parse_traceparent,
    recording_span,
    traceparent_of,
)

__all__ = [
    "CLIENT",
    "CONSUMER",
    "CONTEXT_HEADERS",
    "PREFIX",
    "PRODUCER",
    "SERVER",
    "SpanScope",
    "active",
    "add_link",
    "batch_span",
    "context_of",
    "current_ids",
    "current_span",
    "current_traceparent",
    "event",
    "extract",
    "fail",
    "fail_status",
    "inject",
    "link_to",
    "parse_traceparent",
    "recording_span",
    "sdk_problem",
    "start_sdk",
    "traceparent_of",
]
