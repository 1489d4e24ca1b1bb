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
    # the collectives anchor; before the first, B's extra x is set aside (§2 rule 6) and f, g pair
    assert bases == ["between-anchors", "between-anchors", "input-anchor", "between-anchors", "between-anchors",
                     "input-anchor"]
    assert all(op.args["status"] == "mismatch" for op in a if op.args["correspondence"]["state"] == "paired")
    s = summary.streams[(0, "capture")]
    assert not s.reasons_a and dict(s.reasons_b) == {"not-in-other-segment": 1}


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


def _two_runs(tmp_path: Path) -> None:
    for run in ("a", "b"):
        recs = [dict(r, seq=k, step=0) for k, r in enumerate(synth.program() * 20)]
        synth.write_rank(tmp_path / run, 0, recs)


def test_forked_workers_only_where_forkpool_is_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The passes fork through opguard.staging.forkpool, and only where forkpool.available() says a
    fork is safe (e.g. not with other threads running): otherwise everything runs in this process."""
    from opguard.compare import engine
    from opguard.staging import forkpool

    _two_runs(tmp_path)
    monkeypatch.setattr(engine, "PARALLEL_MIN_OPS", 1)
    monkeypatch.setattr(engine, "workers", lambda: 2)
    calls: list[int] = []
    real_run = forkpool.run

    def counting_run(jobs, workers, fn, lost, before_fork=None, where="?"):  # type: ignore[no-untyped-def]
        calls.append(len(jobs))
        assert where == "a compare worker process"  # what a worker's traceback note says
        return real_run(jobs, workers, fn, lost, before_fork, where)

    monkeypatch.setattr(forkpool, "run", counting_run)
    forked = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "forked.pftrace")
    assert calls == [2, 2]                      # pass 1 (one job per run), pass 2 (one per worker)
    monkeypatch.setattr(forkpool, "available", lambda: False)
    here = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "here.pftrace")
    assert calls == [2, 2]                      # nothing forked
    assert forked.render().splitlines()[1:] == here.render().splitlines()[1:]


def test_a_worker_that_dies_is_an_error_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass-2 worker killed (SIGKILL, as the OOM killer does): exit 1 naming how it died; no export,
    no temporary or part file left."""
    import os
    import signal

    from opguard.compare import engine
    from opguard.errors import OpguardError

    _two_runs(tmp_path)
    monkeypatch.setattr(engine, "PARALLEL_MIN_OPS", 1)
    monkeypatch.setattr(engine, "workers", lambda: 2)
    parent = os.getpid()
    real = engine._rows_worker

    def dying(r0: int, r1: int, part: str, seq_id: int) -> object:
        if os.getpid() != parent and r0 > 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(r0, r1, part, seq_id)

    monkeypatch.setattr(engine, "_rows_worker", dying)
    with pytest.raises(OpguardError) as e:
        compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    assert e.value.exit_code == 1 and "was killed by SIGKILL" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_numeric_differences_are_listed_in_slot_order_in_every_process() -> None:
    """The differing slots were walked in a set's order, which follows the per-process string hash:
    two compares of the same traces listed an EMA's 56 ``out.<j>`` differences in different orders
    (and wrote different view files). They are in A's slot order now, whatever PYTHONHASHSEED."""
    import subprocess
    import sys

    code = (
        "from opguard.compare.diff import diff_pair\n"
        "from opguard.compare.records import Record, Slot\n"
        "def rec(v):\n"
        "    return Record(0, 0, 'torch._foreach_lerp_', 's', outputs=[\n"
        "        Slot(f'out.{j}', f'{v}{j:04x}', 'float32', (2,), stats={'min': float(v + j), 'max': float(v + j)})\n"
        "        for j in range(40)])\n"
        "d = diff_pair(rec(1), rec(2))\n"
        "print(d.fields, d.numeric)\n")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2", "3")}
    assert len(outs) == 1, outs


def test_a_first_divergence_line_shows_a_few_slots_and_counts_the_rest() -> None:
    """An optimizer step whose learning rate changed differs in every parameter and state slot: the
    line listed all of them (24 entries, several KB). It shows 6 and counts the rest."""
    from opguard.compare.summary import FirstMismatch

    numeric = {f"p{i}.weight": {"stats_max_abs_diff": 0.5} for i in range(24)}
    fm = FirstMismatch("A/r0/1", "B/r0/1", "torch.optim.AdamW.step", "t.py:9", [f"outputs.p{i}.weight.digest"
                                                                               for i in range(24)], numeric, 0)
    line = fm.describe()
    assert "p5.weight: stats_max_abs_diff=0.5; ... (18 more)" in line and "p6.weight" not in line
    assert "outputs.p5.weight.digest, ... (18 more)" in line
    assert len(fm.as_json()["numeric"]) == 24


def test_an_error_naming_a_peer_s_ephemeral_port_is_the_same_error(tmp_path: Path) -> None:
    """Two identical runs of a job whose other rank died (``torchrun --max-restarts``): the
    ``backward`` that raised recorded gloo's "Connection closed by peer [127.0.0.1]:45993" in one
    run and ":54458" in the other, and compare named it as an introduced divergence, "outputs
    differ, inputs and arguments equal: outputs.error.digest" (hand test). Socket and object
    addresses and pids in a recorded error are not compared; the rest of the message is."""
    from opguard.compare.records import error_key

    def prog(port: int, size: int) -> list[dict[str, object]]:
        r = synth.op(0, "Tensor.backward", 1, "loss.backward()", ["in"], [])
        r["error"] = (f"RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                      f"[127.0.0.1]:{port} (object at 0x7f3a1c2b4d10, pid {port + 1}), size {size}")
        return [r]

    synth.write_rank(tmp_path / "a", 0, prog(45993, 3), version=2)
    synth.write_rank(tmp_path / "b", 0, prog(54458, 3), version=2)
    synth.write_rank(tmp_path / "c", 0, prog(45993, 4), version=2)
    ab = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "ab.pftrace")
    assert ab.streams[(0, "capture")].status["mismatch"] == 0
    ac = compare(str(tmp_path / "a"), str(tmp_path / "c"), tmp_path / "ac.pftrace")
    assert ac.streams[(0, "capture")].status["mismatch"] == 1  # the message itself still counts
    assert error_key("peer [::1]:6000 at 0x7f00aa11bb22, port 29500") == "peer <addr> at <addr>, <id>"
