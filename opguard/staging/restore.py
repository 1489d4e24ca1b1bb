"""Verify and restore a shared target (``docs/format.md`` §5, §7, §8; legacy formats §9).

``verify(source)`` reads everything and writes nothing; ``materialize(source, dest)`` builds the
logical tree in ``DEST.opguard-partial-<random>/<name>`` beside DEST, verifying every batch as it is
applied, fsyncs it and publishes it with one no-replace rename. On any failure the partial tree
is removed: DEST never appears half-written.

Stream status: **sealed** (the current seal names the last batch), **unsealed** (no seal, or
batches follow it: the job may have died before its final drain; reported loudly, an error with
``require_sealed``), **damaged** (a missing, altered, truncated or foreign batch, a broken hash
chain or a seal naming a missing batch: always an error, exit 5). A newer format is refused
(exit 6). Reference v1 bundles and legacy ``sync.tar.gz`` snapshots carry no seals: their
streams are always reported unsealed.

``progress``, when given, is called as ``progress(stream, batches_done, batches_total)`` after
each batch (or archive) of a stream.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from opguard.errors import ConfigError, IdentityError, IntegrityError
from opguard.staging.fsutil import fsync_dir
from opguard.staging.layout import BUNDLES_DIRNAME, FORMAT_FILE, SNAPSHOT_NAME, STREAMS_DIRNAME, TARGET_TMP_PREFIX
from opguard.staging.restore_report import (
    DAMAGED,
    FIX_DAMAGED,
    FORMAT_SNAPSHOT,
    FORMAT_V1,
    FORMAT_V2,
    SEALED,
    UNSEALED,
    DamagedSource,
    NothingPublished,
    RestoreProgress,
    RestoreReport,
    StreamVerifyReport,
    VerifyReport,
    check_require_sealed,
    warn_unsealed,
)
from opguard.staging.restore_snapshot import find_snapshots, run_snapshots
from opguard.staging.restore_tree import OutputTree, rename_noreplace
from opguard.staging.restore_v1 import find_v1_owners, run_v1
from opguard.staging.restore_v2 import run_v2

__all__ = ["DAMAGED", "FORMAT_SNAPSHOT", "FORMAT_V1", "FORMAT_V2", "SEALED", "UNSEALED", "DamagedSource",
           "NothingPublished", "RestoreProgress", "RestoreReport", "StreamVerifyReport", "VerifyReport", "detect",
           "holds_published_data", "materialize", "rename_noreplace", "verify"]


def holds_published_data(source: Path) -> bool:
    """Whether SOURCE is something to restore: a ``.opguard-bundles/`` directory or legacy
    ``sync.tar.gz`` archives at any depth, the two things :func:`detect` looks for (not yet judged:
    :func:`detect`, :func:`verify` and :func:`materialize` refuse what is wrong with them). For a
    caller that also takes plain trace directories (``opguard compare``); a directory that cannot
    be listed holds nothing found here."""
    if (source / BUNDLES_DIRNAME).is_dir():
        return True
    try:
        return bool(find_snapshots(source))
    except IntegrityError:
        return False


def detect(source: Path) -> str:
    """Which format SOURCE holds (FORMAT_V2, FORMAT_V1 or FORMAT_SNAPSHOT); errors if none/mixed."""
    if not source.is_dir():
        raise ConfigError(f"restore source {source} is not a directory",
                          "pass the run's shared output directory (the one holding .opguard-bundles/)")
    bundles = source / BUNDLES_DIRNAME
    snapshots = find_snapshots(source)
    if bundles.is_symlink():
        raise IntegrityError(f"{bundles} is a symbolic link", "restore from the real directory")
    if bundles.is_dir():
        if snapshots:
            raise IdentityError(
                f"{source} holds both {BUNDLES_DIRNAME}/ and legacy snapshot archives "
                f"(e.g. {snapshots[0]}): the formats are never mixed in one run",
                f"copy the {SNAPSHOT_NAME} files to another directory and restore each format separately")
        names = os.listdir(bundles)
        temporaries = sorted(n for n in names if n.startswith(TARGET_TMP_PREFIX))
        if len(temporaries) == len(names):
            held = (f"only {len(temporaries)} temporary file(s) of a first sync that is running or was killed "
                    f"(e.g. {bundles / temporaries[0]})" if temporaries else "nothing")
            raise NothingPublished(source, f"{bundles} holds {held}, no {FORMAT_FILE} and no batch")
        if (bundles / FORMAT_FILE).exists() or (bundles / FORMAT_FILE).is_symlink():
            return FORMAT_V2
        if find_v1_owners(bundles):
            return FORMAT_V1
        if (bundles / STREAMS_DIRNAME).exists():
            raise IntegrityError(f"{bundles / FORMAT_FILE} is missing but {bundles / STREAMS_DIRNAME} exists",
                                 "the target identity file was lost; recover it from a backup of the target")
        raise IntegrityError(f"{bundles} holds neither {FORMAT_FILE} (format 2) nor reference v1 bundle "
                             "directories (<node16>-rank<NNNNNN>)", "check that SOURCE is the run's output directory")
    if snapshots:
        return FORMAT_SNAPSHOT
    raise ConfigError(f"no opguard data in {source}: no {BUNDLES_DIRNAME}/ and no {SNAPSHOT_NAME}",
                      "pass the run's shared output directory (OPGUARD_LOCAL_DUMP_TARGET of the run)")



def _run(source: Path, tree: OutputTree, report: VerifyReport, require_sealed: bool,
         progress: RestoreProgress | None) -> None:
    report.format = detect(source)
    if report.format == FORMAT_V2:
        run_v2(source, tree, report, progress, require_sealed)
    elif report.format == FORMAT_V1:
        run_v1(source / BUNDLES_DIRNAME, tree, report, progress)
    else:
        run_snapshots(source, tree, report, progress)
    if report.format != FORMAT_V2 or tree.root is None:
        warn_unsealed(report)
    bad = report.with_status(DAMAGED)
    if bad:
        detail = "; ".join(f"{sr.error}" for sr in bad)
        raise DamagedSource(f"{len(bad)} damaged stream(s): {detail}", FIX_DAMAGED, report)
    check_require_sealed(report, require_sealed)
    tree.apply_meta()
    tree.fsync_all()


def verify(source: Path, *, require_sealed: bool = False, progress: RestoreProgress | None = None) -> VerifyReport:
    """Check everything published under SOURCE without writing anything.

    Returns the report when nothing is damaged (unsealed streams are reported and warned about).
    Raises :class:`DamagedSource` (exit 5, with ``.report``) naming every damaged stream, or, with
    ``require_sealed``, every unsealed one; :class:`IdentityError` (exit 6) for a newer format.
    """
    source = Path(os.path.abspath(source))
    report = VerifyReport(str(source))
    try:
        _run(source, OutputTree(None, report.warn), report, require_sealed, progress)
    except OSError as e:  # verify writes nothing: what failed is reading SOURCE
        raise IntegrityError(f"reading {e.filename or source} failed: {e.strerror or e} (errno {e.errno})",
                             "check the storage of SOURCE (permissions, I/O errors) and run verify again") from None
    return report


def materialize(source: Path, dest: Path, *, require_sealed: bool = False,
                progress: RestoreProgress | None = None) -> RestoreReport:
    """Restore SOURCE into DEST (which must not exist), verified, published by one rename."""
    source = Path(os.path.abspath(source))
    dest = Path(os.path.abspath(dest))
    if os.path.lexists(dest):
        raise ConfigError(f"restore destination {dest} already exists",
                          "choose a destination that does not exist (the restore creates it)")
    parent = dest.parent
    if not parent.is_dir():
        raise ConfigError(f"the parent of the restore destination, {parent}, is not a directory",
                          f"create it first: mkdir -p {parent}")
    real_src, real_parent = source.resolve(), parent.resolve()
    if real_parent == real_src or real_src in real_parent.parents:
        raise ConfigError(f"restore destination {dest} is inside the source {source}",
                          "choose a destination outside the source directory")
    report = RestoreReport(str(source), dest=str(dest))
    # DEST is built as DEST.opguard-partial-<random>/<DEST's name>: the outer directory is created
    # mode 0700 (mkdtemp), so no other user can enter the tree being built, whatever the parent allows
    private = Path(tempfile.mkdtemp(prefix=f"{dest.name}.opguard-partial-", dir=parent))
    partial = private / dest.name
    tree: OutputTree | None = None
    try:
        partial.mkdir()
        tree = OutputTree(partial, report.warn)
        try:
            _run(source, tree, report, require_sealed, progress)
            if report.origins:  # which attempt each file's last version came from (docs/format.md §8)
                from opguard.staging.attempts import PROVENANCE_FILE, write_provenance

                if write_provenance(partial, report.origins) is not None:
                    report.provenance = str(dest / PROVENANCE_FILE)
        except OSError as e:  # reads of SOURCE are reported by the readers (exit 5); this is DEST
            raise ConfigError(f"restoring into {dest} failed: {e.strerror or e} (errno {e.errno}"
                              f"{', ' + str(e.filename) if e.filename else ''})",
                              "free space or inodes on the destination's file system, or choose a DEST where you "
                              "can write; nothing was published") from None
        fsync_dir(partial)
        rename_noreplace(partial, dest)
        fsync_dir(parent)
        os.rmdir(private)
    except BaseException:
        if tree is not None:
            tree.remove_all()
        shutil.rmtree(private, ignore_errors=True)
        raise
    finally:
        if tree is not None:
            tree.close()
    return report

