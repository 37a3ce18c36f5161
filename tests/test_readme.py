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

    def run(*command: str, cwd: Path = tmp_path) -> str:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    with ServiceProcess(tmp_path) as service:
        by_curl = run("bash", "-ec", curl.replace(DEFAULT_URL, service.url))
        by_client = run(sys.executable, "-c", client.replace(DEFAULT_URL, service.url))
        cli = cli.replace("flowdecision submit -", f"flowdecision submit --url {service.url} -")
        by_cli = run("bash", "-ec", cli, cwd=ROOT)  # in the checkout, PATH as it is
    assert by_curl.startswith('{"outcome":"submitted","decision_id":"dec-1","attempt":1,')
    assert by_client.splitlines()[0] == "duplicate 1"
    assert by_client.splitlines()[1].startswith("sha256:")
    assert by_cli == "duplicate dec-1 attempt 1\n"


def test_the_docs_never_reuse_a_decision_id_for_other_content() -> None:
    # A reader who follows README.md and then docs/SERVICE.md against one service must
    # not get a 409: every request body shown under one id is the same request.
    import json

    seen: dict[str, tuple[str, str]] = {}
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for body in re.findall(r"'(\{[^']*\"causation_event_id\"[^']*\})'", doc.read_text()):
            parsed = json.loads(body)
            content = json.dumps(parsed, sort_keys=True)
            first = seen.setdefault(parsed["decision_id"], (doc.name, content))
            assert first[1] == content, (
                f"{doc.name} sends `{parsed['decision_id']}` with other content than {first[0]}"
            )
    assert len(seen) >= 2  # the README's and SERVICE.md's examples were found


def test_the_cli_example_runs_as_written_after_make_run() -> None:
    # `make run` installs into .venv/bin, which is not on PATH: the README must say so.
    [cli] = [b for b in _blocks("sh") if "flowdecision submit -" in b]
    assert ".venv/bin/flowdecision submit -" in cli
