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
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

__all__ = ["PostgresServer", "PostgresServerError", "find_bindir"]

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
            *(["--no-sync"] if self.fast else []),
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
