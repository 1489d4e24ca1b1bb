"""`python -m opguard.tools align`: bound to the export's digest, slot links across ranks, rejections,
originals intact — through the real command."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from opguard.compare.perfetto_export import read_export
from tests.compare.helpers import REFERENCE, ops_of, run_compare


def _align(export: Path, amap: Path, new: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opguard.tools", "align", str(export), str(amap), "-o", str(new)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def export(tmp_path: Path) -> Path:
    out = tmp_path / "view.pftrace"
    p = run_compare(REFERENCE / "identical" / "a", REFERENCE / "identical" / "b", out)
    assert p.returncode == 0, p.stderr
    return out


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_wrong_digest_refused(export: Path, tmp_path: Path) -> None:
    amap = tmp_path / "map.json"
    amap.write_text(json.dumps({"version": 1, "export_sha256": "0" * 64, "pairs": [], "reject": []}))
    p = _align(export, amap, tmp_path / "new.pftrace")
    assert p.returncode == 6
    assert "bound to export" in p.stderr and _sha(export) in p.stderr
    assert not (tmp_path / "new.pftrace").exists()


def test_cross_rank_slot_pair_and_a_rejection(export: Path, tmp_path: Path) -> None:
    before = _sha(export)
    view = read_export(export)
    a0 = ops_of(view, "A", 0)
    b1 = ops_of(view, "B", 1)
    mm_a = a0[3]                                     # torch.matmul(x, w) on rank 0 of run A
    relu_b = b1[4]                                   # torch.relu(h) on rank 1 of run B
    assert mm_a.name == "torch.matmul" and relu_b.name == "torch.relu"
    rejected_a = a0[6]
    rejected_b_id = rejected_a.args["correspondence"]["other"]
    amap = tmp_path / "map.json"
    amap.write_text(json.dumps({
        "version": 1, "export_sha256": before,
        "pairs": [{"a": {"record": mm_a.record_id, "slot": "outputs.out"},
                   "b": {"record": relu_b.record_id, "slot": "inputs.args[1]"}, "note": "h flows into relu"},
                  {"a": {"record": mm_a.record_id, "slot": "outputs.out"},
                   "b": {"record": b1[3].record_id, "slot": "outputs.out"}}],
        "reject": [{"a": rejected_a.record_id, "b": rejected_b_id, "note": "not the same add"}]}))
    new = tmp_path / "new.pftrace"
    p = _align(export, amap, new)
    assert p.returncode == 0, p.stderr
    assert _sha(export) == before                   # the original export is intact
    out = read_export(new)
    assert len(out.ops) == len(view.ops)
    ids = out.by_id()
    # the cross-rank slot link: compared fields, a flow from A's slice to B's
    link = ids[mm_a.record_id].args["alignment"]["link0"]
    assert link["other"] == relu_b.record_id and link["other_slot"] == "inputs.args[1]"
    assert link["basis"] == "alignment-map" and link["validation"] == "unreviewed"
    # rank 0's h (matmul output) and rank 1's relu input are different tensors (other seeds)
    assert link["status"] == "mismatch" and "digest" in link["diff"]["fields"]
    other = ids[relu_b.record_id].args["alignment"]["link0"]
    assert other["other"] == mm_a.record_id and other["slot"] == "inputs.args[1]"
    new_flows = set(ids[mm_a.record_id].flows_out) - set(view.by_id()[mm_a.record_id].flows_out)
    assert len(new_flows) == 2
    assert any(f in ids[relu_b.record_id].flows_in for f in new_flows)
    # the rejection: both undetermined with the reason, originals kept, no flow
    for rid in (rejected_a.record_id, rejected_b_id):
        op = ids[rid]
        assert op.args["correspondence"]["state"] == "undetermined"
        assert op.args["correspondence"]["reason"] == "rejected-by-alignment-map"
        assert op.args["status"] == "unaligned" and "validation" not in op.args
        assert op.args["original"]["correspondence"]["state"] == "paired"
        assert op.args["original"]["status"] == "ok"
        assert not op.flows_out and not op.flows_in
    # every other operation and all observations unchanged
    for old in view.ops:
        if old.record_id in (rejected_a.record_id, rejected_b_id):
            assert ids[old.record_id].args["outputs"] == old.args["outputs"]
            continue
        got = dict(ids[old.record_id].args)
        got.pop("alignment", None)
        assert got == old.args
    assert out.attributes["opguard.align.export_sha256"] == before
    assert out.attributes["opguard.input_a.sha256"] == view.attributes["opguard.input_a.sha256"]


def test_bad_map_entries_are_refused(export: Path, tmp_path: Path) -> None:
    sha = _sha(export)
    view = read_export(export)
    a = ops_of(view, "A", 0)
    amap = tmp_path / "map.json"
    cases = [
        ({"pairs": [{"a": {"record": "A/rank9/ops/0", "slot": "outputs.out"},
                     "b": {"record": a[1].record_id, "slot": "outputs.out"}}]}, "is not in the export"),
        ({"pairs": [{"a": {"record": a[0].record_id, "slot": "outputs.nope"},
                     "b": {"record": a[1].record_id, "slot": "outputs.out"}}]}, "choose one of"),
        ({"reject": [{"a": a[0].record_id, "b": a[1].record_id}]}, "are not a pair in the export"),
    ]
    for body, msg in cases:
        amap.write_text(json.dumps({"version": 1, "export_sha256": sha, **body}))
        p = _align(export, amap, tmp_path / "new.pftrace")
        assert p.returncode == 2 and msg in p.stderr, p.stderr
        assert not (tmp_path / "new.pftrace").exists()
    p = _align(export, amap, export)
    assert p.returncode == 2 and "is the export itself" in p.stderr
