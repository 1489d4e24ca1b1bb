"""``python -m opguard.local_sync.materialize SOURCE DEST`` (the spec's spelling of the restore).

Same behaviour as ``opguard materialize``: DEST must not exist; every batch is verified; DEST is
published complete by one rename or not at all. Errors go to stderr with their exit status.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from opguard.errors import OpguardError
from opguard.staging.layout import BUNDLES_DIRNAME
from opguard.staging.restore import RestoreReport, materialize

__all__ = ["has_bundles", "main", "materialize"]


def has_bundles(source: str | Path) -> bool:
    """True when SOURCE holds published batches (``.opguard-bundles/``) rather than plain files."""
    return (Path(source) / BUNDLES_DIRNAME).is_dir()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--require-sealed", is_flag=True, help="fail (exit 5) if any stream is unsealed")
def main(source: Path, dest: Path, require_sealed: bool) -> None:
    """Restore SOURCE (a run's shared output directory) into DEST, which must not exist."""
    try:
        report: RestoreReport = materialize(source, dest, require_sealed=require_sealed)
    except OpguardError as err:
        click.echo(f"opguard: error: {err}", err=True)
        sys.exit(err.exit_code)
    click.echo(f"opguard: restored {len(report.streams)} stream(s), {report.files} file(s), "
               f"{report.bytes} bytes into {report.dest}", err=True)
    click.echo(report.dest)


if __name__ == "__main__":
    main(prog_name="python -m opguard.local_sync.materialize")
