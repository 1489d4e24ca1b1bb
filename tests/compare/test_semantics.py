"""Collectives as natural anchors, tensor dumps in diffs, source-line identity with the source index,
the line-number fallback, and output values never influencing pairing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opguard.compare.engine import compare
from opguard.compare.perfetto_export import read_export
from tests.compare import synth
from tests.compare.helpers import ops_of


def _coll(seq: int, line: int, ins: str, out: str) -> dict[str, object]:
    r = synth.op(seq, "torch.distributed.all_reduce", line, "dist.all_reduce(g)", [ins], [out], api="collective")
    r["group_size"] = 2
    return r


def test_collectives_anchor_even_with_different_data(tmp_path: Path) -> None:
    # A: f g AR f g AR ; B: f g X AR f g AR  (an extra call X; every input digest differs between runs)
    def prog(extra: bool, tag: str) -> list[dict[str, object]]:
        recs: list[dict[str, object]] = []
        for step in range(2):
            recs.append(synth.op(len(recs), "torch.f", 1, "a = f(x)", [synth.digest_of(tag, step, "x")], ["o"]))
            recs.append(synth.op(len(recs), "torch.g", 2, "b = g(a)", [synth.digest_of(tag, step, "a")], ["o"]))
            if extra and step == 0:
                recs.append(synth.op(len(recs), "torch.x", 3, "c = x(b)", [synth.digest_of(tag, "c")], ["o"]))
            recs.append(_coll(len(recs), 4, synth.digest_of(tag, step, "g"), synth.digest_of(tag, step, "r")))
        return recs

    synth.write_rank(tmp_path / "a", 0, prog(False, "a"))
    synth.write_rank(tmp_path / "b", 0, prog(True, "b"))
    summary = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    export = read_export(tmp_path / "v.pftrace")
    a = ops_of(export, "A")
    bases = [op.args["correspondence"].get("basis") for op in a]
    assert bases == [None, None, "input-anchor", "between-anchors", "between-anchors", "input-anchor"]
    assert all(op.args["status"] == "mismatch" for op in a if op.args["correspondence"]["state"] == "paired")
    s = summary.streams[(0, "capture")]
    assert s.reasons_a["segment-differs"] == 2 and s.reasons_b["segment-differs"] == 3


def test_output_values_never_influence_pairing(tmp_path: Path) -> None:
    recs = synth.program()
    changed = json.loads(json.dumps(recs))
    for r in changed:
        for o in r["outputs"]:
            o["digest"] = synth.digest_of("other", o["digest"])
            o["shape"] = [9, 9, 9]
    synth.write_rank(tmp_path / "a", 0, recs)
    synth.write_rank(tmp_path / "b", 0, changed)
    compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    export = read_export(tmp_path / "v.pftrace")
    a = ops_of(export, "A")
    assert all(op.args["correspondence"]["basis"] == "equal-sequence" for op in a)
    assert all(op.args["status"] == "mismatch" for op in a)
    assert a[0].args["diff"]["inputs_equal"] is True and "outputs.out.shape" in a[0].args["diff"]["fields"]


def test_tensor_dumps_give_elementwise_errors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    for run, scale in (("a", 1.0), ("b", 1.5)):
        recs = synth.program(variant="numeric" if run == "b" else "base")
        cap = synth.write_rank(tmp_path / run, 0, recs)
        (cap / "tensors").mkdir()
        torch.save(torch.tensor([1.0, 2.0, scale * 3.0]), cap / "tensors" / "000000006-out.pt")
        with open(cap / "trace.jsonl", "a") as f:
            f.write(json.dumps({"v": 1, "kind": "dump", "seq": 6, "slot": "out",
                                "path": "capture/tensors/000000006-out.pt", "bytes": 1, "sha256": "x"}) + "\n")
    compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    add = ops_of(read_export(tmp_path / "v.pftrace"), "A")[6]
    num = add.args["diff"]["out"]
    assert num["max_abs_err"] == pytest.approx(1.5)
    assert num["max_rel_err"] == pytest.approx(1.5 / 4.5)
    assert 0.9 < num["cosine"] < 1.0
    assert add.args["outputs"]["out"]["dump"].endswith("000000006-out.pt")


@pytest.mark.parametrize("n_workers", [2, 3])
def test_parallel_passes_write_the_same_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_workers: int) -> None:
    """The two-process path (pass 1 per side, pass 2 in row ranges, parts appended) gives the same
    operations, pairs, flows and summary as the single-process path."""
    from opguard.compare import engine

    if engine.workers() < 2:
        pytest.skip("needs 2 CPUs for the parallel path")
    for run, variant in (("a", "base"), ("b", "numeric")):
        recs = []
        for step in range(40):
            for r in synth.program(variant=variant):
                r = dict(r, seq=len(recs), step=step)
                r["inputs"] = [dict(i, digest=synth.digest_of(step, i["digest"])) for i in r["inputs"]]
                r["outputs"] = [dict(o, digest=synth.digest_of(step, o["digest"])) for o in r["outputs"]]
                recs.append(r)
        if run == "b":
            recs.insert(100, synth.op(0, "torch.extra", 99, "e = extra()", [synth.digest_of("e")], ["o"]))
        synth.write_rank(tmp_path / run, 0, [dict(r, seq=k) for k, r in enumerate(recs)])
    serial = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "serial.pftrace")
    monkeypatch.setattr(engine, "PARALLEL_MIN_OPS", 1)
    monkeypatch.setattr(engine, "workers", lambda: n_workers)
    parallel = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "parallel.pftrace")
    assert serial.render().splitlines()[1:] == parallel.render().splitlines()[1:]
    es, ep = read_export(tmp_path / "serial.pftrace"), read_export(tmp_path / "parallel.pftrace")
    key = lambda op: op.record_id  # noqa: E731
    assert [(o.record_id, o.ts, o.args, o.flows_out, o.flows_in) for o in sorted(es.ops, key=key)] == \
        [(o.record_id, o.ts, o.args, o.flows_out, o.flows_in) for o in sorted(ep.ops, key=key)]
    assert serial.streams[(0, "capture")].reasons_b["no-counterpart-in-segment"] == 1
    assert not list(tmp_path.glob(".*opguard-part-*"))
