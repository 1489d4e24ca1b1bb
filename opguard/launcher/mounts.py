"""Which filesystem a path is on, from the kernel's mount table (``/proc/self/mountinfo``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")

# Filesystems shared between nodes (or backed by a network): a node-local staging base must
# not be on one. "fuse" and every "fuse.*" subtype count (sshfs, glusterfs, s3fs, ...).
NETWORK_FSTYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "mmfs", "beegfs", "ceph", "cephfs", "cifs", "smb", "smb3", "smbfs",
    "glusterfs", "panfs", "afs", "pvfs2", "orangefs", "wekafs", "9p", "ncpfs", "davfs", "fuse", "fuseblk",
    "quobyte", "scalityfs", "vastfs", "lizardfs", "moosefs",
})


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse mountinfo lines (``man 5 proc``): fields 5 (mount point) and, after ``-``, fstype/source."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        parts = line.split()
        if "-" not in parts or len(parts) < 7:
            continue
        sep = parts.index("-")
        if sep + 2 >= len(parts) + 1 or sep + 1 >= len(parts):
            continue
        source = parts[sep + 2] if sep + 2 < len(parts) else ""
        mounts.append(Mount(_unescape(parts[4]), parts[sep + 1], _unescape(source)))
    return mounts


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount with the longest mount point that contains ``path`` (resolved); the last one wins on ties."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        inside = real == mp or mp == "/" or real.startswith(mp + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def is_network_fstype(fstype: str) -> bool:
    base = fstype.lower()
    return base in NETWORK_FSTYPES or base.startswith("fuse.") or base.startswith("nfs")


def filesystem_of(path: Path, mountinfo: Path = MOUNTINFO) -> Mount | None:
    """The mount ``path`` lives on (``path`` or its nearest existing parent), or None if unknown."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        text = mountinfo.read_text(errors="replace")
    except OSError:
        return None
    return mount_of(p, parse_mountinfo(text))
