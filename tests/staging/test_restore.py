"""Restore of format-2 targets (docs/format.md §5, §7, §8) through the real CLI and the library."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from opguard.errors import ConfigError, IntegrityError
from opguard.staging.bundle import FOOTER, HEADER
from opguard.staging.restore import (
    DamagedSource,
    NothingPublished,
    detect,
    holds_published_data,
    materialize,
    rename_noreplace,
    verify,
)
from tests.helpers.restore import (
    add_batch,
    batches,
    cli,
    files_of,
    leftovers,
    make_target,
    rename_to_digest,
    seal,
    stream_dir,
    tree_of,
)

R0, R1 = "rank-000000", "rank-000001"


def realistic(root: Path) -> dict[str, bytes]:
    """Two rank streams and a node stream over several batches; returns the expected restored files."""
    make_target(root)
    add_batch(root, R0, [("append", "trace.jsonl", 1, 0, b'{"a":1}\n'),
                         ("file", "tensors/t0.pt", 1, 0, b"\x00" * 100),
                         ("file", "old.txt", 1, 0, b"gone at the source")])
    add_batch(root, R0, [("append", "trace.jsonl", 1, 8, b'{"b":2}\n{"c":3}\n'),
                         ("file", "tensors/t0.pt", 2, 0, b"\x01" * 10)], deleted=["old.txt"])
    add_batch(root, R0, [("append", "trace.jsonl", 2, 0, b'{"new":1}\n'),      # truncation: version 2
                         ("append", "trace.1.jsonl", 1, 0, b'{"rotated":1}\n'),
                         ("append", "trace.jsonl", 2, 10, b'{"new":2}\n')])
    seal(root, R0)
    add_batch(root, R1, [("file", "deep/a/b/c.bin", 1, 0, bytes(range(256)))], node_id="node-b")
    add_batch(root, R1, [("append", "log.ndjson", 1, 0, b"x\n")], node_id="node-a")  # last batch names node-a
    seal(root, R1)
    add_batch(root, "node-node-a", [("file", "instrumentation/config.json", 1, 0, b"{}"),
                                    ("file", "source_files/model.py", 1, 0, b"def f(): pass\n")],
              rank=None)
    seal(root, "node-node-a")
    node = {"instrumentation/config.json": b"{}", "source_files/model.py": b"def f(): pass\n"}
    expected = {
        "ranks/rank-000000/trace.jsonl": b'{"new":1}\n{"new":2}\n',
        "ranks/rank-000000/trace.1.jsonl": b'{"rotated":1}\n',
        "ranks/rank-000000/tensors/t0.pt": b"\x01" * 10,
        "ranks/rank-000000/old.txt": b"gone at the source",
        "ranks/rank-000001/deep/a/b/c.bin": bytes(range(256)),
        "ranks/rank-000001/log.ndjson": b"x\n",
    }
    for rel, data in node.items():
        expected[f"nodes/node-a/{rel}"] = data
        expected[f"ranks/rank-000000/_node/{rel}"] = data
        expected[f"ranks/rank-000001/_node/{rel}"] = data
    return expected


def test_round_trip_restores_latest_content_of_every_path(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    expected = realistic(src)
    before = tree_of(src)
    r = cli("materialize", str(src), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "out")
    assert "WARNING" not in r.stderr  # everything sealed
    assert files_of(tmp_path / "out") == expected
    assert tree_of(src) == before, "a restore must not write to the source"
    assert leftovers(tmp_path) == []
    st = os.stat(tmp_path / "out" / "ranks/rank-000000/trace.jsonl")
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_mtime_ns == 1_700_000_000_000_000_000


def test_library_report_and_progress(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    realistic(src)
    seen: list[tuple[str, int, int]] = []
    report = materialize(src, tmp_path / "out", progress=lambda s, done, total: seen.append((s, done, total)))
    assert {s.stream: s.status for s in report.streams} == {R0: "sealed", R1: "sealed", "node-node-a": "sealed"}
    assert report.batches == 6 and report.ok and report.run_id == "experiment-001"
    # streams are restored in parallel: each stream's calls are in order, streams interleave
    assert sorted(seen) == [("node-node-a", 1, 1), (R0, 1, 3), (R0, 2, 3), (R0, 3, 3), (R1, 1, 2), (R1, 2, 2)]
    assert [x for x in seen if x[0] == R0] == [(R0, 1, 3), (R0, 2, 3), (R0, 3, 3)]
    d = json.loads(report.to_json())
    assert d["sealed"] == 3 and d["damaged"] == 0 and d["dest"] == str(tmp_path / "out")
    v = verify(src)
    assert v.files == report.files and v.bytes == report.bytes


def test_spec_module_spelling(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    expected = realistic(src)
    r = cli(str(src), str(tmp_path / "out"), module=True)
    assert r.returncode == 0, r.stderr
    assert files_of(tmp_path / "out") == expected


def test_unsealed_stream_restores_with_loud_warning_and_fails_with_require_sealed(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    expected = realistic(src)
    add_batch(src, R1, [("append", "log.ndjson", 1, 2, b"y\n")])  # a batch after the seal: unsealed
    expected["ranks/rank-000001/log.ndjson"] = b"x\ny\n"
    r = cli("materialize", str(src), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "WARNING: stream rank-000001 is UNSEALED" in r.stderr and "final drain" in r.stderr
    assert files_of(tmp_path / "out") == expected
    r = cli("materialize", "--require-sealed", str(src), str(tmp_path / "out2"))
    assert r.returncode == 5 and "rank-000001" in r.stderr and "--require-sealed" in r.stderr
    assert not (tmp_path / "out2").exists() and leftovers(tmp_path) == []
    assert cli("verify", str(src)).returncode == 0
    r = cli("verify", "--require-sealed", "--json", str(src))
    assert r.returncode == 5
    assert {s["stream"]: s["status"] for s in json.loads(r.stdout)["streams"]}[R1] == "unsealed"


def test_stream_without_seal_is_unsealed_and_empty_sealed_stream_is_sealed(tmp_path: Path) -> None:
    src = make_target(tmp_path / "shared")
    add_batch(src, R0, [("append", "t.jsonl", 1, 0, b"1\n")])
    stream_dir(src, R1).mkdir()
    seal(src, R1)  # last_sequence 0, last_digest null: a stream that never had data
    report = verify(src)
    assert {s.stream: (s.status, s.sealed_sequence) for s in report.streams} == {
        R0: ("unsealed", None), R1: ("sealed", 0)}
    assert any("rank-000000 is UNSEALED" in w for w in report.warnings)


def _flip_payload_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[HEADER.size + 5] ^= 0xFF
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size - FOOTER.size - 3])


def _swap_from_other_stream(src: Path) -> None:
    mine = batches(src, R0)[1]
    theirs = batches(src, R1)[1]
    mine.unlink()
    (stream_dir(src, R0) / theirs.name).write_bytes(theirs.read_bytes())


def _bad_seal(src: Path) -> None:
    p = stream_dir(src, R0) / "000000000003.seal"
    doc = json.loads(p.read_text())
    doc["last_digest"] = "0" * 64
    p.write_text(json.dumps(doc))


def _forged_batch(src: Path, path: str) -> None:
    """A well-named, internally consistent batch (right digest, right chain) with an unsafe path."""
    add_batch(src, R1, [("file", path, 9, 0, b"owned")], node_id="node-a")


def _newer_batch_header(src: Path) -> None:
    p = batches(src, R0)[-1]
    data = bytearray(p.read_bytes())
    data[8:12] = (3).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    rename_to_digest(p)
    (stream_dir(src, R0) / "000000000003.seal").unlink()
    seal(src, R0)  # the seal names the newer batch, as a newer opguard would have written it


def _newer_format(src: Path) -> None:
    p = src / ".opguard-bundles" / "format.json"
    doc = json.loads(p.read_text())
    doc["version"] = 3
    p.write_text(json.dumps(doc))


DAMAGE: dict[str, tuple[Callable[[Path], None], int, list[str]]] = {
    "missing-middle-batch": (lambda s: batches(s, R0)[1].unlink(), 5, [R0, "000000000002", "missing"]),
    "missing-newest-of-sealed": (lambda s: batches(s, R0)[2].unlink(), 5, [R0, "000000000003", "seal"]),
    "altered-byte": (lambda s: _flip_payload_byte(batches(s, R0)[1]), 5, [R0, "000000000002-", "digest"]),
    "truncated-batch": (lambda s: _truncate(batches(s, R0)[0]), 5, [R0, "000000000001-"]),
    "swapped-from-other-stream": (_swap_from_other_stream, 5, [R0, "000000000002-", "stream"]),
    "bad-seal": (_bad_seal, 5, [R0, "000000000003.seal"]),
    "dotdot-in-manifest": (lambda s: _forged_batch(s, "../../escaped.txt"), 5, [R1, "unsafe path"]),
    "absolute-in-manifest": (lambda s: _forged_batch(s, "/tmp/escaped.txt"), 5, [R1, "unsafe path"]),
    "newer-batch-version": (_newer_batch_header, 6, ["format version 3", "upgrade opguard"]),
    "newer-format-json": (_newer_format, 6, ["format.json", "version 3", "upgrade opguard"]),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_fails_with_its_exit_code_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    damage, code, words = DAMAGE[case]
    src = tmp_path / "shared"
    realistic(src)
    damage(src)
    dest = tmp_path / "out"
    r = cli("materialize", str(src), str(dest))
    assert r.returncode == code, (r.returncode, r.stderr)
    for w in words:
        assert w in r.stderr, f"{w!r} missing from: {r.stderr}"
    assert "fix:" in r.stderr
    assert not dest.exists() and leftovers(tmp_path) == []
    assert not (tmp_path / "escaped.txt").exists() and not Path("/tmp/escaped.txt").exists()
    v = cli("verify", "--json", str(src))
    assert v.returncode == code, v.stderr
    if code == 5:
        streams = {s["stream"]: s for s in json.loads(v.stdout)["streams"]}
        bad = [s for s in streams.values() if s["status"] == "damaged"]
        assert [s["stream"] for s in bad] == [words[0]] and words[1] in bad[0]["error"]
        assert all(s["status"] == "sealed" for s in streams.values() if s not in bad)


def test_verify_reports_every_damaged_stream(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    realistic(src)
    batches(src, R0)[1].unlink()
    _flip_payload_byte(batches(src, R1)[0])
    with pytest.raises(DamagedSource) as e:
        verify(src)
    assert e.value.exit_code == 5
    assert {s.stream for s in e.value.report.with_status("damaged")} == {R0, R1}
    r = cli("verify", str(src))
    assert r.returncode == 5 and "2 damaged stream(s)" in r.stderr
    assert "damaged   rank-000000" in r.stdout and "sealed    node-node-a" in r.stdout


def test_destination_must_not_exist_and_parent_must(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    realistic(src)
    (tmp_path / "out").mkdir()
    r = cli("materialize", str(src), str(tmp_path / "out"))
    assert r.returncode == 2 and "already exists" in r.stderr and "fix:" in r.stderr
    assert list((tmp_path / "out").iterdir()) == []
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert cli("materialize", str(src), str(tmp_path / "link")).returncode == 2
    (tmp_path / "a-file").write_text("x")
    r = cli("materialize", str(src), str(tmp_path / "a-file" / "out"))
    assert r.returncode == 2 and "a-file" in r.stderr and "fix:" in r.stderr
    r = cli("materialize", str(src), str(src / "new-dir" / "restored"))
    assert r.returncode == 2 and "inside the source" in r.stderr and not (src / "new-dir").exists()
    r = cli("materialize", str(src), str(src / "restored"))
    assert r.returncode == 2 and "inside the source" in r.stderr
    r = cli("materialize", str(tmp_path / "missing"), str(tmp_path / "out2"))
    assert r.returncode == 2 and "not a directory" in r.stderr
    assert leftovers(tmp_path) == [] and leftovers(src) == []


def test_no_opguard_data_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "random.txt").write_text("x")
    with pytest.raises(ConfigError, match="no opguard data"):
        verify(tmp_path / "src")


def test_target_with_nothing_published_is_an_error_saying_so(tmp_path: Path) -> None:
    src = make_target(tmp_path / "shared")  # format.json only: killed before any stream
    with pytest.raises(NothingPublished, match=r"holds format\.json .* but no stream"):
        verify(src)
    stream_dir(src, R0).mkdir(parents=True)  # a stream directory, no batch, no seal
    r = cli("materialize", str(src), str(tmp_path / "out"))
    assert r.returncode == 5 and "nothing has been published" in r.stderr and "no batch and no seal" in r.stderr
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    seal(src, R0)  # a sealed empty stream is a complete run that wrote nothing: restores (empty)
    assert materialize(src, tmp_path / "out").streams[0].status == "sealed"
    assert files_of(tmp_path / "out") == {}


def test_temporaries_ignored_and_unexpected_files_reported(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    expected = realistic(src)
    (stream_dir(src, R0) / ".tmp-000000000004-abc.ogb").write_bytes(b"half an upload")
    (stream_dir(src, R0) / "notes.txt").write_text("hello")
    report = materialize(src, tmp_path / "out")
    assert files_of(tmp_path / "out") == expected
    assert report.warnings == [f"ignoring unexpected file {stream_dir(src, R0) / 'notes.txt'} (not a batch or a seal)"]


def test_zero_byte_append_starts_an_empty_version(tmp_path: Path) -> None:
    src = make_target(tmp_path / "shared")
    add_batch(src, R0, [("append", "t.jsonl", 1, 0, b"1\n2\n")])
    add_batch(src, R0, [("append", "t.jsonl", 2, 0, b"")])  # truncated, no complete record yet
    before = tree_of(src)
    verify(src)
    assert tree_of(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
    materialize(src, tmp_path / "out")
    assert (tmp_path / "out" / "ranks/rank-000000/t.jsonl").read_bytes() == b""


def test_gap_inside_an_append_version_is_damage(tmp_path: Path) -> None:
    src = make_target(tmp_path / "shared")
    add_batch(src, R0, [("append", "t.jsonl", 1, 0, b"1\n")])
    add_batch(src, R0, [("append", "t.jsonl", 1, 5, b"2\n")])  # 3 bytes never published
    with pytest.raises(IntegrityError, match=r"continues at offset 5 but 2 bytes were restored"):
        materialize(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_symlinked_batch_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "shared"
    realistic(src)
    b = batches(src, R1)[1]
    real = tmp_path / b.name
    os.rename(b, real)
    b.symlink_to(real)
    with pytest.raises(IntegrityError, match="not a regular file"):
        materialize(src, tmp_path / "out")
    assert leftovers(tmp_path) == []


def test_reserved_node_copy_path_in_rank_stream_is_refused(tmp_path: Path) -> None:
    src = make_target(tmp_path / "shared")
    add_batch(src, R0, [("file", "_node/x", 1, 0, b"mine")])
    with pytest.raises(IntegrityError, match="reserved"):
        materialize(src, tmp_path / "out")


def test_rename_noreplace_never_replaces(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # an empty directory: plain rename(2) would silently replace it
    with pytest.raises(ConfigError, match="appeared while the restore was running"):
        rename_noreplace(tmp_path / "a", tmp_path / "b")
    rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c").is_dir() and not (tmp_path / "a").exists()


def test_holds_published_data_finds_what_detect_looks_for(tmp_path: Path) -> None:
    """The question compare asks before restoring (bundles or legacy snapshots at any depth), and
    detect's own answer for the same directories: nothing there is a ConfigError."""
    plain = tmp_path / "plain"
    (plain / "ranks" / "rank-000000" / "capture").mkdir(parents=True)
    assert not holds_published_data(plain)
    with pytest.raises(ConfigError, match="no opguard data"):
        detect(plain)
    staged = tmp_path / "staged"
    (staged / ".opguard-bundles").mkdir(parents=True)
    assert holds_published_data(staged)
    legacy = tmp_path / "legacy"
    (legacy / "a" / "b").mkdir(parents=True)
    (legacy / "a" / "b" / "sync.tar.gz").write_bytes(b"")
    assert holds_published_data(legacy)
    assert detect(legacy) == "legacy-snapshot"


def test_stream_and_seal_names_have_one_parser_each() -> None:
    """layout spells stream IDs, bundle spells batch and seal names; names/bundle parse them back,
    canonical spellings only (a writer never makes another one)."""
    from opguard.staging import names
    from opguard.staging.bundle import batch_name, parse_batch_name, parse_seal_name, seal_name
    from opguard.staging.layout import node_stream, rank_stream

    for r in (0, 7, 999_999, 1_234_567):
        assert names.parse_rank_stream(rank_stream(r)) == r
        assert names.stream(rank_stream(r), "stream") == ("rank", r, None)
    assert names.parse_stream(node_stream("n-1")) == ("node", None, "n-1")
    for bad in ("rank-1", "rank-0000001", "rank-00000x", "rank-٠٠٠٠٠١", "node-", "node-.x", "x", 3):
        assert names.parse_rank_stream(bad) is None
    assert names.parse_stream("node-.x") is None and names.parse_stream("rank-1") is None
    assert parse_seal_name(seal_name(42)) == 42 and seal_name(42) == "000000000042.seal"
    assert parse_batch_name(batch_name(3, "a" * 64)) == (3, "a" * 64)
    for bad in ("42.seal", "00000000004x.seal", "٠٠٠٠٠٠٠٠٠٠٤٢.seal", "000000000042.sealx", "000000000042-x.ogb"):
        assert parse_seal_name(bad) is None
