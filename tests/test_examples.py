"""Every script in examples/ runs as a subprocess and does what it says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_process import ROOT

EXAMPLES = ROOT / "examples"


def _example(
    name: str, args: list[str], *, cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python examples/NAME ARGS`` (relative to ``cwd`` when it is the checkout)."""
    script = f"examples/{name}" if cwd == ROOT else str(EXAMPLES / name)
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _run(name: str, *args: str, cwd: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    return _example(name, list(args), cwd=cwd, env=env).stdout.splitlines()


def test_every_example_is_listed() -> None:
    listed = (EXAMPLES / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for script in sorted(EXAMPLES.glob("[0-9]*.py")):
        assert f"({script.name})" in listed, f"{script.name} is not in examples/README.md"
        assert f"(examples/{script.name})" in readme, f"README.md does not point to {script.name}"


def test_01_library_quickstart(tmp_path: Path) -> None:
    lines = _run("01_library_quickstart.py", str(tmp_path), cwd=tmp_path)
    assert lines[:3] == ["engine accepted dec-1 attempt 1", "submitted 1", "duplicate False"]
    assert "'completed': 1" in lines[3] and "'duplicates': 1" in lines[3]
    assert (tmp_path / "ledger.db").exists()
    # The ledger is durable: a second run (a restart) submits nothing again.
    rerun = _run("01_library_quickstart.py", str(tmp_path), cwd=tmp_path)
    assert rerun[:2] == ["duplicate 1", "duplicate False"]


def test_08_approval_hold_delivers_the_approved_step_once(tmp_path: Path) -> None:
    lines = _run("08_approval_hold.py", str(tmp_path), cwd=tmp_path)
    assert lines == [
        "agent: lookup-order submitted",
        "agent: refund-order-7 held",
        "operator: approved `refund-order-7` (was held, attempts 1); audit #1",
        "agent: refund-order-7 is now completed",
        "agent retries: refund-order-7 duplicate",
        "outbox: ['lookup-order', 'refund-order-7']",
        "audit: approve refund-order-7 by alice: customer verified by phone (was held)",
        "service stopped with exit code 0",
    ]
    assert (tmp_path / "flowdecision.db").exists()


def test_02_two_processes_one_killed(tmp_path: Path) -> None:
    lines = _run("02_two_processes.py", str(tmp_path), cwd=tmp_path)
    assert "B: dec-04 duplicate" in lines and "B: dec-05 submitted" in lines
    assert any(line.startswith("B: dec-05 busy") for line in lines)
    assert lines[-1] == "each decision submitted exactly once"
    engine = (tmp_path / "engine.log").read_text().splitlines()
    assert sorted(line.split()[0] for line in engine) == [f"dec-{n:02d}" for n in range(1, 13)]
    assert "dec-05 attempt=2 worker=B" in engine  # taken over after the lease expired


def test_03_service_and_client(tmp_path: Path) -> None:
    lines = _run("03_service_and_client.py", str(tmp_path), cwd=tmp_path)
    assert lines[1:] == [
        "submitted dec-1 attempt 1",
        "duplicate same receipt: True",
        "claim: completed attempts 1",
        "outbox: [(1, 'dec-1')]",
        "conflict: ServiceConflictError dec-1",
        "health: healthy completed 1",
        "service stopped with exit code 0",
    ]


def _needs_postgres(name: str) -> bool:
    """Whether examples/README.md says the example takes a PostgreSQL URL."""
    listed = (EXAMPLES / "README.md").read_text()
    line = next(line for line in listed.splitlines() if f"({name})" in line)
    return "POSTGRES_URL" in line


#: What each example prints last when it did what it says (checked on an empty store).
LAST_LINES = {
    "01_library_quickstart.py": re.compile(r"\{'status': 'healthy'.*'completed': 1"),
    "02_two_processes.py": re.compile(r"each decision submitted exactly once"),
    "03_service_and_client.py": re.compile(r"service stopped with exit code 0"),
    "04_postgres_two_hosts.py": re.compile(
        r"outbox: 40 of 40 decisions, each delivered once: True"
    ),
    "05_procrastinate_sink.py": re.compile(r"the job ran 1 time\(s\)"),
    "06_temporal_sink.py": re.compile(r"each step scheduled once: True"),
    "07_restate_sink.py": re.compile(r"each decision applied once: True"),
    "08_approval_hold.py": re.compile(r"service stopped with exit code 0"),
}


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("[0-9]*.py")))
def test_every_example_runs_from_an_empty_store_as_its_readme_says(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Exactly examples/README.md's command, from the checkout: `python examples/NAME.py`,
    # plus a PostgreSQL URL for those that say so, and that URL names a brand-new,
    # unmigrated database (what a user has after `createdb`). Nothing else is prepared:
    # no directory argument, no PYTHONPATH (the package is installed), no FLOWDECISION_*.
    args = [request.getfixturevalue("pg_empty_url")] if _needs_postgres(name) else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env.pop("PYTHONPATH", None)
    env["TMPDIR"] = str(tmp_path)  # the examples' default directories land here
    done = _example(name, args, cwd=ROOT, env=env)
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert name in LAST_LINES, f"say what {name} prints when it works"
    assert lines and LAST_LINES[name].search(lines[-1]), done.stdout
    if name == "04_postgres_two_hosts.py":
        assert "submitted in all: 40 (one per decision)" in lines
        assert len([line for line in lines if line.startswith("host-")]) == 2
