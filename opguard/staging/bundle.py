"""The batch file format (``docs/format.md`` §7): write one, read one, verify one.

A batch is header | zstd(payload) | zstd(manifest JSON) | footer. The payload is the
concatenation of the entries' bytes in manifest order. Readers never trust the zstd stream
alone: sizes and SHA-256 digests are checked for every entry.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

from opguard.errors import IdentityError, IntegrityError
from opguard.staging import names
from opguard.staging.fsutil import dumps_json, loads_json, open_regular

FORMAT_VERSION = 2
FORMAT_NAME = "opguard-bundles"  # the "format" field of the target's format.json (docs/format.md §5.1)
HEADER_MAGIC = b"OPGBATCH"
FOOTER_MAGIC = b"OPGBEND\0"
HEADER = struct.Struct("<8sII")
FOOTER = struct.Struct("<QQ32s8s")
CHUNK = 1 << 20
ZSTD_LEVEL = 3
ZSTD_THREADS = 0  # BatchWriter's default: inline (a sync passes sync.zstd_workers(...))
ZSTD_JOB_SIZE = 2 << 20  # input per zstd job when threads > 0 (bounds what the workers buffer)


BATCH_SUFFIX = ".ogb"
SEAL_SUFFIX = ".seal"
_DIGITS = frozenset("0123456789")


def batch_name(sequence: int, digest: str) -> str:
    """A batch file's name (``docs/format.md`` §5): ``<sequence:012d>-<sha256 hex>.ogb``."""
    return f"{sequence:012d}-{digest}{BATCH_SUFFIX}"


def parse_batch_name(name: str) -> tuple[int, str] | None:
    """(sequence, digest) for a well-formed batch name, else None."""
    if not name.endswith(BATCH_SUFFIX) or len(name) != 12 + 1 + 64 + 4 or name[12] != "-":
        return None
    seq, digest = name[:12], name[13:77]
    if not seq.isdigit() or any(c not in "0123456789abcdef" for c in digest):
        return None
    return int(seq), digest


def seal_name(sequence: int) -> str:
    """The seal record of a stream whose last batch is ``sequence`` (``docs/format.md`` §5.2)."""
    return f"{sequence:012d}{SEAL_SUFFIX}"


def parse_seal_name(name: str) -> int | None:
    """The sequence a well-formed seal name names, else None."""
    if not name.endswith(SEAL_SUFFIX) or len(name) != 12 + len(SEAL_SUFFIX) or not _DIGITS.issuperset(name[:12]):
        return None
    return int(name[:12])


class BatchWriteError(Exception):
    """Writing the batch file itself failed (not reading a source): e.g. the staging disk is full."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"{path}: {error.strerror or error}")
        self.path = path
        self.error = error


class _HashingWriter:
    """File-like sink that hashes and counts what passes through to ``f``."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


class BatchWriter:
    """Builds one batch file at ``path``. Use :meth:`add_bytes`/:meth:`add_stream`, then :meth:`finish`."""

    def __init__(self, path: Path, manifest: dict[str, Any], threads: int = ZSTD_THREADS) -> None:
        self.path = path
        self.manifest = dict(manifest)
        self.entries: list[dict[str, Any]] = []
        try:
            self._f = open(path, "wb")  # noqa: SIM115 - closed by finish()/abort()
        except OSError as e:
            raise BatchWriteError(path, e) from None
        self._out = _HashingWriter(self._f)
        self._out.write(HEADER.pack(HEADER_MAGIC, FORMAT_VERSION, HEADER.size))
        # threads > 0: that many zstd workers compress jobs of ZSTD_JOB_SIZE input while this thread
        # reads and hashes the sources and writes what they produced (sync.zstd_workers picks the count
        # from the CPUs the stream builders leave). The job size bounds what they buffer: the default
        # (8 MiB at level 3) took 44 MiB for one worker, and -1 (one per core) passed 128 MiB on 2 cores.
        # One frame either way (format.md §7); output differs from threads=0 only in how it was cut
        # into blocks. threads=0: inline, in this thread.
        params = zstandard.ZstdCompressionParameters.from_level(
            ZSTD_LEVEL, threads=threads, job_size=ZSTD_JOB_SIZE if threads > 0 else 0, write_checksum=True)
        cctx = zstandard.ZstdCompressor(compression_params=params)
        self._z = cctx.stream_writer(self._out, closefd=False, write_return_read=True)  # type: ignore[arg-type]
        self.payload_size = 0

    def add_stream(self, entry: dict[str, Any], src: IO[bytes], size: int,
                   on_chunk: Callable[[int], None] | None = None) -> str:
        """Copy exactly ``size`` bytes of ``src`` as one entry; returns its sha256."""
        sha = hashlib.sha256()
        left = size
        while left:
            buf = src.read(min(CHUNK, left))
            if not buf:
                raise OSError(f"source for {entry.get('path')!r} ended {left} bytes early")
            sha.update(buf)
            try:
                self._z.write(buf)
            except OSError as e:  # the batch file, not the source: a caller must not take it for a torn read
                raise BatchWriteError(self.path, e) from None
            left -= len(buf)
            if on_chunk:
                on_chunk(len(buf))
        digest = sha.hexdigest()
        self.entries.append({**entry, "size": size, "sha256": digest})
        self.payload_size += size
        return digest

    def add_bytes(self, entry: dict[str, Any], data: bytes) -> str:
        """Add ``data`` as one entry (one compressor call: the path for small files); returns its sha256.

        ``entry`` is taken over (its ``size`` and ``sha256`` are set).
        """
        try:
            self._z.write(data)
        except OSError as e:  # the batch file, not the source
            raise BatchWriteError(self.path, e) from None
        digest = hashlib.sha256(data).hexdigest()
        entry["size"] = len(data)
        entry["sha256"] = digest
        self.entries.append(entry)
        self.payload_size += len(data)
        return digest

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            self.path.unlink(missing_ok=True)

    def finish(self) -> tuple[str, int]:
        """Write manifest and footer, fsync, close. Returns (sha256 of file, file size).

        Raises :class:`BatchWriteError` if writing, fsyncing or closing the batch file fails."""
        try:
            return self._finish()
        except OSError as e:
            raise BatchWriteError(self.path, e) from None

    def _finish(self) -> tuple[str, int]:
        self._z.flush(zstandard.FLUSH_FRAME)
        payload_len = self._out.size - HEADER.size
        self.manifest.update({"format": "opguard-batch", "version": FORMAT_VERSION,
                              "entries": self.entries, "payload_size": self.payload_size})
        mbytes = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(
            dumps_json(self.manifest))
        self._out.write(mbytes)
        self._out.write(FOOTER.pack(payload_len, len(mbytes), hashlib.sha256(mbytes).digest(), FOOTER_MAGIC))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._out.sha.hexdigest(), self._out.size


@dataclass
class BatchInfo:
    path: Path
    manifest: dict[str, Any]
    payload_offset: int
    payload_len: int
    size: int
    fd: int = -1  # the open batch (from :func:`open_batch`) that iter_entries reads, or -1: reopen ``path``

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


NOT_ITS_DIGEST = "its content does not match the digest in its name (altered or truncated)"

# docs/format.md §11: the most a real manifest expands when decompressed. Every entry carries a
# SHA-256 (32 bytes of entropy no compressor removes) and at most a 4095-byte path JSON-escaped to
# 6 bytes a byte plus 512 bytes of other fields: (6 * 4095 + 512) / 32 < 784. A manifest frame is
# decompressed as a stream and refused past max(MANIFEST_FLOOR, MANIFEST_RATIO * its length on
# disk), whatever size the frame declares.
MANIFEST_RATIO = 784
MANIFEST_FLOOR = 1 << 20


def manifest_cap(frame_len: int) -> int:
    return max(MANIFEST_FLOOR, MANIFEST_RATIO * frame_len)


def _damaged(path: Path, what: str) -> IntegrityError:
    return IntegrityError(f"batch {path} is damaged: {what}",
                          "the shared copy was altered or truncated; restore it from a backup or re-run")


def _decompress_capped(data: bytes, cap: int, path: Path) -> bytes:
    """One zstd frame's content, read as a stream and refused past ``cap`` bytes."""
    out = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False)
    with reader:
        while buf := reader.read(CHUNK):
            out += buf
            if len(out) > cap:
                raise _damaged(path, f"manifest decompresses to more than {cap} bytes, {MANIFEST_RATIO} times its "
                                     f"{len(data)}-byte frame: more than any real manifest (docs/format.md §11)")
    return bytes(out)


def _check_entries(path: Path, manifest: dict[str, Any]) -> None:
    """Types and names of every entry (``docs/format.md`` §7), before anything is read or written."""
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        raise _damaged(path, f"manifest field entries is {names.show(entries)}, not a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise _damaged(path, f"manifest field entries[{i}] is {names.show(entry)}, not an object")
        try:
            names.relpath(entry.get("path"), f"manifest field entries[{i}].path")
        except IntegrityError as e:
            raise _damaged(path, e.message) from None
        for key in ("size", "offset", "version"):
            value = entry.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _damaged(path, f"manifest field entries[{i}].{key} is {names.show(value)}, not an integer >= 0")
        sha = entry.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise _damaged(path, f"manifest field entries[{i}].sha256 is {names.show(sha)}, not a SHA-256")
    total = manifest.get("payload_size")
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise _damaged(path, f"manifest field payload_size is {names.show(total)}, not an integer >= 0")


def open_batch(path: Path, dir_fd: int | None = None) -> BatchInfo:
    """:func:`read_manifest` of the regular file ``path`` (its name relative to ``dir_fd`` when given),
    opened without following a link; the returned info keeps it open for :func:`iter_entries`
    (call ``close()``)."""
    try:
        fd = open_regular(path.name if dir_fd is not None else path, dir_fd)
    except OSError as e:
        raise _damaged(path, f"cannot be opened as a regular file without following links ({e.strerror or e})") \
            from None
    try:
        info = _parse(path, fd)
    except BaseException:
        os.close(fd)
        raise
    info.fd = fd
    return info


def read_manifest(path: Path) -> BatchInfo:
    """Parse header, footer and manifest of a batch (no payload check)."""
    info = open_batch(path)
    info.close()
    return info


def _parse(path: Path, fd: int) -> BatchInfo:
    size = os.fstat(fd).st_size
    if size < HEADER.size + FOOTER.size:
        raise _damaged(path, f"only {size} bytes")
    magic, version, hlen = HEADER.unpack(os.pread(fd, HEADER.size, 0))
    if magic != HEADER_MAGIC:
        raise _damaged(path, "bad header magic")
    if version > FORMAT_VERSION:
        raise IdentityError(f"batch {path} has format version {version}; this opguard reads up to {FORMAT_VERSION}",
                            "upgrade opguard to read it")
    plen, mlen, msha, fmagic = FOOTER.unpack(os.pread(fd, FOOTER.size, size - FOOTER.size))
    if fmagic != FOOTER_MAGIC:
        raise _damaged(path, "bad footer magic (truncated?)")
    if hlen != HEADER.size or hlen + plen + mlen + FOOTER.size != size:
        raise _damaged(path, "section lengths do not add up to the file size")
    mbytes = os.pread(fd, mlen, hlen + plen)
    if len(mbytes) != mlen or hashlib.sha256(mbytes).digest() != msha:
        raise _damaged(path, "manifest checksum mismatch")
    try:
        raw = _decompress_capped(mbytes, manifest_cap(mlen), path)
        manifest = loads_json(raw)
    except (zstandard.ZstdError, ValueError, RecursionError) as e:
        raise _damaged(path, f"manifest unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "opguard-batch":
        raise _damaged(path, "manifest is not an opguard batch manifest")
    mversion = manifest.get("version")
    if not isinstance(mversion, int) or isinstance(mversion, bool):
        raise _damaged(path, f"manifest field version is {names.show(mversion)}, not an integer")
    if mversion > FORMAT_VERSION:
        raise IdentityError(f"batch {path} manifest version {mversion} is newer than {FORMAT_VERSION}",
                            "upgrade opguard to read it")
    _check_entries(path, manifest)
    return BatchInfo(path, manifest, hlen, plen, size)


def iter_entries(info: BatchInfo,
                 expected_digest: str | None = None) -> Iterator[tuple[dict[str, Any], Iterator[bytes]]]:
    """Yield (entry, chunks) in order; each entry's chunks MUST be consumed before the next.

    Raises IntegrityError on any size or digest mismatch, including a truncated stream. With
    ``expected_digest``, the SHA-256 of the whole file is computed in the same pass (the file is
    read once) and checked when the last entry has been consumed: a caller must not trust what it
    applied until the generator is exhausted. A damaged payload is then also reported as a file
    that does not match its name's digest. Memory is one CHUNK whatever the entries declare.
    """
    dctx = zstandard.ZstdDecompressor()
    file_sha = hashlib.sha256() if expected_digest is not None else None
    fd = os.dup(info.fd) if info.fd >= 0 else open_regular(info.path)
    with os.fdopen(fd, "rb") as f:
        f.seek(0)

        def digest_differs() -> bool:
            """Hash the rest of the file (manifest and footer at least); True on a mismatch."""
            assert file_sha is not None
            while buf := f.read(CHUNK):
                file_sha.update(buf)
            return file_sha.hexdigest() != expected_digest

        def damage(what: str) -> IntegrityError:
            try:
                if file_sha is not None and digest_differs():
                    what = f"{NOT_ITS_DIGEST}: {what}"
            except OSError as e:
                what = f"{what}; reading the rest failed too ({e.strerror or e})"
            return _damaged(info.path, what)

        if file_sha is not None:
            file_sha.update(f.read(info.payload_offset))
        f.seek(info.payload_offset)
        limited = _Limited(f, info.payload_len, file_sha)
        reader = dctx.stream_reader(limited, read_across_frames=False, closefd=False)  # type: ignore[arg-type]
        total = 0
        for entry in info.manifest["entries"]:
            yield entry, _entry_chunks(reader, entry, damage)
            total += int(entry["size"])
        try:
            longer = reader.read(1)
        except zstandard.ZstdError as e:
            raise damage(f"zstd error after the last entry: {e}") from None
        if longer:
            raise damage("payload longer than the manifest says")
        if total != info.manifest.get("payload_size"):
            raise damage("payload_size disagrees with the entries")
        if limited.left != 0:
            raise damage(f"{limited.left} unread payload bytes after the zstd frame")
        if file_sha is not None and digest_differs():
            raise _damaged(info.path, NOT_ITS_DIGEST)


def _entry_chunks(reader: Any, entry: dict[str, Any], damage: Callable[[str], IntegrityError]) -> Iterator[bytes]:
    sha = hashlib.sha256()
    left = int(entry["size"])
    while left:
        try:
            buf = reader.read(min(CHUNK, left))
        except (zstandard.ZstdError, OSError) as e:  # OSError: SOURCE's storage failed (EIO)
            raise damage(f"zstd or read error in {entry['path']!r}: {e}") from None
        if not buf:
            raise damage(f"payload ends {left} bytes early inside {entry['path']!r}")
        sha.update(buf)
        left -= len(buf)
        yield buf
    if sha.hexdigest() != entry["sha256"]:
        raise damage(f"checksum mismatch for {entry['path']!r}")


class _Limited:
    """Read at most ``left`` bytes from ``f`` (the payload section)."""

    def __init__(self, f: IO[bytes], left: int, sha: Any = None) -> None:
        self.f = f
        self.left = left
        self.sha = sha  # hashes what passes (the whole-file digest), or None

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self.left:
            n = self.left
        data = self.f.read(n)
        self.left -= len(data)
        if self.sha is not None:
            self.sha.update(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(CHUNK):
            sha.update(buf)
    return sha.hexdigest()


def verify_batch(path: Path, expected_digest: str | None = None) -> BatchInfo:
    """Full check of one batch in one read: manifest, every entry, file digest (if given)."""
    info = read_manifest(path)
    for _entry, chunks in iter_entries(info, expected_digest):
        for _ in chunks:
            pass
    return info
