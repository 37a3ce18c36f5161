"""The tracer provider ``serve --otel``, ``relay --otel`` and ``submit --trace`` register.

The OpenTelemetry SDK's own, as any application would set it up: its
``TracerProvider`` (resource, sampler and span limits from the standard
variables), its ``BatchSpanProcessor`` and the official OTLP/HTTP exporter
(``opentelemetry-exporter-otlp-proto-http``). Nothing here is imported before
:func:`start_sdk` runs, so the ``otel`` extra stays optional.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ...errors import InvalidArgumentError
from .spans import active

_EXTRA_HINT = "install the `otel` extra: pip install 'flowdecision[otel]'"
#: What ``OTEL_TRACES_EXPORTER`` may name here (a comma-separated list).
EXPORTERS = ("otlp", "console", "none")


def sdk_problem() -> str | None:
    """Why :func:`start_sdk` cannot run here (None: it can)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as error:
        return f"--otel needs the OpenTelemetry SDK and OTLP exporter ({error.name}): {_EXTRA_HINT}"
    return None


def start_sdk() -> Callable[[], None]:
    """Register the SDK's tracer provider with a batch OTLP/HTTP exporter; returns its shutdown.

    Configured by the standard variables: ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` (the resource; the service name defaults to
    ``flowdecision``), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``
    (the sampler), ``OTEL_SPAN_*_LIMIT`` (span limits), ``OTEL_TRACES_EXPORTER``
    (``otlp``, the default; ``console``; ``none``), ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._HEADERS``, ``..._TIMEOUT``,
    ``..._COMPRESSION`` and ``..._CERTIFICATE`` (where and how OTLP/HTTP goes),
    ``OTEL_BSP_*`` (the batch processor). Does nothing (and returns a no-op)
    when a real provider is registered already.
    """
    exporters = [
        name.strip()
        for name in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
        if name.strip()
    ]
    for name in exporters:
        if name not in EXPORTERS:
            raise InvalidArgumentError(
                f"OTEL_TRACES_EXPORTER `{name}` is not supported here: use otlp, console or none"
            )
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if active():
        return lambda: None
    provider = TracerProvider(resource=_resource())
    for name in exporters:
        exporter: Any
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif name == "console":
            exporter = ConsoleSpanExporter()
        else:
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    active()  # binds the API's modules for the callers that follow
    shutdown: Callable[[], None] = provider.shutdown
    return shutdown


def _resource() -> Any:
    """The SDK's resource from the environment, ``service.name`` defaulting to flowdecision,
    its hash computed once."""
    from opentelemetry.sdk.resources import Resource

    class _Resource(Resource):
        """The same resource, hashed once: the OTLP encoder hashes the resource of every
        span it encodes (a JSON dump of its attributes each time), and a resource never
        changes."""

        def __hash__(self) -> int:
            cached: int | None = self.__dict__.get("flowdecision_hash")
            if cached is None:
                cached = self.__dict__["flowdecision_hash"] = super().__hash__()
            return cached

    attributes = {}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = "flowdecision"
    resource = Resource.create(attributes)
    return _Resource(resource.attributes, resource.schema_url)
