"""``python -m opguard.tools align EXPORT MAP -o NEW`` — see docs/compare.md §7."""

from __future__ import annotations

from pathlib import Path

import click

from opguard.errors import OpguardError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def tools() -> None:
    """opguard offline report tools."""


@tools.command("align")
@click.argument("export", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("amap", metavar="MAP", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "new", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the new Perfetto view to write")
def align_cmd(export: Path, amap: Path, new: Path) -> None:
    """Write a new Perfetto view from EXPORT and an alignment MAP bound to EXPORT's SHA-256."""
    from opguard.compare.align import align

    try:
        rep = align(export, amap, new)
    except OpguardError as err:
        click.echo(f"opguard: error: {err}", err=True)
        raise SystemExit(err.exit_code) from None
    click.echo(f"opguard align: {rep.links} slot link(s), {rep.rejected} rejected pair(s), {rep.ops} operations; "
               f"view: {rep.path} ({rep.bytes} bytes); {export} unchanged", err=True)


if __name__ == "__main__":
    tools(prog_name="python -m opguard.tools")
