"""``opguard compare A B -o OUT`` (CLI layer over :mod:`opguard.compare`)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import click

from opguard.cli import handle_errors, main
from opguard.errors import ConfigError


def _ints(option: str, values: tuple[str, ...]) -> frozenset[int] | None:
    """``--step 3 --step 5-7`` / ``--rank 0,1``: integers and inclusive ranges."""
    if not values:
        return None
    out: set[int] = set()
    for value in values:
        for part in value.split(","):
            lo, sep, hi = part.strip().partition("-")
            try:
                if sep:
                    a, b = int(lo), int(hi)
                    if a > b:
                        raise ValueError
                    out.update(range(a, b + 1))
                else:
                    out.add(int(lo))
            except ValueError:
                raise ConfigError(f"{option} {value!r}: not an integer or a range like 2-5",
                                  f"pass e.g. {option} 3, {option} 0,2 or {option} 2-5") from None
    return frozenset(out)


def _check_output(option: str, path: Path | None, taken: list[Path]) -> None:
    if path is None:
        return
    if not path.parent.is_dir():
        raise ConfigError(f"{option} {path}: the directory {path.parent} does not exist", "create it first")
    if any(path.resolve() == t.resolve() for t in taken):
        raise ConfigError(f"{option} {path} is also another output of this command", "pass a separate file")
    taken.append(path)


@contextmanager
def _atomic(path: Path | None) -> Iterator[IO[str] | None]:
    """A text file written beside ``path`` and renamed into place only when the block succeeds."""
    if path is None:
        yield None
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.opguard-tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@main.command("compare")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the Perfetto view to write (protobuf trace, e.g. compare.pftrace)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="also write the summary as JSON (per rank: counts, first introduced divergence, notes)")
@click.option("--pairs", "pairs_out", type=click.Path(dir_okay=False, path_type=Path),
              help="also write every pair and every unresolved operation as JSON lines")
@click.option("--rank", "ranks", multiple=True, help="compare only these ranks (e.g. 1, 0,2 or 0-3)")
@click.option("--step", "steps", multiple=True,
              help="count, report and list only operations of these steps (e.g. 3 or 2-5)")
@click.option("--function", "functions", multiple=True,
              help="count, report and list only these functions (fnmatch pattern, e.g. 'torch.nn.functional.*')")
@click.option("--show", "show", multiple=True, metavar="RECORD_ID",
              help="print the full evidence of the pair (or unresolved operation) holding this record_id as "
                   "JSON on stdout (record_ids are in the summary, --pairs and the view)")
@handle_errors
def compare_cmd(a: str, b: str, out: Path, json_out: Path | None, pairs_out: Path | None, ranks: tuple[str, ...],
                steps: tuple[str, ...], functions: tuple[str, ...], show: tuple[str, ...]) -> None:
    """Pair the operations of runs A and B, diff the pairs and write a Perfetto view.

    A and B are each a trace directory, a restored directory, a shared target with
    .opguard-bundles/ (restored on the fly into a temporary directory), a legacy sync.tar.gz
    snapshot, or reference-implementation traces (exec_trace/gpu_<rank>/ops/...). The summary
    goes to stderr; it leads, per rank, with the first introduced divergence. See docs/compare.md.
    """
    from opguard.compare.engine import Options, Select, check_paired, compare

    taken = [out]
    _check_output("--json", json_out, taken)
    _check_output("--pairs", pairs_out, taken)
    select = Select(_ints("--rank", ranks), _ints("--step", steps), tuple(functions) or None)
    with _atomic(pairs_out) as pairs:
        summary = compare(a, b, out, Options(select, pairs, frozenset(show)))
    click.echo(summary.render(), err=True)
    if json_out is not None:
        with _atomic(json_out) as f:
            assert f is not None
            json.dump(summary.as_json(), f, indent=1, sort_keys=True)
            f.write("\n")
    if show:
        found = {r for e in summary.shown for side in ("a", "b") if side in e for r in [e[side]["record"]]}
        for e in summary.shown:
            click.echo(json.dumps(e, indent=1, sort_keys=True))
        missing = sorted(set(show) - found)
        if missing:
            raise ConfigError(f"--show: no operation with record_id {', '.join(missing)} in this comparison",
                              "copy a record_id from the summary, --pairs or the view (e.g. A/rank0/capture/12)")
    check_paired(summary)
