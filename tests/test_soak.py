"""The soak, short: ``bench/soak.py`` runs ``serve`` on its default layout at a
fixed rate and samples it (the full 30-minute run and its plots are in
docs/BENCHMARKS.md, "Soak"). Here: 45 s at 100 decisions/s, checking what does
not depend on the machine's speed: every request answered 201, every decision
in the ledger and the outbox, every series sampled, no descriptor leak, the WAL
checkpointed (bounded).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_soak_answers_everything_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--rate",
            "100",
            "--minutes",
            "0.75",
            "--warmup-s",
            "15",
            "--sample-s",
            "3",
            "--connections",
            "8",
            "--json",
            str(out),
            "--no-judge",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    verdict, samples = result["verdict"], result["samples"]
    requests = verdict["requests"]
    assert requests["errors"] == 0 and requests["sent"] == 4500, requests
    assert requests["ledger_rows"] == requests["outbox_rows"] == 4500
    assert len(samples) >= 10
    for sample in samples:
        assert sample["rss_mib"] > 10 and sample["fds"] > 5 and sample["metrics_series"] > 10
    assert verdict["fds"]["met"], verdict["fds"]  # no descriptor leak
    assert verdict["wal"]["met"] and samples[-1]["wal_mib"] > 0, verdict["wal"]
    assert sum(m["sent"] for m in result["minutes"]) == 4500
    assert "soak" in proc.stdout  # the report was printed
