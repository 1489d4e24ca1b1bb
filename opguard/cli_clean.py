"""``opguard clean``: remove this node's local copies of streams sealed on the target (``docs/slurm.md``)."""

from __future__ import annotations

import sys

import click

from opguard.cli import handle_errors, main


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def render(report: object) -> list[str]:
    """The lines ``opguard clean`` prints (also used by ``opguard-run --clean-local``)."""
    from opguard.staging.clean import CleanReport

    assert isinstance(report, CleanReport)
    verb = "would remove" if report.dry_run else "removed"
    lines = [f"{verb} {stream} ({_mib(size)})" for stream, size in report.removed]
    lines += [f"kept {stream}: {why}" for stream, why in report.kept]
    lines.append(f"{verb} {len(report.removed)} stream(s), {report.freed} bytes ({_mib(report.freed)}) "
                 f"{'would be ' if report.dry_run else ''}freed; kept {len(report.kept)} not safely published")
    return lines


@main.command("clean")
@click.option("--rank", "ranks", type=int, multiple=True, help="only this global rank's stream (repeatable)")
@click.option("--node", is_flag=True, help="only this node's metadata stream")
@click.option("--dry-run", is_flag=True, help="list what would be removed and the bytes it would free; remove nothing")
@handle_errors
def clean_cmd(ranks: tuple[int, ...], node: bool, dry_run: bool) -> None:
    """Remove this node's local copies of streams that are sealed on the target.

    Each stream's seal and batch digests on the target are re-checked against the local
    checkpoint, and every local file against what was published; anything not safely published
    is kept and listed. Default: every stream staged on this node. Exit 0 when nothing had to be
    kept, 5 when some stream was kept.
    """
    from opguard.staging.clean import clean
    from opguard.staging.config import StagingConfig
    from opguard.staging.layout import Layout, current_node_id, node_stream, rank_stream
    from opguard.staging.sync import all_streams

    config = StagingConfig.from_env()
    config.require_staging()
    layout = Layout(config)
    node_id = current_node_id(config)
    streams = [rank_stream(r) for r in ranks] + ([node_stream(node_id)] if node else [])
    if not streams:
        streams = all_streams(config, layout, node_id)
    report = clean(config, layout, streams, node_id, dry_run=dry_run)
    for line in render(report):
        click.echo(f"opguard clean: {line}", err=True)
    sys.exit(5 if report.kept else 0)
