"""Run ``flowdecision serve`` as a real subprocess on a random port (for the service tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowdecision.core.model import Complete, DecisionRequest, DecisionStep, ScheduleStep

ROOT = Path(__file__).resolve().parent.parent


def decision(
    decision_id: str | None = None,
    *,
    branch: str = "production",
    run_id: str | None = None,
    n: int = 1,
    step: bool = True,
) -> DecisionRequest:
    """A valid request; change ``n`` to get different content under the same id.

    A step's run is ``run-1`` unless named; a ``complete`` (``step=False``) gets
    a run of its own (``run-<id>``), as a run takes one ``complete``.
    """
    decision_id = decision_id or f"dec-{uuid.uuid4().hex[:12]}"
    if run_id is None:
        run_id = "run-1" if step else f"run-{decision_id}"
    chosen = (
        ScheduleStep(
            step=DecisionStep(step_id=f"{decision_id}-s", step_name="fetch", input={"n": n})
        )
        if step
        else Complete(output={"n": n})
    )
    return DecisionRequest(
        decision_id=decision_id,
        run_id=run_id,
        authority_branch_id=branch,
        causation_event_id=f"event-{decision_id}",
        decision=chosen,
    )


class ServiceProcess:
    """``python -m flowdecision.cli serve --port 0 ...`` in ``cwd``; ``url`` once ready."""

    def __init__(
        self,
        cwd: Path,
        *args: str,
        token: str | None = None,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.cwd = cwd
        self.token = token
        self.stderr_path = cwd / f"service-{uuid.uuid4().hex[:6]}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
        full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        full_env["PYTHONUNBUFFERED"] = "1"
        if token is not None:
            full_env["FLOWDECISION_TOKEN"] = token
        full_env.update(env or {})
        self._stderr = open(self.stderr_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0", *args],
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            preexec_fn=preexec_fn,
        )
        self.stdout_lines: list[str] = []
        self.url = self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> str:
        found: list[str] = []
        done = threading.Event()

        def reader() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.stdout_lines.append(line)
                if line.startswith("flowdecision serving on ") and not found:
                    found.append(line.split()[-1])
                if found and line.strip().startswith("curl "):  # the last line printed
                    done.set()
            done.set()

        threading.Thread(target=reader, daemon=True).start()
        done.wait(timeout)
        if not found:
            self.stop()
            raise RuntimeError(
                f"service did not start (exit {self.proc.returncode}):\n"
                + "\n".join(self.stdout_lines)
                + "\n"
                + self.log_text()[-4000:]
            )
        return found[0]

    @property
    def headers(self) -> dict[str, str]:
        """What a well-behaved client sends: the JSON content type and the token, if any."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def log_text(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
        return self.proc.returncode

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.02) -> None:
    """Poll ``predicate()`` until it is truthy (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)
