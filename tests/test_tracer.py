"""flowdecision's lean tracer provider (what ``serve --otel`` registers): the same
API behaviour, configuration and OTLP bytes as the SDK's.

The span trees of the dispatcher and the service are asserted with both
providers (tests/otel_support.py parametrizes the ``spans`` fixture); here:
the encoder against the SDK's, sampling and limits from the standard
variables, the batch processor against a real OTLP/HTTP receiver, and which
provider ``start_sdk`` picks (in subprocesses: a process registers one
provider once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowdecision.tracer import (
    LeanBatchProcessor,
    LeanHTTPTransport,
    LeanOTLPExporter,
    LeanSpan,
    LeanTracerProvider,
    _lean_transport,
    encode_spans,
    lean_exporter_problem,
)
from tests.otlp_receiver import OtlpReceiver

REMOTE = trace.SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=trace.TraceFlags(1),
    trace_state=trace.TraceState([("vendor", "v1"), ("other", "x")]),
)


def _record(provider: Any) -> list[Any]:
    """Every kind of thing a span carries, recorded through ``provider``."""
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("flowdecision", "0.1.0")
    parent = trace.set_span_in_context(trace.NonRecordingSpan(REMOTE))
    attributes = {
        "text": "é ✓",
        "long": "x" * 300,
        "yes": True,
        "no": False,
        "zero": 0,
        "big": 2**40,
        "negative": -5,
        "ratio": 0.25,
        "nothing": 0.0,
        "words": ["a", "b"],
        "flags": (True, False),
        "numbers": [1, 2, 3],
        "empty": [],
        "status": 201,  # two-byte varints: the shortcuts at their edges
        "edge": 16383,
        "over": 16384,
        "k" * 130: 1,  # keys too long for the one-byte shortcuts
        "t" * 120: "short",
    }
    with tracer.start_as_current_span(
        "POST /v1/decisions", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
    ) as server:
        server.add_event("flowdecision.takeover", {"flowdecision.attempt": 2})
        server.add_link(REMOTE)  # no attributes: as a decision's span links its batch
        with tracer.start_as_current_span(
            "flowdecision.dispatch",
            links=[trace.Link(REMOTE, {"flowdecision.link": "completed_original"})],
        ) as dispatch:
            dispatch.set_attributes(
                {"flowdecision.outcome": "submitted", "flowdecision.attempt": 1}
            )
            dispatch.set_status(trace.Status(trace.StatusCode.ERROR, "sink_failed"))
            dispatch.record_exception(ValueError("boom"))
        server.set_status(trace.StatusCode.OK)
    other = provider.get_tracer(
        "another.scope", schema_url="https://opentelemetry.io/schemas/1.21.0"
    )
    other.start_span("root", kind=trace.SpanKind.PRODUCER).end()
    return list(memory.get_finished_spans())


def test_the_encoder_writes_the_sdks_bytes() -> None:
    resource = Resource.create({"service.name": "flowdecision", "deployment": "test"})
    spans = _record(LeanTracerProvider(resource=resource))
    assert [type(span) for span in spans] == [LeanSpan] * 3
    ours = encode_spans(spans)
    assert ours == sdk_encode(spans).SerializeToString()
    request = ExportTraceServiceRequest.FromString(ours)
    scopes = request.resource_spans[0].scope_spans
    assert [scope.scope.name for scope in scopes] == ["flowdecision", "another.scope"]
    assert [span.name for span in scopes[0].spans] == [
        "flowdecision.dispatch",
        "POST /v1/decisions",
    ]


def test_ids_and_one_scope_encode_to_the_sdks_bytes() -> None:
    """A key whose values do not repeat (an id: past the per-key cache) and a batch
    from one resource and one scope (the export's common case) are written as the
    SDK writes them."""
    provider = LeanTracerProvider(resource=Resource.create({"service.name": "flowdecision"}))
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("flowdecision", "0.1.0")
    for n in range(80):
        attributes: dict[str, Any] = {"flowdecision.decision_id": f"d-{n}", "attempt": n}
        tracer.start_span("flowdecision.dispatch", attributes=attributes).end()
    spans = list(memory.get_finished_spans())
    assert encode_spans(spans) == sdk_encode(spans).SerializeToString()


def test_sdk_spans_encode_to_the_same_bytes_too() -> None:
    # The encoder reads the ReadableSpan fields: the SDK's spans go through it as well.
    spans = _record(TracerProvider(resource=Resource.create({"service.name": "x"})))
    assert encode_spans(spans) == sdk_encode(spans).SerializeToString()


def test_a_span_records_what_the_sdk_records() -> None:
    lean, sdk = _record(LeanTracerProvider()), _record(TracerProvider())

    def shape(span: Any) -> tuple[Any, ...]:
        return (
            span.name,
            span.kind,
            dict(span.attributes),
            [(event.name, sorted(event.attributes)) for event in span.events],
            [(link.context, dict(link.attributes or {})) for link in span.links],
            span.status.status_code,
            span.status.description,
            span.parent is not None and span.parent.is_remote,
        )

    assert [shape(span) for span in lean] == [shape(span) for span in sdk]
    server = lean[1]
    assert server.context.trace_id == REMOTE.trace_id  # continues the remote parent
    assert server.parent.span_id == REMOTE.span_id
    assert server.context.trace_state == REMOTE.trace_state
    assert lean[0].parent.span_id == server.context.span_id
    assert lean[0].events[0].attributes["exception.type"] == "ValueError"


def test_invalid_attributes_are_dropped_and_limits_counted() -> None:
    provider = LeanTracerProvider(span_limits=SpanLimits(max_span_attributes=3, max_events=1))
    span = provider.get_tracer("t").start_span("s", attributes={"a": 1, "": 2, "mixed": [1, "x"]})
    span.set_attributes({"b": 2, "c": 3, "d": 4})
    span.set_attribute("a", 10)  # an existing key: replaced, not counted
    span.add_event("one")
    span.add_event("two")
    span.end()
    assert isinstance(span, LeanSpan)
    assert span.attributes == {"a": 10, "b": 2, "c": 3}
    assert span.dropped_attributes == 1
    assert [event.name for event in span.events] == ["one"]
    assert span.dropped_events == 1
    span.set_attribute("late", 1)  # after end: ignored
    assert "late" not in span.attributes
    decoded = ExportTraceServiceRequest.FromString(encode_spans([span]))
    encoded = decoded.resource_spans[0].scope_spans[0].spans[0]
    assert (encoded.dropped_attributes_count, encoded.dropped_events_count) == (1, 1)


def test_an_integer_past_int64_is_left_out_as_the_sdk_leaves_it_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """OTLP's ``int_value`` is an int64: the SDK's encoder logs and leaves such an
    attribute out (the rest of the span is exported); so does ours."""
    provider = LeanTracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    attributes: dict[str, Any] = {
        "kept": 1,
        "huge": 2**63,
        "tiny": -(2**63) - 1,
        "numbers": [1, 2**64],
        "edges": [2**63 - 1, -(2**63)],
    }
    provider.get_tracer("t").start_span("s", attributes=attributes).end()
    spans = list(memory.get_finished_spans())
    ours = encode_spans(spans)
    assert ours == sdk_encode(spans).SerializeToString()
    (span,) = ExportTraceServiceRequest.FromString(ours).resource_spans[0].scope_spans[0].spans
    assert [attribute.key for attribute in span.attributes] == ["kept", "edges"]
    assert sum("failed to encode span attribute" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize(
    ("sampler", "root", "child_of_sampled", "child_of_unsampled"),
    [
        (sampling.DEFAULT_ON, True, True, False),
        (sampling.ALWAYS_ON, True, True, True),
        (sampling.ALWAYS_OFF, False, False, False),
        (sampling.ParentBasedTraceIdRatio(0.0), False, True, False),
        (sampling.TraceIdRatioBased(1.0), True, True, True),
    ],
)
def test_the_sampler_decides_as_the_sdks_does(
    sampler: sampling.Sampler, root: bool, child_of_sampled: bool, child_of_unsampled: bool
) -> None:
    tracer = LeanTracerProvider(sampler=sampler).get_tracer("t")

    def recorded(flags: int | None) -> bool:
        context = None
        if flags is not None:
            parent = trace.SpanContext(1, 2, True, trace.TraceFlags(flags))
            context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        span = tracer.start_span("s", context=context)
        assert span.get_span_context().trace_flags.sampled == span.is_recording()
        return span.is_recording()

    assert (recorded(None), recorded(1), recorded(0)) == (
        root,
        child_of_sampled,
        child_of_unsampled,
    )


def test_the_installed_otlp_exporter_has_what_the_lean_exporter_sends_through() -> None:
    # The contract: LeanOTLPExporter hands its bytes to the exporter's `_client.export`
    # (opentelemetry-exporter-otlp-proto-http 1.45). If an upgrade moves it, this fails
    # here, and start_sdk falls back to the SDK's provider (with a warning) meanwhile.
    assert lean_exporter_problem() is None


@pytest.fixture(name="receiver")
def receiver_fixture() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def test_the_batch_processor_delivers_every_span_over_otlp_http(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16")
    provider = LeanTracerProvider(resource=Resource.create({"service.name": "lean-test"}))
    processor = LeanBatchProcessor(LeanOTLPExporter(endpoint=f"{receiver.endpoint}/v1/traces"))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("flowdecision")
    ids = set()
    for n in range(40):  # two full batches sent by the thread, the rest on shutdown
        with tracer.start_as_current_span("work", attributes={"n": n}) as span:
            ids.add(f"{span.get_span_context().span_id:016x}")
    unsampled = trace.SpanContext(5, 6, True, trace.TraceFlags(0))
    tracer.start_span(
        "not sampled", context=trace.set_span_in_context(trace.NonRecordingSpan(unsampled))
    ).end()
    provider.shutdown()
    assert {span.span_id for span in receiver.spans} == ids
    assert sorted(span.attributes["n"] for span in receiver.spans) == list(range(40))
    assert {span.service_name for span in receiver.spans} == {"lean-test"}
    assert receiver.posts >= 3
    assert processor.dropped == 0


def test_a_full_queue_drops_spans_and_counts_them(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    provider = LeanTracerProvider()
    processor = LeanBatchProcessor(LeanOTLPExporter(endpoint=f"{receiver.endpoint}/v1/traces"))
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("flowdecision")
    for _ in range(50):
        tracer.start_span("burst").end()
    provider.shutdown()
    assert processor.batch == 4
    assert len(receiver.spans) + processor.dropped == 50
    assert len(receiver.spans) >= 4


def test_force_flush_sends_what_is_queued_now(receiver: OtlpReceiver) -> None:
    provider = LeanTracerProvider()
    provider.add_span_processor(
        LeanBatchProcessor(LeanOTLPExporter(endpoint=f"{receiver.endpoint}/v1/traces"))
    )
    provider.get_tracer("flowdecision").start_span("one").end()
    assert provider.force_flush()
    assert [span.name for span in receiver.spans] == ["one"]
    provider.shutdown()


_WHICH = """
import json, os
from opentelemetry import trace
from flowdecision import tracing
shutdown = tracing.start_sdk()
provider = trace.get_tracer_provider()
with tracing.span("probe"):
    pass
print("WHICH " + json.dumps({
    "provider": type(provider).__name__,
    "processors": [type(p).__name__ for p in (
        provider.processors if hasattr(provider, "processors")
        else provider._active_span_processor._span_processors
    )],
}))
shutdown()
"""


def _which(receiver: OtlpReceiver, **env: str) -> dict[str, Any]:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OTEL_", "FLOWDECISION_OTEL"))
    }
    environment.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="which", **env
    )
    done = subprocess.run(
        [sys.executable, "-c", _WHICH], env=environment, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("WHICH ")]
    result: dict[str, Any] = json.loads(line.removeprefix("WHICH "))
    return result


def test_start_sdk_registers_the_lean_provider_by_default(receiver: OtlpReceiver) -> None:
    assert _which(receiver) == {
        "provider": "LeanTracerProvider",
        "processors": ["LeanBatchProcessor"],
    }
    deadline = time.monotonic() + 10
    while not receiver.named("probe") and time.monotonic() < deadline:
        time.sleep(0.05)
    [probe] = receiver.named("probe")
    assert probe.service_name == "which"


def test_the_sdks_provider_on_request_or_for_the_console_exporter(receiver: OtlpReceiver) -> None:
    assert _which(receiver, FLOWDECISION_OTEL_PROVIDER="sdk")["provider"] == "TracerProvider"
    console = _which(receiver, OTEL_TRACES_EXPORTER="console")
    assert console["provider"] == "TracerProvider"
    assert _which(receiver, OTEL_TRACES_EXPORTER="none") == {
        "provider": "LeanTracerProvider",
        "processors": [],
    }


def test_an_unknown_provider_choice_is_refused_by_name() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from flowdecision import tracing; tracing.start_sdk()"],
        env={**os.environ, "FLOWDECISION_OTEL_PROVIDER": "fast"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "FLOWDECISION_OTEL_PROVIDER `fast` is not supported: use lean or sdk" in done.stderr


def _send(exporter: LeanOTLPExporter, *names: str) -> None:
    provider = LeanTracerProvider(resource=Resource.create({"service.name": "transport-test"}))
    provider.add_span_processor(LeanBatchProcessor(exporter))
    tracer = provider.get_tracer("flowdecision")
    for name in names:
        tracer.start_span(name).end()
        assert provider.force_flush()  # one POST per span
    provider.shutdown()


def test_the_exporter_posts_over_http_client_with_its_headers_and_compression(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=acme")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    exporter = LeanOTLPExporter(endpoint=f"{receiver.endpoint}/v1/traces")
    assert isinstance(exporter._client._transport, LeanHTTPTransport)
    _send(exporter, "one", "two", "three")
    assert [span.name for span in receiver.spans] == ["one", "two", "three"]
    assert {h["x-tenant"] for h in receiver.headers} == {"acme"}
    assert {h["content-encoding"] for h in receiver.headers} == {"gzip"}
    assert {h["content-type"] for h in receiver.headers} == {"application/x-protobuf"}
    assert receiver.connections == 1  # kept alive across the three POSTs


def test_a_refused_post_is_retried_and_a_closed_connection_reopened(
    receiver: OtlpReceiver,
) -> None:
    receiver.refuse = [503, 429]  # answered with Retry-After: 0, so the retries wait 0 s
    receiver.close_connections = True
    _send(LeanOTLPExporter(endpoint=f"{receiver.endpoint}/v1/traces"), "one", "two")
    assert [span.name for span in receiver.spans] == ["one", "two"]
    assert receiver.posts == 2 and len(receiver.headers) == 4
    assert receiver.connections == 2  # the collector closed after each answer


def test_a_collector_that_is_not_there_fails_the_export_without_raising() -> None:
    with OtlpReceiver() as gone:
        endpoint = f"{gone.endpoint}/v1/traces"
    exporter = LeanOTLPExporter(endpoint=endpoint, timeout=0.5)
    assert exporter.send(b"") is SpanExportResult.FAILURE
    exporter.shutdown()


def test_a_proxy_or_a_credential_provider_keeps_the_sdks_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    endpoint = "http://collector.example:4318/v1/traces"
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    proxied = LeanOTLPExporter(endpoint=endpoint)._client._transport
    assert type(proxied).__name__ == "RequestsHTTPTransport"
    monkeypatch.setenv("NO_PROXY", "collector.example")
    assert isinstance(LeanOTLPExporter(endpoint=endpoint)._client._transport, LeanHTTPTransport)
    monkeypatch.delenv("HTTP_PROXY")
    monkeypatch.delenv("NO_PROXY")
    # A credential provider's session (an entry point the SDK loads) may carry auth:
    # the decision is checked on the transport the SDK built without one.
    sdk_transport = OTLPSpanExporter(endpoint=endpoint)._client._transport
    monkeypatch.setenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER", "vault")
    assert _lean_transport(sdk_transport, endpoint) is sdk_transport


def _self_signed(directory: Path) -> tuple[str, str]:
    cert, key = directory / "collector.pem", directory / "collector.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def test_tls_verifies_the_collector_with_the_configured_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = _self_signed(tmp_path)
    with OtlpReceiver(tls=(cert, key)) as collector:
        endpoint = f"{collector.endpoint}/v1/traces"
        assert endpoint.startswith("https://")
        untrusted = LeanOTLPExporter(endpoint=endpoint, timeout=2)
        assert untrusted.send(b"") is SpanExportResult.FAILURE  # not in the default CAs
        untrusted.shutdown()
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", cert)
        _send(LeanOTLPExporter(endpoint=endpoint), "over tls")
        assert [span.name for span in collector.spans] == ["over tls"]
