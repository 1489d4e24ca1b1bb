"""``opguard materialize`` and ``opguard verify`` (restore side of ``docs/format.md`` §8–§9)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import click

from opguard.cli import handle_errors, main
from opguard.errors import OpguardError


def _attempt_lines(source: Path, restored: Path | None = None) -> list[str]:
    """Every node's attempts (``docs/format.md`` §4.1): as published under SOURCE, or, after a
    restore, as the restore verified and wrote them under ``restored`` (no second read of SOURCE)."""
    from opguard.staging.attempts import describe, published_attempts, restored_attempts

    found = published_attempts(source) if restored is None else restored_attempts(restored)
    lines = []
    for node, attempts in sorted(found.items()):
        lines += [f"node {node} {describe(a)}" for a in attempts if isinstance(a, dict)]
    return lines


def _finite(v: Any) -> Any:
    """``v`` with every non-finite float as null: ``--json`` prints strict JSON whatever a forged
    ``attempts.json`` holds (NaN is no JSON value)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _summary(report: object) -> str:
    from opguard.staging.restore import VerifyReport

    assert isinstance(report, VerifyReport)
    counts = ", ".join(f"{len(report.with_status(s))} {s}" for s in ("sealed", "unsealed", "damaged"))
    return (f"{report.format}: {len(report.streams)} stream(s) ({counts}), {report.batches} batch(es), "
            f"{report.files} file(s), {report.bytes} bytes")


@main.command("materialize")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--require-sealed", is_flag=True, help="fail (exit 5) if any stream is unsealed")
@handle_errors
def materialize_cmd(source: Path, dest: Path, require_sealed: bool) -> None:
    """Restore SOURCE (a run's shared output) into DEST, which must not exist (its parents are created).

    Every batch is verified; DEST appears complete or not at all. Prints DEST on stdout.
    """
    from opguard.staging.dirs import make_dest_parents
    from opguard.staging.restore import materialize

    make_dest_parents(source, dest)
    report = materialize(source, dest, require_sealed=require_sealed)
    click.echo(f"opguard: restored {_summary(report)} into {report.dest}", err=True)
    try:  # DEST is in place: nothing read back from it may turn the restore into a failure now
        for line in _attempt_lines(source, Path(report.dest)):
            click.echo(f"opguard: {line}", err=True)
    except Exception as err:
        click.echo(f"opguard: the restored attempts record (nodes/*/attempts.json) could not be described "
                   f"({type(err).__name__}: {err}); the restore itself is complete", err=True)
    click.echo(report.dest)


@main.command("verify")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--require-sealed", is_flag=True, help="fail (exit 5) if any stream is unsealed")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON on stdout")
@handle_errors
def verify_cmd(source: Path, require_sealed: bool, as_json: bool) -> None:
    """Check everything published under SOURCE without writing anything.

    Exit 0 when all published data is intact (unsealed streams are reported), 5 naming the
    damaged (or, with --require-sealed, unsealed) streams, 6 for a newer format.
    """
    from opguard.staging.restore import DamagedSource, VerifyReport, verify

    report: VerifyReport | None = None
    error: OpguardError | None = None
    try:
        report = verify(source, require_sealed=require_sealed)
    except DamagedSource as e:
        report, error = e.report, e
    if as_json:
        import json

        from opguard.staging.attempts import published_attempts

        doc = json.loads(report.to_json())
        doc["attempts"] = _finite(published_attempts(source))
        click.echo(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False))
    else:
        for sr in report.streams:
            line = f"{sr.status:9} {sr.stream}: {sr.batches} batch(es), {sr.files} file(s), {sr.bytes} bytes"
            click.echo(line + (f" -- {sr.error}" if sr.error else ""))
        click.echo(_summary(report))
        for line in _attempt_lines(source):
            click.echo(line)
    sys.stdout.flush()
    if error is not None:
        raise error
