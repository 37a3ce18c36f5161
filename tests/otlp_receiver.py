"""A minimal OTLP/HTTP trace receiver on localhost: what a collector would get, decoded.

``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest`` (gzip or
not) is answered 200 and every span kept as a :class:`ReceivedSpan`, and each
POST's headers in :attr:`OtlpReceiver.headers`. A test can queue refusals
(:attr:`OtlpReceiver.refuse`: statuses answered first, with ``Retry-After: 0``),
close every connection after its answer (``close_connections``), or serve TLS
(``tls=(certfile, keyfile)``).
"""

from __future__ import annotations

import gzip
import http.server
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    attributes: dict[str, Any]
    events: list[str]
    links: list[tuple[str, str]]
    service_name: str | None
    resource: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver:
    def __init__(self, tls: tuple[str, str] | None = None) -> None:
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self.headers: list[dict[str, str]] = []
        self.refuse: list[int] = []
        self.close_connections = False
        self.connections = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with receiver._lock:
                    receiver.connections += 1

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                    refusal = receiver.refuse.pop(0) if receiver.refuse else None
                if refusal is not None:
                    self.send_response(refusal)
                    self.send_header("Retry-After", "0")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._keep(request)
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                if receiver.close_connections:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        scheme = "http"
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            scheme = "https"
        self.endpoint = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        found: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            status_code=span.status.code,
                            status_message=span.status.message,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[event.name for event in span.events],
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in span.links],
                            service_name=resource.get("service.name"),
                            resource=resource,
                        )
                    )
        with self._lock:
            self.posts += 1
            self.spans.extend(found)

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.name == name]

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
