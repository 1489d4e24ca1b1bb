"""``opguard sync``: publish this node's staged trace files (CLI layer over opguard.staging.syncrun)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from opguard.cli import handle_errors, main


def _say(msg: str) -> None:
    click.echo(f"opguard sync: {msg}", err=True)


@main.command("sync")
@click.option("--rank", "ranks", type=int, multiple=True,
              help="global rank to sync (repeatable; default: from the environment)")
@click.option("--node", is_flag=True, help="sync this node's metadata stream")
@click.option("--all", "all_", is_flag=True, help="every rank staged on this node plus the node stream")
@click.option("--final", is_flag=True, help="drain everything visible now (several batches), then seal")
@click.option("--report-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write a JSON report of this sync to PATH")
@click.option("--quiet", "-q", is_flag=True, help="no summary line (errors are still printed)")
@click.option("--verbose", "-v", is_flag=True, help="one line per stream")
@handle_errors
def sync_cmd(ranks: tuple[int, ...], node: bool, all_: bool, final: bool, report_json: Path | None,
             quiet: bool, verbose: bool) -> None:
    """Publish new trace data of this node to the shared target as immutable batches.

    A periodic sync publishes at most one batch per stream; --final drains and seals.
    Exit status: 0 ok, 2 configuration, 3 lock timeout, 4 publish failure (batch kept for
    retry), 6 identity refusal; the worst error decides.
    """
    from opguard.staging.syncrun import SyncRequest, run

    code = run(SyncRequest(ranks, node, all_, final, None, report_json, quiet, verbose), say=_say,
               error=lambda msg: click.echo(f"opguard: error: {msg}", err=True))
    if code:
        sys.exit(code)
