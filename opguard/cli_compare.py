"""``opguard compare A B -o OUT`` (CLI layer over :mod:`opguard.compare`)."""

from __future__ import annotations

from pathlib import Path

import click

from opguard.cli import handle_errors, main


@main.command("compare")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the Perfetto view to write (protobuf trace, e.g. compare.pftrace)")
@handle_errors
def compare_cmd(a: str, b: str, out: Path) -> None:
    """Pair the operations of runs A and B, diff the pairs and write a Perfetto view.

    A and B are each a trace directory, a restored directory, a shared target with
    .opguard-bundles/ (restored on the fly into a temporary directory), a legacy sync.tar.gz
    snapshot, or reference-implementation traces (exec_trace/gpu_<rank>/ops/...). The summary
    goes to stderr. See docs/compare.md.
    """
    from opguard.compare.engine import check_paired, compare

    summary = compare(a, b, out)
    click.echo(summary.render(), err=True)
    check_paired(summary)
