"""One sync, as ``opguard sync`` and the wrapper's sync children run it (``docs/launcher.md`` §3).

:func:`run` is the whole command: it resolves this node, checks the node claim's conflict markers
(``docs/format.md`` §5.3) *inside the sync*, before anything is uploaded, selects the streams,
syncs them, writes the report and prints what the CLI prints. The wrapper starts it as a module
entry point, ``python -m opguard.staging.syncrun ARGS`` (:func:`module_command`), and reads the
report back as a typed :class:`SyncOutcome`; ``opguard sync`` is a thin click layer over the same
:class:`SyncRequest`. No CLI, no launcher, no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opguard.errors import ConfigError, OpguardError

if TYPE_CHECKING:
    from opguard.staging.config import StagingConfig
    from opguard.staging.layout import Layout
    from opguard.staging.sync import SyncReport

MODULE = "opguard.staging.syncrun"


@dataclass(frozen=True)
class SyncRequest:
    """What to sync. ``since``: the wrapper's start (wall clock) when a wrapper runs the sync
    (conflict markers recorded after it count); None for a stand-alone sync (markers of this Slurm
    job count, ``claim.job_conflict``)."""

    ranks: tuple[int, ...] = ()
    node: bool = False
    all: bool = False
    final: bool = False
    since: float | None = None
    report_json: Path | None = None
    quiet: bool = False
    verbose: bool = False

    def argv(self) -> list[str]:
        """The module entry point's arguments for this request (:func:`parse`'s inverse)."""
        args: list[str] = [] if self.since is None else ["--since", repr(self.since)]
        for r in self.ranks:
            args += ["--rank", str(r)]
        args += [flag for flag, on in (("--node", self.node), ("--all", self.all), ("--final", self.final),
                                       ("--quiet", self.quiet), ("--verbose", self.verbose)) if on]
        if self.report_json is not None:
            args += ["--report-json", str(self.report_json)]
        return args


def module_command(req: SyncRequest, python: str = sys.executable) -> list[str]:
    """The command line that runs ``req`` in a child process."""
    return [python, "-m", MODULE, *req.argv()]


def parse(argv: Sequence[str]) -> SyncRequest:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="one opguard sync (docs/launcher.md §3)")
    p.add_argument("--since", type=float, default=None)
    p.add_argument("--rank", dest="ranks", type=int, action="append", default=[])
    for flag in ("--node", "--all", "--final", "--quiet", "--verbose"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--report-json", type=Path, default=None)
    a = p.parse_args(list(argv))
    return SyncRequest(tuple(a.ranks), a.node, a.all, a.final, a.since, a.report_json, a.quiet, a.verbose)


# ---------------------------------------------------------------------------------------------
# the report, typed


@dataclass(frozen=True)
class StreamOutcome:
    stream: str
    batches: int
    uploaded_bytes: int
    backlog_bytes: int
    sealed: bool
    error: str | None


@dataclass(frozen=True)
class SyncOutcome:
    """A sync's ``--report-json`` as the wrapper reads it (``SyncReport.to_json``, plus
    ``node_id_conflict``/``fix`` when the claim check refused the sync before it uploaded)."""

    exit_code: int
    batches: int
    uploaded_bytes: int
    backlog_bytes: int
    streams: tuple[StreamOutcome, ...]
    node_id_conflict: str | None = None
    fix: str | None = None
    error: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SyncOutcome:
        streams = tuple(StreamOutcome(str(s["stream"]), int(s.get("batches", 0)), int(s.get("uploaded_bytes", 0)),
                                      int(s.get("backlog_bytes", 0)), bool(s.get("sealed")), s.get("error"))
                        for s in d.get("streams", []))
        return cls(int(d.get("exit_code", 0)), int(d.get("batches", 0)), int(d.get("uploaded_bytes", 0)),
                   int(d.get("backlog_bytes", 0)), streams, d.get("node_id_conflict"), d.get("fix"), d.get("error"))

    @classmethod
    def read(cls, path: Path) -> SyncOutcome | None:
        """The report at ``path``; None when the sync wrote none (killed, or failed before)."""
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        try:
            return cls.from_json(doc) if isinstance(doc, dict) else None
        except (KeyError, TypeError, ValueError):
            return None


def _conflict_report(err: ConfigError) -> dict[str, Any]:
    return {"exit_code": err.exit_code, "node_id_conflict": err.message, "fix": err.fix, "batches": 0,
            "uploaded_bytes": 0, "backlog_bytes": 0, "streams": []}


# ---------------------------------------------------------------------------------------------
# the command


def _say(msg: str) -> None:
    sys.stderr.write(f"opguard sync: {msg}\n")
    sys.stderr.flush()


def _error(msg: str) -> None:
    sys.stderr.write(f"opguard: error: {msg}\n")
    sys.stderr.flush()


def _streams(req: SyncRequest, config: StagingConfig, layout: Layout, node_id: str) -> list[str]:
    """The streams a request names (``--all``: every rank staged here plus the node stream)."""
    from opguard.staging.layout import current_rank, node_stream, rank_stream
    from opguard.staging.sync import all_streams

    if req.all and (req.ranks or req.node):
        raise ConfigError("--all already includes every rank and the node stream",
                          "use --all alone, or --rank/--node")
    if any(r < 0 for r in req.ranks):
        raise ConfigError(f"--rank {min(req.ranks)} is negative", "pass a global rank >= 0")
    if req.all:
        return all_streams(config, layout, node_id)
    streams = [rank_stream(r) for r in dict.fromkeys(req.ranks)]
    if not req.ranks and not req.node:
        streams = [rank_stream(current_rank())]
    if req.node:
        streams.append(node_stream(node_id))
    return streams


def _print(report: SyncReport, req: SyncRequest, say: Callable[[str], None], error: Callable[[str], None]) -> None:
    """What ``opguard sync`` prints: every error, a line per stream (``--verbose``), the summary."""
    from opguard.staging.units import format_bytes

    if report.error and not report.streams:
        error(report.error)
    for s in report.streams:
        if s.error:
            error(f"{s.stream}: {s.error}")
        elif req.verbose and not req.quiet:
            say(f"{s.stream}: {s.batches} batch(es), {format_bytes(s.payload_bytes)} payload, "
                f"{format_bytes(s.uploaded_bytes)} uploaded, backlog {format_bytes(s.backlog_bytes)}"
                + (", sealed" if s.sealed else ""))
    if req.quiet:
        return
    rate = report.uploaded_bytes / report.seconds if report.seconds > 0 else 0.0
    failed = sum(1 for s in report.streams if s.error)
    say(f"{'final: ' if req.final else ''}{len(report.streams)} stream(s), {report.batches} batch(es), "
        f"{format_bytes(report.payload_bytes)} payload, {format_bytes(report.uploaded_bytes)} uploaded in "
        f"{report.seconds:.2f} s ({format_bytes(rate)}/s), backlog {format_bytes(report.backlog_bytes)}"
        + (f", {failed} failed" if failed else "")
        + (f", {sum(1 for s in report.streams if s.sealed)} sealed" if req.final else ""))


def run(req: SyncRequest, say: Callable[[str], None] = _say, error: Callable[[str], None] = _error) -> int:
    """One sync; returns its exit status. Raises ConfigError for a bad request or environment, and
    for a node ID conflict (after writing its report: ``node_id_conflict``, nothing uploaded)."""
    from opguard.staging.claim import sync_conflict
    from opguard.staging.config import StagingConfig
    from opguard.staging.fsutil import atomic_replace_json
    from opguard.staging.layout import Layout, current_node_id
    from opguard.staging.sync import sync_streams

    config = StagingConfig.from_env()
    config.require_staging()
    layout = Layout(config)
    node_id = current_node_id(config)
    if config.target is not None:  # refused claimants of this node ID (docs/format.md §5.3)
        conflict = sync_conflict(config.target, node_id, req.since)
        if conflict is not None:
            if req.report_json is not None:
                atomic_replace_json(req.report_json.absolute(), _conflict_report(conflict))
            raise conflict
    streams = _streams(req, config, layout, node_id)
    loud = (req.final or req.verbose) and not req.quiet

    def progress(msg: str) -> None:
        if loud or msg.startswith("warning:"):
            say(msg)

    report = sync_streams(config, layout, streams, final=req.final, node_id=node_id, progress=progress)
    if req.report_json is not None:
        atomic_replace_json(req.report_json.absolute(), report.to_json())
    _print(report, req, say, error)
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m opguard.staging.syncrun``: the wrapper's sync child."""
    req = parse(sys.argv[1:] if argv is None else argv)
    try:
        return run(req)
    except OpguardError as err:
        _error(str(err))
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
