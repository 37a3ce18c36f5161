"""What ``serve --otel``, ``relay --otel`` and ``submit --trace`` register
(:func:`flowdecision.observability.tracing.start_sdk`): the SDK's tracer provider, its batch
span processor and the official OTLP/HTTP exporter, configured by the standard
``OTEL_*`` variables.

Each case runs in a subprocess (a process registers its tracer provider once)
that exports to a real OTLP/HTTP receiver.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.otlp_receiver import OtlpReceiver

_PROBE = """
import sys
from opentelemetry import trace
from flowdecision.observability import tracing
shutdown = tracing.start_sdk()
print("provider", type(trace.get_tracer_provider()).__name__)
with tracing.SpanScope("probe", attributes={"flowdecision.n": 1}):
    pass
# A caller's sampled trace context is honoured whatever the ratio.
parent = tracing.context_of("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
with tracing.SpanScope("child of a sampled caller", parent=parent):
    pass
tracing.start_sdk()()  # a second call keeps the first provider (and stops nothing)
with tracing.SpanScope("after a second start"):
    pass
shutdown()  # exports what the batch processor holds
"""


@pytest.fixture(name="receiver")
def receiver_fixture() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def _probe(receiver: OtlpReceiver, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    environment.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, **env)
    return subprocess.run(
        [sys.executable, "-c", _PROBE], env=environment, capture_output=True, text=True, timeout=60
    )


def test_start_sdk_exports_over_otlp_http_as_the_variables_say(receiver: OtlpReceiver) -> None:
    done = _probe(
        receiver,
        OTEL_SERVICE_NAME="probe-service",
        OTEL_EXPORTER_OTLP_HEADERS="x-tenant=acme",
        OTEL_EXPORTER_OTLP_TRACES_COMPRESSION="gzip",
    )
    assert done.returncode == 0, done.stderr
    assert "provider TracerProvider" in done.stdout
    [probe] = receiver.named("probe")
    assert len(receiver.named("after a second start")) == 1
    assert probe.service_name == "probe-service"
    assert probe.attributes == {"flowdecision.n": 1}
    [child] = receiver.named("child of a sampled caller")
    assert (child.trace_id, child.parent_span_id) == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
    )
    assert {h["x-tenant"] for h in receiver.headers} == {"acme"}
    assert {h["content-encoding"] for h in receiver.headers} == {"gzip"}
    assert {h["content-type"] for h in receiver.headers} == {"application/x-protobuf"}


def test_the_service_name_defaults_to_flowdecision(receiver: OtlpReceiver) -> None:
    assert _probe(receiver).returncode == 0
    assert {span.service_name for span in receiver.spans} == {"flowdecision"}


def test_a_sampler_ratio_drops_new_traces_but_keeps_a_sampled_callers(
    receiver: OtlpReceiver,
) -> None:
    done = _probe(
        receiver,
        OTEL_TRACES_SAMPLER="parentbased_traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0",
    )
    assert done.returncode == 0, done.stderr
    assert [span.name for span in receiver.spans] == ["child of a sampled caller"]


def test_the_console_exporter_or_none(receiver: OtlpReceiver) -> None:
    console = _probe(receiver, OTEL_TRACES_EXPORTER="console")
    assert console.returncode == 0, console.stderr
    assert '"name": "probe"' in console.stdout
    none = _probe(receiver, OTEL_TRACES_EXPORTER="none")
    assert none.returncode == 0, none.stderr
    assert "provider TracerProvider" in none.stdout
    assert receiver.posts == 0


def test_an_unknown_exporter_is_refused_by_name(receiver: OtlpReceiver) -> None:
    done = _probe(receiver, OTEL_TRACES_EXPORTER="otlp,jaeger")
    assert done.returncode != 0
    assert "OTEL_TRACES_EXPORTER `jaeger` is not supported here: use otlp, console or none" in (
        done.stderr
    )
    assert receiver.posts == 0
