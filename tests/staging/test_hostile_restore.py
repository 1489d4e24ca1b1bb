"""Restore and verify of hostile or corrupted targets (issue 14; docs/format.md §11).

Every forgery here has its checksums, names, hash chain and seals recomputed: what anyone with
write access to the shared target can do. Each case was refused wrongly (exit 0, a traceback,
GiBs of memory or minutes of time) before the reader split; each test fails on that code.
Runs the real CLI (``opguard materialize`` / ``opguard verify``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.hostile import (
    bomb_manifest_frame,
    forge_manifest,
    manifest_of,
    oversized_header_archive,
    remove_deep,
    run_measured,
    snapshot,
    snapshot_of_files,
    split_batch,
    write_batch,
)
from tests.helpers.restore import add_batch, batches, cli, leftovers, make_target, seal, stream_dir

R0 = "rank-000000"
RSS_BOUND = 256 << 20  # the bound for verify and materialize on a bomb


def _both(src: Path, out: Path) -> tuple[str, str]:
    """Run materialize and verify; both must refuse with exit 5, no traceback, no DEST, no partial."""
    m = cli("materialize", str(src), str(out))
    v = cli("verify", str(src))
    for r in (m, v):
        assert r.returncode == 5, (r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
    assert not out.exists() and leftovers(out.parent) == []
    return m.stderr, v.stderr


def _rank_target(root: Path, **override: object) -> Path:
    src = make_target(root)
    add_batch(src, R0, [("file", "a.txt", 1, 0, b"A")], **override)  # type: ignore[arg-type]
    seal(src, R0)
    return src


# ---- 1. node_id joined onto the tree --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["absolute", "dotdot", "nesting"])
def test_hostile_node_id_is_refused_and_nothing_outside_is_copied(tmp_path: Path, kind: str) -> None:
    secret = tmp_path / "private"
    secret.mkdir()
    (secret / "key").write_bytes(b"SECRET")
    (secret / "link").symlink_to(tmp_path / "only-the-restorer-reads-this")
    (tmp_path / "only-the-restorer-reads-this").write_bytes(b"PRIVATE")
    node = {"absolute": str(secret), "dotdot": "../../../private", "nesting": "../ranks"}[kind]
    src = _rank_target(tmp_path / "shared", node_id=node)
    out = tmp_path / "out"
    m, v = _both(src, out)
    for err in (m, v):
        assert "manifest field node_id" in err and "is not a node ID" in err, err
        assert "000000000001-" in err  # the batch is named


# ---- 2. entries that are not what the format says ------------------------------------------------

def _forged_entry(tmp_path: Path, key: str, value: object) -> Path:
    src = _rank_target(tmp_path / "shared")
    b = batches(src, R0)[0]

    def mutate(m: dict[str, object]) -> None:
        m["entries"][0][key] = value  # type: ignore[index]

    forge_manifest(b, mutate)
    (stream_dir(src, R0) / "000000000001.seal").unlink()
    seal(src, R0)
    return src


@pytest.mark.parametrize(("key", "value", "words"), [
    ("path", 7, "entries[0].path is 7, not a path"),
    ("path", "x" * 300, "a component of 300 bytes, more than NAME_MAX"),
    ("path", "a/" * 2100 + "f", "more than PATH_MAX"),
    ("size", "12", "entries[0].size is '12'"),
    ("sha256", None, "entries[0].sha256 is None"),
])
def test_malformed_entry_is_a_clean_refusal(tmp_path: Path, key: str, value: object, words: str) -> None:
    src = _forged_entry(tmp_path, key, value)
    m, v = _both(src, tmp_path / "out")
    for err in (m, v):
        assert words in err, err
        assert "stream rank-000000 is damaged: batch 000000000001-" in err, err


def test_a_path_as_deep_as_the_format_allows_restores(tmp_path: Path) -> None:
    """2,000 levels (4,001 bytes, under PATH_MAX; DEST's own path pushes the absolute path past it):
    restored through directory descriptors, no RecursionError, no ENAMETOOLONG."""
    deep = "a/" * 2000 + "f"
    src = make_target(tmp_path / "shared")
    add_batch(src, R0, [("file", deep, 1, 0, b"deep")])
    seal(src, R0)
    out = tmp_path / "out"
    r = cli("materialize", str(src), str(out))
    assert r.returncode == 0, r.stderr
    fd = os.open(out / "ranks" / R0, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(2000):
            nfd = os.open("a", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with os.fdopen(os.open("f", os.O_RDONLY, dir_fd=fd), "rb") as f:
            assert f.read() == b"deep"
    finally:
        os.close(fd)
    assert cli("verify", str(src)).returncode == 0
    remove_deep(out)  # pytest's cleanup recurses


# ---- 3. memory bombs --------------------------------------------------------------------------------

def test_manifest_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    src = _rank_target(tmp_path / "shared")
    b = batches(src, R0)[0]
    header, payload, _m = split_batch(b)
    write_batch(b, header, payload, bomb_manifest_frame(512 << 20))
    (stream_dir(src, R0) / "000000000001.seal").unlink()
    seal(src, R0)
    size = batches(src, R0)[0].stat().st_size
    assert size < 64 << 10  # a 512 MiB manifest in a few KiB
    for args in (("verify", str(src)), ("materialize", str(src), str(tmp_path / "out"))):
        r, rss = run_measured(*args)
        assert r.returncode == 5, r.stderr
        assert "manifest decompresses to more than" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert rss <= RSS_BOUND, f"{args[0]}: peak RSS {rss >> 20} MiB"
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", [b"L", b"x"], ids=["gnu-long-name", "pax-header"])
def test_legacy_tar_header_bomb_is_refused_in_bounded_memory(tmp_path: Path, kind: bytes) -> None:
    src = tmp_path / "legacy"
    archive = oversized_header_archive(src / "exec_trace" / "gpu_000" / "sync.tar.gz", kind, 256 << 20)
    assert archive.stat().st_size < 1 << 20
    for args in (("verify", str(src)), ("materialize", str(src), str(tmp_path / "out"))):
        r, rss = run_measured(*args)
        assert r.returncode == 5, r.stderr
        assert "Traceback" not in r.stderr and "at most" in r.stderr, r.stderr
        assert rss <= RSS_BOUND, f"{args[0]}: peak RSS {rss >> 20} MiB"
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ---- 4. quadratic conflicts --------------------------------------------------------------------------

def test_file_and_directory_in_one_batch_is_refused(tmp_path: Path) -> None:
    """2,000 pairs ``p<i>/f`` then ``p<i>``: one scan cannot see both; refused (was: exit 0, 4,000
    warnings, and quadratic time: 8,000 pairs took 43-52 s)."""
    src = make_target(tmp_path / "shared")
    pairs = 2000
    entries = [("file", f"p{i}/f", 1, 0, b"") for i in range(pairs)] + \
              [("file", f"p{i}", 1, 0, b"") for i in range(pairs)]
    add_batch(src, R0, entries)
    seal(src, R0)
    m, v = _both(src, tmp_path / "out")
    for err in (m, v):
        assert "is both a file and the directory of" in err, err
        assert err.count("WARNING") == 0


# ---- 5. free space --------------------------------------------------------------------------------

def test_declared_sizes_beyond_free_space_are_refused_before_writing(tmp_path: Path) -> None:
    src = _rank_target(tmp_path / "shared")
    free = shutil.disk_usage(tmp_path).free
    b = batches(src, R0)[0]

    def mutate(m: dict[str, object]) -> None:
        m["entries"][0]["size"] = free * 4  # type: ignore[index]
        m["payload_size"] = free * 4

    forge_manifest(b, mutate)
    (stream_dir(src, R0) / "000000000001.seal").unlink()
    seal(src, R0)
    out = tmp_path / "out"
    r = cli("materialize", str(src), str(out))
    assert r.returncode == 2, r.stderr
    assert f"declares {free * 4} bytes" in r.stderr and "bytes free" in r.stderr, r.stderr
    assert not out.exists() and leftovers(tmp_path) == []


# ---- links planted in the target -------------------------------------------------------------------

@pytest.mark.parametrize("where", ["bundles", "streams", "stream", "batch", "seal", "format"])
def test_a_link_planted_anywhere_in_the_target_is_never_followed(tmp_path: Path, where: str) -> None:
    """The link points at a real, valid copy of what it replaces: following it would restore (exit 0).
    Not following it refuses (exit 5, or exit 2 where SOURCE no longer looks like a run at all)."""
    src = _rank_target(tmp_path / "shared")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bundles = src / ".opguard-bundles"
    victim = {"bundles": bundles, "streams": bundles / "streams", "stream": stream_dir(src, R0),
              "batch": batches(src, R0)[0], "seal": stream_dir(src, R0) / "000000000001.seal",
              "format": bundles / "format.json"}[where]
    moved = elsewhere / victim.name
    os.rename(victim, moved)
    victim.symlink_to(moved)
    out = tmp_path / "out"
    m = cli("materialize", str(src), str(out))
    v = cli("verify", str(src))
    for r in (m, v):
        assert r.returncode in (2, 5), (where, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_fifo_planted_as_a_batch_does_not_hang(tmp_path: Path) -> None:
    src = _rank_target(tmp_path / "shared")
    b = batches(src, R0)[0]
    b.unlink()
    os.mkfifo(b)
    m, _v = _both(src, tmp_path / "out")
    assert "not a regular file" in m


def test_legacy_snapshot_behind_a_link_is_not_read(tmp_path: Path) -> None:
    src = tmp_path / "legacy"
    real = tmp_path / "elsewhere" / "gpu_000"
    snapshot(real / "sync.tar.gz", {"trace.jsonl": b"{}\n"})
    (src / "exec_trace").mkdir(parents=True)
    snapshot(src / "exec_trace" / "gpu_001" / "sync.tar.gz", {"trace.jsonl": b"{}\n"})
    os.symlink(real / "sync.tar.gz", src / "exec_trace" / "gpu_002.tar.gz")  # not a snapshot name: ignored
    (src / "exec_trace" / "gpu_003").mkdir()
    (src / "exec_trace" / "gpu_003" / "sync.tar.gz").symlink_to(real / "sync.tar.gz")
    m, _v = _both(src, tmp_path / "out")
    assert "gpu_003/sync.tar.gz" in m


def test_normal_target_still_restores_byte_for_byte(tmp_path: Path) -> None:
    src = make_target(tmp_path / "shared")
    add_batch(src, R0, [("file", "a/b.txt", 1, 0, b"B"), ("append", "t.jsonl", 1, 0, b"1\n")])
    add_batch(src, R0, [("append", "t.jsonl", 1, 2, b"2\n")])
    seal(src, R0)
    add_batch(src, "node-node-a", [("file", "cfg/x.json", 1, 0, b"{}")], rank=None)
    seal(src, "node-node-a")
    out = tmp_path / "out"
    r = cli("materialize", str(src), str(out))
    assert r.returncode == 0, r.stderr
    assert snapshot_of_files(out) == {
        "ranks": None, "ranks/rank-000000": None, "ranks/rank-000000/a": None,
        "ranks/rank-000000/a/b.txt": b"B", "ranks/rank-000000/t.jsonl": b"1\n2\n",
        "ranks/rank-000000/_node": None, "ranks/rank-000000/_node/cfg": None,
        "ranks/rank-000000/_node/cfg/x.json": b"{}",
        "nodes": None, "nodes/node-a": None, "nodes/node-a/cfg": None, "nodes/node-a/cfg/x.json": b"{}"}
    assert manifest_of(batches(src, R0)[0])["node_id"] == "node-a"


def test_a_deep_directory_in_a_legacy_source_is_walked_without_recursion(tmp_path: Path) -> None:
    src = tmp_path / "legacy"
    snapshot(src / "exec_trace" / "gpu_000" / "sync.tar.gz", {"trace.jsonl": b"{}\n"})
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1100):  # was: RecursionError from os.walk
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    r = cli("verify", str(src))
    remove_deep(src / "d")  # pytest's cleanup recurses
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_links_planted_as_node_claims_are_ignored_not_followed(tmp_path: Path) -> None:
    """Readers ignore ``nodes/`` (claims, conflict markers): a link there, or a claim that is a link,
    brings nothing of what it points at into DEST; the node metadata copied into ``_node/`` comes
    from the restored node stream only."""
    src = _rank_target(tmp_path / "shared", node_id="node-a")
    add_batch(src, "node-node-a", [("file", "cfg/x.json", 1, 0, b"{}")], rank=None)
    seal(src, "node-node-a")
    theirs = tmp_path / "theirs"
    (theirs / "node-a").mkdir(parents=True)
    (theirs / "node-a" / "secret").write_bytes(b"SECRET")
    (src / ".opguard-bundles" / "nodes").symlink_to(theirs)
    out = tmp_path / "out"
    r = cli("materialize", str(src), str(out))
    assert r.returncode == 0, r.stderr
    restored = snapshot_of_files(out)
    assert b"SECRET" not in restored.values()
    assert restored["ranks/rank-000000/_node/cfg/x.json"] == b"{}"


def test_a_destination_that_runs_out_of_inodes_is_a_clean_refusal(tmp_path: Path) -> None:
    """Declared sizes fit, but DEST's file system (a real 4 MiB, 64-inode tmpfs) runs out of inodes
    while writing: exit 2 naming the file and errno (was: an OSError traceback), nothing left."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=64", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        src = make_target(tmp_path / "shared")
        add_batch(src, R0, [("file", f"f{i}.txt", 1, 0, b"x") for i in range(200)])
        seal(src, R0)
        out = mnt / "out"
        r2 = cli("materialize", str(src), str(out))
        assert r2.returncode == 2, r2.stderr
        assert "into the restore destination failed" in r2.stderr and "errno 28" in r2.stderr, r2.stderr
        assert "Traceback" not in r2.stderr
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=True)
