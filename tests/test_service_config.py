"""Service settings (flags > env > TOML > defaults) and sink URLs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowdecision.connections.urls import redact_url
from flowdecision.service.config import (
    LEGACY_LEDGER_URL,
    LEGACY_SINK_URL,
    MIN_TOKEN_CHARS,
    ConfigError,
    Settings,
    default_outbox_url,
    load_settings,
)
from flowdecision.sinks.loader import SinkConfigError, close_sink, open_sink, sink_kind
from flowdecision.sinks.outbox import OutboxSink
from flowdecision.sinks.webhook import WebhookSink
from tests.service_process import decision
from tests.service_sinks import GateSink


def test_defaults_need_nothing_external(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings({}, env={})
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    assert settings.ledger == "sqlite:///.flowdecision/flowdecision.db"
    assert settings.sink == settings.ledger  # one file: the transactional outbox
    assert settings.production_branch == "production"
    assert settings.tokens() == ()
    assert settings.auth_healthz is False


def test_flags_beat_env_beat_toml(tmp_path: Path) -> None:
    config = tmp_path / "flowdecision.toml"
    config.write_text(
        'port = 9000\nlease_ms = 5000\nproduction_branch = "main"\nsink = "https://e/h"\n'
    )
    env = {"FLOWDECISION_PORT": "9100", "FLOWDECISION_LEASE_MS": "7000"}
    settings = load_settings({"port": 9200, "host": None}, env=env, config_file=str(config))
    assert settings.port == 9200  # flag
    assert settings.lease_ms == 7000  # env over TOML
    assert settings.production_branch == "main"  # TOML over default
    assert settings.sink == "https://e/h"
    assert settings.host == "127.0.0.1"  # a flag left as None is "not given"
    via_env = load_settings({}, env={"FLOWDECISION_CONFIG": str(config)})
    assert via_env.port == 9000


def test_a_serve_table_in_toml_and_booleans(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[serve]\nauth_healthz = true\naccess_log = false\n")
    settings = load_settings({}, env={"FLOWDECISION_CONFIG": str(config)})
    assert settings.auth_healthz is True and settings.access_log is False
    assert load_settings({}, env={"FLOWDECISION_AUTH_HEALTHZ": "yes"}).auth_healthz is True


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({}, {"FLOWDECISION_PORT": "eighty"}, "FLOWDECISION_PORT"),
        ({"port": 70000}, {}, "port must be in"),
        ({"lease_ms": 0}, {}, "lease_ms must be at least 1"),
        ({}, {"FLOWDECISION_ACCESS_LOG": "maybe"}, "must be a boolean"),
        ({"host": "0.0.0.0"}, {}, "refusing to listen on `0.0.0.0` without a token"),
        ({"log_level": "loud"}, {}, "log_level"),
        ({"production_branch": "b" * 1025}, {}, "production_branch is 1025 bytes"),
        ({}, {"FLOWDECISION_PRODUCTION_BRANCH": "main\u0000"}, "control characters"),
    ],
)
def test_bad_settings_are_named(
    flags: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(flags, env=env)


def test_lossy_numbers_is_off_unless_asked_for(tmp_path: Path) -> None:
    assert load_settings({}, env={}).lossy_numbers is False
    assert load_settings({"lossy_numbers": True}, env={}).lossy_numbers is True
    assert load_settings({}, env={"FLOWDECISION_LOSSY_NUMBERS": "on"}).lossy_numbers is True
    config = tmp_path / "c.toml"
    config.write_text("[serve]\nlossy_numbers = true\n")
    assert load_settings({}, env={}, config_file=str(config)).lossy_numbers is True


def test_unknown_toml_keys_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting `prot`"):
        load_settings({}, env={}, config_file=str(config))


def test_public_bind_with_a_token_or_an_explicit_opt_out(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("old-token-0123456789\n\nnew-token-0123456789\n")
    settings = load_settings({"host": "0.0.0.0", "token_file": str(tokens)}, env={})
    assert settings.tokens() == (b"old-token-0123456789", b"new-token-0123456789")
    assert load_settings({"host": "0.0.0.0", "allow_no_auth": True}, env={}).tokens() == ()
    env_token = load_settings({}, env={"FLOWDECISION_TOKEN": "t0"})
    assert env_token.tokens() == (b"t0",)
    assert "t0" not in repr(env_token)


def test_redact_url_hides_passwords() -> None:
    assert (
        redact_url("postgresql://app:hunter2@db:5432/flow") == "postgresql://app:***@db:5432/flow"
    )
    assert redact_url("sqlite:///x.db") == "sqlite:///x.db"
    assert (
        redact_url("postgresql://app@db/ledger?password=s3cret&sslmode=require")
        == "postgresql://app@db/ledger?password=***&sslmode=require"
    )
    assert redact_url("https://hooks.example/x?api_key=abc&x=1") == (
        "https://hooks.example/x?api_key=***&x=1"
    )
    assert redact_url("https://u:p@[::1]:8443/x") == "https://u:***@[::1]:8443/x"


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Settings().port = 1  # type: ignore[misc]


# -- sinks by URL -------------------------------------------------------------------


def test_sink_kinds() -> None:
    assert sink_kind("sqlite:///o.db") == "outbox"
    assert sink_kind("postgresql://h/db") == "outbox"
    assert sink_kind("https://engine/hook") == "webhook"
    assert sink_kind("python:pkg.mod:Sink") == "python"
    with pytest.raises(SinkConfigError, match="unsupported sink URL scheme `ftp`"):
        sink_kind("ftp://x/")
    with pytest.raises(SinkConfigError, match=r"scheme \(none\)"):
        sink_kind("just-a-path")


async def test_open_sink_by_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outbox = await open_sink(f"sqlite:///{tmp_path / 'o.db'}")
    assert isinstance(outbox, OutboxSink)
    await outbox.submit(decision("dec-loader"), 1)
    assert await outbox.count() == 1
    await close_sink(outbox)

    webhook = await open_sink("http://127.0.0.1:9/hook")
    assert isinstance(webhook, WebhookSink)
    await close_sink(webhook)

    monkeypatch.setenv("FLOWDECISION_TEST_GATE", str(tmp_path / "gate"))
    assert isinstance(await open_sink("python:tests.service_sinks:GateSink"), GateSink)
    assert isinstance(await open_sink("python:tests.service_sinks:make_gate_sink"), GateSink)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("python:tests.service_sinks", "must look like python:module:attribute"),
        ("python:tests.no_such_module:X", "cannot import"),
        ("python:tests.service_sinks:Missing", "has no attribute `Missing`"),
        ("python:tests.service_sinks:NotASink", "must provide `async def submit"),
    ],
)
async def test_bad_custom_sinks_are_explained(url: str, message: str) -> None:
    with pytest.raises(SinkConfigError, match=message):
        await open_sink(url)


def test_serve_exits_2_on_a_bad_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from flowdecision.cli import cli

    for name in ("FLOWDECISION_TOKEN", "FLOWDECISION_TOKEN_FILE", "FLOWDECISION_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "refusing to listen on `0.0.0.0` without a token" in result.output
    monkeypatch.setenv("FLOWDECISION_LEASE_MS", "soon")
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2
    assert "FLOWDECISION_LEASE_MS" in result.output


async def test_a_decision_arriving_during_shutdown_gets_503_not_a_closed_ledger() -> None:
    # In-process ASGI call (the HTTP paths are covered over real sockets in
    # test_service.py): the moment between "stop accepting" and the socket closing.
    import httpx

    from flowdecision.ledger import MemoryLedger
    from flowdecision.service.app import Service, create_app
    from tests.helpers import RecordingSink

    settings = Settings(ledger="memory:", sink="python:tests.helpers:RecordingSink")
    service = Service(settings, MemoryLedger(), RecordingSink())
    app = create_app(settings, service=service)
    service.closed = True
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.post(
            "/v1/decisions",
            headers={"Content-Type": "application/json"},
            content=b'{"decision_id":"d","run_id":"r","authority_branch_id":"production",'
            b'"causation_event_id":"e","decision":{"type":"fail","error":"x"}}',
        )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "shutting_down"
    assert response.headers["Retry-After"] == "1"
    assert service.dispatcher.health().attempted == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "0", "-1"])
@pytest.mark.parametrize("name", ["shutdown_grace_s", "webhook_timeout_s"])
def test_float_settings_must_be_finite_and_positive(name: str, value: str, tmp_path: Path) -> None:
    expected = f"{name} must be a finite positive number"
    with pytest.raises(ConfigError, match=expected):
        load_settings({name: value}, env={})
    with pytest.raises(ConfigError, match=expected):
        load_settings({}, env={f"FLOWDECISION_{name.upper()}": value})
    config = tmp_path / "c.toml"
    config.write_text(f"{name} = {value.lower()}\n")  # TOML spells nan and inf natively
    with pytest.raises(ConfigError, match=expected):
        load_settings({}, env={}, config_file=str(config))


def test_a_short_token_is_refused_off_loopback_and_allowed_on_it() -> None:
    short = "x" * (MIN_TOKEN_CHARS - 1)
    with pytest.raises(ConfigError, match=f"shorter than {MIN_TOKEN_CHARS} characters"):
        load_settings({"host": "0.0.0.0"}, env={"FLOWDECISION_TOKEN": "x"})
    with pytest.raises(ConfigError, match="shorter than"):
        load_settings({"host": "0.0.0.0"}, env={"FLOWDECISION_TOKEN": short})
    long_enough = load_settings({"host": "0.0.0.0"}, env={"FLOWDECISION_TOKEN": short + "y"})
    assert long_enough.short_token_count() == 0
    loopback = load_settings({"host": "127.0.0.1"}, env={"FLOWDECISION_TOKEN": "x"})
    assert loopback.short_token_count() == 1


def test_serve_warns_about_a_short_token_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from click.testing import CliRunner

    from flowdecision.cli import cli

    for name in ("FLOWDECISION_TOKEN_FILE", "FLOWDECISION_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLOWDECISION_TOKEN", "x")
    with socket.socket() as taken:  # serve stops at the bind, after its warnings
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", "--host", "127.0.0.1", "--port", str(port)])
    assert result.exit_code == 1
    assert f"warning: a bearer token is shorter than {MIN_TOKEN_CHARS} characters" in (
        result.output
    )


def test_default_layout_is_one_store_and_an_old_layout_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shared = "sqlite:///.flowdecision/flowdecision.db"
    assert default_outbox_url() == shared
    # Only the ledger given: a SQL ledger's own store holds the outbox.
    for ledger in ("sqlite:///elsewhere.db", "postgresql://db.example/flow"):
        settings = load_settings({"ledger": ledger}, env={})
        assert settings.sink == ledger
    for ledger in ("memory:", f"file://{tmp_path / 'files'}"):
        assert load_settings({"ledger": ledger}, env={}).sink == LEGACY_SINK_URL
    # A sink given explicitly is kept whatever the ledger.
    assert load_settings({"sink": "sqlite:///o.db"}, env={}).ledger == shared
    # A directory laid out the old way (two files) keeps that layout...
    (tmp_path / ".flowdecision").mkdir()
    (tmp_path / ".flowdecision" / "ledger.db").write_bytes(b"")
    settings = load_settings({}, env={})
    assert (settings.ledger, settings.sink) == (LEGACY_LEDGER_URL, LEGACY_SINK_URL)
    assert default_outbox_url() == LEGACY_SINK_URL
    # ... and so does an outbox.db beside a ledger named alone (its consumers' cursors).
    (tmp_path / ".flowdecision" / "outbox.db").write_bytes(b"")
    assert load_settings({"ledger": "sqlite:///x.db"}, env={}).sink == LEGACY_SINK_URL
    assert load_settings({"ledger": "sqlite:///x.db", "sink": "sqlite:///x.db"}, env={}).sink == (
        "sqlite:///x.db"
    )
    # ... until the shared file exists (an operator moved to it).
    (tmp_path / ".flowdecision" / "flowdecision.db").write_bytes(b"")
    settings = load_settings({}, env={})
    assert (settings.ledger, settings.sink) == (shared, shared)
    assert default_outbox_url() == shared


async def test_sqlite_ledger_without_a_path_is_the_ledger_serve_uses_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SqliteLedger()`` follows ``serve``'s layout rule: the one shared file in a
    new directory, the old ``ledger.db`` where only the old layout exists (it never
    creates the shared file beside it, which would flip ``serve`` to an empty store)."""
    from flowdecision import SqliteLedger

    monkeypatch.chdir(tmp_path)
    fresh = SqliteLedger()
    assert fresh.path == Path(".flowdecision/flowdecision.db")
    assert fresh.path.as_posix() == load_settings({}, env={}).ledger.removeprefix("sqlite:///")
    old = tmp_path / "old"
    (old / ".flowdecision").mkdir(parents=True)
    monkeypatch.chdir(old)
    legacy = await SqliteLedger.open(Path(".flowdecision/ledger.db"))
    await legacy.claim("d", "h", "owner", lease_ms=1000)
    await legacy.close()
    ledger = await SqliteLedger.open()
    try:
        assert ledger.path == Path(".flowdecision/ledger.db")
        assert (await ledger.lookup("d")) is not None
        assert not (old / ".flowdecision" / "flowdecision.db").exists()
        assert load_settings({}, env={}).ledger == LEGACY_LEDGER_URL
    finally:
        await ledger.close()


def test_a_relay_url_is_checked_whole_when_the_settings_load() -> None:
    """serve exits 2 on a malformed relay URL at once, instead of starting a relay that
    stops for good later (or waits forever on an engine it can never reach)."""
    for bad, problem in (
        ("temporal://127.0.0.1:7233/default?workflow=W", "needs ?task_queue="),
        ("restate+http://127.0.0.1:9", "Restate sink URL"),
        ("python:nodots", "python:module:attribute"),
        ("ftp://x/y", "unsupported sink URL scheme"),
    ):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            load_settings({"relay_to": bad}, env={})
    with pytest.raises(ConfigError, match=r"relay_concurrency must be in 1\.\.1000"):
        load_settings({"relay_concurrency": 0}, env={})
    good = "temporal://127.0.0.1:7233/default?task_queue=q&workflow=W"
    settings = load_settings({"relay_to": good}, env={"FLOWDECISION_RELAY_CONCURRENCY": "8"})
    assert (settings.relay_to, settings.relay_concurrency) == (good, 8)
