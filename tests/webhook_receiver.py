"""A real local HTTP server that plays a workflow engine's webhook endpoint.

``script`` is a list of ``(status, headers)`` answers used in order (the last
one repeats); the special status ``0`` closes the connection without answering.
Every request is recorded as ``(path, headers, body)``. ``delay_s`` slows each
answer down; ``most_in_flight`` is the most requests it ever served at once.
"""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any


class _Server(http.server.ThreadingHTTPServer):
    # socketserver's listen backlog is 5: 64 clients connecting at once overflow it and
    # wait out TCP's one-second SYN retry (a stall of the receiver, not of the sender).
    request_queue_size = 256


class WebhookReceiver:
    def __init__(self, script: list[tuple[int, dict[str, str]]] | None = None, port: int = 0):
        self.script = list(script or [(200, {})])
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.delay_s = 0.0
        self.in_flight = 0
        self.most_in_flight = 0
        self.stopped = False
        #: decision ids (the Idempotency-Key) answered 400: refused for good
        self.refuse: set[str] = set()
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                if receiver.stopped:  # a kept-alive connection outliving stop(): drop it
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.in_flight += 1
                    receiver.most_in_flight = max(receiver.most_in_flight, receiver.in_flight)
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                with receiver._lock:
                    receiver.in_flight -= 1
                    receiver.requests.append((self.path, dict(self.headers.items()), body))
                    status, headers = (
                        receiver.script.pop(0) if len(receiver.script) > 1 else receiver.script[0]
                    )
                    if self.headers.get("Idempotency-Key") in receiver.refuse:
                        status, headers = 400, {}
                if status == 0:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                payload = b'{"ok":true}' if status < 300 else b'{"error":"nope"}'
                if status == 204:  # a 204 has no content (RFC 9110 15.3.5): sending one
                    payload = b""  # corrupts the kept-alive connection's next answer
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = _Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks/decisions"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def set_script(self, script: list[tuple[int, dict[str, str]]]) -> None:
        with self._lock:
            self.script = list(script)

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped = True
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
