"""The README's code runs as written: the library quick start is examples/01 (run by
tests/test_examples.py), and curl, the client and the CLI submit the same decision to a
real service."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.service_process import ROOT, ServiceProcess

README = ROOT / "README.md"
DEFAULT_URL = "http://127.0.0.1:8080"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.DOTALL)


def test_library_quick_start_is_the_first_example() -> None:
    blocks = _blocks("python")
    assert blocks, "README has no python quick start"
    example = (ROOT / "examples" / "01_library_quickstart.py").read_text()
    assert blocks[0] == example, "README's quick start and examples/01 differ"


def test_curl_client_and_cli_submit_the_same_decision(tmp_path: Path) -> None:
    [curl] = [b for b in _blocks("sh") if "curl -sS -X POST" in b and "dec-1" in b]
    [client] = [b for b in _blocks("py") if "SyncDecisionClient" in b]
    [cli] = [b for b in _blocks("sh") if "flowdecision submit -" in b]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])

    def run(*command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    with ServiceProcess(tmp_path) as service:
        by_curl = run("bash", "-ec", curl.replace(DEFAULT_URL, service.url))
        by_client = run(sys.executable, "-c", client.replace(DEFAULT_URL, service.url))
        cli = cli.replace("flowdecision submit -", f"flowdecision submit --url {service.url} -")
        by_cli = run("bash", "-ec", cli)
    assert by_curl.startswith('{"outcome":"submitted","decision_id":"dec-1","attempt":1,')
    assert by_client.splitlines()[0] == "duplicate 1"
    assert by_client.splitlines()[1].startswith("sha256:")
    assert by_cli == "duplicate dec-1 attempt 1\n"
