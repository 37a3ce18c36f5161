# examples/01_library_quickstart.py: the library with the durable SQLite ledger and your own sink.
import asyncio
import sys
import tempfile
from pathlib import Path

from flowdecision import DecisionRequest, Dispatcher, SqliteLedger


class PrintSink:
    """Your boundary to the workflow engine. It must deduplicate on decision_id."""

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        print("engine accepted", request.decision_id, "attempt", attempt)


async def main(directory: Path) -> None:
    ledger = SqliteLedger(directory / "ledger.db")  # durable; shared by processes on one host
    dispatcher = Dispatcher("production", PrintSink(), ledger)
    request = DecisionRequest.parse(
        b'{"decision_id":"dec-1","run_id":"run-1","authority_branch_id":"production",'
        b'"causation_event_id":"evt-1","decision":{"type":"complete","output":{"ok":true}}}'
    )
    try:
        first = await dispatcher.dispatch(request)  # a DispatchOutcome
        print(first.outcome, first.attempt)  # submitted 1
        again = await dispatcher.dispatch(request)
        print(again.outcome, bool(again))  # duplicate False: not submitted again
        print(dispatcher.health().to_dict())
    finally:
        await ledger.close()


if __name__ == "__main__":
    # A fresh directory each run; pass one to keep the ledger (a rerun then prints two duplicates).
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())))
