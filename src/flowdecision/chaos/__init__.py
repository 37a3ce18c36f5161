"""The crash harness behind ``flowdecision chaos``: real processes, killed for real.

A controller (:mod:`.controller`) starts ``workers`` processes (:mod:`.worker`).
Each dispatches its share of ``decisions`` (:mod:`.workload`) through one
ledger into one :class:`~flowdecision.sinks.OutboxSink`; every decision is
proposed by at least two workers, some are proposed again (duplicates) and
some are re-proposed with different content under the same id (conflicting
reuse). Leases are short. While they run, the controller SIGKILLs and restarts
workers and SIGSTOPs them for longer than a lease. The sink sleeps at random,
before and after it writes, and sometimes raises after writing, so faults land
mid-sink.

Evidence (:mod:`.journal`): each worker appends one JSON line per event to its
own journal -- every ledger call with its start/end wall-clock times, every
outbox delivery and every dispatch outcome -- and keeps a health report beside
it. After every worker has finished its plan, :func:`verify` (:mod:`.verify`,
:mod:`.health_check`) checks the stores against the journals.

The harness uses only the public API of ledgers, dispatcher and outbox.

Modules: :mod:`.config` (settings), :mod:`.workload`, :mod:`.journal` (the
journal and the journaling ledger), :mod:`.worker`, :mod:`.controller`,
:mod:`.verify` and :mod:`.health_check` (the checks), :mod:`.report`.
"""

from __future__ import annotations

import shutil

from .config import ChaosConfig
from .controller import run_chaos
from .report import ChaosReport, summary_rows
from .verify import verify

__all__ = ["ChaosConfig", "ChaosReport", "cleanup", "run_chaos", "summary_rows", "verify"]


def cleanup(cfg: ChaosConfig) -> None:
    """Delete a run's working directory."""
    if cfg.workdir is not None:
        shutil.rmtree(cfg.workdir, ignore_errors=True)
