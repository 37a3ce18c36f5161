"""examples/05_procrastinate_sink.py runs as a real subprocess against the test PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.service_process import ROOT


def run_example(url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["FLOWDECISION_EXAMPLE_POSTGRES_URL"] = url
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "05_procrastinate_sink.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_the_procrastinate_example_runs_its_job_once(pg_empty_url: str) -> None:
    done = run_example(pg_empty_url)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "applied procrastinate's schema" in lines
    assert "first dispatch submitted: True" in lines
    assert "second dispatch submitted: False" in lines
    assert "crash-window re-submission deferred: False" in lines
    assert "re-submission after the job ran deferred: False" in lines
    assert lines.count("job ran: example-procrastinate-1 (complete)") == 1
    assert lines[-1] == "the job ran 1 time(s)"
    # A second run on the same database: the decision was deferred before, so no job
    # runs at all even though the example's SQLite ledger is brand-new.
    again = run_example(pg_empty_url)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "first dispatch submitted: True" in again.stdout.splitlines()
    assert again.stdout.splitlines()[-1] == "the job ran 0 time(s)"
