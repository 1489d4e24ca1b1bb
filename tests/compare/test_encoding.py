"""The fast encoder of capture records (straight from JSON) writes what the Record path writes.

The engine encodes capture ``op`` records without building a Record; a Record is built only for
diffs and for records the fast path refuses. Both must give the same view for every record shape
the capture schema (docs/capture.md §3) and the normalisation in records.py allow.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from opguard.compare.opevents import OpEncoder
from opguard.compare.perfetto_export import ExportWriter, read_export
from opguard.compare.records import SiteCache, from_capture
from tests.compare import synth


def _records() -> list[dict[str, Any]]:
    base = synth.op(7, "torch.matmul", 13, "h = torch.matmul(x, w)", ["d1", "d2"], ["d3"], step=2)
    recs = [base]
    r = copy.deepcopy(base)
    r["outputs"][0]["stats"] = {"min": "-inf", "max": "inf", "mean": "nan", "std": 1, "absmax": True}
    recs.append(r)
    r = copy.deepcopy(base)
    r["outputs"][0]["stats"] = {"min": "1.5", "max": "abc", "mean": None, "std": 2.5}   # only numbers, "nan", "inf"
    recs.append(r)
    r = copy.deepcopy(base)
    r["inputs"][0]["shape"] = [True, 4]
    r["inputs"][1]["shape"] = [4.0, 4]
    r["outputs"][0]["shape"] = "4x4"
    recs.append(r)
    r = copy.deepcopy(base)
    del r["inputs"][0]["slot"]
    r["inputs"][1]["slot"] = None
    del r["outputs"][0]["slot"]
    recs.append(r)
    r = copy.deepcopy(base)
    r["error"] = "RuntimeError: boom"
    r["outputs"] = []
    recs.append(r)
    r = copy.deepcopy(base)
    r["inputs"][0]["dtype"] = 5
    r["inputs"][0]["device"] = ["cpu"]
    r["inputs"][1]["digest"] = 17
    r["outputs"][0]["stats"] = {}
    recs.append(r)
    r = copy.deepcopy(base)
    r["outputs"][0]["stats"] = [1, 2]
    r["inputs"] = None
    del r["seq"]
    del r["step"]
    recs.append(r)
    r = copy.deepcopy(base)
    r.update(module="model.layers.3", context="micro-batch 2", phase="backward", api="collective",
             fn="torch.distributed.all_reduce")
    recs.append(r)
    r = copy.deepcopy(base)
    r["seq"] = 8
    r["inputs"][0]["digest"] = "d\u00e9j\u00e0"
    recs.append(r)
    r = copy.deepcopy(base)              # schema v2: arguments and uninitialised entries
    r["v"] = 2
    r["args"] = [synth.arg("approximate", "str", "tanh"), synth.arg("dim", "int", -1),
                 synth.arg("dtype", "dtype", "float32"), synth.arg("out", "none", None),
                 synth.arg("keep", "bool", True), synth.arg("sizes", "list", list(range(30)))]
    r["outputs"][0]["uninitialized"] = True
    r["inputs"][1]["uninitialized"] = True
    recs.append(r)
    return recs


DUMPS = {7: {"arg0": "/r/dumps/7-arg0.npy", "error": "/r/dumps/7-error.npy"}, 8: {"out": "/r/dumps/8-out.npy"}}


def _write(path: Path, fast: bool, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    w = ExportWriter(path, {"opguard.export": "test"})
    em = OpEncoder(w)
    sites = SiteCache(None)
    track = w.track("rank 0", order=0)
    for k, obj in enumerate(recs):
        corr = ("paired", "input-anchor", "ok") if k % 2 else ("undetermined", "segment-differs", "unaligned")
        other = b"B/rank0/capture/%d" % k if k % 2 else None
        flow = k + 1 if k % 2 else None
        if fast:
            em.capture_op(track, k * 1000, em.head("A", "capture", 0), em.site_entry(sites.get(obj)), k,
                          em.record_id("A", "capture", 0, k), obj, DUMPS, corr, other, flow_out=flow)
        else:
            rec = from_capture(obj, k, sites, "test")
            if rec.seq in DUMPS:
                for slot in (*rec.inputs, *rec.outputs):
                    slot.dump = DUMPS[rec.seq].get(slot.name)
            em.op(track, k * 1000, "A", "capture", rec, corr, other, None, flow_out=flow)
    w.commit()
    return [{"name": op.name, "ts": op.ts, "flows": op.flows_out, **op.args} for op in read_export(path).ops]


def test_fast_capture_encoding_equals_record_encoding(tmp_path: Path) -> None:
    recs = _records()
    fast = _write(tmp_path / "fast.pftrace", True, recs)
    slow = _write(tmp_path / "slow.pftrace", False, recs)
    assert len(fast) == len(recs)
    for f, s in zip(fast, slow, strict=True):
        assert repr(f) == repr(s)        # repr: a NaN statistic is not equal to itself
    # the normalisations are visible, so the comparison above covers them
    assert fast[1]["outputs"]["out"]["stats"]["mean"] != fast[1]["outputs"]["out"]["stats"]["mean"]   # nan
    assert fast[2]["outputs"]["out"]["stats"] == {"std": 2.5}
    assert "shape" not in fast[3]["inputs"]["arg0"] and "shape" not in fast[3]["outputs"]["out"]
    assert set(fast[4]["inputs"]) == {"in0", "None"} and set(fast[4]["outputs"]) == {"out0"}
    assert fast[5]["outputs"]["error"] == {"digest": "RuntimeError: boom", "dump": "/r/dumps/7-error.npy"}
    assert fast[0]["inputs"]["arg0"]["dump"] == "/r/dumps/7-arg0.npy"
    assert fast[9]["outputs"]["out"]["dump"] == "/r/dumps/8-out.npy"
    assert "seq" not in fast[7] and "inputs" not in fast[7]
    assert fast[8]["collective"] is True and fast[8]["context"].endswith("backward")
    digest = synth.arg("sizes", "list", list(range(30)))
    assert fast[10]["args"] == {"approximate": "'tanh'", "dim": "-1", "dtype": "float32", "out": "None",
                                "keep": "True", "sizes": f"<sha256:{digest['digest']}/{digest['len']}>"}
    assert fast[10]["outputs"]["out"]["uninitialized"] is True and fast[10]["inputs"]["arg1"]["uninitialized"] is True
    assert "uninitialized" not in fast[10]["inputs"]["arg0"]


@pytest.mark.parametrize("bad", [{"rank": "0"}, {"inputs": [3]}, {"outputs": {"out": {}}}])
def test_fast_encoder_refuses_what_the_record_path_must_judge(tmp_path: Path, bad: dict[str, Any]) -> None:
    """A malformed record raises in the fast encoder (the engine then takes the Record path)."""
    obj = {**_records()[0], **bad}
    w = ExportWriter(tmp_path / "x.pftrace", {"opguard.export": "test"})
    em = OpEncoder(w)
    with pytest.raises((KeyError, TypeError, ValueError, AttributeError)):
        em.capture_op(1, 0, em.head("A", "capture", 0), em.site_entry(SiteCache(None).get(obj)), 0,
                      b"A/rank0/capture/0", obj, {}, ("undetermined", "x", "unaligned"), None)
    w.abort()


def test_fast_pass1_equals_the_generic_index(tmp_path: Path) -> None:
    """Pass 1 over capture streams (engine._index_capture, inlined) gives the keys, anchors and
    positions that Stream.index_fields (the generic definition) gives."""
    from opguard.compare import engine
    from opguard.compare.sources import open_run

    recs = _records()
    recs[3]["inputs"][0]["digest"] = ""                     # no digest: not part of the anchor
    recs[6]["src"] = None                                   # no source-line digest
    recs.append({**recs[0], "seq": 11})                     # a repeated anchor (not unique)
    synth.write_rank(tmp_path / "run", 0, recs)
    with open_run(str(tmp_path / "run"), "A") as run:
        st = run.streams[(0, "capture")]
        table, idx = engine._index_local(st)
        expect = list(st.index_fields())
    assert [table[k] for k in idx.keys] == [e[0] for e in expect]
    assert [table[k] for k in idx.line_keys] == [e[1] for e in expect]
    assert list(idx.anchors) == [engine.anchor_hash(e[2]) if e[2] and not e[3] else engine.NO_ANCHOR
                                 for e in expect]
    assert idx.collectives == [i for i, e in enumerate(expect) if e[3]] and idx.collectives
    assert idx.all_digests is False and all(e[4] for i, e in enumerate(expect) if i != 6)
    assert list(zip(idx.files, idx.offsets, strict=True)) == [(e[5], e[6]) for e in expect]
    assert [idx.sites[s].key for s in idx.site_ids] == [e[0] for e in expect]


def test_repeated_strings_are_interned_once_per_sequence(tmp_path: Path) -> None:
    """Event names and low-cardinality annotation values (call site, context, dtype, device, bases,
    states) are Perfetto interned data: written once, referenced by iid (docs/compare.md §5)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    from opguard.compare.engine import compare
    from opguard.compare.perfetto_export import read_export
    from tests.compare import synth

    recs = []
    for step in range(20):
        for r in synth.program():
            recs.append(dict(r, seq=len(recs), step=step))
    for run in ("a", "b"):
        synth.write_rank(tmp_path / run, 0, recs)
    compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    data = (tmp_path / "v.pftrace").read_bytes()
    assert data.count(b"torch.matmul") == 1
    assert data.count(b"float32") == 1 and data.count(b"equal-sequence") == 1
    trace = pb.Trace.FromString(data)
    texts = [s.str for p in trace.packet if p.HasField("interned_data")
             for s in p.interned_data.debug_annotation_string_values if s.str.startswith(b'{"file":')]
    # the callsite annotation is the interned JSON text of its dict: once per distinct call site
    assert len(texts) == len(set(texts)) == data.count(b"/work/train.py") == len({r["line"] for r in synth.program()})
    begins = [p.track_event for p in trace.packet if p.HasField("track_event") and p.track_event.type == 1]
    assert len(begins) == 320 and all(ev.HasField("name_iid") and not ev.HasField("name") for ev in begins)
    ops = read_export(tmp_path / "v.pftrace").ops                  # the reader resolves the iids
    assert {op.name for op in ops} == {"torch.randn", "torch.matmul", "torch.relu", "torch.add", "torch.sum"}
    mm = next(op for op in ops if op.name == "torch.matmul")
    assert mm.args["callsite"]["file"] == "/work/train.py" and mm.args["inputs"]["arg0"]["dtype"] == "float32"


def test_implied_annotations_are_left_out_and_restored(tmp_path: Path) -> None:
    """docs/compare.md §5: run/rank/stream/index are not written (the record_id holds them), the
    callsite is JSON text, and B's slice of an ok pair with slots equal in every field says
    `slots: same as other`; read_export restores all of it. A pair whose slots differ keeps B's own."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    from opguard.compare.engine import compare
    from opguard.compare.perfetto_export import read_export
    from opguard.compare.protoenc import decode_annotation
    from tests.compare import synth

    recs_a = [dict(r, seq=i, step=0) for i, r in enumerate(synth.program())]
    recs_b = [dict(r, outputs=[dict(s) for s in r["outputs"]]) for r in recs_a]
    recs_b[-1]["outputs"][0]["digest"] = "changed"              # the last op: a mismatch
    synth.write_rank(tmp_path / "a", 0, recs_a)
    synth.write_rank(tmp_path / "b", 0, recs_b)
    compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    trace = pb.Trace.FromString((tmp_path / "v.pftrace").read_bytes())
    names: dict[int, str] = {}
    strings: dict[int, str] = {}
    raw = []
    for p in trace.packet:
        if p.HasField("interned_data"):
            names.update({n.iid: n.name for n in p.interned_data.debug_annotation_names})
            strings.update({s.iid: s.str.decode() for s in p.interned_data.debug_annotation_string_values})
        if p.HasField("track_event") and p.track_event.type == 1:
            raw.append(dict(decode_annotation(a, names, strings) for a in p.track_event.debug_annotations))
    assert raw and not any(k in r for r in raw for k in ("run", "rank", "stream", "index"))
    assert all(isinstance(r["callsite"], str) and r["callsite"].startswith('{"file":') for r in raw)
    same = [r for r in raw if r.get("slots") == "same as other"]
    assert len(same) == len(recs_a) - 1 and all(r["record_id"].startswith("B/") and "inputs" not in r for r in same)
    ops = {op.record_id: op for op in read_export(tmp_path / "v.pftrace").ops}
    n = len(recs_a)
    for i in range(n):
        a, b = ops[f"A/rank0/capture/{i}"].args, ops[f"B/rank0/capture/{i}"].args
        assert (b["run"], b["rank"], b["stream"], b["index"]) == ("B", 0, "capture", i) and "slots" not in b
        assert isinstance(b["callsite"], dict) and b["callsite"]["line"] == recs_a[i]["line"]
        assert b.get("inputs") == a.get("inputs") and (b["outputs"] == a["outputs"]) == (i < n - 1)
    assert ops[f"B/rank0/capture/{n - 1}"].args["outputs"]["out"]["digest"] == "changed"


_LINE = (b'{"v":1,"kind":"op","seq":%s,"step":0,"rank":0,"fn":"torch.add","args":%s,'
         b'"inputs":[{"slot":"arg0","digest":"%s"}],"outputs":[]}\n')


@pytest.mark.parametrize(("a", "b", "fast"), [
    (_LINE % (b"9", b"{}", b"d1"), _LINE % (b"10", b"{}", b"d1"), True),           # only seq differs
    (_LINE % (b"7", b"{}", b"d1"), _LINE % (b"7", b"{}", b"d1"), True),            # identical
    (_LINE % (b"9", b"{}", b"d1"), _LINE % (b"10", b"{}", b"d2"), False),          # an input differs
    (_LINE % (b"9", b'{"seq":1}', b"d1"), _LINE % (b"10", b'{"seq":1}', b"d1"), False),  # a nested seq too
    (_LINE % (b' 9', b"{}", b"d1"), _LINE % (b"10", b"{}", b"d1"), False),         # not digits only
    (b'{"v":1,"kind":"op","fn":"x","seq":3}\n', b'{"v":1,"kind":"op","fn":"x","seq":4}\n', False),  # last key
    (b'{"v":1,"fn":"[","seq":3,"step":1}\n', b'{"v":1,"fn":"[","seq":4,"step":1}\n', False),  # "[" before it
    (b'{"v":1,"a":{"seq":3},"seq":3,"s":1}\n', b'{"v":1,"a":{"seq":3},"seq":4,"s":1}\n', False),  # nested first
])
def test_pass2_takes_b_as_a_with_bs_seq_only_when_parsing_b_would_give_that(a: bytes, b: bytes, fast: bool) -> None:
    """Pass 2 skips parsing B's line of a pair when it equals A's except the top-level seq digits
    (engine._same_but_seq); whenever it does, A's record with B's seq is exactly B's parsed record."""
    import orjson

    from opguard.compare.engine import _same_but_seq

    got = _same_but_seq(a, b)
    assert (got is not None) == fast
    if got is not None:
        oa, ob = orjson.loads(a), orjson.loads(b)
        assert got == (oa["seq"], ob["seq"])
        assert {**oa, "seq": got[1]} == ob
