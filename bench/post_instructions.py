"""Instructions per POST /v1/decisions, counted by valgrind rather than timed (issue 39).

    .venv/bin/python bench/post_instructions.py                  # in process (post_costs)
    .venv/bin/python bench/post_instructions.py --server         # flowdecision serve, over HTTP
    .venv/bin/python bench/post_instructions.py --root ../start  # another checkout's code

CPU time on a shared 2-core machine moves by more than the few percent two
versions of the code differ by; the number of instructions a POST executes
barely moves (about 1% between runs). Each measurement runs the code under
``valgrind --tool=callgrind`` twice, with fewer and with more POSTs, and
reports the difference over the difference in POSTs, so start-up and imports
cancel out. Both processes' threads count: the event loop's, the ledger's and
the checkpointer's.

* in process (default): ``bench/post_costs.py --time`` of the checkout
  (``create_app`` on the embedded defaults, 50 concurrent callers, no sockets);
* ``--server``: ``flowdecision serve`` on the embedded defaults (access log
  on), POSTed to over ``--connections`` keep-alive connections (50 by default,
  as ``bench/service_bench.py``'s wrk) by a client outside valgrind, with
  ``service_bench``'s request body.

In process, one event loop schedules every caller, so the ledger's batches,
and the count, come out the same run after run. Over HTTP, how many requests
share a commit depends on how fast the client sends them against the server
under valgrind, which the machine's load moves: compare ``--server`` counts
of runs made one after the other on an idle machine (or with
``--connections 1``, where every commit is one request's).

WAL checkpoints run on a timer (``store/checkpoint.py``). Under valgrind (about
50 times slower) the timer fires every few POSTs instead of every few hundred,
so checkpoints weigh far more than they do in real time, and by how much
depends on timing; the figure is also given without them (the inclusive cost
of SQLite's ``sqlite3PagerCheckpoint``). Compare two checkouts with the same
command, ``--root`` naming the other one (a ``git worktree`` with its
``_fastreq`` built in place: ``setup.py build_ext --inplace``). Needs valgrind
(``apt install valgrind``); a few minutes per measurement.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKPOINT = "sqlite3PagerCheckpoint"


def _annotate(out: Path, *options: str) -> str:
    return subprocess.run(
        ["callgrind_annotate", "--threshold=100", *options, str(out)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def instructions(out: Path) -> tuple[int, int]:
    """(all instructions, those under WAL checkpoints) a callgrind output file counted."""
    total = re.search(r"^\s*([\d,]+)\s.*PROGRAM TOTALS", _annotate(out), re.MULTILINE)
    if total is None:
        raise SystemExit(f"no total in {out}: did valgrind finish?")
    checkpoint = 0
    for line in _annotate(out, "--inclusive=yes").splitlines():
        if f":{CHECKPOINT} " in line:
            checkpoint = int(line.split()[0].replace(",", ""))
            break
    return int(total.group(1).replace(",", "")), checkpoint


def _callgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    env.update(PYTHONPATH=str(root / "src"), PYTHONHASHSEED="0")
    return env


def in_process(root: Path, posts: int, out: Path, connections: int) -> None:
    """``post_costs.py --time`` of ``root`` with ``posts`` POSTs, under callgrind
    (its 50 callers: ``connections`` is for ``--server``)."""
    argv = [sys.executable, "bench/post_costs.py", "--time", "--posts", str(posts)]
    subprocess.run(
        [*_callgrind(out), *argv], cwd=root, env=_env(root), check=True, capture_output=True
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _template() -> bytes:
    """bench/service_bench.py's request body, ``@ID@`` where each POST's id goes."""
    from service_bench import body_template  # this checkout's, beside this file

    path = body_template()
    try:
        return path.read_bytes()
    finally:
        path.unlink()


def _post_all(port: int, posts: int, connections: int) -> None:
    token = uuid.uuid4().hex[:8]
    failures: list[str] = []
    template = _template()

    def client(number: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        for n in range(posts // connections):
            body = template.replace(b"@ID@", f"{token}-{number}-{n}".encode())
            conn.request("POST", "/v1/decisions", body, {"content-type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status != 201:
                failures.append(f"status {response.status}")
                return

    threads = [threading.Thread(target=client, args=(n,)) for n in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise SystemExit(f"the server refused a POST: {failures[0]}")


def served(root: Path, posts: int, out: Path, connections: int) -> None:
    """``flowdecision serve`` of ``root`` under callgrind, sent ``posts`` POSTs."""
    port = _free_port()
    work = Path(tempfile.mkdtemp(prefix="post-instructions-"))
    argv = [sys.executable, "-m", "flowdecision.cli", "serve", "--port", str(port)]
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(
            [*_callgrind(out), *argv], cwd=work, env=_env(root), stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: see {work / 'server.log'}")
            time.sleep(1)
        _post_all(port, posts, connections)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=300)
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=HERE.parent,
                        help="the checkout whose code is measured (default: this one)")  # fmt: skip
    parser.add_argument("--server", action="store_true",
                        help="flowdecision serve over HTTP, not the app in process")  # fmt: skip
    parser.add_argument("--posts", type=int, nargs=2, default=None, metavar=("FEW", "MANY"),
                        help="the runs' POSTs (default 1000 3000; --server 400 1600)")  # fmt: skip
    parser.add_argument("--connections", type=int, default=50,
                        help="--server: keep-alive connections the client POSTs over")  # fmt: skip
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        raise SystemExit("needs valgrind (callgrind and callgrind_annotate): apt install valgrind")
    few, many = args.posts or ((400, 1600) if args.server else (1000, 3000))
    if args.server and (few % args.connections or many % args.connections):
        raise SystemExit("--posts must be multiples of --connections (each sends its share)")
    run = served if args.server else in_process
    root = args.root.resolve()
    with tempfile.TemporaryDirectory(prefix="post-instructions-") as tmp:
        counted = []
        for posts in (few, many):
            out = Path(tmp) / f"callgrind-{posts}.out"
            run(root, posts, out, args.connections)
            counted.append(instructions(out))
    (total_few, checkpoint_few), (total_many, checkpoint_many) = counted
    per_post = (total_many - total_few) / (many - few)
    without = (total_many - checkpoint_many - total_few + checkpoint_few) / (many - few)
    where = f"flowdecision serve, {args.connections} connections" if args.server else "in process"
    print(
        f"{root} ({where}): {per_post:,.0f} instructions per POST, "
        f"{without:,.0f} without WAL checkpoints ({few} and {many} POSTs)"
    )


if __name__ == "__main__":
    main()
