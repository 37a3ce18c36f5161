"""A throwaway PostgreSQL server for the test suite and the benchmark.

``initdb`` into a fresh temporary directory as an unprivileged user (when we
run as root, as in CI, the directory is handed to the ``postgres`` account and
every server command runs through ``runuser``), listening only on a unix
socket inside that directory, started with ``pg_ctl`` and stopped (``immediate``)
by :meth:`PostgresServer.stop`, which also removes the directory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

__all__ = ["PostgresServer", "PostgresServerError", "ReplicatedPostgres", "find_bindir"]

#: Settings that make a test server fast; the benchmark keeps the durable defaults.
FAST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


class PostgresServerError(RuntimeError):
    """The throwaway server could not be created or started; the message says why."""


def find_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/<n>/bin`` with ``initdb`` (or ``$PG_BINDIR``)."""
    explicit = os.environ.get("PG_BINDIR")
    candidates = [explicit] if explicit else []
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
        reverse=True,
    )
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise PostgresServerError(
        "no PostgreSQL server binaries found (looked for initdb in $PG_BINDIR, "
        "/usr/lib/postgresql/*/bin and $PATH); install postgresql or set "
        "FLOWDECISION_TEST_POSTGRES_URL to an existing server"
    )


class PostgresServer:
    """One server in a temporary directory; use :meth:`start` and :meth:`stop`."""

    def __init__(self, *, fast: bool = True, user: str = "postgres") -> None:
        self.bindir = find_bindir()
        self.fast = fast
        self.os_user = user if os.geteuid() == 0 else None
        self.base = Path(tempfile.mkdtemp(prefix="flowdecision-pg-"))
        self.datadir = self.base / "data"
        self.socket_dir = self.base
        self.log = self.base / "server.log"
        self.db_user = "flowdecision"
        self.started = False
        #: more ``-c name=value`` settings
        self.extra_options: list[str] = []
        #: ``initdb --no-sync`` even when not ``fast``
        self.no_sync_initdb = False

    # -- helpers ---------------------------------------------------------------

    def _cmd(self, *args: str) -> list[str]:
        if self.os_user is None:
            return list(args)
        return ["runuser", "-u", self.os_user, "--", *args]

    def _run(self, *args: str, timeout: float = 120) -> None:
        proc = subprocess.run(
            self._cmd(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.base,
        )
        if proc.returncode != 0:
            log = ""
            with contextlib.suppress(OSError):
                log = self.log.read_text()[-4000:]
            raise PostgresServerError(
                f"`{' '.join(args)}` failed with exit code {proc.returncode}:\n"
                f"{proc.stdout}\n{proc.stderr}\n{log}"
            )

    def url(self, database: str = "postgres") -> str:
        """A libpq URL over the unix socket."""
        return (
            f"postgresql://{self.db_user}@/{database}?host={quote(str(self.socket_dir), safe='')}"
        )

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> PostgresServer:
        if self.os_user is not None:
            try:
                entry = pwd.getpwnam(self.os_user)
            except KeyError as error:
                raise PostgresServerError(
                    f"running as root but there is no `{self.os_user}` account to run "
                    "PostgreSQL as (initdb refuses root)"
                ) from error
            os.chown(self.base, entry.pw_uid, entry.pw_gid)
        os.chmod(self.base, 0o700)
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.datadir),
            "-U",
            self.db_user,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            *(["--no-sync"] if self.fast or self.no_sync_initdb else []),
        )
        self.resume()
        return self

    def options(self) -> list[str]:
        """The server's ``-c`` settings (``pg_ctl -o``)."""
        options = [
            "-c listen_addresses=''",
            f"-c unix_socket_directories='{self.socket_dir}'",
            "-c max_connections=200",
            "-c shared_buffers=256MB",
        ]
        if self.fast:
            options += [f"-c {key}={value}" for key, value in FAST_SETTINGS.items()]
        return options + self.extra_options

    def resume(self) -> None:
        """Start the server on its existing data directory (after :meth:`halt`)."""
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.datadir),
            "-l",
            str(self.log),
            "-o",
            " ".join(self.options()),
            "-w",
            "-t",
            "60",
            "start",
        )
        self.started = True

    def halt(self, mode: str = "immediate") -> None:
        """Stop the server (``immediate``: no checkpoint wait), keeping its directory."""
        if self.started:
            self._run(
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-m",
                mode,
                "-w",
                "stop",
                timeout=60,
            )
            self.started = False

    def stop(self) -> None:
        """Stop the server (fast, no checkpoint wait) and delete its directory."""
        try:
            with contextlib.suppress(Exception):
                self.halt()
            self.started = False
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- a primary and a streaming standby, for the failover fault -----------------------------

#: Settings of a replicated pair: durable enough for kill -9 (the OS never crashes
#: here, so fsync may stay off), full-page writes on (pg_basebackup needs them).
REPLICATION_SETTINGS = {
    "fsync": "off",
    "wal_level": "replica",
    "max_wal_senders": "10",
    "max_replication_slots": "10",
    "hot_standby": "on",
    "wal_receiver_status_interval": "1s",
    "wal_sender_timeout": "10s",
}


class ReplicatedPostgres:
    """A primary and a streaming standby (``pg_basebackup -R``, a physical
    replication slot), each in its own directory with its own unix socket, run
    as the same unprivileged account as :class:`PostgresServer`.

    ``synchronous=True`` sets ``synchronous_standby_names='*'`` and
    ``synchronous_commit=on`` on both (a commit is acknowledged once the
    standby has flushed it); False leaves the standby asynchronous.
    ``durable=True`` keeps ``fsync`` on (for throughput figures: a flush is
    then a real one on both servers).

    :meth:`failover` kills the primary (SIGKILL to the postmaster and every
    backend at once), promotes the standby and rebuilds the old primary as the
    new standby. :attr:`url` lists both sockets with
    ``target_session_attrs=read-write``, so clients follow the primary.

    The pair's state (directories, which one is primary) is kept in
    ``state.json`` so another process can run the failover:
    ``python -m tests.postgres_server failover STATE`` (what the chaos
    harness's ``--failover-command`` runs).
    """

    def __init__(
        self, *, synchronous: bool = True, durable: bool = False, state: Path | None = None
    ) -> None:
        if state is not None:
            saved = json.loads(state.read_text())
            self.synchronous = bool(saved["synchronous"])
            self.durable = bool(saved.get("durable", False))
            self.servers = [self._server(Path(base)) for base in saved["bases"]]
            self.primary = int(saved["primary"])
            self.failovers = int(saved["failovers"])
            self.state = state
            for server in self.servers:
                server.started = True
            return
        self.synchronous = synchronous
        self.durable = durable
        self.servers = [self._server(None), self._server(None)]
        self.primary = 0
        self.failovers = 0
        self.state = self.servers[0].base.parent / f"{self.servers[0].base.name}.state.json"

    def _server(self, base: Path | None) -> PostgresServer:
        server = PostgresServer(fast=False)
        if base is not None:
            shutil.rmtree(server.base, ignore_errors=True)
            server.base = base
            server.datadir, server.socket_dir = base / "data", base
            server.log = base / "server.log"
        server.no_sync_initdb = True  # the OS never crashes here: initdb need not fsync
        settings = {**REPLICATION_SETTINGS, **({"fsync": "on"} if self.durable else {})}
        server.extra_options = [f"-c {k}={v}" for k, v in settings.items()]
        sync = "'*'" if self.synchronous else "''"
        server.extra_options += [
            f"-c synchronous_standby_names={sync}",
            "-c synchronous_commit=on",
        ]
        return server

    @property
    def standby(self) -> int:
        return 1 - self.primary

    def url(self, database: str = "postgres") -> str:
        """Both servers (primary first at the start), read-write sessions only."""
        hosts = ",".join(quote(str(s.socket_dir), safe="") for s in self.servers)
        user = self.servers[0].db_user
        return f"postgresql://{user}@/{database}?host={hosts}&target_session_attrs=read-write"

    def _save(self) -> None:
        self.state.write_text(
            json.dumps(
                {
                    "synchronous": self.synchronous,
                    "durable": self.durable,
                    "bases": [str(s.base) for s in self.servers],
                    "primary": self.primary,
                    "failovers": self.failovers,
                }
            )
        )

    def start(self) -> ReplicatedPostgres:
        self.servers[self.primary].start()
        self._rebuild_standby()
        self._save()
        return self

    def _rebuild_standby(self) -> None:
        primary, standby = self.servers[self.primary], self.servers[self.standby]
        shutil.rmtree(standby.datadir, ignore_errors=True)
        # The killed postmaster may linger as a zombie until init reaps it; its
        # socket lock names that pid, and a pid that still exists (even a zombie)
        # makes the restarted server refuse to start. It is dead: drop its locks.
        for stale in standby.socket_dir.glob(".s.PGSQL.*"):
            stale.unlink(missing_ok=True)
        if standby.os_user is not None:
            entry = pwd.getpwnam(standby.os_user)
            os.chown(standby.base, entry.pw_uid, entry.pw_gid)
        os.chmod(standby.base, 0o700)
        slot = f"standby_{self.failovers}_{self.standby}"
        standby._run(
            str(standby.bindir / "pg_basebackup"),
            "-D",
            str(standby.datadir),
            "-h",
            str(primary.socket_dir),
            "-U",
            primary.db_user,
            "-R",
            "-C",
            "-S",
            slot,
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        )
        standby.resume()
        self._wait_streaming()

    def _sql(self, server: PostgresServer, query: str) -> str:
        proc = subprocess.run(
            server._cmd(
                str(server.bindir / "psql"),
                "-h",
                str(server.socket_dir),
                "-U",
                server.db_user,
                "-d",
                "postgres",
                "-Atc",
                query,
            ),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            cwd=server.base,
        )
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def _wait_streaming(self, timeout: float = 60) -> None:
        """Until the primary sees the standby streaming (if synchronous: as its sync standby)."""
        want = "streaming|sync" if self.synchronous else "streaming|async"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self._sql(
                self.servers[self.primary],
                "SELECT state || '|' || sync_state FROM pg_stat_replication",
            )
            if want in rows.splitlines():
                return
            time.sleep(0.05)
        raise PostgresServerError(f"the standby did not reach `{want}` in {timeout} s")

    def _postmaster_pid(self, server: PostgresServer) -> int | None:
        try:
            return int((server.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and all its processes at once (a crash)."""
        server = self.servers[self.primary]
        pid = self._postmaster_pid(server)
        if pid is None:
            raise PostgresServerError(f"no running primary in {server.datadir}")
        victims = [pid] + [
            int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == pid
        ]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        for victim in victims:
            while Path(f"/proc/{victim}").exists() and _state(victim) not in ("Z", "X", None):
                time.sleep(0.005)
        server.started = False

    def hold_standby(self, seconds: float) -> None:
        """SIGSTOP the primary's WAL sender for ``seconds``: replication falls behind
        (the WAL stays on the primary; stopping the standby's receiver would not do,
        the socket buffer would keep what was sent)."""
        primary = self.servers[self.primary]
        pid = self._postmaster_pid(primary)
        receivers = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and _ppid(p) == pid and "walsender" in _cmdline(p)
        ]
        for receiver in receivers:
            os.kill(receiver, signal.SIGSTOP)
        time.sleep(seconds)
        self._held = receivers

    def failover(self, *, hold_standby_s: float = 0.0) -> dict[str, float]:
        """Kill the primary, promote the standby, rebuild the old primary as the
        new standby; how long each step took (seconds)."""
        self._held: list[int] = []
        started = time.monotonic()
        if hold_standby_s > 0:
            self.hold_standby(hold_standby_s)
        self.kill_primary()
        killed = time.monotonic()
        for receiver in self._held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(receiver, signal.SIGCONT)
        new = self.servers[self.standby]
        new._run(str(new.bindir / "pg_ctl"), "-D", str(new.datadir), "-w", "-t", "60", "promote")
        promoted = time.monotonic()
        self.primary = self.standby
        self.failovers += 1
        self._save()
        self._rebuild_standby()
        self._save()
        return {
            "kill_s": round(killed - started, 3),
            "promote_s": round(promoted - killed, 3),
            "rebuild_s": round(time.monotonic() - promoted, 3),
        }

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        with contextlib.suppress(OSError):
            self.state.unlink()


S = TypeVar("S", PostgresServer, ReplicatedPostgres)


@contextlib.contextmanager
def running(server: S, what: str) -> Iterator[S]:
    """For a test fixture: start ``server``, yield it, stop it (and remove its
    files) even on failure. A server that cannot start fails the test, saying
    why: it is never skipped."""
    import pytest

    try:
        server.start()
    except Exception as error:
        server.stop()
        pytest.fail(f"cannot start {what}: {error}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def migrate_postgres(url: str) -> None:
    """Migrate the ledger and the outbox schemas in ``url``'s database
    (PostgreSQL stores migrate only when asked)."""
    from flowdecision.ledger.postgres import PostgresLedger
    from flowdecision.sinks.outbox import OutboxSink

    ledger = PostgresLedger(url)
    try:
        await ledger.migrate()
    finally:
        await ledger.close()
    await OutboxSink(url).migrate()


def main(argv: list[str]) -> int:
    """``failover STATE [--hold-standby-ms N]``: one failover of the pair in STATE."""
    if len(argv) < 2 or argv[0] != "failover":
        print("usage: python -m tests.postgres_server failover STATE [--hold-standby-ms N]")
        return 2
    hold = 0.0
    if "--hold-standby-ms" in argv:
        hold = float(argv[argv.index("--hold-standby-ms") + 1]) / 1000
    pair = ReplicatedPostgres(state=Path(argv[1]))
    print(json.dumps(pair.failover(hold_standby_s=hold)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
