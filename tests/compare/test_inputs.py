"""Each input kind of `opguard compare` (trace dir, restored dir, a staged target restored on the fly,
reference v1 bundles, a legacy sync.tar.gz, reference traces), and the never-silent refusals."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

from opguard.compare.perfetto_export import read_export
from tests.compare import synth
from tests.compare.helpers import OPGUARD, REFERENCE, ops_of, run_compare


def _staged(staging_env: dict[str, str]) -> tuple[Path, Path]:
    """Capture-schema traces of ranks 0 and 1 in the local base, published by the real `opguard sync`."""
    local = Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"])
    target = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"])
    for rank in (0, 1):
        synth.write_rank(local, rank, synth.program(rank=rank))
    p = subprocess.run([*OPGUARD, "sync", "--all", "--final"], env=staging_env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert (target / ".opguard-bundles" / "format.json").is_file()
    return local, target


def _env_with_tmp(tmp_path: Path) -> tuple[dict[str, str], Path]:
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    return {**os.environ, "TMPDIR": str(tmp)}, tmp


def test_trace_dir_vs_target_restored_on_the_fly(staging_env: dict[str, str], tmp_path: Path) -> None:
    local, target = _staged(staging_env)
    env, tmp = _env_with_tmp(tmp_path)
    out = tmp_path / "v.pftrace"
    p = run_compare(local, target, out, env)
    assert p.returncode == 0, p.stderr
    export = read_export(out)
    assert len(export.ops) == 32
    assert all(op.args["status"] == "ok" and op.args["correspondence"]["basis"] == "equal-sequence"
               for op in export.ops)
    assert export.attributes["opguard.input_b.path"] == str(target.resolve())
    assert export.attributes["opguard.input_a.sha256"] == export.attributes["opguard.input_b.sha256"]
    assert list(tmp.iterdir()) == []                    # the temporary restore was removed


def test_restored_dir_and_target_agree(staging_env: dict[str, str], tmp_path: Path) -> None:
    local, target = _staged(staging_env)
    restored = tmp_path / "restored"
    p = subprocess.run([*OPGUARD, "materialize", str(target), str(restored)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "v.pftrace"
    p = run_compare(restored, local / "ranks" / "rank-000001", out)      # one rank directory as B
    assert p.returncode == 0, p.stderr
    export = read_export(out)
    assert {op.args["rank"] for op in export.ops if op.args["correspondence"]["state"] == "paired"} == {1}
    assert all(op.args["correspondence"]["reason"] == "no-corresponding-file"
               for op in ops_of(export, "A", 0))


def test_damaged_target_exit_5_and_temporary_removed(staging_env: dict[str, str], tmp_path: Path) -> None:
    local, target = _staged(staging_env)
    batch = next((target / ".opguard-bundles" / "streams").rglob("*.ogb"))
    data = bytearray(batch.read_bytes())
    data[len(data) // 2] ^= 0xFF
    batch.write_bytes(bytes(data))
    env, tmp = _env_with_tmp(tmp_path)
    out = tmp_path / "v.pftrace"
    p = run_compare(local, target, out, env)
    assert p.returncode == 5, p.stderr
    assert "compare input B" in p.stderr and "cannot be restored" in p.stderr
    assert not out.exists() and list(tmp.iterdir()) == []
    assert not list(tmp_path.glob(".v.pftrace.opguard-tmp-*"))


def test_reference_v1_bundles_restored_on_the_fly(tmp_path: Path) -> None:
    env, tmp = _env_with_tmp(tmp_path)
    out = tmp_path / "v.pftrace"
    p = run_compare(REFERENCE / "identical" / "a", REFERENCE / "v1-bundles" / "target", out, env)
    assert p.returncode == 0, p.stderr
    export = read_export(out)
    assert export.attributes["opguard.input_b.kind"] == "reference-exec-trace"
    rank0 = ops_of(export, "A", 0)
    assert len(rank0) == 8 and all(op.args["status"] == "ok" for op in rank0)
    assert all(op.args["correspondence"]["basis"] == "equal-sequence" for op in rank0)
    assert list(tmp.iterdir()) == []
    # restore's warning says which input it is about
    target = REFERENCE / "v1-bundles" / "target"
    assert f"opguard: WARNING: compare input B ({target}): 1 stream(s) in reference-v1-bundles format are " \
        "UNSEALED" in p.stderr


def test_empty_bundles_directory_one_clear_message(tmp_path: Path) -> None:
    (tmp_path / "run" / ".opguard-bundles").mkdir(parents=True)
    p = run_compare(tmp_path / "run", REFERENCE / "identical" / "a", tmp_path / "v.pftrace")
    assert p.returncode == 5, p.stderr
    first = p.stderr.splitlines()[0]
    assert first.startswith(f"opguard: error: compare input A ({tmp_path / 'run'}) cannot be restored: nothing has "
                            f"been published to {tmp_path / 'run'} yet"), first
    assert first.count("nothing has been published") == 1 and first.count("there is nothing to restore") == 1


def test_reference_function_names_keep_inner_brackets() -> None:
    from opguard.compare.records import unbracket

    assert unbracket("<torch.distributed.<anonymous>>") == "torch.distributed.<anonymous>"
    assert unbracket("<torch.relu>") == "torch.relu" and unbracket("torch.relu") == "torch.relu"


def test_legacy_sync_tar_gz(tmp_path: Path) -> None:
    src = REFERENCE / "identical" / "b" / "exec_trace" / "gpu_000"
    snap = tmp_path / "legacy" / "exec_trace" / "gpu_000"
    snap.mkdir(parents=True)
    with tarfile.open(snap / "sync.tar.gz", "w:gz") as tar:
        for p in sorted(src.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(src)), recursive=False)
    out = tmp_path / "v.pftrace"
    p = run_compare(REFERENCE / "identical" / "a" / "exec_trace" / "gpu_000", snap / "sync.tar.gz", out)
    assert p.returncode == 0, p.stderr
    export = read_export(out)
    assert len(export.ops) == 16 and all(op.args["status"] == "ok" for op in export.ops)
    # the snapshot holds no source files: both sides fall back to line numbers, and say so
    assert "call sites identified by file name and line number in train.py: run B has no source" in p.stderr
    assert all(op.args["callsite"]["identity"].startswith("train.py:line=") for op in export.ops)


def test_no_trace_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    p = run_compare(tmp_path / "empty", REFERENCE / "identical" / "a", tmp_path / "v.pftrace")
    assert p.returncode == 2
    assert "compare input A: no trace files in" in p.stderr and "fix:" in p.stderr
    p = run_compare(tmp_path / "missing", REFERENCE / "identical" / "a", tmp_path / "v.pftrace")
    assert p.returncode == 2 and "does not exist" in p.stderr
    assert not (tmp_path / "v.pftrace").exists()


def test_no_corresponding_files_is_an_error(tmp_path: Path) -> None:
    synth.write_rank(tmp_path / "a", 0, synth.program(rank=0))
    synth.write_rank(tmp_path / "b", 1, synth.program(rank=1))
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 2
    assert "no corresponding trace files" in p.stderr and "rank 0 [capture]" in p.stderr
    assert "rank 1 [capture]" in p.stderr


def test_nothing_paired_is_an_error_with_the_view_written(tmp_path: Path) -> None:
    synth.write_rank(tmp_path / "a", 0, synth.program())
    other = [synth.op(i, f"torch.f{i}", 100 + i, f"z{i} = f{i}()", [synth.digest_of("o", i)],
                      [synth.digest_of("p", i)]) for i in range(5)]
    synth.write_rank(tmp_path / "b", 0, other)
    out = tmp_path / "v.pftrace"
    p = run_compare(tmp_path / "a", tmp_path / "b", out)
    assert p.returncode == 2
    assert "nothing was paired: all 8 operations of A and 5 of B stayed undetermined (segment-differs 13;" \
        in p.stderr and str(out) in p.stderr
    assert "check that A and B are runs of the same program" not in p.stderr
    assert "undetermined in A: segment-differs 8" in p.stderr
    assert all(op.args["status"] == "unaligned" for op in read_export(out).ops)


def test_newer_capture_schema_refused(tmp_path: Path) -> None:
    """Versions 1 and 2 are read; a meta.json or a record of version 3 is refused (exit 6)."""
    cap = synth.write_rank(tmp_path / "a", 0, synth.program())
    (cap / "meta.json").write_text(json.dumps({"schema": "opguard-capture", "version": 3, "rank": 0}))
    p = run_compare(tmp_path / "a", tmp_path / "a", tmp_path / "v.pftrace")
    assert p.returncode == 6 and "capture schema version 3; this opguard reads versions 1 to 2" in p.stderr
    cap = synth.write_rank(tmp_path / "b", 0, synth.program())
    trace = cap / "trace.jsonl"
    trace.write_text(trace.read_text().replace('"v": 1,', '"v": 3,', 1))
    p = run_compare(tmp_path / "b", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 6 and "capture record version 3; this opguard reads versions 1 to 2" in p.stderr
    assert not (tmp_path / "v.pftrace").exists()


def test_bad_record_names_the_line(tmp_path: Path) -> None:
    cap = synth.write_rank(tmp_path / "a", 0, synth.program())
    with open(cap / "trace.jsonl", "a") as f:
        f.write("{not json\n")
    p = run_compare(tmp_path / "a", tmp_path / "a", tmp_path / "v.pftrace")
    assert p.returncode == 2 and "trace.jsonl:10: not a JSON record" in p.stderr
    assert not (tmp_path / "v.pftrace").exists()
    assert not list(tmp_path.glob(".v.pftrace.opguard-tmp-*"))


def test_cap_and_missing_end_are_reported(tmp_path: Path) -> None:
    recs = synth.program()
    cap = {"v": 1, "kind": "cap", "seq": 8, "step": 0, "rank": 0, "limit_bytes": 1, "written_bytes": 2,
           "message": "cap"}
    synth.write_rank(tmp_path / "a", 0, [*recs, cap])
    synth.write_rank(tmp_path / "b", 0, [r for r in recs if r["seq"] != 3], end=False)
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "run A: capture reached its size cap" in p.stderr
    assert "run B: records seq 3..3 are missing" in p.stderr
    assert "run B: no end record" in p.stderr
