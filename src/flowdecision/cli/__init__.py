"""The ``flowdecision`` command line.

Exit codes: 0 success, 1 a ledger/store error, 2 bad usage, 3 the decision is
missing or conflicts with what was asked, 4 the store does not exist (commands
that read or prune a store never create one). Errors are one ``error: ...`` line
on stderr, never a traceback (``FLOWDECISION_DEBUG=1`` shows one for a bug).
"""

from __future__ import annotations

import click

from .chaos import chaos
from .common import CleanErrorsGroup
from .demo import demo
from .ledger_cmds import inspect_cmd, migrate_cmd, prune_cmd
from .ops_cmds import approve_cmd, audit_cmd, forget_cmd, list_cmd, reject_cmd, release_cmd
from .relay import cursors_cmd, outbox_audit_cmd, parked_cmd, relay_cmd, retry_cmd, skip_cmd
from .serve import outbox, serve_cmd
from .submit import submit_cmd

__all__ = ["cli", "main"]


@click.group(cls=CleanErrorsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flowdecision")
def cli() -> None:
    """Submit workflow decisions exactly once, and operate the ledger behind it."""


cli.add_command(inspect_cmd)
cli.add_command(prune_cmd)
cli.add_command(list_cmd)
cli.add_command(release_cmd)
cli.add_command(forget_cmd)
cli.add_command(approve_cmd)
cli.add_command(reject_cmd)
cli.add_command(audit_cmd)
cli.add_command(migrate_cmd)
cli.add_command(demo)
cli.add_command(chaos)
cli.add_command(serve_cmd)
outbox.add_command(cursors_cmd)
outbox.add_command(parked_cmd)
outbox.add_command(retry_cmd)
outbox.add_command(skip_cmd)
outbox.add_command(outbox_audit_cmd)
cli.add_command(outbox)
cli.add_command(relay_cmd)
cli.add_command(submit_cmd)


def main() -> None:
    """Console-script entry point."""
    cli(auto_envvar_prefix="FLOWDECISION")
