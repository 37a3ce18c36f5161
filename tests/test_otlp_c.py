"""The C span encoder (``flowdecision._otlp``, built by ``pip install``) against the
Python one and the SDK's: the same bytes for every span it takes, None (the Python
encoder's turn) for every span it does not, no references leaked."""

from __future__ import annotations

import enum
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowdecision.errors import InvalidArgumentError
from flowdecision.tracer import LeanSpan, LeanTracerProvider, _span, c_encoder, encode_spans

REMOTE = trace.SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=trace.TraceFlags(1),
)
LOCAL = trace.SpanContext(
    0xFFFFFFFFFFFFFFFF0000000000000001, 0x1, is_remote=False, trace_flags=trace.TraceFlags(1)
)
LIMITS = SpanLimits(max_span_attributes=40, max_links=2)


@pytest.fixture(scope="module")
def fast() -> Any:
    encoder = c_encoder()
    # make test builds the extension (setup.py): the C encoder is the one in use
    assert encoder is not None and encoder.__module__ == "flowdecision._otlp"
    return encoder


def _tracer(limits: SpanLimits | None = None) -> tuple[Any, InMemorySpanExporter]:
    provider = LeanTracerProvider(
        resource=Resource.create({"service.name": "flowdecision"}), span_limits=limits
    )
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider.get_tracer("flowdecision", "0.1.0"), memory


def _common_spans() -> list[Any]:
    """What a service ends: every kind, scalar attributes at the varints' edges, a
    remote and a local parent, links without attributes, dropped counts, statuses."""
    tracer, memory = _tracer(LIMITS)
    attributes: dict[str, Any] = {
        "text": "é ✓ 𝄞",
        "empty": "",
        "long": "x" * 300,
        "longer": "y" * 20_000,
        "yes": True,
        "no": False,
        "zero": 0,
        "small": 127,
        "two": 128,
        "status": 201,
        "edge": 16383,
        "over": 16384,
        "big": 2**40,
        "top": 2**63 - 1,
        "negative": -5,
        "bottom": -(2**63),
        "ratio": 0.25,
        "nothing": 0.0,
        "minus": -1.5e300,
        "k" * 130: 1,
        "t" * 120: "short",
    }
    parent = trace.set_span_in_context(trace.NonRecordingSpan(REMOTE))
    local = trace.set_span_in_context(trace.NonRecordingSpan(LOCAL))
    with tracer.start_as_current_span(
        "POST /v1/decisions", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
    ) as server:
        server.add_link(REMOTE)
        server.add_link(LOCAL)
        server.add_link(REMOTE)  # over the limit of two: counted as dropped
        with tracer.start_as_current_span("flowdecision.dispatch") as dispatch:
            dispatch.set_attributes({f"a{n}": n for n in range(30)})  # over 40 in all: dropped
            dispatch.set_status(trace.Status(trace.StatusCode.ERROR, "sink_failed ✗"))
        server.set_status(trace.StatusCode.OK)
    for kind in trace.SpanKind:
        tracer.start_span(f"root {kind.name}", context=local, kind=kind).end()
    span = tracer.start_span("errored")
    span.set_status(trace.StatusCode.ERROR)
    span.end()
    tracer.start_span("n" * 200, start_time=0).end(end_time=2**64 - 1)
    return list(memory.get_finished_spans())


def test_every_common_span_is_encoded_in_c_to_the_python_and_sdk_bytes(fast: Any) -> None:
    spans = _common_spans()
    assert len(spans) == 9
    for span in spans:
        encoded = fast(span)
        assert encoded is not None, span.name
        assert encoded == _span(span), span.name
    assert encode_spans(spans) == sdk_encode(spans).SerializeToString()


class Color(enum.IntEnum):
    RED = 1


def _rare_spans() -> list[tuple[str, Any]]:
    """Spans the C encoder leaves to Python, each for one reason."""
    tracer, memory = _tracer()
    state = trace.SpanContext(
        REMOTE.trace_id,
        REMOTE.span_id,
        is_remote=True,
        trace_flags=trace.TraceFlags(1),
        trace_state=trace.TraceState([("vendor", "v1")]),
    )
    reasons: list[str] = []

    def end(reason: str, span: Any) -> None:
        reasons.append(reason)
        span.end()

    span = tracer.start_span("events")
    span.add_event("flowdecision.takeover", {"flowdecision.attempt": 2})
    end("an event", span)
    end(
        "a trace state",
        tracer.start_span(
            "state", context=trace.set_span_in_context(trace.NonRecordingSpan(state))
        ),
    )
    end("a list value", tracer.start_span("list", attributes={"words": ["a", "b"]}))
    end("an IntEnum value", tracer.start_span("enum", attributes={"color": Color.RED}))
    end("an int over 63 bits", tracer.start_span("huge", attributes={"huge": 2**63}))
    end("an int under -2**63", tracer.start_span("tiny", attributes={"tiny": -(2**63) - 1}))
    end("a lone surrogate", tracer.start_span("surrogate", attributes={"s": "a\udc80b"}))
    end("a lone surrogate in a name", tracer.start_span("\udc80"))
    end("a link with attributes", tracer.start_span("link", links=[trace.Link(REMOTE, {"k": "v"})]))
    wide = trace.SpanContext(1 << 128, 1, is_remote=False)  # invalid: the API takes it as is
    negative = trace.SpanContext(1, -1, is_remote=False)
    end("a trace id over 128 bits", tracer.start_span("wide", links=[trace.Link(wide)]))
    end("a negative span id", tracer.start_span("negative", links=[trace.Link(negative)]))
    return list(zip(reasons, memory.get_finished_spans(), strict=True))


def test_rare_spans_are_left_to_python_and_still_encoded_as_the_sdk_does(fast: Any) -> None:
    rare = _rare_spans()
    for reason, span in rare:
        assert fast(span) is None, reason
    # The SDK refuses lone surrogates and ids out of range, as the Python encoder does
    # (ints past int64: the attribute is left out, logged).
    spans = [span for reason, span in rare if not {"surrogate", "id"} & set(reason.split())]
    assert len(spans) == len(rare) - 4
    assert encode_spans(spans) == sdk_encode(spans).SerializeToString()


def test_a_span_without_the_fields_is_left_to_python(fast: Any) -> None:
    assert fast(object()) is None
    span = _common_spans()[0]
    assert fast(span) is not None
    assert fast(span) == _span(span)


def test_no_reference_is_leaked(fast: Any) -> None:
    spans = _common_spans()
    text = "leak-check-value-" + "z" * 10
    tracer, memory = _tracer()
    tracer.start_span("leak", attributes={"id": text}, links=[trace.Link(REMOTE)]).end()
    spans += memory.get_finished_spans()
    watched = [text, REMOTE, REMOTE.trace_id, *spans, *(s.attributes for s in spans)]

    def encode_all(rounds: int) -> list[int]:
        for _ in range(rounds):
            for span in spans:
                fast(span)
        return [sys.getrefcount(item) for item in watched]

    assert encode_all(2_000) == encode_all(1)


scalars = st.one_of(
    st.text(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    name=st.text(min_size=1),
    attributes=st.dictionaries(st.text(min_size=1), scalars, max_size=12),
    kind=st.sampled_from(list(trace.SpanKind)),
    remote_parent=st.booleans(),
    links=st.integers(min_value=0, max_value=3),
)
def test_any_scalar_span_encodes_as_python_does(
    fast: Any, name: str, attributes: dict[str, Any], kind: Any, remote_parent: bool, links: int
) -> None:
    tracer, memory = _tracer()
    context = trace.set_span_in_context(trace.NonRecordingSpan(REMOTE)) if remote_parent else None
    tracer.start_span(
        name, context=context, kind=kind, attributes=attributes, links=[trace.Link(LOCAL)] * links
    ).end()
    (span,) = memory.get_finished_spans()
    assert isinstance(span, LeanSpan)
    encoded = fast(span)
    text = [name, *span.attributes, *(v for v in span.attributes.values() if isinstance(v, str))]
    if any(_has_surrogate(value) for value in text):
        assert encoded is None
    else:
        assert encoded == _span(span)


def _has_surrogate(value: str) -> bool:
    return any(0xD800 <= ord(char) <= 0xDFFF for char in value)


def _random_text(rng: random.Random, most: int) -> str:
    """Up to ``most`` characters (past one- and two-byte length varints), of every
    UTF-8 width, with a lone surrogate now and then."""
    size = min(most, rng.choice([0, 1, 5, 127, 128, 300, 20_000]))
    piece = "".join(chr(rng.choice(_CODE_POINTS)) for _ in range(8))
    text = (piece * (size // 8 + 1))[:size]
    if text and rng.random() < 0.02:
        at = rng.randrange(len(text))
        text = text[:at] + "\ud800" + text[at + 1 :]
    return text


_CODE_POINTS = [0x20, 0x41, 0x7F, 0x80, 0xE9, 0x7FF, 0x800, 0x2713, 0xFFFF, 0x1D11E]


def _random_value(rng: random.Random) -> Any:
    kind = rng.randrange(4)
    if kind == 0:
        return _random_text(rng, 20_000)
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, 127, 128, 2**31, 2**63 - 1, -1, -(2**63), rng.getrandbits(64)])
    return rng.choice([0.0, -0.0, 1.5, -1e300, 5e-324, rng.uniform(-1e9, 1e9)])


def test_many_random_spans_encode_as_python_does(fast: Any) -> None:
    """Seeded random spans past the generated ones' sizes (make test also runs this
    under ASan and UBSan, tests/c_check.sh): the C bytes are the Python encoder's, or
    None where a text has a lone surrogate or an int is past int64."""
    rng = random.Random(39)
    tracer, memory = _tracer(SpanLimits(max_span_attributes=20, max_links=3))
    statuses = [None, trace.StatusCode.OK, trace.StatusCode.ERROR]
    for _ in range(3_000):
        parent = rng.choice([None, REMOTE, LOCAL])
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        attributes = {
            _random_text(rng, 40) or "k": _random_value(rng) for _ in range(rng.randrange(25))
        }
        span = tracer.start_span(
            _random_text(rng, 200) or "span",
            context=context,
            kind=rng.choice(list(trace.SpanKind)),
            attributes=attributes,
            links=[trace.Link(rng.choice([REMOTE, LOCAL])) for _ in range(rng.randrange(5))],
        )
        status = rng.choice(statuses)
        if status is trace.StatusCode.ERROR:
            span.set_status(trace.Status(status, _random_text(rng, 50) or None))
        elif status is not None:
            span.set_status(status)
        span.end()
    spans = memory.get_finished_spans()
    taken = 0
    for span in spans:
        encoded = fast(span)
        texts = [span.name, *span.attributes, span.status.description or ""]
        texts += [value for value in span.attributes.values() if isinstance(value, str)]
        wide = any(isinstance(v, int) and v >= 2**63 for v in span.attributes.values())
        if wide or any(_has_surrogate(text) for text in texts):
            assert encoded is None
        else:
            assert encoded == _span(span)
            taken += 1
    assert len(spans) == 3_000 and taken > 500


def _c_encoder_in(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from flowdecision.tracer import c_encoder; print(c_encoder())"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_python_encoder_on_request_and_a_bad_choice_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    python = _c_encoder_in({"FLOWDECISION_OTEL_ENCODER": "python"})
    assert python.returncode == 0 and python.stdout.strip() == "None"
    c = _c_encoder_in({"FLOWDECISION_OTEL_ENCODER": "C"})
    assert c.returncode == 0 and "built-in function span" in c.stdout
    monkeypatch.setenv("FLOWDECISION_OTEL_ENCODER", "rust")
    with pytest.raises(InvalidArgumentError, match="FLOWDECISION_OTEL_ENCODER `rust`"):
        c_encoder()


def test_serve_refuses_a_bad_encoder_choice_by_name(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "serve", "--otel", "--port", "0"],
        cwd=tmp_path,
        env={**os.environ, "FLOWDECISION_OTEL_ENCODER": "rust"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "error: FLOWDECISION_OTEL_ENCODER `rust` is not supported: use c or python"
    )


def test_the_batch_processor_encodes_in_c(fast: Any) -> None:
    from flowdecision.tracer import LeanBatchProcessor, LeanOTLPExporter

    processor = LeanBatchProcessor(LeanOTLPExporter(endpoint="http://127.0.0.1:9/v1/traces"))
    try:
        assert processor._fast is fast
    finally:
        processor.shutdown()


def test_without_the_extension_python_encodes_every_span() -> None:
    """As installed where no C compiler was at hand (setup.py builds it optionally)."""
    code = """
import sys

class NoExtension:
    def find_spec(self, name, path=None, target=None):
        if name == "flowdecision._otlp":
            raise ModuleNotFoundError(name, name=name)

sys.meta_path.insert(0, NoExtension())
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from tests.test_otlp_c import _common_spans
from flowdecision.tracer import c_encoder, encode_spans

spans = _common_spans()
assert c_encoder() is None
assert encode_spans(spans) == sdk_encode(spans).SerializeToString()
assert "flowdecision._otlp" not in sys.modules
print("python encoded", len(spans))
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python encoded 9"


class _ShiftFails(int):
    """A trace id whose ``>> 64`` fails as a big int's would out of memory."""

    def __rshift__(self, other: Any) -> Any:
        raise MemoryError("trace id")


class _Fields:
    """A finished span's fields (the C encoder reads any object's), with a read of
    ``dropped_attributes`` -- the next field after the ids -- recorded."""

    def __init__(self, span: Any, context: trace.SpanContext) -> None:
        names = ("parent", "name", "kind", "start_time", "end_time", "attributes")
        names += ("events", "links", "status", "dropped_events", "dropped_links")
        for name in names:
            setattr(self, name, getattr(span, name))
        self.context = context
        self.reads = 0

    @property
    def dropped_attributes(self) -> int:
        self.reads += 1
        return 0


def test_a_failure_ends_the_encoding_with_its_own_error(fast: Any) -> None:
    """A span whose trace id fails to shift (out of memory): the encoder raises that
    MemoryError at once, reading nothing more of the span (no Python run with it
    pending, which would make it a SystemError), and leaks nothing."""
    span = _common_spans()[0]
    context = trace.SpanContext(_ShiftFails(REMOTE.trace_id), REMOTE.span_id, is_remote=False)
    fields = _Fields(span, context)
    with pytest.raises(MemoryError, match=r"^trace id$") as raised:
        fast(fields)
    assert raised.value.__context__ is None
    assert fields.reads == 0
    watched = [fields, context, span.attributes]
    before = [sys.getrefcount(item) for item in watched]
    for _ in range(2_000):
        with pytest.raises(MemoryError):
            fast(fields)
    assert [sys.getrefcount(item) for item in watched] == before
    fields.context = span.context  # the same fields with a plain id: encoded as before
    assert fast(fields) == fast(span) == _span(span)
