"""Draws docs/post_sequence.png: one POST /v1/decisions on serve's default layout.

Run: .venv/bin/python docs/diagrams/post_sequence.py (needs matplotlib, the
``bench`` extra). The steps are the ones docs/ARCHITECTURE.md lists under
"A POST, file by file"; keep the two in step.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LANES = [
    ("client", ""),
    ("edge + uvicorn", "service/server.py\nservice/edge/"),
    ("pipeline", "service/pipeline.py: head, rules\n(guards, auth), route, answer"),
    ("handler", "service/handlers.py\nservice/runtime.py"),
    ("dispatcher", "core/dispatcher.py"),
    ("outbox sink", "sinks/outbox.py"),
    ("ledger", "ledger/base.py\nledger/sqlite.py"),
    ("ledger thread", "store/sqlite_thread.py\nstore/joint.py"),
    ("SQLite file", ".flowdecision/\nflowdecision.db"),
]
X = {name: i for i, (name, _) in enumerate(LANES)}
THREAD = {"ledger thread", "SQLite file"}
#: Steps that cross between the event loop and the ledger's thread, and the ones on it.
HAND_OFFS = {9, 15}
ON_THREAD = {10, 11, 12, 13, 14}

#: (from, to, label); a self-step when from == to.
STEPS = [
    ("client", "edge + uvicorn", "POST /v1/decisions"),
    ("edge + uvicorn", "pipeline", "parsed request (timeouts, cap)"),
    ("pipeline", "handler", "request id, Host/Origin, token, route"),
    ("handler", "handler", "read body, DecisionRequest.parse, size"),
    ("handler", "dispatcher", "await dispatch (its task tracked)"),
    ("dispatcher", "dispatcher", "branch, ids, hash, receipt, id gate"),
    ("dispatcher", "outbox sink", "prepare(request) -> JointRow (data)"),
    ("dispatcher", "ledger", "joint_commit(..., row)"),
    ("ledger", "ledger thread", "validate, JointOperation; apply() queues a Job"),
    ("ledger thread", "SQLite file", "BEGIN IMMEDIATE (group commit: the batch)"),
    ("ledger thread", "ledger", "write_batch: machine.claim + complete per job"),
    ("ledger", "ledger", "outbox rows: store.joint sqlite_insert_rows"),
    ("ledger", "ledger", "ledger rows: one multi-row upsert"),
    ("ledger thread", "SQLite file", "COMMIT (synchronous=FULL: durable)"),
    ("ledger thread", "dispatcher", "call_soon_threadsafe(settle): JointOutcome"),
    ("dispatcher", "outbox sink", "committed(row): wake the outbox's readers"),
    ("dispatcher", "handler", "DispatchOutcome"),
    ("handler", "pipeline", "201: outcome.to_json() (to_dict()'s bytes)"),
    ("pipeline", "edge + uvicorn", "access log line"),
    ("edge + uvicorn", "client", "one send (coalesced)"),
]


def main() -> None:
    width, step_h = 1.55, 0.42
    fig, ax = plt.subplots(figsize=(len(LANES) * width + 0.6, len(STEPS) * step_h + 2.0))
    top = len(STEPS) + 0.8
    ax.axhspan(-0.6, top + 0.4, xmin=0, xmax=1, color="white")
    for name, files in LANES:
        x = X[name] * width
        color = "#b04a2f" if name in THREAD else "#2f5fb0"
        ax.plot([x, x], [-0.4, top - 0.1], color=color, lw=1, ls=":")
        ax.text(x, top + 0.75, name, ha="center", va="bottom", fontsize=9, weight="bold")
        ax.text(x, top + 0.7, files, ha="center", va="top", fontsize=6.5, color="#444")
    for n, (src, dst, label) in enumerate(STEPS, start=1):
        y = len(STEPS) - n + 0.2
        x0, x1 = X[src] * width, X[dst] * width
        color = "#b04a2f" if n in HAND_OFFS else ("#7a3a2a" if n in ON_THREAD else "black")
        if src == dst:
            ax.annotate(
                "", xy=(x0 + 0.05, y - 0.18), xytext=(x0 + 0.05, y + 0.12),
                arrowprops={"arrowstyle": "->", "connectionstyle": "arc3,rad=-1.2", "lw": 0.9},
            )  # fmt: skip
            ax.text(x0 + 0.32, y, f"{n}. {label}", ha="left", va="center", fontsize=7, color=color)
            continue
        ax.annotate(
            "", xy=(x1, y), xytext=(x0, y),
            arrowprops={"arrowstyle": "->", "lw": 1.1, "color": color},
        )  # fmt: skip
        mid = (x0 + x1) / 2
        ax.text(mid, y + 0.08, f"{n}. {label}", ha="center", va="bottom", fontsize=7, color=color)
    ax.text(
        0, -0.9,
        "Red: a hand-off between the event loop and the ledger's connection thread "
        "(a queue in, call_soon_threadsafe out). Steps 10-14 (brown) run on that thread, once per batch.",
        fontsize=7, color="#b04a2f", ha="left",
    )  # fmt: skip
    ax.set_xlim(-width / 2, (len(LANES) - 0.5) * width)
    ax.set_ylim(-1.2, top + 1.5)
    ax.axis("off")
    ax.set_title("POST /v1/decisions -> one commit -> the answer (serve's default layout)", fontsize=11)
    fig.tight_layout()
    out = Path(__file__).resolve().parent.parent / "post_sequence.png"
    fig.savefig(out, dpi=130)
    print(out)


if __name__ == "__main__":
    main()
