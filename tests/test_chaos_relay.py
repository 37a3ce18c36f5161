"""``flowdecision chaos --sink temporal://…``: the harness's dispatchers fill the
outbox while being killed, then relays killed mid-batch and restarted drain it
into a real Temporal server, and Temporal must have applied each decision once,
in seq order (the session's dev server, tests/engine_fixtures.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowdecision.chaos import ChaosConfig
from flowdecision.errors import InvalidArgumentError
from tests.engine_servers import TemporalServer
from tests.service_process import ROOT


def test_chaos_drains_into_temporal_through_killed_relays(
    temporal_server: TemporalServer, tmp_path: Path
) -> None:
    ledger = f"sqlite:///{tmp_path / 'chaos.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "chaos", "--ledger", ledger,
         "--workers", "3", "--decisions", "200", "--kill-every-ms", "400",
         "--pause-every-ms", "600", "--seed", "11", "--timeout", "240", "--json",
         "--workdir", str(tmp_path / "work"),
         "--sink", f"temporal://{temporal_server.address}/default"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.stdout.startswith("{"), done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    failed = {name: c for name, c in report["checks"].items() if not c["passed"]}
    assert done.returncode == 0 and not failed, json.dumps(report, indent=2) + done.stderr[-3000:]
    assert {"relay_delivered", "engine_exactly_once", "engine_seq_order"} <= set(report["checks"])
    assert report["figures"]["relay_kills"] >= 1
    assert (
        "200 of 200 decisions applied by Temporal; 0 twice"
        in (report["checks"]["engine_exactly_once"]["detail"])
    )


def test_chaos_sink_must_be_temporal_and_small(tmp_path: Path) -> None:
    base = {"ledger_url": f"sqlite:///{tmp_path / 'x.db'}", "workdir": str(tmp_path)}
    with pytest.raises(InvalidArgumentError, match="at most 1000"):
        ChaosConfig(**base, decisions=5000, sink="temporal://127.0.0.1:7233").resolved()
    from flowdecision.chaos.relay_phase import chaos_sink_url

    cfg = ChaosConfig(**base, decisions=10, sink="http://x/y").resolved()
    with pytest.raises(InvalidArgumentError, match="temporal://"):
        chaos_sink_url(cfg)
    cfg = ChaosConfig(**base, decisions=10, sink="temporal://h:1/ns?workflow=Other").resolved()
    with pytest.raises(InvalidArgumentError, match="its own workflow"):
        chaos_sink_url(cfg)
    cfg = ChaosConfig(**base, decisions=10, sink="temporal://h:1").resolved()
    url, address, namespace, queue = chaos_sink_url(cfg)
    assert (address, namespace) == ("h:1", "default") and queue in url
