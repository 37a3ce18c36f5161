"""The console script, run as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from flowdecision.ledger import JsonFileLedger
from flowdecision.ledger.sqlite import SCHEMA_VERSION as LEDGER_VERSION
from flowdecision.sinks.outbox import OUTBOX_SCHEMA_VERSION as OUTBOX_VERSION

CLI = [sys.executable, "-m", "flowdecision.cli"]


def flowdecision(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_demo_shows_every_fate_and_the_health_snapshot(tmp_path: Path) -> None:
    result = flowdecision("demo", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for fate in (
        "submitted",
        "duplicate (not resubmitted)",
        "UnauthorizedBranchError",
        "DecisionConflictError",
        "SinkError",
        "DecisionBusyError",
        "after the lease expired (takeover)",
    ):
        assert fate in out
    health = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert health["completed"] == 3 and health["takeovers"] == 2 and health["in_flight"] == 0
    # The demo ran through the real seed-format file.
    records = asyncio.run(JsonFileLedger(tmp_path).records())
    assert {"dec-submit", "dec-retry", "dec-race", "dec-orphan"} <= set(records)
    assert all(r.status.value == "completed" for r in records.values())


def test_inspect_and_prune_a_file_ledger(tmp_path: Path) -> None:
    async def seed() -> None:
        ledger = JsonFileLedger(tmp_path)
        await ledger.claim("done", "hash-d", "secret-owner", lease_ms=1000, now_ms=100)
        await ledger.complete("done", "hash-d", "secret-owner", completed_at_ms=200)
        await ledger.claim("live", "hash-l", "secret-owner", lease_ms=1000, now_ms=100)

    asyncio.run(seed())
    shown = flowdecision("inspect", "--ledger", str(tmp_path), "live", "--request-hash", "hash-l")
    assert shown.returncode == 0, shown.stderr
    assert "pending" in shown.stdout and "1100" in shown.stdout
    assert "secret-owner" not in shown.stdout

    as_json = flowdecision("inspect", "--ledger", f"file://{tmp_path}", "done", "--json")
    assert json.loads(as_json.stdout)["state"] == "completed"
    assert json.loads(as_json.stdout)["completed_at_ms"] == 200

    missing = flowdecision("inspect", "--ledger", str(tmp_path), "nope")
    assert missing.returncode == 3 and "missing" in missing.stdout

    # `inspect --help` promises exit 3 for a mismatch (as for a missing decision).
    help_text = flowdecision("inspect", "--help").stdout
    assert "mismatch exits 3" in " ".join(help_text.split())
    mismatch = flowdecision("inspect", "--ledger", str(tmp_path), "live", "--request-hash", "x")
    assert mismatch.returncode == 3, mismatch.stderr
    assert "request hash conflicts with its claim" in mismatch.stderr
    mismatch_json = flowdecision(
        "inspect", "--ledger", str(tmp_path), "live", "--request-hash", "x", "--json"
    )
    assert mismatch_json.returncode == 3, mismatch_json.stderr

    pruned = flowdecision("prune", "--ledger", str(tmp_path), "--before", "201", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout) == {"before_ms": 201, "pruned": 1}
    assert set(asyncio.run(JsonFileLedger(tmp_path).records())) == {"live"}


def test_prune_older_than_uses_the_ledger_clock(tmp_path: Path) -> None:
    async def seed() -> None:
        ledger = JsonFileLedger(tmp_path)
        await ledger.claim("old", "h", "o", lease_ms=10, now_ms=1)
        await ledger.complete("old", "h", "o", completed_at_ms=5)

    asyncio.run(seed())
    result = flowdecision("prune", "--ledger", str(tmp_path), "--older-than", "7d")
    assert result.returncode == 0, result.stderr
    assert "pruned 1" in result.stdout
    assert "pruning... 1 removed" in result.stderr  # the live progress counter


def test_usage_and_store_errors_have_distinct_exit_codes(tmp_path: Path) -> None:
    bad_scheme = flowdecision("inspect", "--ledger", "redis://x", "d")
    assert bad_scheme.returncode == 1
    assert "unsupported ledger URL scheme `redis`" in bad_scheme.stderr
    bad_duration = flowdecision("prune", "--ledger", str(tmp_path), "--older-than", "soon")
    assert bad_duration.returncode == 2 and "not a duration" in bad_duration.stderr
    both = flowdecision("prune", "--ledger", str(tmp_path), "--before", "1", "--older-than", "1d")
    assert both.returncode == 2
    (tmp_path / "flow-decisions.json").write_text("{not json")
    corrupt = flowdecision("inspect", "--ledger", str(tmp_path), "d")
    assert corrupt.returncode == 1 and "flow-decisions.json" in corrupt.stderr


def test_migrate_then_inspect_postgres_and_sqlite(pg_empty_url: str, tmp_path: Path) -> None:
    before = flowdecision("inspect", "--ledger", pg_empty_url, "d")
    assert before.returncode == 1 and "flowdecision migrate" in before.stderr
    migrated = flowdecision("migrate", "--ledger", pg_empty_url, "--json")
    assert migrated.returncode == 0, migrated.stderr
    assert json.loads(migrated.stdout) == {
        "url": pg_empty_url,
        "migrated": True,
        "version_before": 0,
        "version_after": json.loads(migrated.stdout)["version_after"],
    }
    assert json.loads(migrated.stdout)["version_after"] >= 1
    after = flowdecision("inspect", "--ledger", pg_empty_url, "d")
    assert after.returncode == 3 and "missing" in after.stdout
    lite = flowdecision("migrate", "--ledger", f"sqlite:///{tmp_path}/l.db")
    assert (
        lite.returncode == 0
        and f"ledger sqlite:///{tmp_path}/l.db: schema at version" in lite.stdout
    )
    assert (tmp_path / "l.db").exists()


def test_migrate_json_reports_nothing_migrated_on_an_up_to_date_store(
    pg_empty_url: str, tmp_path: Path
) -> None:
    for url in (pg_empty_url, f"sqlite:///{tmp_path}/l.db"):
        first = flowdecision("migrate", "--ledger", url, "--json")
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["migrated"] is True
        version = json.loads(first.stdout)["version_after"]
        again = flowdecision("migrate", "--ledger", url, "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == {
            "url": url,
            "migrated": False,
            "version_before": version,
            "version_after": version,
        }
        text = flowdecision("migrate", "--ledger", url)
        assert "already up to date" in text.stdout


def _tree(root: Path) -> dict[str, bytes]:
    files = sorted(path for path in root.rglob("*") if path.is_file())
    return {str(path.relative_to(root)): path.read_bytes() for path in files}


def test_read_commands_report_a_missing_store_with_exit_4_and_create_nothing(
    tmp_path: Path,
) -> None:
    typo_db = f"sqlite:///{tmp_path / 'nonexist' / 'typo.db'}"
    typo_dir = str(tmp_path / "x")
    commands = [
        ("inspect", "--ledger", typo_db, "dec-1"),
        ("inspect", "--ledger", typo_dir, "dec-1"),
        ("inspect", "--ledger", f"file://{typo_dir}", "dec-1", "--json"),
        ("prune", "--ledger", typo_db, "--before", "5"),
        ("prune", "--ledger", typo_dir, "--older-than", "7d"),
        ("outbox", "tail", "--sink", f"sqlite:///{tmp_path / 'nonexist' / 'outbox.db'}"),
    ]
    for command in commands:
        result = flowdecision(*command)
        assert result.returncode == 4, (command, result.stderr)
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, command
        assert "does not exist (nothing was created)" in result.stderr, command
        assert list(tmp_path.iterdir()) == [], command


def test_outbox_tail_on_a_ledger_database_adds_no_tables(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    assert flowdecision("migrate", "--ledger", ledger).returncode == 0
    before = _tree(tmp_path)
    result = flowdecision("outbox", "tail", "--sink", ledger)
    assert result.returncode == 4, result.stderr
    assert "is not an outbox" in result.stderr and "Traceback" not in result.stderr
    assert _tree(tmp_path) == before
    inspect_outbox = flowdecision("inspect", "--ledger", f"sqlite:///{tmp_path / 'o.db'}", "d")
    assert inspect_outbox.returncode == 4 and list(tmp_path.iterdir()) == [tmp_path / "ledger.db"]


def test_a_negative_prune_cutoff_is_a_usage_error(tmp_path: Path) -> None:
    result = flowdecision("prune", "--ledger", str(tmp_path), "--before", "-1")
    assert result.returncode == 2, result.stderr
    assert "--before" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_demo_in_an_unwritable_directory_is_one_clean_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    targets = [blocker / "demo"]
    if os.geteuid() != 0:  # chmod does not stop root; a file in the way stops everyone
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        targets.append(read_only)
    for target in targets:
        result = flowdecision("demo", "--dir", str(target))
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith(f"error: cannot write the demo ledger in `{target}`")
        assert result.stderr.count("\n") == 1


def test_store_errors_are_one_line(tmp_path: Path) -> None:
    # A directory where a SQLite file is expected: the driver's error, on one line.
    (tmp_path / "dir.db").mkdir()
    for url in (f"sqlite:///{tmp_path / 'dir.db'}", "sqlite:///a%00b", "file:///a%00b"):
        for command in (("inspect", "--ledger", url, "d"), ("migrate", "--ledger", url)):
            result = flowdecision(*command)
            assert result.returncode == 1, (command, result.stderr)
            assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, command
            assert "Traceback" not in result.stderr


def test_an_unexpected_error_is_one_line_unless_debugging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from click.testing import CliRunner

    from flowdecision.cli.common import CleanErrorsGroup

    @click.group(cls=CleanErrorsGroup)
    def group() -> None:
        pass

    @group.command()
    def broken() -> None:
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.delenv("FLOWDECISION_DEBUG", raising=False)
    result = CliRunner().invoke(group, ["broken"])
    assert result.exit_code == 1
    assert result.output == (
        "error: unexpected RuntimeError: a bug over two lines "
        "(set FLOWDECISION_DEBUG=1 for the traceback)\n"
    )
    monkeypatch.setenv("FLOWDECISION_DEBUG", "1")
    debugging = CliRunner().invoke(group, ["broken"])
    assert isinstance(debugging.exception, RuntimeError)


_BLOCK_SERVICE_EXTRA = """
import sys

class BlockServiceExtra:
    # Behaves as if `pip install flowdecision` ran without the service extra.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"starlette", "uvicorn", "httpx", "prometheus_client"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, BlockServiceExtra())
for loaded in [m for m in sys.modules if m.split(".")[0] in {"starlette", "uvicorn"}]:
    del sys.modules[loaded]
from flowdecision.cli import main
sys.argv = ["flowdecision", *sys.argv[1:]]
main()
"""


def test_serve_without_the_service_extra_says_what_to_install(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_SERVICE_EXTRA, "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert "pip install 'flowdecision[service]'" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_chaos_refuses_a_ledger_that_holds_decisions_unless_forced(tmp_path: Path) -> None:
    tiny = ["--workers", "2", "--decisions", "5", "--kill-every-ms", "0", "--pause-every-ms", "0"]

    async def seed() -> None:
        await JsonFileLedger(tmp_path / "prod").claim("real-1", "h", "o", lease_ms=60_000)

    asyncio.run(seed())
    before = _tree(tmp_path / "prod")
    refused = flowdecision("chaos", "--ledger", f"file://{tmp_path / 'prod'}", *tiny)
    assert refused.returncode == 2, refused.stderr
    assert "already holds decisions" in refused.stderr and "--force" in refused.stderr
    assert _tree(tmp_path / "prod") == before
    lite = f"sqlite:///{tmp_path / 'l.db'}"
    fresh = flowdecision("chaos", "--ledger", lite, *tiny, "--json")  # a new ledger: fine
    assert fresh.returncode == 0, fresh.stderr
    again = flowdecision("chaos", "--ledger", lite, *tiny)
    assert again.returncode == 2 and "already holds decisions" in again.stderr
    forced = flowdecision("chaos", "--ledger", f"file://{tmp_path / 'prod'}", *tiny, "--force")
    assert forced.returncode == 0, forced.stderr
    records = asyncio.run(JsonFileLedger(tmp_path / "prod").records())
    assert "real-1" in records and len(records) == 6


def test_chaos_refuses_a_postgres_ledger_that_holds_decisions(pg_empty_url: str) -> None:
    tiny = ["--workers", "2", "--decisions", "3", "--kill-every-ms", "0", "--pause-every-ms", "0"]
    fresh = flowdecision("chaos", "--ledger", pg_empty_url, *tiny)  # never migrated: fine
    assert fresh.returncode == 0, fresh.stderr
    refused = flowdecision("chaos", "--ledger", pg_empty_url, *tiny)
    assert refused.returncode == 2, refused.stderr
    assert "already holds decisions" in refused.stderr
    assert pg_empty_url not in refused.stderr  # the URL may hold a password


def test_migrate_refuses_a_json_ledger_with_a_newer_schema(tmp_path: Path) -> None:
    # Every other command refuses it (exit 1); migrate must not call it "nothing to migrate".
    ledger = tmp_path / "flow-decisions.json"
    ledger.write_text('{"schema_version":99,"records":{}}')
    for command in (
        ("inspect", "--ledger", str(tmp_path), "d"),
        ("migrate", "--ledger", str(tmp_path)),
    ):
        result = flowdecision(*command)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert "newer than supported schema" in result.stderr, command
    assert ledger.read_text() == '{"schema_version":99,"records":{}}'
    # A current JSON ledger (or none at all) still has no schema to migrate.
    ledger.write_text('{"schema_version":1,"records":{}}')
    current = flowdecision("migrate", "--ledger", str(tmp_path))
    assert current.returncode == 0 and "no schema to migrate" in current.stdout


def _run_in(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWDECISION_")}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_migrate_outbox_alone_touches_only_the_outbox(tmp_path: Path) -> None:
    outbox = tmp_path / "o.db"
    result = _run_in(tmp_path, "migrate", "--outbox", f"sqlite:///{outbox}")
    assert result.returncode == 0, result.stderr
    # The default ledger (.flowdecision/flowdecision.db) was neither created nor migrated.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.db"]
    assert result.stdout.splitlines() == [
        f"outbox sqlite:///{outbox}: schema at version {OUTBOX_VERSION} (was 0)"
    ]
    as_json = json.loads(
        _run_in(tmp_path, "migrate", "--outbox", f"sqlite:///{outbox}", "--json").stdout
    )
    assert as_json == {"outbox": {"url": f"sqlite:///{outbox}", "migrated": False,
                                  "version_before": OUTBOX_VERSION,
                                  "version_after": OUTBOX_VERSION}}  # fmt: skip


def test_migrate_names_each_store_it_migrated(tmp_path: Path) -> None:
    ledger, outbox = f"sqlite:///{tmp_path / 'l.db'}", f"sqlite:///{tmp_path / 'o.db'}"
    result = _run_in(tmp_path, "migrate", "--ledger", ledger, "--outbox", outbox)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"ledger {ledger}: schema at version {LEDGER_VERSION} (was 0)",
        f"outbox {outbox}: schema at version {OUTBOX_VERSION} (was 0)",
    ]


def test_migrate_with_a_bad_outbox_url_leaves_nothing_behind(tmp_path: Path) -> None:
    for bad in ("http://x", "mysql://u@h/db", "memory:"):
        for args in (
            ("--outbox", bad),
            ("--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--outbox", bad),
        ):
            result = _run_in(tmp_path, "migrate", *args)
            assert result.returncode == 1, (args, result.stderr)
            assert list(tmp_path.iterdir()) == [], (args, list(tmp_path.iterdir()))
            # Only the schemes an outbox accepts are offered.
            assert "sqlite:///path" in result.stderr and "postgresql://" in result.stderr, (
                result.stderr
            )
            assert "memory:" not in result.stderr.replace(f"`{bad}`", ""), result.stderr
            assert "file:///" not in result.stderr, result.stderr


def test_outbox_tail_offers_only_outbox_schemes(tmp_path: Path) -> None:
    result = _run_in(tmp_path, "outbox", "tail", "--sink", "mysql://u@h/db")
    assert result.returncode == 2, result.stderr
    assert "sqlite:///path" in result.stderr and "postgresql://" in result.stderr
    for refused in ("http", "python:", "procrastinate", "dbos", "memory:"):
        assert refused not in result.stderr, (refused, result.stderr)


def test_demo_says_its_temporary_ledger_is_deleted_and_how_to_keep_one(tmp_path: Path) -> None:
    result = _run_in(tmp_path, "demo")
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert "deleted" in last and "--dir" in last, last
    shown = last.split("ledger file: ")[1].split(" ")[0]
    assert not Path(shown).exists()  # what it says: gone
    kept = _run_in(tmp_path, "demo", "--dir", str(tmp_path / "keep"))
    last = kept.stdout.strip().splitlines()[-1]
    assert last == f"ledger file: {tmp_path / 'keep' / 'flow-decisions.json'} (kept)"
    assert (tmp_path / "keep" / "flow-decisions.json").exists()


def test_inspect_on_a_read_only_filesystem_says_so_and_what_to_do(tmp_path: Path) -> None:
    # A real read-only mount (a private mount namespace, so nothing leaks out of the
    # test): a WAL ledger needs its -wal/-shm files beside it, which it cannot create.
    source, mounted = tmp_path / "src", tmp_path / "ro"
    source.mkdir()
    mounted.mkdir()
    ledger = f"sqlite:///{source / 'l.db'}"
    assert flowdecision("migrate", "--ledger", ledger).returncode == 0
    for leftover in source.glob("l.db-*"):
        leftover.unlink()
    script = (
        f"mount --bind {source} {mounted} && mount -o remount,bind,ro {mounted} && "
        f"exec {' '.join(CLI)} inspect --ledger sqlite:///{mounted / 'l.db'} x"
    )
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=60
    )
    assert "Permission denied" not in done.stderr and "not permitted" not in done.stderr, (
        f"cannot make a read-only mount for this test (needs root): {done.stderr}"
    )
    assert done.returncode == 1, done.stderr
    message = done.stderr.strip()
    assert message.startswith("error: ") and message.count("\n") == 0, message
    assert "read-only" in message and "l.db" in message, message
    assert "copy" in message and "read-write" in message, message


def test_serve_help_names_every_sink_scheme_and_log_level() -> None:
    from flowdecision.sinks.loader import SINK_SCHEMES

    text = " ".join(flowdecision("serve", "--help").stdout.split())
    unwrapped = "".join(text.split())  # click breaks long URLs across lines
    for scheme in SINK_SCHEMES:
        assert scheme in unwrapped, scheme
    for level in ("debug", "info", "warning", "error", "critical"):
        assert level in text.split("--log-level", 1)[1].split("--", 1)[0], level
