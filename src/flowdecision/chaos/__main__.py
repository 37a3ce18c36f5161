"""``python -m flowdecision.chaos worker WORKDIR WORKER INCARNATION``: one worker process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from .worker import worker_main

if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        sys.exit(asyncio.run(worker_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
    print("usage: python -m flowdecision.chaos worker WORKDIR WORKER INCARNATION", file=sys.stderr)
    sys.exit(2)
