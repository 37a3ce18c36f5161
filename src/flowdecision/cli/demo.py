"""``flowdecision demo``: one scripted run through the real file ledger."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import click

from ..core.dispatcher import Dispatcher, DispatchOutcome
from ..core.model import Complete, DecisionRequest, DecisionStep, Fail, ScheduleStep, request_hash
from ..errors import DispatchError
from ..ledger import JsonFileLedger
from .common import fail, run, table

__all__ = ["demo", "run_demo"]


class DemoSink:
    """Records deliveries; can be told to fail the next submission, or to be slow."""

    def __init__(self) -> None:
        self.delivered: list[tuple[str, int]] = []
        self.fail_next = False
        self.delay_s = 0.0

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("workflow engine unavailable")
        self.delivered.append((request.decision_id, attempt))


def _request(decision_id: str, branch: str = "production", **decision: object) -> DecisionRequest:
    kind = decision.get("kind", "step")
    chosen = (
        Fail(error=str(decision["error"]))
        if kind == "fail"
        else Complete(output={"answer": 42})
        if kind == "complete"
        else ScheduleStep(
            step=DecisionStep(step_id=f"{decision_id}-step", step_name="fetch", input={"n": 1})
        )
    )
    return DecisionRequest(
        decision_id=decision_id,
        run_id="run-demo",
        authority_branch_id=branch,
        causation_event_id=f"event-{decision_id}",
        decision=chosen,
    )


async def run_demo(root: Path, echo: Callable[[str], None]) -> list[tuple[str, str, str]]:
    """Run every scenario; return ``(decision_id, scenario, fate)`` rows."""
    sink = DemoSink()
    ledger = JsonFileLedger(root)
    main = Dispatcher("production", sink, ledger, owner_id="demo-main")
    fates: list[tuple[str, str, str]] = []

    async def attempt(
        decision_id: str, scenario: str, call: Callable[[], Awaitable[DispatchOutcome]]
    ) -> None:
        try:
            outcome = await call()
            fate = (
                f"submitted (attempt {outcome.attempt})"
                if outcome.submitted
                else "duplicate (not resubmitted)"
            )
        except DispatchError as error:
            fate = f"{type(error).__name__}: {error}"
        fates.append((decision_id, scenario, fate))

    first = _request("dec-submit")

    async def submission() -> None:
        await attempt("dec-submit", "new decision", lambda: main.dispatch(first))

    async def duplicate() -> None:
        await attempt("dec-submit", "same decision again", lambda: main.dispatch(first))

    async def fork() -> None:
        forked = _request("dec-fork", branch="fork")
        await attempt("dec-fork", "speculative fork branch", lambda: main.dispatch(forked))

    async def conflict() -> None:
        reused = _request("dec-submit", kind="fail", error="boom")
        await attempt("dec-submit", "same id, different content", lambda: main.dispatch(reused))

    async def sink_failure_and_retry() -> None:
        sink.fail_next = True
        retry = _request("dec-retry", kind="complete")
        await attempt("dec-retry", "sink fails", lambda: main.dispatch(retry))
        await attempt("dec-retry", "retry after failure", lambda: main.dispatch(retry))

    async def race() -> None:
        racer_a = Dispatcher("production", sink, JsonFileLedger(root), owner_id="demo-a")
        racer_b = Dispatcher("production", sink, JsonFileLedger(root), owner_id="demo-b")
        contested = _request("dec-race")
        sink.delay_s = 0.05
        try:
            await asyncio.gather(
                attempt("dec-race", "racer A", lambda: racer_a.dispatch(contested)),
                attempt("dec-race", "racer B", lambda: racer_b.dispatch(contested)),
            )
        finally:
            sink.delay_s = 0.0

    async def takeover() -> None:
        orphan = _request("dec-orphan")
        # Another dispatcher claims, then "crashes" before submitting: its lease expires.
        await ledger.claim(orphan.decision_id, request_hash(orphan), "crashed-owner", lease_ms=50)
        live = "while the crashed owner's lease is live"
        await attempt("dec-orphan", live, lambda: main.dispatch(orphan))
        await asyncio.sleep(0.06)
        expired = "after the lease expired (takeover)"
        await attempt("dec-orphan", expired, lambda: main.dispatch(orphan))

    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("submission", submission),
        ("duplicate", duplicate),
        ("fork", fork),
        ("conflict", conflict),
        ("sink failure + retry", sink_failure_and_retry),
        ("race", race),
        ("takeover", takeover),
    ]
    with click.progressbar(steps, label="scenarios", item_show_func=lambda s: s and s[0]) as bar:
        for _name, step in bar:
            await step()
    echo("")
    echo(table(["decision", "scenario", "fate"], fates))
    echo("")
    echo("sink deliveries (decision, attempt): " + ", ".join(f"{d}#{a}" for d, a in sink.delivered))
    echo("")
    echo("health of the main dispatcher:")
    echo(json.dumps(main.health().to_dict(), indent=2))
    return fates


@click.command("demo")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep the ledger in this directory instead of a temporary one.",
)
def demo(directory: Path | None) -> None:
    """Show submission, duplicate, fork, conflict, retry, race and takeover."""
    if directory is not None:
        _check_writable(directory)
        run(lambda: run_demo(directory, click.echo))
        click.echo(f"\nledger file: {JsonFileLedger(directory).path} (kept)")
        return
    with tempfile.TemporaryDirectory(prefix="flowdecision-demo-") as tmp:
        run(lambda: run_demo(Path(tmp), click.echo))
        path = JsonFileLedger(Path(tmp)).path
    # The temporary directory is gone now: say so, rather than name a missing file.
    click.echo(f"\nledger file: {path} (deleted on exit; run with --dir DIR to keep it)")


def _check_writable(directory: Path) -> None:
    """Fail with one line before any scenario runs if the demo cannot write there
    (otherwise every scenario would report the same ledger failure)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        fail(f"cannot write the demo ledger in `{directory}`: {error.strerror or error}")
