"""What tracing costs the service: three configurations side by side, in one run.

    .venv/bin/python bench/tracing_bench.py                 # 5 rounds x 15 s, 50 clients
    .venv/bin/python bench/tracing_bench.py --rounds 3 --seconds 10 --write-docs
    .venv/bin/python bench/tracing_bench.py --without-on --rounds 8 --seconds 5 --warmup 2
    .venv/bin/python bench/tracing_bench.py --also-ratio 0.1 --rounds 4 --seconds 8

Targets (``flowdecision serve`` with its default layout: ledger and outbox in one
SQLite file, ``synchronous=FULL``, access log on; ``POST /v1/decisions`` with a
new decision id per request, loaded by ``wrk`` as in ``bench/service_bench.py``):

* ``not installed``: OpenTelemetry hidden from the server process (a
  ``sitecustomize`` that makes every ``opentelemetry`` import fail), as on a
  machine without the ``otel`` extra;
* ``installed, off``: the extra installed, ``serve`` without ``--otel``;
* ``on (ratio 1.0)``: ``serve --otel`` with the SDK's batch span processor and
  the OTLP/HTTP exporter sending every span (``OTEL_TRACES_SAMPLER=always_on``)
  to a receiver this script runs on localhost (it reads and counts each export).

Method: ``--rounds`` interleaved rounds; each round starts every target fresh
(new directory), in a rotating order, warms it up for ``--warmup`` seconds and
measures ``--seconds``. The table gives medians over rounds: requests/s (and
its min-max), server CPU ms per request (user + system of the server process,
less sensitive than rates to the shared machine), p50/p99 latency, and the
ratio of each median rate to ``installed, off``, and the paired ratio: the
median over rounds of each round's rate over the same round's ``installed,
off`` (rounds run minutes apart on a machine whose speed drifts; within a
round the targets run back to back, so the paired ratio cancels most of the
drift and is the figure to hold a target against). Raw samples go to
``bench/results/tracing.json``; ``--write-docs`` updates docs/BENCHMARKS.md.
``--without-on`` runs only the two untraced targets, their order flipping
every round (more pairs in the same time, for the 2% question); its samples go
to ``bench/results/tracing-without-on.json`` and its table to a block of its own.
``--also-ratio R`` adds a fourth target, ``on (ratio R)``: tracing on with
``OTEL_TRACES_SAMPLER=parentbased_traceidratio`` and ``..._ARG=R`` (what
docs/OBSERVABILITY.md suggests to pay for fewer traces).

The targets: ``not installed`` vs ``installed, off`` within 2%; issue 17's ``on``
at least 0.80x of ``off`` was withdrawn by issue 39 (public OpenTelemetry APIs
only; docs/BENCHMARKS.md). To compare with another source tree, run its server
as a variant: ``--variant 'before:PYTHONPATH=/other/tree/src:/other/tree/bench'``;
``--variant 'nothing exported:OTEL_TRACES_EXPORTER=none'`` records spans and
exports none (the ceiling of any exporter).
"""

from __future__ import annotations

import argparse
import datetime
import http.server
import json
import os
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from ledger_bench import machine_description  # noqa: E402
from service_bench import (  # noqa: E402
    Server,
    Target,
    body_template,
    load_average,
    process_tree_cpu_s,
    served,
    server_env,
    wrk,
)

RESULTS = HERE / "results" / "tracing.json"
DOCS = ROOT / "docs" / "BENCHMARKS.md"
POST = Target("post sqlite", "flowdecision", "post", "/v1/decisions", 201, "sqlite")
TARGETS = ("not installed", "installed, off", "on (ratio 1.0)")
#: ``--variant LABEL:KEY=VALUE,...``: target ``on (ratio 1.0, LABEL)`` gets that environment.
VARIANTS: dict[str, dict[str, str]] = {}

_BLOCKER = """
import sys

class _NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoOpenTelemetry())
"""


class Receiver:
    """An OTLP/HTTP endpoint on localhost that reads every export and answers 200."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.exports = 0
        self.bytes = 0
        self.spans = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.exports += 1
                receiver.bytes += len(body)
                # Counted, so that spans the batch processor dropped (a full queue) show.
                export = ExportTraceServiceRequest.FromString(body)
                receiver.spans += sum(
                    len(scope.spans) for res in export.resource_spans for scope in res.scope_spans
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def serving(target: str, receiver: Receiver) -> Iterator[Server]:
    """``flowdecision serve --port 0`` in a fresh directory, configured for ``target``."""
    cwd = Path(tempfile.mkdtemp(prefix="tracing-bench-"))
    env = server_env()
    argv = [sys.executable, "-m", "flowdecision.cli", "serve", "--port", "0"]
    if target == "not installed":
        site = cwd / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_BLOCKER)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    elif target.startswith("on (ratio "):
        ratio, _, variant = target.removeprefix("on (ratio ").removesuffix(")").partition(", ")
        argv.append("--otel")
        env.update(VARIANTS.get(variant, {}))
        env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_SERVICE_NAME="flowdecision-bench",
        )
        if ratio == "1.0":
            env["OTEL_TRACES_SAMPLER"] = "always_on"
        else:  # what OBSERVABILITY.md suggests to pay for fewer traces
            env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
            env["OTEL_TRACES_SAMPLER_ARG"] = ratio
    with served(argv, cwd, env) as server:
        yield server


@dataclass
class Sample:
    target: str
    round: int
    rate: float
    cpu_ms: float
    p50_ms: float
    p99_ms: float
    bad: int
    load: float
    #: Spans the receiver got per request served (warm-up included): a batch processor
    #: that dropped spans (queue full) would show fewer than the span tree has.
    spans_per_request: float = 0.0


def run_once(target: str, round_: int, args: argparse.Namespace, template: Path) -> Sample:
    receiver = Receiver()
    try:
        with serving(target, receiver) as server:
            warm, _ = wrk(POST, server.url, args.clients, args.warmup, template)
            load = load_average()
            cpu_before = process_tree_cpu_s(server.proc.pid)
            data, _ = wrk(POST, server.url, args.clients, args.seconds, template)
            cpu_s = process_tree_cpu_s(server.proc.pid) - cpu_before
        # The server stopped cleanly: its batch processor exported what it still held.
    finally:
        exports, spans = receiver.exports, receiver.spans
        receiver.stop()
    ok = data["ok"]
    served = ok + warm["ok"] + warm["bad"] + data["bad"]
    sample = Sample(
        target=target,
        round=round_,
        rate=ok / (data["duration_us"] / 1e6),
        cpu_ms=1000 * cpu_s / ok if ok else 0.0,
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        bad=data["bad"] + data["timeouts"] + data["connect_errors"] + data["read_errors"],
        load=load,
        spans_per_request=spans / served if served else 0.0,
    )
    exporting = VARIANTS.get(target.partition(", ")[2].removesuffix(")"), {})
    if target.startswith("on") and exports == 0 and exporting.get("OTEL_TRACES_EXPORTER") != "none":
        raise RuntimeError("tracing on, but the receiver got no export")
    print(
        f"  round {round_} {target:<16} {sample.rate:8,.0f}/s  cpu {sample.cpu_ms:.3f} ms/req  "
        f"p50 {sample.p50_ms:.1f}  p99 {sample.p99_ms:.1f} ms  load {load:.1f}"
        + (
            f"  exports {exports}, {sample.spans_per_request:.2f} spans/request"
            if target.startswith("on")
            else ""
        ),
        flush=True,
    )
    return sample


def report(samples: list[Sample], args: argparse.Namespace) -> str:
    targets = _targets(args)
    by: dict[str, list[Sample]] = {t: [s for s in samples if s.target == t] for t in targets}
    off = statistics.median(s.rate for s in by["installed, off"])
    off_cpu = statistics.median(s.cpu_ms for s in by["installed, off"])
    lines = [
        f"`python bench/tracing_bench.py --rounds {args.rounds} --seconds {args.seconds} "
        f"--warmup {args.warmup} --clients {args.clients}"
        f"{' --without-on' if args.without_on else ''}"
        f"{f' --also-ratio {args.also_ratio:g}' if args.also_ratio is not None else ''}"
        f"{' --skip-not-installed' if args.skip_not_installed else ''}"
        f"{''.join(f' --variant {v!r}' for v in args.asked_variants)}` "
        f"({datetime.date.today()}, {machine_description()}; "
        f"median 1-min load average {statistics.median(s.load for s in samples):.1f}):",
        "",
        "| target | requests/s (median, min–max) | vs off | vs off, paired (min–max) "
        "| CPU ms/request | vs off | p50 ms | p99 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    # Paired: each round's rate over the same round's `off` (the rounds run minutes
    # apart on a machine whose speed drifts; a ratio within one round cancels that).
    off_by_round = {s.round: s.rate for s in by["installed, off"]}
    for target in targets:
        group = by[target]
        rate = statistics.median(s.rate for s in group)
        cpu = statistics.median(s.cpu_ms for s in group)
        paired = [s.rate / off_by_round[s.round] for s in group if off_by_round.get(s.round)]
        lines.append(
            f"| {target} | {rate:,.0f} ({min(s.rate for s in group):,.0f}–"
            f"{max(s.rate for s in group):,.0f}) | {rate / off:.3f}× "
            f"| {statistics.median(paired):.3f}× ({min(paired):.2f}–{max(paired):.2f}) "
            f"| {cpu:.3f} | {cpu / off_cpu:.3f}× "
            f"| {statistics.median(s.p50_ms for s in group):.1f} "
            f"| {statistics.median(s.p99_ms for s in group):.1f} | {sum(s.bad for s in group)} |"
        )
    traced = by.get(TARGETS[2])
    if not traced:
        return "\n".join(lines)
    lines += [
        "",
        f"Spans the receiver got per request served, on: "
        f"{statistics.median(s.spans_per_request for s in traced):.2f} (median; "
        f"{min(s.spans_per_request for s in traced):.2f}–"
        f"{max(s.spans_per_request for s in traced):.2f}).",
    ]
    return "\n".join(lines)


def _targets(args: argparse.Namespace) -> tuple[str, ...]:
    if args.without_on:
        return TARGETS[:2]
    targets = TARGETS[1:] if args.skip_not_installed else TARGETS
    targets += tuple(f"on (ratio 1.0, {label})" for label in VARIANTS)
    if args.also_ratio is not None:
        targets += (f"on (ratio {args.also_ratio:g})",)
    return targets


def write_docs(text: str, name: str) -> None:
    """Replace the docs block ``name`` (``tracing-bench``, ``tracing-bench-off``)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    docs = DOCS.read_text(encoding="utf-8")
    block = f"{begin}\n{text}\n{end}"
    if begin in docs:
        start, stop = docs.index(begin), docs.index(end) + len(end)
        docs = docs[:start] + block + docs[stop:]
    else:
        docs = docs.rstrip("\n") + "\n\n## Tracing overhead\n\n" + block + "\n"
    DOCS.write_text(docs, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument(
        "--without-on",
        action="store_true",
        help="only `not installed` and `installed, off` (their order flips every round)",
    )
    parser.add_argument(
        "--also-ratio",
        type=float,
        help="a fourth target: on, sampling that ratio of traces (parentbased_traceidratio)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE,...",
        help="a target more: on (ratio 1.0) with that environment (repeatable)",
    )
    parser.add_argument(
        "--skip-not-installed", action="store_true", help="leave out `not installed`"
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    args.asked_variants = list(args.variant)
    for variant in args.variant:
        label, _, pairs = variant.partition(":")
        VARIANTS[label] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    template = body_template()
    samples: list[Sample] = []
    try:
        targets = _targets(args)
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(targets)
            for target in targets[shift:] + targets[:shift]:
                samples.append(run_once(target, round_, args, template))
    finally:
        template.unlink(missing_ok=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = RESULTS.with_name("tracing-without-on.json") if args.without_on else RESULTS
    results.write_text(json.dumps([asdict(s) for s in samples], indent=1) + "\n")
    text = report(samples, args)
    print()
    print(text)
    if args.write_docs:
        write_docs(text, "tracing-bench-off" if args.without_on else "tracing-bench")


if __name__ == "__main__":
    main()
