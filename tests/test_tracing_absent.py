"""Without the `otel` extra (and with it installed but unused) flowdecision loads no
OpenTelemetry module: checked in subprocesses where a ``sitecustomize`` hides the
package from the import system and writes down every attempt to import it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx

from tests.service_process import ServiceProcess, decision

ROOT = Path(__file__).resolve().parent.parent

_BLOCKER = """
import sys

class _NoOpenTelemetry:
    # Hides the `otel` extra: importing any opentelemetry module fails, and the
    # attempt is written down, so a test can tell "never tried" from "tried and failed".
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            with open({log!r}, "a") as log:
                log.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NoOpenTelemetry())
"""

_SCRIPT = """
import asyncio, sys
from flowdecision import Dispatcher
from flowdecision.observability import tracing
from flowdecision.client import SyncDecisionClient
from flowdecision.ledger import SqliteLedger
from flowdecision.service.app import create_app
from flowdecision.sinks import OutboxSink
from flowdecision.sinks.webhook import WebhookSink
from tests.helpers import request

async def main():
    path = sys.argv[1]
    ledger = await SqliteLedger.open(path)
    outbox = await OutboxSink(f"sqlite:///{path}").open()
    dispatcher = Dispatcher("production", outbox, ledger)
    assert (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted
    assert not (await dispatcher.dispatch(request(decision_id="dec-1"))).submitted
    entry = await outbox.get("dec-1")
    assert entry.traceparent is None
    record = await ledger.read_record("dec-1")
    assert record.traceparent is None
    await outbox.close()
    await ledger.close()

asyncio.run(main())
assert not tracing.active()
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
print("loaded:", loaded)
assert not loaded, loaded
import os
print("attempts by flowdecision:", os.path.exists(sys.argv[2]))
try:  # last: this attempt is the script's own
    import opentelemetry.trace
except ImportError:
    print("api installed: False")
else:
    print("api installed: True")
"""


def _env(tmp_path: Path, blocked: bool) -> dict[str, str]:
    paths = [str(ROOT / "src"), str(ROOT)]
    if blocked:
        paths.insert(0, str(tmp_path / "site"))
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("FLOWDECISION_", "OTEL_"))},
        "PYTHONPATH": os.pathsep.join(paths),
    }


def _blocker(tmp_path: Path) -> Path:
    log = tmp_path / "otel-imports.log"
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCKER.format(log=str(log)))
    return log


def _run_script(tmp_path: Path, blocked: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(tmp_path / "flowdecision.db"),
         str(tmp_path / "otel-imports.log")],
        capture_output=True, text=True, timeout=120, env=_env(tmp_path, blocked), cwd=ROOT,
    )  # fmt: skip


def test_without_the_extra_the_library_runs_and_never_tries_opentelemetry(
    tmp_path: Path,
) -> None:
    log = _blocker(tmp_path)
    done = _run_script(tmp_path, blocked=True)
    assert done.returncode == 0, done.stderr
    assert "api installed: False" in done.stdout  # the blocker really hides it
    assert "loaded: []" in done.stdout
    # Not even an attempt: flowdecision looks in sys.modules, never imports.
    assert "attempts by flowdecision: False" in done.stdout
    assert log.read_text().split() == ["opentelemetry"]  # the script's own, last


def test_installed_but_unused_loads_nothing_either(tmp_path: Path) -> None:
    done = _run_script(tmp_path, blocked=False)
    assert done.returncode == 0, done.stderr
    assert "api installed: True" in done.stdout
    assert "loaded: []" in done.stdout


def test_the_service_serves_without_the_extra_and_never_tries_it(tmp_path: Path) -> None:
    log = _blocker(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src"), str(ROOT)])}
    with ServiceProcess(tmp_path, env=env) as service:
        answer = httpx.post(
            f"{service.url}/v1/decisions",
            content=decision().to_json(),
            headers={
                "Content-Type": "application/json",
                # A caller's trace context is ignored without the extra, not an error.
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            },
            timeout=30,
        )
        assert answer.status_code == 201, answer.text
        health = httpx.get(f"{service.url}/healthz", timeout=30)
        assert health.status_code == 200
    assert not log.exists(), log.read_text()
