"""Structure-aware fuzzing of restore and verify (issue 14; docs/format.md §11).

Each example takes a real small target (format 2 with seals, a legacy snapshot, a reference v1
bundle), mutates one structure of it the way someone with write access could (a manifest field or
entry, a batch header, a seal, ``format.json``, a tar member header, a v1 manifest), recomputing the
unkeyed checksums, names, hash chain and seals where the mutation would otherwise be caught by
them, and runs the real ``opguard materialize`` and ``opguard verify``. Asserted for every example:

* exit status in {0, 5, 6} (2 only for the free-space refusal, which names "bytes free"),
* no traceback on stderr,
* nothing outside DEST is created, changed or removed (SOURCE included),
* DEST exists exactly when the exit status is 0, and no partial directory is left,
* the peak RSS of ``materialize`` stays under 256 MiB.

Time-bounded for CI: ``OPGUARD_FUZZ_EXAMPLES`` examples per structure (default 12; e.g.
``OPGUARD_FUZZ_EXAMPLES=500`` for a long run).
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opguard.staging.bundle import HEADER
from tests.helpers.hostile import (
    forge_manifest,
    manifest_of,
    relink_chain,
    run_measured,
    split_batch,
    write_batch,
)
from tests.helpers.restore import add_batch, batches, cli, make_target, seal, stream_dir

EXAMPLES = int(os.environ.get("OPGUARD_FUZZ_EXAMPLES", "12"))
RSS_BOUND = 256 << 20
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize="OPGUARD_FUZZ_SEED" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
R0, R1, NODE = "rank-000000", "rank-000001", "node-node-a"

# ---- values: what a hostile writer puts in a field -------------------------------------------------

names = st.sampled_from(["a", "..", ".", "", "/abs", "../x", "a/../b", "a//b", "a\\b", "x\0y", "_node/x",
                         "x" * 300, "a/" * 1500 + "f", "nodes", "ranks", "ü", "\udcff"])
ints = st.one_of(st.integers(-2, 3), st.sampled_from([2**31, 2**63, 2**64, -2**63, 10**30, 512 << 20]))
scalars = st.one_of(st.none(), st.booleans(), ints, names, st.floats(allow_nan=True), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


# ---- the base targets ----------------------------------------------------------------------------

def _v2(root: Path) -> Path:
    src = make_target(root)
    add_batch(src, R0, [("append", "trace.jsonl", 1, 0, b'{"a":1}\n'), ("file", "t/x.pt", 1, 0, b"\0" * 64)])
    add_batch(src, R0, [("append", "trace.jsonl", 1, 8, b'{"b":2}\n')])
    seal(src, R0)
    add_batch(src, R1, [("file", "deep/a/b.bin", 1, 0, bytes(range(32)))], node_id="node-a")
    seal(src, R1)
    add_batch(src, NODE, [("file", "cfg/c.json", 1, 0, b"{}")], rank=None)
    seal(src, NODE)
    return src


def _snapshot(root: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    archive = root / "exec_trace" / "gpu_000" / "sync.tar.gz"
    archive.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(archive, "wb") as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.isfile() else None)
    return root


def _v1(root: Path, manifest: dict[str, Any], payload: bytes = b"owned\n") -> Path:
    owner = root / ".opguard-bundles" / f"{'ab' * 8}-rank000000"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ti = tarfile.TarInfo("data/0")
        ti.size = len(payload)
        tar.addfile(ti, io.BytesIO(payload))
        data = json.dumps(manifest).encode()
        ti = tarfile.TarInfo("manifest.json")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    raw = buf.getvalue()
    owner.mkdir(parents=True, exist_ok=True)
    (owner / f"{1:012d}-{hashlib.sha256(raw).hexdigest()}.tar").write_bytes(raw)
    return root


V1_MANIFEST = {"version": 1, "sequence": 1, "entries": [
    {"path": "exec_trace/gpu_000/x", "member": "data/0", "mode": "replace", "offset": 0, "size": 6,
     "sha256": hashlib.sha256(b"owned\n").hexdigest()}]}


# ---- running one example ---------------------------------------------------------------------------

def _state(root: Path, skip: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` except ``skip`` (DEST): (mode, size, mtime_ns), links not followed."""
    out = {}
    stack = [root]
    while stack:
        d = stack.pop()
        for e in os.scandir(d):
            p = Path(e.path)
            if p == skip:
                continue
            s = e.stat(follow_symlinks=False)
            out[str(p.relative_to(root))] = (s.st_mode, s.st_size, s.st_mtime_ns)
            if e.is_dir(follow_symlinks=False):
                stack.append(p)
    return out


def _check(sandbox: Path, src: Path) -> None:
    dest = sandbox / "out"
    before = _state(sandbox, dest)
    m, rss = run_measured("materialize", str(src), str(dest), timeout=300)
    v = cli("verify", str(src), timeout=300)
    for r in (m, v):
        assert "Traceback" not in r.stderr, r.stderr
        assert r.returncode in (0, 5, 6) or (r.returncode == 2 and "bytes free" in r.stderr), \
            (r.returncode, r.stderr)
    assert dest.exists() == (m.returncode == 0), (m.returncode, m.stderr)
    assert _state(sandbox, dest) == before, "something outside DEST was created, changed or removed"
    assert rss <= RSS_BOUND, f"materialize peak RSS {rss >> 20} MiB"
    if m.returncode == 0:
        assert v.returncode == 0, (v.returncode, v.stderr)  # what restores also verifies


@pytest.fixture(scope="module")
def v2_base() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield _v2(Path(d) / "shared")


def _sandbox(base: Path) -> Iterator[tuple[Path, Path]]:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "shared"
        shutil.copytree(base, src, symlinks=True)
        yield Path(d), src


# ---- v2: manifests, entries, headers, seals, format.json ------------------------------------------

MANIFEST_KEYS = ["run_id", "stream", "kind", "rank", "node_id", "sequence", "prev_digest", "payload_size",
                 "entries", "format", "version", "deleted"]
ENTRY_KEYS = ["op", "path", "version", "offset", "size", "sha256", "mode", "mtime_ns"]


def _reseal(src: Path, stream: str) -> None:
    for p in stream_dir(src, stream).glob("*.seal"):
        p.unlink()
    seal(src, stream)


@SETTINGS
@given(stream=st.sampled_from([R0, R1, NODE]), which=st.integers(0, 1), key=st.sampled_from(MANIFEST_KEYS),
       value=values, delete=st.booleans(), rechain=st.booleans())
def test_fuzz_v2_manifest_field(v2_base: Path, stream: str, which: int, key: str, value: object, delete: bool,
                                rechain: bool) -> None:
    for sandbox, src in _sandbox(v2_base):
        b = batches(src, stream)[min(which, len(batches(src, stream)) - 1)]

        def mutate(m: dict[str, Any]) -> None:
            if delete:
                m.pop(key, None)
            else:
                m[key] = value

        forge_manifest(b, mutate)
        if rechain:
            relink_chain(stream_dir(src, stream))
            _reseal(src, stream)
        _check(sandbox, src)


@SETTINGS
@given(stream=st.sampled_from([R0, R1, NODE]), index=st.integers(0, 1), key=st.sampled_from(ENTRY_KEYS),
       value=values, duplicate=st.booleans())
def test_fuzz_v2_entry(v2_base: Path, stream: str, index: int, key: str, value: object, duplicate: bool) -> None:
    for sandbox, src in _sandbox(v2_base):
        b = batches(src, stream)[0]

        def mutate(m: dict[str, Any]) -> None:
            entries = m["entries"]
            e = entries[min(index, len(entries) - 1)]
            if duplicate:
                entries.append(copy.deepcopy(e))
                e = entries[-1]
            e[key] = value

        forge_manifest(b, mutate)
        relink_chain(stream_dir(src, stream))
        _reseal(src, stream)
        _check(sandbox, src)


@SETTINGS
@given(field=st.sampled_from(["magic", "version", "hlen", "footer", "payload"]), number=st.integers(0, 2**32 - 1),
       position=st.integers(0, 10**6))
def test_fuzz_v2_header_and_sections(v2_base: Path, field: str, number: int, position: int) -> None:
    for sandbox, src in _sandbox(v2_base):
        b = batches(src, R0)[0]
        header, payload, mframe = split_batch(b)
        if field == "magic":
            header = number.to_bytes(4, "little") * 2 + header[8:]
        elif field == "version":
            header = header[:8] + number.to_bytes(4, "little") + header[12:]
        elif field == "hlen":
            header = header[:12] + number.to_bytes(4, "little")
        elif field == "payload":
            data = bytearray(payload)
            data[position % len(data)] ^= 1 + number % 255
            payload = bytes(data)
        if field == "footer":
            data = bytearray(b.read_bytes())
            data[-1 - position % 56] ^= 1 + number % 255
            b.write_bytes(bytes(data))
        else:
            assert len(header) == HEADER.size
            write_batch(b, header, payload, mframe)
        relink_chain(stream_dir(src, R0))
        _reseal(src, R0)
        _check(sandbox, src)


@SETTINGS
@given(target=st.sampled_from(["seal", "format"]), key=st.sampled_from(
    ["version", "stream", "run_id", "last_sequence", "last_digest", "format", "junk"]), value=values,
       raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzz_v2_seal_and_format(v2_base: Path, target: str, key: str, value: object, raw: bytes | None) -> None:
    for sandbox, src in _sandbox(v2_base):
        path = (stream_dir(src, R1) / "000000000001.seal" if target == "seal"
                else src / ".opguard-bundles" / "format.json")
        if raw is not None:
            path.write_bytes(raw)
        else:
            doc = json.loads(path.read_text())
            doc[key] = value
            path.write_text(json.dumps(doc))
        _check(sandbox, src)


# ---- legacy snapshot: tar member headers -----------------------------------------------------------

@SETTINGS
@given(name=names, kind=st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                                         tarfile.FIFOTYPE, tarfile.CHRTYPE, b"7", b"Z"]),
       size=st.integers(0, 64), declared=st.one_of(st.none(), st.integers(0, 2**33)),
       mode=st.integers(0, 0o7777), mtime=st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False)),
       pax=st.dictionaries(st.sampled_from(["path", "size", "mtime", "linkpath", "uname", "x"]),
                           st.text(max_size=30), max_size=2))
def test_fuzz_legacy_tar_header(name: str, kind: bytes, size: int, declared: int | None, mode: int,
                                mtime: float, pax: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        sandbox = Path(d)
        ti = tarfile.TarInfo(name or "x")
        ti.type = kind
        ti.mode = mode
        ti.mtime = mtime if mtime == mtime and abs(mtime) < 2**40 else 0
        ti.linkname = "../../etc" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        ti.pax_headers = pax
        data = b"z" * size
        ti.size = size if kind == tarfile.REGTYPE else 0
        ok = tarfile.TarInfo("ok.txt")
        ok.size = 3
        try:
            src = _snapshot(sandbox / "legacy", [(ok, b"ok\n"), (ti, data)])
        except (ValueError, OverflowError, UnicodeError, tarfile.TarError):
            return  # tarfile cannot even write this header; nothing to read
        if declared is not None:  # a size field that disagrees with the data that follows
            archive = src / "exec_trace" / "gpu_000" / "sync.tar.gz"
            raw = bytearray(gzip.decompress(archive.read_bytes()))
            raw[124:136] = f"{declared % 8**11:011o}\0".encode()
            raw[148:156] = b"        "
            raw[148:155] = f"{sum(raw[0:512]):06o}\0".encode()
            archive.write_bytes(gzip.compress(bytes(raw)))
        _check(sandbox, src)


# ---- reference v1 manifests -------------------------------------------------------------------------

@SETTINGS
@given(top=st.sampled_from(["version", "sequence", "entries", None]), key=st.sampled_from(
    ["path", "restore_path", "member", "mode", "offset", "size", "sha256", None]), value=values)
def test_fuzz_v1_manifest(top: str | None, key: str | None, value: object) -> None:
    with tempfile.TemporaryDirectory() as d:
        sandbox = Path(d)
        m: dict[str, Any] = copy.deepcopy(V1_MANIFEST)
        if top is not None:
            m[top] = value
        if key is not None and isinstance(m.get("entries"), list) and m["entries"] \
                and isinstance(m["entries"][0], dict):
            m["entries"][0][key] = value
        try:
            json.dumps(m)
        except (ValueError, TypeError):
            return
        _check(sandbox, _v1(sandbox / "shared", m))


def test_the_base_targets_restore(tmp_path: Path) -> None:
    """The unmutated targets restore (exit 0): the fuzz starts from valid data."""
    src = _v2(tmp_path / "v2")
    assert cli("materialize", str(src), str(tmp_path / "o2")).returncode == 0
    ok = tarfile.TarInfo("ok.txt")
    ok.size = 3
    src = _snapshot(tmp_path / "legacy", [(ok, b"ok\n")])
    assert cli("materialize", str(src), str(tmp_path / "o3")).returncode == 0
    src = _v1(tmp_path / "v1", copy.deepcopy(V1_MANIFEST))
    r = cli("materialize", str(src), str(tmp_path / "o1"))
    assert r.returncode == 0, r.stderr
    assert manifest_of(batches(tmp_path / "v2", R0)[0])["stream"] == R0


