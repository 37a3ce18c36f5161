"""The status page in a real headless Chromium (Debian's ``chromium``; ``make test``
installs it when missing)."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from flowdecision.core.model import DecisionRequest
from tests.service_process import ServiceProcess, decision

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "browser-token-51c0"


def dump_dom(url: str, profile: Path, *extra: str) -> str:
    """Load ``url`` in headless Chromium and return the DOM it rendered."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: run `make test` (it installs Debian's chromium)")
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            *extra,
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_status_page_shows_health_and_a_submitted_decision(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, token=TOKEN) as service:
        submitted = decision(run_id="run-browser")
        forked = decision(branch="fork-7")
        with httpx.Client(base_url=service.url, headers=service.headers) as client:
            assert client.post("/v1/decisions", content=submitted.to_json()).status_code == 201
            assert client.post("/v1/decisions", content=forked.to_json()).status_code == 403

        # The browser authenticates like an operator would: the token as a Basic password.
        host = service.url.removeprefix("http://")
        dom = dump_dom(f"http://operator:{TOKEN}@{host}/", tmp_path / "profile")

    assert re.search(r'<span id="health" class="badge healthy">healthy</span>', dom), dom[:2000]
    assert '<meta http-equiv="refresh"' in dom
    assert "<script" not in dom
    recent = dom[dom.index('id="recent"') :]
    row = recent[recent.index(submitted.decision_id) :]
    row = row[: row.index("</tr>")]
    assert "run-browser" in row and 'class="fate-submitted"' in row
    assert forked.decision_id in recent and "forbidden_branch" in recent
    assert re.search(r'id="counter-completed">completed<b>1</b>', dom)
    assert re.search(r'id="counter-rejected">rejected<b>1</b>', dom)
    assert TOKEN not in dom


def test_status_page_without_credentials_is_refused_in_the_browser(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, token=TOKEN) as service:
        dom = dump_dom(f"{service.url}/", tmp_path / "profile")
    assert "Recent decisions" not in dom


# -- browser and host safety (another origin, DNS rebinding) ----------------------------

ATTACK_PAGE = """<!doctype html><html><body><p id="result">pending</p><script>
(async () => {
  const out = [];
  try {
    await fetch(SERVICE + "/v1/decisions", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body: PLAIN});
    out.push("plain:sent");
  } catch (error) { out.push("plain:" + error.name); }
  try {
    const response = await fetch(SERVICE + "/v1/decisions", {method: "POST",
      headers: JSON_HEADERS, body: JSON_BODY});
    out.push("json:" + response.status);
  } catch (error) { out.push("json:" + error.name); }
  document.getElementById("result").textContent = out.join(" ");
})();
</script></body></html>"""


def _page(
    service_url: str, plain: DecisionRequest, as_json: DecisionRequest, headers: dict[str, str]
) -> str:
    return (
        ATTACK_PAGE.replace("SERVICE", json.dumps(service_url))
        .replace("PLAIN", json.dumps(plain.to_json().decode()))
        .replace("JSON_BODY", json.dumps(as_json.to_json().decode()))
        .replace("JSON_HEADERS", json.dumps(headers))
    )


@contextmanager
def serve_page(html: str | list[str], port: int = 0) -> Iterator[int]:
    """A web server on another port (another origin) that serves ``html``; yields its port.

    ``html`` may be a one-item list filled in after the port is known.
    """

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (html if isinstance(html, str) else html[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_on_another_origin_cannot_submit_a_decision(tmp_path: Path) -> None:
    # The token-less default of `make run`: the exposure the guard exists for.
    with ServiceProcess(tmp_path) as service:
        plain, as_json = decision(), decision()
        page = _page(service.url, plain, as_json, {"Content-Type": "application/json"})
        with serve_page(page) as port:
            dom = dump_dom(
                f"http://attacker.test:{port}/",
                tmp_path / "profile",
                "--host-resolver-rules=MAP attacker.test 127.0.0.1",
                "--virtual-time-budget=15000",
            )
        # Both requests were made: the simple one reached the service, the JSON one
        # was stopped at its preflight.
        assert re.search(r'<p id="result">plain:sent json:TypeError</p>', dom), dom[:2000]
        with httpx.Client(base_url=service.url) as client:
            for request in (plain, as_json):
                assert client.get(f"/v1/decisions/{request.decision_id}").status_code == 404
            assert client.get("/healthz").json()["attempted"] == 0
        access = [
            json.loads(line) for line in service.log_text().splitlines() if "http_request" in line
        ]
        refused = {
            (entry["method"], entry["status"])
            for entry in access
            if entry["path"] == "/v1/decisions"
        }
        assert ("POST", 403) in refused, access
        assert ("OPTIONS", 403) in refused, access


def test_dns_rebinding_to_the_loopback_service_is_refused(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path) as service:
        port = service.url.rsplit(":", 1)[1]
        # The attacker's name now resolves to 127.0.0.1: the browser sends `Host: rebind.test`.
        dom = dump_dom(
            f"http://rebind.test:{port}/",
            tmp_path / "profile",
            "--host-resolver-rules=MAP rebind.test 127.0.0.1",
        )
        assert "Recent decisions" not in dom
        assert "host_not_allowed" in dom
        with httpx.Client(base_url=service.url) as client:  # by its own name it still answers
            assert "Recent decisions" in client.get("/").text


def test_a_console_on_an_allowed_origin_can_call_the_api_with_its_token(tmp_path: Path) -> None:
    page: list[str] = [""]
    with serve_page(page) as port:
        origin = f"http://console.test:{port}"
        with ServiceProcess(tmp_path, "--allowed-origins", origin, token=TOKEN) as service:
            plain, as_json = decision(), decision()
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
            page[0] = _page(service.url, plain, as_json, headers)
            dom = dump_dom(
                f"{origin}/",
                tmp_path / "profile",
                "--host-resolver-rules=MAP console.test 127.0.0.1",
                "--virtual-time-budget=15000",
            )
            # The preflight passed (before auth), the JSON POST was answered and readable.
            assert re.search(r'<p id="result">plain:sent json:201</p>', dom), dom[:2000]
            with httpx.Client(base_url=service.url, headers=service.headers) as client:
                assert client.get(f"/v1/decisions/{as_json.decision_id}").status_code == 200
                # The simple request had no token (and the wrong type): nothing recorded.
                assert client.get(f"/v1/decisions/{plain.decision_id}").status_code == 404
