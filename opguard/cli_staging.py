"""``opguard sync``: publish this node's staged trace files (CLI layer over opguard.staging.sync)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from opguard.cli import handle_errors, main
from opguard.errors import ConfigError


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
    from opguard.staging.config import StagingConfig
    from opguard.staging.fsutil import atomic_replace_json
    from opguard.staging.layout import Layout, current_node_id, current_rank, node_stream, rank_stream
    from opguard.staging.sync import all_streams, sync_streams
    from opguard.staging.units import format_bytes

    config = StagingConfig.from_env()
    config.require_staging()
    layout = Layout(config)
    node_id = current_node_id(config)
    if config.target is not None:  # refused claimants of this node ID in this job (docs/format.md §5.3)
        from opguard.launcher.claim import job_conflict

        conflict = job_conflict(config.target, node_id)
        if conflict is not None:
            raise conflict
    if all_ and (ranks or node):
        raise ConfigError("--all already includes every rank and the node stream",
                          "use --all alone, or --rank/--node")
    if any(r < 0 for r in ranks):
        raise ConfigError(f"--rank {min(ranks)} is negative", "pass a global rank >= 0")
    if all_:
        streams = all_streams(config, layout, node_id)
    else:
        streams = [rank_stream(r) for r in dict.fromkeys(ranks)]
        if not ranks and not node:
            streams = [rank_stream(current_rank())]
        if node:
            streams.append(node_stream(node_id))
    progress = _say if (final or verbose) and not quiet else None
    if progress is None:
        def progress(msg: str) -> None:
            if msg.startswith("warning:"):
                _say(msg)
    report = sync_streams(config, layout, streams, final=final, node_id=node_id, progress=progress)
    if report_json is not None:
        atomic_replace_json(report_json.absolute(), report.to_json())
    if report.error and not report.streams:
        click.echo(f"opguard: error: {report.error}", err=True)
    for s in report.streams:
        if s.error:
            click.echo(f"opguard: error: {s.stream}: {s.error}", err=True)
        elif verbose and not quiet:
            _say(f"{s.stream}: {s.batches} batch(es), {format_bytes(s.payload_bytes)} payload, "
                 f"{format_bytes(s.uploaded_bytes)} uploaded, backlog {format_bytes(s.backlog_bytes)}"
                 + (", sealed" if s.sealed else ""))
    if not quiet:
        rate = report.uploaded_bytes / report.seconds if report.seconds > 0 else 0.0
        failed = sum(1 for s in report.streams if s.error)
        _say(f"{'final: ' if final else ''}{len(report.streams)} stream(s), {report.batches} batch(es), "
             f"{format_bytes(report.payload_bytes)} payload, {format_bytes(report.uploaded_bytes)} uploaded in "
             f"{report.seconds:.2f} s ({format_bytes(rate)}/s), backlog {format_bytes(report.backlog_bytes)}"
             + (f", {failed} failed" if failed else "")
             + (f", {sum(1 for s in report.streams if s.sealed)} sealed" if final else ""))
    if report.exit_code:
        sys.exit(report.exit_code)


