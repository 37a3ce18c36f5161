"""Every script in examples/ runs as a subprocess and does what it says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.service_process import ROOT

EXAMPLES = ROOT / "examples"


def _run(name: str, *args: str, cwd: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout.splitlines()


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
    assert _run("01_library_quickstart.py", str(tmp_path), cwd=tmp_path)[:2] == [
        "duplicate False",
        "duplicate False",
    ]


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


def test_04_postgres_two_hosts(tmp_path: Path, pg_url: str) -> None:
    lines = _run("04_postgres_two_hosts.py", pg_url, cwd=tmp_path)
    assert "submitted in all: 40 (one per decision)" in lines
    assert "outbox: 40 of 40 decisions, each delivered once: True" in lines
    hosts = [line for line in lines if line.startswith("host-")]
    assert len(hosts) == 2
