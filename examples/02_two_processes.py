"""Two processes share one SQLite ledger; one is killed mid-way, the other takes over.

    python examples/02_two_processes.py [DIRECTORY]

Worker A submits decisions dec-01..dec-12 in order and hangs inside its sink on
dec-05 (think: the engine call stalled). Worker B starts on the same ledger
while A still holds dec-05's lease, and A is killed with SIGKILL: no cleanup,
no release. B finds dec-01..04 completed (duplicates, not submitted again),
finds dec-05 busy until A's lease expires, then takes it over as attempt 2,
and submits the rest. The "engine" is a file every sink appends one line to:
at the end it holds each decision exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flowdecision import DecisionBusyError, DecisionRequest, Dispatcher, SqliteLedger

DECISIONS = [f"dec-{n:02d}" for n in range(1, 13)]
HANG_ON = "dec-05"
LEASE_MS = 1500  # short, so the takeover comes quickly; the heartbeat renews it every 0.5 s


class FileEngine:
    """A sink appending ``decision_id attempt worker`` to a file (one write per line)."""

    def __init__(self, path: Path, worker: str, hang_on: str | None) -> None:
        self.path = path
        self.worker = worker
        self.hang_on = hang_on

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        if request.decision_id == self.hang_on:
            (self.path.parent / f"{self.worker}.stuck").touch()
            await asyncio.Event().wait()  # stalls until the process is killed
        line = f"{request.decision_id} attempt={attempt} worker={self.worker}\n"
        await asyncio.to_thread(self._append, line)

    def _append(self, line: str) -> None:
        with open(self.path, "a") as engine:  # O_APPEND: whole lines, even from two processes
            engine.write(line)


def request_for(decision_id: str) -> DecisionRequest:
    return DecisionRequest.parse(
        {
            "decision_id": decision_id,
            "run_id": "run-1",
            "authority_branch_id": "production",
            "causation_event_id": f"evt-{decision_id}",
            # Steps of one run: a run takes any number of these, and one "complete".
            "decision": {
                "type": "schedule_step",
                "step": {"step_id": decision_id, "step_name": "work", "input": {"id": decision_id}},
            },
        }
    )


async def worker(name: str, directory: Path, hang_on: str | None) -> None:
    ledger = SqliteLedger(directory / "ledger.db")
    sink = FileEngine(directory / "engine.log", name, hang_on)
    dispatcher = Dispatcher("production", sink, ledger, lease_ms=LEASE_MS)
    try:
        for decision_id in DECISIONS:
            while True:
                try:
                    submitted = await dispatcher.dispatch(request_for(decision_id))
                except DecisionBusyError as busy:
                    # Another live owner: wait for its lease (renewed while it is alive).
                    wait_ms = max(busy.lease_expires_at_ms - ledger.now_ms(), 50)
                    print(f"{name}: {decision_id} busy, retrying in {wait_ms} ms", flush=True)
                    await asyncio.sleep(wait_ms / 1000)
                    continue
                outcome = "submitted" if submitted else "duplicate"
                print(f"{name}: {decision_id} {outcome}", flush=True)
                break
    finally:
        await ledger.close()


def spawn(name: str, directory: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, "worker", name, str(directory), *extra])


def wait_for(path: Path, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"worker never reached {path.name}")
        time.sleep(0.02)


def main(directory: Path) -> int:
    a = spawn("A", directory, HANG_ON)
    wait_for(directory / "A.stuck", a)  # A completed dec-01..04 and holds dec-05's lease
    b = spawn("B", directory)
    os.kill(a.pid, signal.SIGKILL)  # mid-way: dec-05 claimed, never completed, never released
    a.wait()
    if b.wait(timeout=120) != 0:
        return 1

    lines = (directory / "engine.log").read_text().splitlines()
    ids = [line.split()[0] for line in lines]
    takeover = next(line for line in lines if line.startswith(HANG_ON))
    print(f"engine received {len(lines)} submissions for {len(set(ids))} decisions")
    print(f"{HANG_ON}: {takeover.split(' ', 1)[1]}")
    ok = sorted(ids) == DECISIONS and takeover.endswith("attempt=2 worker=B")
    print("each decision submitted exactly once" if ok else "UNEXPECTED: see engine.log")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        hang = sys.argv[4] if len(sys.argv) > 4 else None
        asyncio.run(worker(sys.argv[2], Path(sys.argv[3]), hang))
    else:
        target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
        target.mkdir(parents=True, exist_ok=True)
        sys.exit(main(target))
