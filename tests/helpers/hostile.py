"""Helpers for the hostile-target tests: forge batches whose checksums, names and chain are all
recomputed (what anyone with write access to a shared target can do), build legacy archives with
oversized headers, and run the real CLI while measuring its peak RSS."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import subprocess
import sys
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

from opguard.staging.bundle import FOOTER, FOOTER_MAGIC, HEADER, batch_name, parse_batch_name
from opguard.staging.fsutil import dumps_json, loads_json
from tests.conftest import BIN, REPO

# runs argv, then prints the child's peak RSS (KiB) as the last line of stderr
_MEASURE = ("import resource, subprocess, sys\n"
            "r = subprocess.run(sys.argv[1:])\n"
            "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(r.returncode)\n")


def run_measured(*args: str, timeout: float = 120,
                 env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], int]:
    """``opguard ARGS`` through the real CLI; (result, peak RSS of the opguard process in bytes)."""
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(BIN / "opguard"), *args], capture_output=True,
                       text=True, timeout=timeout, cwd=REPO, env=env)
    lines = r.stderr.rstrip("\n").split("\n")
    assert lines[-1].startswith("maxrss_kib "), r.stderr
    r.stderr = "\n".join(lines[:-1])
    return r, int(lines[-1].split()[1]) * 1024


def split_batch(path: Path) -> tuple[bytes, bytes, bytes]:
    """(header, payload frame, manifest frame) of a batch file."""
    data = path.read_bytes()
    plen, mlen, _sha, _magic = FOOTER.unpack(data[-FOOTER.size:])
    return data[:HEADER.size], data[HEADER.size:HEADER.size + plen], data[HEADER.size + plen:HEADER.size + plen + mlen]


def write_batch(path: Path, header: bytes, payload: bytes, mframe: bytes) -> Path:
    """Replace ``path`` by a batch of these sections with a correct footer and the name its digest
    gives (sequence kept): a forgery every unkeyed check accepts. Returns the new path."""
    data = header + payload + mframe + FOOTER.pack(len(payload), len(mframe), hashlib.sha256(mframe).digest(),
                                                   FOOTER_MAGIC)
    seq, _ = parse_batch_name(path.name)  # type: ignore[misc]
    new = path.with_name(batch_name(seq, hashlib.sha256(data).hexdigest()))
    path.unlink()
    new.write_bytes(data)
    return new


def manifest_of(path: Path) -> dict[str, Any]:
    _h, _p, mframe = split_batch(path)
    m = loads_json(zstandard.ZstdDecompressor().decompress(mframe))
    assert isinstance(m, dict)
    return m


def forge_manifest(path: Path, mutate: Callable[[dict[str, Any]], None] | None = None, *,
                   raw: bytes | None = None) -> Path:
    """Rewrite the manifest of batch ``path`` (``mutate`` it, or replace it by ``raw`` JSON bytes)."""
    header, payload, _m = split_batch(path)
    if raw is None:
        m = manifest_of(path)
        assert mutate is not None
        mutate(m)
        raw = dumps_json(m)
    return write_batch(path, header, payload, zstandard.ZstdCompressor(level=3, write_checksum=True).compress(raw))


def relink_chain(stream_dir: Path) -> list[Path]:
    """After forging batch k, rewrite prev_digest of every later batch (and rename it) so that the
    hash chain is intact again, as an attacker would. Returns the batches in order."""
    out: list[Path] = []
    for p in sorted(q for q in stream_dir.iterdir() if parse_batch_name(q.name)):
        if out:
            prev = parse_batch_name(out[-1].name)[1]  # type: ignore[index]
            if manifest_of(p).get("prev_digest") != prev:
                p = forge_manifest(p, lambda m, prev=prev: m.__setitem__("prev_digest", prev))  # type: ignore[misc]
        out.append(p)
    return out


def bomb_manifest_frame(declared: int) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes of content, and that really holds them
    (spaces after an opening brace: what a forged manifest bomb looks like)."""
    sink = _Sink()
    cctx = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    with cctx.stream_writer(sink, size=declared, closefd=False) as w:  # type: ignore[arg-type]
        w.write(b"{")
        left = declared - 1
        block = b" " * (1 << 20)
        while left:
            n = min(left, len(block))
            w.write(block[:n])
            left -= n
    return bytes(sink.data)


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> int:
        self.data += b
        return len(b)

    def flush(self) -> None:
        pass


def oversized_header_archive(path: Path, kind: bytes, size: int) -> Path:
    """A ``sync.tar.gz`` whose first member is a GNU long-name (``kind`` b"L") or pax (b"x") header
    declaring ``size`` bytes, all present (zeros, which gzip shrinks ~1000:1), then a regular file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ti = tarfile.TarInfo("././@LongLink" if kind == b"L" else "./PaxHeaders/x")
    ti.type = kind
    ti.size = size
    head = ti.tobuf(tarfile.GNU_FORMAT if kind == b"L" else tarfile.USTAR_FORMAT)
    z = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip container
    with open(path, "wb") as f:
        f.write(z.compress(head))
        block = b"\0" * (1 << 20)
        left = size + (-size % 512)
        while left:
            n = min(left, len(block))
            f.write(z.compress(block[:n]))
            left -= n
        real = tarfile.TarInfo("trace.jsonl")
        real.size = 3
        f.write(z.compress(real.tobuf(tarfile.GNU_FORMAT) + b"{}\n" + b"\0" * 509 + b"\0" * 1024))
        f.write(z.flush())
    return path


def snapshot(path: Path, members: dict[str, bytes]) -> Path:
    """A well-formed legacy ``sync.tar.gz`` holding ``members`` (regular files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o644
            ti.mtime = 1_700_000_000
            tar.addfile(ti, io.BytesIO(data))
    return path


def snapshot_of_files(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (file -> bytes, dir -> None), walked by descriptors (any depth)."""
    out: dict[str, bytes | None] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        for e in os.scandir(root / rel if rel else root):
            r = f"{rel}/{e.name}" if rel else e.name
            if e.is_symlink():
                raise AssertionError(f"{r} is a symlink")
            if e.is_dir():
                out[r] = None
                stack.append(r)
            else:
                out[r] = Path(e.path).read_bytes()
    return out


def remove_deep(path: Path) -> None:
    """Remove a directory tree of any depth (pytest's own cleanup recurses, and fails past ~1,000
    levels): walk down and up by descriptors, holding one at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    below: list[str] = []
    while True:
        sub = None
        for name in os.listdir(fd):
            if _is_dir(name, fd):
                sub = name
            else:
                os.unlink(name, dir_fd=fd)
        if sub is not None:
            nfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
            below.append(sub)
            continue
        if not below:
            os.close(fd)
            os.rmdir(path)
            return
        pfd = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        os.rmdir(below.pop(), dir_fd=pfd)
        fd = pfd


def _is_dir(name: str, dir_fd: int) -> bool:
    return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
