"""The status page: plain HTML and CSS, no JavaScript, refreshed by ``<meta refresh>``."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from urllib.parse import urlencode

from ..ledger.query import DecisionPage, DecisionRow, TimeField
from ..ledger.states import AuditEntry, DecisionState
from ..observability.health import HealthSnapshot, HealthStatus
from ..observability.redact import printable
from ..sinks.cursor import CursorState
from ..sinks.parking import ParkedRow
from ..sinks.relay import RelayStatus
from .holds import HoldsView
from .metrics import HEALTH_COUNTERS

__all__ = [
    "FIND_PARAMS",
    "SHOWN_ID_MAX_CHARS",
    "Finder",
    "RecentActions",
    "RecentDecision",
    "render_status_page",
    "shown_text",
]

#: Characters of an id the status page shows (and keeps); longer ones end in "…".
SHOWN_ID_MAX_CHARS = 96


def shown_text(text: str, limit: int = SHOWN_ID_MAX_CHARS) -> str:
    """``text`` cut to ``limit`` characters; control characters, lone surrogates and
    format characters (bidi overrides, zero-width characters) shown as ``\\uXXXX``.

    The page shows what a client sent, including what the service refused (an
    over-long id, a NUL byte), so it must stay small and printable, and an id
    must not pass for another (``pay-\\u202eexe.fdp`` reads as ``pay-pdf.exe``).
    """
    return printable(text if len(text) <= limit else text[:limit] + "…")


@dataclass(slots=True)
class RecentDecision:
    """One ``POST /v1/decisions`` outcome, kept for the status page (never the owner).

    Ids are kept as :func:`shown_text` shows them, so fifty 1 MB ids do not
    stay in memory. (Not frozen: one is made per POST, and a frozen dataclass's
    constructor costs twice as much; nothing changes one once made.)
    """

    at_ms: int
    decision_id: str
    run_id: str
    fate: str
    status: int
    attempt: int | None
    duration_ms: float

    def __post_init__(self) -> None:
        decision_id, run_id = self.decision_id, self.run_id
        both = decision_id + run_id
        # (Short printable ASCII, the usual pair of ids, is shown as it is.)
        if (
            len(decision_id) > SHOWN_ID_MAX_CHARS
            or len(run_id) > SHOWN_ID_MAX_CHARS
            or not (both.isascii() and both.isprintable())
        ):
            self.decision_id = shown_text(decision_id)
            self.run_id = shown_text(run_id)


#: Fates of a POST that need an operator's eye on the status page.
ATTENTION_FATES = frozenset({"sink_failed", "conflict", "lease_lost"})


@dataclass(frozen=True, slots=True)
class Attention:
    """The status page's "needs attention" section: claims pending past their lease
    (oldest first, from the ledger's query) and recent sink failures and conflicts."""

    expired: Sequence[DecisionRow]
    expired_count: int | None
    failures: Sequence[RecentDecision]
    error: str | None = None


def _section(heading: str, section_id: str, error: str | None, failure: str) -> list[str]:
    """A section's opening parts; ``failure: error`` when its data could not be read."""
    parts = [f'<h2>{heading}</h2><section id="{section_id}">']
    if error is not None:
        parts.append(f"<p>{failure}: {escape(error)}</p>")
    return parts


def _attention_html(attention: Attention | None) -> str:
    if attention is None:
        return ""
    parts = _section(
        "Needs attention", "attention", attention.error, "The ledger could not be queried"
    )
    if attention.error is None and attention.expired:
        rows = "".join(
            f"<tr><td><code>{escape(shown_text(row.decision_id))}</code></td>"
            f"<td><code>{escape(shown_text(row.run_id or '-'))}</code></td>"
            f'<td class="num">{row.attempts}</td>'
            f"<td>{escape(_ms(row.created_at_ms))}</td></tr>"
            for row in attention.expired
        )
        parts.append(
            f'<h3 id="expired">{attention.expired_count} claim(s) pending past their lease</h3>'
            '<table><thead><tr><th>decision</th><th>run</th><th class="num">attempts</th>'
            f"<th>first claimed (UTC)</th></tr></thead><tbody>{rows}</tbody></table>"
            '<p class="meta">Release with <code>flowdecision release ID --reason ...</code> '
            '(docs/OPERATIONS.md, "A stuck lease").</p>'
        )
    elif attention.error is None:
        parts.append('<p id="expired">No claim is pending past its lease.</p>')
    if attention.failures:
        rows = "".join(
            f"<tr><td>{escape(_ms(item.at_ms))}</td><td><code>{escape(item.decision_id)}</code>"
            f"</td><td><code>{escape(item.run_id)}</code></td>"
            f'<td class="fate-{escape(item.fate)}">{escape(item.fate)}</td></tr>'
            for item in attention.failures
        )
        parts.append(
            '<h3 id="failures">Recent sink failures and conflicts</h3>'
            "<table><thead><tr><th>time (UTC)</th><th>decision</th><th>run</th><th>fate</th>"
            f"</tr></thead><tbody>{rows}</tbody></table>"
        )
    else:
        parts.append('<p id="failures">No recent sink failure or conflict.</p>')
    parts.append("</section>")
    return "".join(parts)


def _holds_html(holds: HoldsView | None, now_ms: int) -> str:
    """The "Awaiting approval" section: held decisions, oldest first, with their
    content (escaped, every line made printable) and how to act on them."""
    if holds is None:
        return ""
    parts = _section("Awaiting approval", "holds", holds.error, "The ledger could not be queried")
    if holds.error is None and holds.count:
        parts.append(
            f'<p id="held-count">{holds.count} decision(s) held for approval; the oldest '
            f"has waited {holds.oldest_age_s(now_ms):.0f} s.</p>"
        )
        for item in holds.shown:
            row = item.row
            decision = escape(shown_text(row.decision_id))
            content = (
                "(its content could not be read)"
                if item.content is None
                else "\n".join(printable(line) for line in item.content.split("\n"))
            )
            expires = "never" if row.hold_expires_at_ms is None else _ms(row.hold_expires_at_ms)
            parts.append(
                f'<div class="held"><h3><code>{decision}</code></h3>'
                f'<p class="meta">run <code>{escape(shown_text(row.run_id or "-"))}</code> · '
                f"held since {escape(_ms(row.created_at_ms))} · expires {escape(expires)}</p>"
                f"<pre>{escape(content)}</pre>"
                f'<p class="meta">Approve: <code>flowdecision approve {decision} --reason '
                f"...</code> · reject: <code>flowdecision reject {decision} --reason ...</code> "
                "(or <code>POST /v1/actions/approve</code> and <code>/reject</code> with the "
                "admin token)</p></div>"
            )
        if holds.count > len(holds.shown):
            parts.append('<p class="meta">More: <code>flowdecision list --state held</code>.</p>')
    elif holds.error is None:
        parts.append('<p id="held-count">No decision is held for approval.</p>')
    parts.append("</section>")
    return "".join(parts)


#: The status page's "Find decisions" form fields (``GET /?run_id=...``), as in
#: ``GET /v1/decisions``, except that times may also be ISO-8601 (UTC).
FIND_PARAMS = ("run_id", "state", "by", "after", "before", "cursor")


@dataclass(frozen=True, slots=True)
class Finder:
    """The "Find decisions" form as submitted (echoed back) and its answer, if asked."""

    params: Mapping[str, str] = field(default_factory=dict)
    page: DecisionPage | None = None
    count: int | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RecentActions:
    """Operator actions of the last day (the audit trail, oldest first)."""

    entries: Sequence[AuditEntry]
    more: bool = False
    error: str | None = None


def _options(name: str, values: Sequence[str], chosen: str, blank: str) -> str:
    options = [f'<option value=""{" selected" if not chosen else ""}>{blank}</option>']
    options += [
        f"<option{' selected' if value == chosen else ''}>{escape(value)}</option>"
        for value in values
    ]
    return f'<select name="{name}">{"".join(options)}</select>'


def _table(headings: Sequence[str], rows: Iterable[Sequence[str]], table_id: str = "") -> str:
    """A table of text cells (escaped here); a heading or cell starting with "#" is a
    number (right-aligned), one starting with "`" is code."""

    def cell(tag: str, text: str) -> str:
        if text.startswith("#"):
            return f'<{tag} class="num">{escape(text[1:])}</{tag}>'
        if text.startswith("`"):
            return f"<{tag}><code>{escape(text[1:])}</code></{tag}>"
        return f"<{tag}>{escape(text)}</{tag}>"

    head = "".join(cell("th", heading) for heading in headings)
    body = "".join(f"<tr>{''.join(cell('td', text) for text in row)}</tr>" for row in rows)
    attribute = f' id="{table_id}"' if table_id else ""
    return f"<table{attribute}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _finder_html(finder: Finder | None) -> str:
    if finder is None:
        return ""
    params = finder.params

    def text(name: str, label: str, hint: str) -> str:
        value = escape(params.get(name, ""), quote=True)
        return f'<label>{label} <input name="{name}" value="{value}" placeholder="{hint}"></label>'

    states = _options("state", [s.value for s in DecisionState], params.get("state", ""), "any")
    by = _options("by", [t.value for t in TimeField], params.get("by", ""), "claimed")
    form = (
        '<form method="get" action="" id="find-form">'
        f"{text('run_id', 'run', 'run id')} "
        f"<label>state {states}</label> <label>by {by}</label> "
        f"{text('after', 'after', 'Unix ms or 2026-01-31T08:00')} "
        f"{text('before', 'before', 'Unix ms or ISO-8601 (UTC)')} "
        '<button type="submit">Find</button></form>'
    )
    parts = ['<h2>Find decisions</h2><section id="find">', form]
    if finder.error is not None:
        parts.append(f'<p id="find-error">{escape(finder.error)}</p>')
    elif finder.page is not None:
        headings = ["decision", "state", "run", "#attempts", "first claimed (UTC)",
                    "completed (UTC)"]  # fmt: skip
        rows = [
            [
                f"`{shown_text(row.decision_id)}",
                row.state.value,
                f"`{shown_text(row.run_id or '-')}",
                f"#{row.attempts}",
                _ms(row.created_at_ms),
                _ms(row.completed_at_ms) if row.completed_at_ms else "-",
            ]
            for row in finder.page.decisions
        ]
        parts.append(f'<p id="find-count">{finder.count} decision(s) match</p>')
        parts.append(_table(headings, rows, "find-results"))
        if finder.page.next_cursor is not None:
            query = {k: v for k, v in params.items() if v and k != "cursor"}
            query["cursor"] = finder.page.next_cursor
            parts.append(
                f'<p><a id="find-next" href="?{escape(urlencode(query))}">next page</a></p>'
            )
    parts.append("</section>")
    return "".join(parts)


def _actions_html(actions: RecentActions | None) -> str:
    if actions is None:
        return ""
    parts = _section(
        "Operator actions (last 24 hours)",
        "actions",
        actions.error,
        "The audit trail could not be read",
    )
    if actions.error is None and actions.entries:
        rows = [
            [
                _ms(entry.at_ms),
                entry.action,
                f"`{shown_text(entry.decision_id)}",
                shown_text(entry.actor),
                shown_text(entry.reason),
                entry.state_before,
            ]
            for entry in actions.entries
        ]
        headings = ["time (UTC)", "action", "decision", "actor", "reason", "was"]
        parts.append(_table(headings, rows))
        if actions.more:
            parts.append('<p class="meta">More: <code>flowdecision audit --after 24h</code>.</p>')
    elif actions.error is None:
        parts.append("<p>No operator action in the last 24 hours.</p>")
    parts.append("</section>")
    return "".join(parts)


_CSS = """
:root { color-scheme: light dark; --ok: #1a7f37; --bad: #cf222e; --muted: #6e7781; }
body { font: 15px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 62rem;
       padding: 0 1rem; }
h1 { font-size: 1.4rem; margin: 0 0 .25rem; }
h2 { font-size: 1.1rem; margin-top: 2rem; }
.meta { color: var(--muted); margin: 0; }
.badge { display: inline-block; padding: .15rem .6rem; border-radius: 1rem; color: #fff;
         font-weight: 600; }
.healthy { background: var(--ok); } .degraded { background: var(--bad); }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .3rem .6rem; border-bottom: 1px solid #8884; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.counters { display: grid; gap: .5rem;
            grid-template-columns: repeat(auto-fill, minmax(11rem, 1fr)); }
.counter { border: 1px solid #8884; border-radius: .4rem; padding: .4rem .6rem; }
.counter b { display: block; font-size: 1.3rem; }
.fate-submitted, .fate-duplicate { color: var(--ok); }
.fate-sink_failed, .fate-ledger_unavailable, .fate-lease_lost { color: var(--bad); }
code { font-size: .9em; }
.held pre { white-space: pre-wrap; overflow-wrap: anywhere; max-height: 16rem; overflow: auto;
            border: 1px solid #8884; border-radius: .4rem; padding: .4rem .6rem; }
"""


def _ms(at_ms: int | None) -> str:
    if not at_ms:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at_ms / 1000)) + f".{at_ms % 1000:03d}Z"


def _relays_html(relays: Sequence[CursorState], own: RelayStatus | None) -> str:
    """The outbox relays' cursors and lag (none: no section at all)."""
    if not relays and own is None:
        return ""
    rows = []
    for state in relays:
        here = own is not None and own.name == state.name
        doing = escape(own.state) if here and own is not None else ""
        error = (
            f"<br><small>{escape(shown_text(own.last_error, 200))}</small>"
            if here
            and own is not None
            and own.last_error
            and own.state in ("retrying", "backing_off", "opening")
            else ""
        )
        rows.append(
            f'<tr id="relay-{escape(shown_text(state.name))}">'
            f"<td><code>{escape(shown_text(state.name))}</code></td>"
            f'<td class="num">{state.position}</td>'
            f'<td class="num">{state.head_seq}</td>'
            f'<td class="num lag-rows">{state.lag_rows}</td>'
            f'<td class="num lag-seconds">{state.lag_seconds:.1f}</td>'
            f'<td class="num">{state.delivered}</td>'
            f'<td class="num parked-rows">{state.parked_rows}</td>'
            f"<td>{'leased' if state.leased else 'idle'}{' · ' + doing if doing else ''}"
            f"{error}</td>"
            "</tr>"
        )
    body = (
        '<table><thead><tr><th>relay</th><th class="num">cursor</th>'
        '<th class="num">newest seq</th><th class="num">lag rows</th>'
        '<th class="num">lag s</th><th class="num">delivered</th><th class="num">parked</th>'
        "<th>state</th></tr>"
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
        if rows
        else "<p>No relay cursor yet.</p>"
    )
    return f'<h2>Outbox relays</h2>\n<section id="relays">{body}</section>\n'


#: Parked rows shown on the status page at most (``outbox parked`` lists them all).
PARKED_SHOWN = 50


def _parked_html(parked: Sequence[ParkedRow] | None) -> str:
    """The rows relays parked (their sinks refused them) and the rows held behind them."""
    if parked is None:
        return ""
    if not parked:
        return '<h2>Parked rows</h2>\n<section id="parked"><p>No row is parked.</p></section>\n'
    rows = "".join(
        f'<tr class="parked-{escape(row.state)}">'
        f"<td><code>{escape(shown_text(row.relay))}</code></td>"
        f'<td class="num">{row.seq}</td>'
        f"<td><code>{escape(shown_text(row.decision_id))}</code></td>"
        f"<td><code>{escape(shown_text(row.run_id))}</code></td>"
        f'<td>{escape(row.state)}</td><td class="num">{row.attempts}</td>'
        f"<td>{escape(_ms(row.parked_at_ms))}</td>"
        f"<td><small>{escape(shown_text(row.error or '', 300))}</small></td></tr>"
        for row in parked[:PARKED_SHOWN]
    )
    more = (
        f'<p class="meta">{len(parked) - PARKED_SHOWN} more: <code>flowdecision outbox parked'
        "</code>.</p>"
        if len(parked) > PARKED_SHOWN
        else ""
    )
    return (
        '<h2>Parked rows</h2>\n<section id="parked">'
        '<table><thead><tr><th>relay</th><th class="num">seq</th><th>decision</th><th>run</th>'
        '<th>state</th><th class="num">attempts</th><th>parked (UTC)</th><th>error</th></tr>'
        f"</thead><tbody>{rows}</tbody></table>{more}"
        '<p class="meta">The sink refused these for good; a run\'s later rows are held behind '
        "its parked row. Deliver again with <code>flowdecision outbox retry ID</code> or drop "
        "with <code>flowdecision outbox skip ID --reason ...</code> (docs/OPERATIONS.md, "
        '"Parked rows").</p></section>\n'
    )


def render_status_page(
    *,
    health: HealthSnapshot,
    recent: Iterable[RecentDecision],
    ledger: str,
    sink: str,
    production_branch: str,
    started_at_ms: int,
    refresh_s: int,
    relays: Sequence[CursorState] = (),
    own_relay: RelayStatus | None = None,
    parked: Sequence[ParkedRow] | None = None,
    attention: Attention | None = None,
    finder: Finder | None = None,
    actions: RecentActions | None = None,
    holds: HoldsView | None = None,
    now_ms: int | None = None,
) -> str:
    """The page's HTML. ``holds``: the "Awaiting approval" section (None: not shown);
    ``now_ms`` judges the holds' ages (now, unless given)."""
    now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    healthy = health.status is HealthStatus.HEALTHY
    status_class = "healthy" if healthy else "degraded"
    counters = "".join(
        f'<div class="counter" id="counter-{name}">{escape(name.replace("_", " "))}'
        f"<b>{getattr(health, name)}</b></div>"
        for name in (*HEALTH_COUNTERS, "in_flight")
    )
    rows = []
    for item in recent:
        attempt = "" if item.attempt is None else str(item.attempt)
        rows.append(
            "<tr>"
            f"<td>{escape(_ms(item.at_ms))}</td>"
            f"<td><code>{escape(item.decision_id)}</code></td>"
            f"<td><code>{escape(item.run_id)}</code></td>"
            f'<td class="fate-{escape(item.fate)}">{escape(item.fate)}</td>'
            f'<td class="num">{item.status}</td>'
            f'<td class="num">{attempt}</td>'
            f'<td class="num">{item.duration_ms:.1f}</td>'
            "</tr>"
        )
    recent_html = (
        "<table><thead><tr><th>time (UTC)</th><th>decision</th><th>run</th><th>fate</th>"
        '<th class="num">HTTP</th><th class="num">attempt</th><th class="num">ms</th></tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
        if rows
        else "<p>No decisions submitted since start.</p>"
    )
    relays_html = _relays_html(relays, own_relay)
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="refresh" content="{refresh_s}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>flowdecision: {escape(health.status.value)}</title>
<style>{_CSS}</style>
</head>
<body>
<header>
<h1>flowdecision
<span id="health" class="badge {status_class}">{escape(health.status.value)}</span></h1>
<p class="meta">production branch <code>{escape(production_branch)}</code> ·
ledger <code>{escape(ledger)}</code> · sink <code>{escape(sink)}</code></p>
<p class="meta">up since {escape(_ms(started_at_ms))}
· last success {escape(_ms(health.last_success_at_ms))}
· last failure {escape(_ms(health.last_failure_at_ms))} · average dispatch
{health.average_dispatch_micros / 1000:.1f} ms · max {health.max_dispatch_micros / 1000:.1f} ms
· refreshes every {refresh_s}s</p>
</header>
<main>
<h2>Counters</h2>
<section class="counters">{counters}</section>
{_attention_html(attention)}{_holds_html(holds, now_ms)}{_actions_html(actions)}
{_finder_html(finder)}
{relays_html}{_parked_html(parked)}<h2>Recent decisions</h2>
<section id="recent">{recent_html}</section>
</main>
</body>
</html>
"""
