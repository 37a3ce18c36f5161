"""Passwords in URLs are never printed, and ids cannot hide behind invisible characters.

One helper (``flowdecision.observability.redact``) does both; these tests hold it to each URL
scheme the project accepts or refuses, and hold every place that shows a URL
or an id (CLI errors and tables, the JSON log, the status page) to using it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from flowdecision.connections.urls import redact_url
from flowdecision.observability.redact import (
    _CANDIDATES,
    json_safe,
    printable,
    redact_text,
)

SECRET = "S3CRETPW"
CLI = [sys.executable, "-m", "flowdecision.cli"]

#: Every scheme the issue names (and the others a user may type), with a password.
URLS = [
    f"mysql://u:{SECRET}@h/db",
    f"postgresql://u:{SECRET}@db.example:5432/flow",
    f"postgres://u:{SECRET}@db.example/flow",
    f"postgresql://u:{SECRET}@h1:5432,h2:5433/flow?target_session_attrs=read-write",
    f"postgresql://u:{SECRET}@[::1]:5432/flow",
    f"procrastinate+postgresql://postgres:{SECRET}@127.0.0.1:1/db?task=m.t",
    f"dbos+postgresql://u:{SECRET}@127.0.0.1:1/db?workflow=m:f",
    f"https://user:{SECRET}@hooks.example/in",
    f"postgresql://u@h/db?password={SECRET}",
    f"https://hooks.example/in?token={SECRET}&x=1",
]


@pytest.mark.parametrize("url", URLS)
def test_redact_url_masks_the_password_of_every_scheme(url: str) -> None:
    shown = redact_url(url)
    assert SECRET not in shown and "***" in shown
    # The rest stays readable: scheme and host are still there.
    assert shown.split("://")[0] == url.split("://")[0]
    assert redact_url(shown) == shown


def test_redact_url_leaves_urls_without_secrets_alone() -> None:
    for url in ("sqlite:///relative.db", "sqlite:////abs/x.db", "memory:", "postgresql://u@h/db"):
        assert redact_url(url) == url


@pytest.mark.parametrize("url", URLS)
def test_redact_text_masks_urls_inside_messages(url: str) -> None:
    text = f"DBOS sink `{url}`: did not launch (connection to {url} refused)\nnext line"
    shown = redact_text(text)
    assert SECRET not in shown
    assert shown.endswith("refused)\nnext line")


def test_redact_text_masks_libpq_keyword_passwords() -> None:
    shown = redact_text(f"connection failed: host=h user=u password={SECRET} dbname=d")
    assert SECRET not in shown and "dbname=d" in shown
    assert redact_text(f"password = '{SECRET} x'") == "password = ***"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


#: (command, URL) pairs that fail while naming the URL they were given.
FAILING = [
    ("inspect", "--ledger", f"mysql://u:{SECRET}@h/db", "x"),
    ("inspect", "--ledger", f"postgresql://u:{SECRET}@127.0.0.1:1,127.0.0.2:2/db", "x"),
    ("prune", "--ledger", f"postgresql://u:{SECRET}@127.0.0.1:1/db", "--before", "1"),
    ("migrate", "--outbox", f"mysql://u:{SECRET}@h/db"),
    ("migrate", "--ledger", f"postgresql://u:{SECRET}@127.0.0.1:1/db"),
    ("outbox", "tail", "--sink", f"mysql://u:{SECRET}@h/db"),
    ("serve", "--port", "0", "--ledger", "memory:", "--sink", f"mysql://u:{SECRET}@h/db"),
    ("serve", "--port", "0", "--ledger", f"postgresql://u:{SECRET}@127.0.0.1:1/db"),
    ("serve", "--port", "0", "--ledger", "memory:",
     "--sink", f"procrastinate+postgresql://postgres:{SECRET}@127.0.0.1:1/db?task=m.t"),
    ("serve", "--port", "0", "--ledger", "memory:",
     "--sink", f"dbos+postgresql://u:{SECRET}@127.0.0.1:1/db?workflow=os:getcwd"),
    ("serve", "--port", "0", "--ledger", "memory:",
     "--sink", f"procrastinate+postgresql://postgres:{SECRET}@h/db"),
]  # fmt: skip


@pytest.mark.parametrize("command", FAILING, ids=lambda c: " ".join(c[:2]) + " " + c[-1][:30])
def test_no_command_prints_a_password(command: tuple[str, ...], tmp_path: Path) -> None:
    result = _cli(*command, cwd=tmp_path)
    assert result.returncode != 0, result.stdout
    out = result.stdout + result.stderr
    assert SECRET not in out, out
    url = next(arg for arg in command if SECRET in arg)
    host = url.split("@")[1].split("/")[0].split(":")[0].split(",")[0]
    assert host in out, out  # the message still says which store or sink failed
    # Tracebacks only inside JSON log lines (a logged exception), never raw.
    assert not [line for line in out.splitlines() if "Traceback" in line and not _is_json(line)]


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_the_json_log_redacts_urls_in_messages_extras_and_tracebacks() -> None:
    from flowdecision.service.logs import JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test_redact.log")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        url = f"dbos+postgresql://u:{SECRET}@h/db"
        try:
            raise OSError(f"cannot reach {url}")
        except OSError as error:
            logger.exception("sink %s failed", url, extra={"detail": str(error), "sink": url})
    finally:
        logger.removeHandler(handler)
    line = stream.getvalue()
    assert SECRET not in line
    record = json.loads(line)
    assert record["message"] == "sink dbos+postgresql://u:***@h/db failed"
    assert record["sink"] == "dbos+postgresql://u:***@h/db"


# -- Unicode format characters (category Cf) ---------------------------------------------

SPOOF = "pay-\u202eexe.fdp-\u202d-ok"


def test_the_candidate_class_covers_every_format_character() -> None:
    # A newer Unicode (a newer Python) with new Cf characters must extend the class.
    missing = [
        f"U+{code:04X}"
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) == "Cf" and not _CANDIDATES.match(chr(code))
    ]
    assert missing == []


def test_printable_escapes_bidi_and_other_format_characters() -> None:
    assert printable(SPOOF) == "pay-\\u202eexe.fdp-\\u202d-ok"
    assert printable("a\u200bb\u2066c\u2069\ufeff\U000e0041") == (
        "a\\u200bb\\u2066c\\u2069\\ufeff\\U000e0041"
    )
    assert printable("nul\x00 esc\x1b c1\x9b") == "nul\\u0000 esc\\u001b c1\\u009b"
    # Letters, marks and emoji of every script stay as they are.
    for text in ("dec-1", "décision-ü", "決定-1", "قرار-١", "e\u0301", "🙂"):
        assert printable(text) == text


def test_json_safe_lines_decode_to_the_same_text() -> None:
    line = json.dumps({"id": SPOOF + "\U000e0041\x9b"}, ensure_ascii=False)
    safe = json_safe(line)
    assert safe.isascii()
    assert json.loads(safe) == json.loads(line)


def test_the_status_page_shows_format_characters_escaped() -> None:
    from flowdecision.service.status import RecentDecision

    shown = RecentDecision(0, SPOOF, "run-\u2067x", "submitted", 201, 1, 1.0)
    assert shown.decision_id == "pay-\\u202eexe.fdp-\\u202d-ok"
    assert shown.run_id == "run-\\u2067x"


def test_log_lines_carry_format_characters_as_json_escapes() -> None:
    from flowdecision.service.logs import LineWriter

    stream = io.StringIO()
    writer = LineWriter(stream)
    logger = logging.getLogger("test_redact.cf")
    logger.addHandler(writer)
    logger.propagate = False
    try:
        logger.warning("decision failed", extra={"decision_id": SPOOF})
    finally:
        logger.removeHandler(writer)
    writer.flush()
    line = stream.getvalue().strip()
    assert "\u202e" not in line and "\\u202e" in line
    assert json.loads(line)["decision_id"] == SPOOF


def test_cli_tables_show_format_characters_escaped(tmp_path: Path) -> None:
    import asyncio

    from flowdecision.ledger import JsonFileLedger

    async def seed() -> None:
        ledger = JsonFileLedger(tmp_path)
        await ledger.claim(SPOOF, "hash", "owner", lease_ms=1000, now_ms=1)

    asyncio.run(seed())
    shown = _cli("inspect", "--ledger", str(tmp_path), SPOOF, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "\u202e" not in shown.stdout and "pay-\\u202eexe.fdp-\\u202d-ok" in shown.stdout
    missing = _cli("inspect", "--ledger", str(tmp_path), "x\u202ey", cwd=tmp_path)
    assert missing.returncode == 3 and "x\\u202ey" in missing.stdout
    # --json keeps the exact id (JSON escapes decode to it).
    as_json = _cli("inspect", "--ledger", str(tmp_path), SPOOF, "--json", cwd=tmp_path)
    assert "\u202e" not in as_json.stdout
    assert json.loads(as_json.stdout)["decision_id"] == SPOOF


def test_submit_prints_ids_with_format_characters_escaped(tmp_path: Path) -> None:
    from tests.service_process import ServiceProcess, decision

    body = decision(SPOOF, step=False).to_json()
    (tmp_path / "d.json").write_bytes(body)
    with ServiceProcess(tmp_path) as service:
        text = _cli("submit", "--url", service.url, str(tmp_path / "d.json"), cwd=tmp_path)
        as_json = _cli(
            "submit", "--url", service.url, "--json", str(tmp_path / "d.json"), cwd=tmp_path
        )
    assert text.returncode == 0, text.stderr
    assert text.stdout == "submitted pay-\\u202eexe.fdp-\\u202d-ok attempt 1\n"
    assert "\u202e" not in as_json.stdout
    assert json.loads(as_json.stdout)["decision_id"] == SPOOF
