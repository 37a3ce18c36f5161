"""The status page in a real headless Chromium (Debian's ``chromium``; ``make test``
installs it when missing)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.service_process import ServiceProcess, decision

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "browser-token-51c0"


def dump_dom(url: str, profile: Path) -> str:
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
