"""Capture holds on real programs (issue 12): a zoo of model families run with and without
``opguard-run --capture`` (bitwise equal results, no traceback, records at the script's call sites),
DDP on gloo through torchrun, an unmodified nanoGPT-style script's records (no noise, uninitialised
outputs, argument records, steps at Optimizer.step), step selections that match nothing, and
failures injected into each of capture's own stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import opguard.capture as oc  # noqa: E402
from opguard.capture import records, session  # noqa: E402
from tests.capture.helpers import ops, read_trace, trace_dir  # noqa: E402
from tests.capture.progs import calls  # noqa: E402
from tests.capture.progs.models import MLP  # noqa: E402
from tests.capture.test_hostkernel import oc_digest_of  # noqa: E402
from tests.capture.test_torchrun import TORCHRUN, clean_env, free_port, run, run_plain  # noqa: E402
from tests.conftest import BIN  # noqa: E402

pytestmark = [pytest.mark.torch]
PROGS = Path(__file__).parent / "progs"
ZOO, NANOGPT, DDP = str(PROGS / "zoo.py"), str(PROGS / "nanogpt.py"), str(PROGS / "ddp_app.py")
FSDP2 = str(PROGS / "fsdp2_app.py")
PY = sys.executable


def captured(cmd: list[str], base: Path, extra_env: dict[str, str] | None = None,
             **options: str) -> subprocess.CompletedProcess[str]:
    env = {**clean_env(), **(extra_env or {}), "OPGUARD_TRACE_OUTPUT_BASE": str(base),
           **{f"OPGUARD_CAPTURE_{k.upper()}": v for k, v in options.items()}}
    return run([str(BIN / "opguard-run"), "--capture", *cmd], env)


# ---- the zoo ---------------------------------------------------------------------------------------
def test_zoo_of_model_families_bitwise_equal_under_opguard_run_capture(tmp_path: Path) -> None:
    plain, cap = tmp_path / "plain", tmp_path / "cap"
    plain.mkdir()
    cap.mkdir()
    base = tmp_path / "traces"
    p = run_plain([PY, ZOO, str(plain)], clean_env())
    # its own inductor cache: the captured run compiles as the first run on a machine does (a lazy
    # backward compile's torch calls were recorded only then)
    c = captured([PY, ZOO, str(cap)], base, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")})
    assert "Traceback" not in p.stderr + c.stderr and "RecursionError" not in c.stderr
    a = json.loads((plain / "zoo.json").read_text())
    b = json.loads((cap / "zoo.json").read_text())
    assert set(a) == set(b) and len(a) == 14
    d = trace_dir(base)
    meta = json.loads((d / "meta.json").read_text())
    for family in a:  # eval_encoder too: kept on PyTorch's fused fast path, one record (fused.py)
        assert a[family] == b[family], family
    assert meta["fast_path_off"] == []
    assert meta["version"] == 2 and meta["ended_at"] is not None and meta["step_source"] == "optimizer"
    assert any("torch.compile" in n for n in meta["notes"])
    op = ops(read_trace(d))
    assert all(r["file"] == ZOO for r in op)  # every record at the script's own call sites
    # no padding mask: no nested-tensor conversion, each layer on its fast path (docs/capture.md §3.13)
    assert [(r["module"], r["func"]) for r in op if r["api"] == "module"] == [
        ("TransformerEncoder.layers.0", "eval_encoder"), ("TransformerEncoder.layers.1", "eval_encoder")]
    assert not any(r["fn"] == "torch.promote_types" for r in op)  # inductor's lowering is not the program's
    fns = {r["fn"] for r in op}
    for fn in ("torch.nn.functional.multi_head_attention_forward", "Tensor.unflatten",
               "torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.batch_norm",
               "torch._pack_padded_sequence", "torch.lstm", "torch.gru", "torch.nn.functional.embedding_bag",
               "torch._foreach_norm", "torch.optim.AdamW.step"):
        assert fn in fns, fn
    # each AdamW.step() one record (docs/capture.md §3.8): the scheduled learning rate and foreach=True
    # as arguments, nothing of the foreach kernels inside it recorded
    adamw = [r for r in op if r["fn"] == "torch.optim.AdamW.step" and r["func"] == "adamw_clip_sched"]
    lrs = [next(a["value"] for a in r["args"] if a["slot"] == "group0.lr") for r in adamw]
    assert len(adamw) >= 3 and len(set(lrs)) == len(lrs)
    assert all({"slot": "group0.foreach", "type": "bool", "value": True} in r["args"] for r in adamw)
    assert not any(r["fn"] in ("torch._foreach_add_", "torch._foreach_lerp_") for r in op)
    assert not any(r.get("capture_error") for r in op)


def _ddp(out: Path, *extra: str) -> list[str]:
    """2 ranks of ``progs/ddp_app.py`` through torchrun, 3 steps, writing to ``out``."""
    return [TORCHRUN, "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            DDP, str(out), "3", *extra]


def test_ddp_on_gloo_through_torchrun_bitwise_equal(tmp_path: Path) -> None:
    plain, cap = tmp_path / "plain", tmp_path / "cap"
    plain.mkdir()
    cap.mkdir()
    run_plain(_ddp(plain), clean_env())
    base = tmp_path / "traces"
    c = captured(_ddp(cap), base)
    assert "Traceback" not in c.stderr
    for rank in (0, 1):
        assert (plain / f"loss-{rank}.txt").read_text() == (cap / f"loss-{rank}.txt").read_text()
        op = ops(read_trace(trace_dir(base, rank)))
        assert any(r["fn"] == "torch.nn.functional.linear" and r["file"] == DDP for r in op)
        # each SGD.step() advanced the step (step 3: the calls after the last one)
        assert {r["step"] for r in op} == {0, 1, 2, 3}


def _fsdp2(out: Path, *extra: str) -> list[str]:
    """2 ranks of ``progs/fsdp2_app.py`` through torchrun, 3 steps, writing to ``out``."""
    return [TORCHRUN, "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            FSDP2, str(out), "3", *extra]


def test_fsdp2_identical_reruns_compare_equal_and_a_changed_lr_is_the_first_divergence(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``, gloo) frees and re-allocates its unsharded parameters' memory with
    ``UntypedStorage.resize_``, which capture's mode does not see. Before, capture's digest cache
    served a freed parameter's digest to whatever the allocator put at its address next (the
    parameter object lives on), and views of the re-allocated memory were digested as content: two
    identical runs compared with 188 mismatches and, on rank 1, a false "first divergence" (a
    ``linear`` whose outputs differed with equal inputs). Found hand-testing; fails on the old code."""
    plain, a, b, v = (tmp_path / n for n in ("plain", "a", "b", "v"))
    for d in (plain, a, b, v):
        d.mkdir()
    run_plain(_fsdp2(plain), clean_env())
    for out in (a, b):
        c = captured(_fsdp2(out), tmp_path / f"traces-{out.name}")
        assert "Traceback" not in c.stderr
        for rank in (0, 1):
            assert (plain / f"loss-{rank}.txt").read_text() == (out / f"loss-{rank}.txt").read_text()
    captured(_fsdp2(v, "0.02"), tmp_path / "traces-v")

    def compare(x: str, y: str) -> dict[str, Any]:
        js = tmp_path / f"{x}{y}.json"
        run([str(BIN / "opguard"), "compare", str(tmp_path / f"traces-{x}"), str(tmp_path / f"traces-{y}"),
             "-o", str(tmp_path / f"{x}{y}.pftrace"), "--json", str(js)], clean_env())
        return dict(json.loads(js.read_text()))

    same = compare("a", "b")
    assert same["pairs"] > 600 and same["mismatch"] == 0 and same["unaligned"] == 0
    for rank in (0, 1):
        op = ops(read_trace(trace_dir(tmp_path / "traces-a", rank)))
        views = [r for r in op if r["fn"] == "Tensor.view" and r["parent"] is not None]
        assert any(e.get("uninitialized") for r in views for e in r["inputs"])  # the re-allocated memory
    changed = compare("a", "v")
    for r in changed["ranks"]:
        first = r["first_divergence"]
        assert first["function"] == "torch.optim.AdamW.step" and first["args"] == ["group0.lr: 0.01 -> 0.02"]


def test_ddp_broadcast_buffers_are_digested_from_memory(tmp_path: Path) -> None:
    """DDP (``broadcast_buffers=True``, the default) writes rank 0's BatchNorm running statistics into
    rank 1's module in C++ before each forward, leaving the version counters as they were: rank 1's
    ``batch_norm`` records had its own, stale, running-mean digest from the step before (found
    hand-testing; fails on the old code)."""
    plain, cap = tmp_path / "plain", tmp_path / "cap"
    plain.mkdir()
    cap.mkdir()
    run_plain(_ddp(plain, "bn"), clean_env())
    base = tmp_path / "traces"
    c = captured(_ddp(cap, "bn"), base, dump_steps="0-10", dump_filter="torch.nn.functional.batch_norm")
    assert "Traceback" not in c.stderr
    for rank in (0, 1):
        assert (plain / f"bn-{rank}.txt").read_text() == (cap / f"bn-{rank}.txt").read_text()
        d = trace_dir(base, rank)
        recs = read_trace(d)
        bn = [r for r in ops(recs) if r["fn"] == "torch.nn.functional.batch_norm"]
        dumped = {r["seq"]: torch.load(d.parent / r["path"]) for r in recs
                  if r["kind"] == "dump" and r["slot"] == "arg1"}
        assert len(bn) == len(dumped) == 3, rank
        assert [r["inputs"][1]["digest"] for r in bn] == [oc_digest_of(dumped[r["seq"]]) for r in bn], rank


LOADER = str(PROGS / "loader_app.py")


def _line_of(path: str, marker: str) -> int:
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if marker in line)


def test_tensor_rebuilds_of_dataloader_batches_and_torch_load_are_not_recorded(tmp_path: Path) -> None:
    """A DataLoader's workers send each batch through shared memory; the main process rebuilds its
    tensors when it unpickles them (``torch.empty((0,))`` + ``set_`` in torch's rebuild code), at a
    moment that depends on when a worker delivered it. Those calls were recorded at the loop's line,
    in whichever step the batch happened to arrive: two identical runs compared with 28 unaligned
    operations (found hand-testing). They compute nothing and are not recorded now, nor are
    ``torch.load``'s (docs/capture.md §3.5); the batch is digested at its first use, so a batch that
    differs is still the first divergence's input."""
    plain = tmp_path / "plain"
    plain.mkdir()
    run_plain([PY, LOADER, str(plain)], clean_env())
    bases = {}
    for name in ("a", "b", "noise"):
        out = tmp_path / name
        out.mkdir()
        bases[name] = tmp_path / f"traces-{name}"
        c = captured([PY, LOADER, str(out)], bases[name], **({"record_noise": "1"} if name == "noise" else {}))
        assert "Traceback" not in c.stderr
        assert (out / "losses.txt").read_text() == (plain / "losses.txt").read_text()
    batches, load = _line_of(LOADER, "# <batches>"), _line_of(LOADER, "# <load>")
    op = ops(read_trace(trace_dir(bases["a"])))
    at_loop = [r["fn"] for r in op if r["line"] == batches]
    # per epoch only the loader's own seed and shuffle (torch.empty((), int64).random_(), randperm): the
    # old code added a torch.empty per batch tensor (2 per batch, 16 batches per epoch)
    assert at_loop.count("torch.empty") == 2 and "Tensor.set_" not in at_loop, at_loop
    assert not any(r["line"] == load for r in op)
    # what torch.load rebuilt is digested where it is used: load_state_dict's copies read the saved weights
    saved = [r for r in op if r["fn"] == "torch.optim.SGD.step"][-1]
    restored = [r for r in op if r["fn"] == "Tensor.copy_" and r["line"] == _line_of(LOADER, "# <restore>")]
    assert len(restored) == 4
    assert [r["inputs"][1]["digest"] for r in restored] == [e["digest"] for e in saved["outputs"]]
    # two identical runs: every operation paired, in sequence
    summary = tmp_path / "ab.json"
    r = subprocess.run([str(BIN / "opguard"), "compare", str(bases["a"]), str(bases["b"]), "-o",
                        str(tmp_path / "ab.pftrace"), "--json", str(summary)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "0 unaligned operations" in r.stderr and "mismatch 0" in r.stderr, r.stderr
    # record_noise restores them
    noisy = ops(read_trace(trace_dir(bases["noise"])))
    assert sum(1 for r in noisy if r["line"] == load and r["fn"] == "torch.empty") == 4


# ---- records of an unmodified nanoGPT-style script ------------------------------------------------
def nanogpt(tmp_path: Path, name: str, **options: str) -> tuple[list[dict[str, Any]], dict[str, Any], str, str]:
    out = tmp_path / name
    out.mkdir()
    base = tmp_path / f"{name}-traces"
    r = captured([PY, NANOGPT, str(out), "4"], base, **options)
    d = trace_dir(base)
    return read_trace(d), json.loads((d / "meta.json").read_text()), (out / "losses.txt").read_text(), r.stderr


def test_nanogpt_records_without_noise_with_arguments_uninitialized_and_optimizer_steps(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    run_plain([PY, NANOGPT, str(plain), "4"], clean_env())
    recs, meta, losses, _ = nanogpt(tmp_path, "cap")
    assert losses == (plain / "losses.txt").read_text()
    op = ops(recs)
    fns = {r["fn"] for r in op}
    assert not fns & {"Tensor.grad", "Tensor.__index__", "Tensor.data", "Tensor.shape", "Tensor.__len__"}
    # clip_grad_norm_'s norm.to(device) per parameter and the batch's .to(device) return their input on CPU
    assert "Tensor.to" not in fns
    assert all(r["file"] == NANOGPT for r in op)     # not numpy's memmap.py
    # torch.empty: the output is marked, never summarised; the first write's input too
    empty = [r for r in op if r["fn"] == "torch.empty"]
    assert empty and all(r["outputs"][0]["uninitialized"] is True and r["outputs"][0]["digest"] is None
                         and r["outputs"][0]["stats"] is None for r in empty)
    buf = next(r for r in empty if r["outputs"][0]["shape"] == [4])
    assert buf["args"] == [{"slot": "arg0", "type": "int", "value": 4}]
    # losses[it] = loss writes one element: the buffer's other elements are still what the allocator
    # left, so self stays marked after every write (before, the second write on read self as content,
    # unwritten elements included: a digest that differs between identical runs); the value is content
    writes = [r for r in op if r["fn"] == "Tensor.__setitem__"]
    assert len(writes) == 4
    for w in writes:
        assert w["inputs"][0]["slot"] == "self" and w["inputs"][0]["uninitialized"] is True
        assert w["outputs"][0]["uninitialized"] is True and w["outputs"][0]["digest"] is None
        assert w["inputs"][-1]["digest"] and "uninitialized" not in w["inputs"][-1]
    # non-tensor arguments as evidence
    gelu = [r for r in op if r["fn"] == "torch.nn.functional.gelu"]
    assert gelu and all({"slot": "approximate", "type": "str", "value": "tanh"} in r["args"] for r in gelu)
    sdpa = next(r for r in op if r["fn"] == "torch.nn.functional.scaled_dot_product_attention")
    assert {"slot": "is_causal", "type": "bool", "value": True} in sdpa["args"]
    assert {"slot": "dropout_p", "type": "float", "value": 0.0} in sdpa["args"]
    # steps advance at each AdamW.step(): step records with their source, op records in steps 0..4
    steps = [r for r in recs if r["kind"] == "step"]
    assert [(r["step"], r["source"], r["v"]) for r in steps] == [(i, "optimizer", 2) for i in (1, 2, 3, 4)]
    assert meta["step_source"] == "optimizer" and meta["record_noise"] is False and meta["notes"] == []
    per_step = [sum(1 for r in op if r["step"] == s) for s in range(4)]
    # the same records every step once the wrappers that only forward their call are collapsed (after
    # their second call: a wrapper called once per step is collapsed at the end of step 1, §3.10)
    collapsed = {w["fn"] for w in meta["collapsed_wrappers"]}
    assert {"torch.nn.functional.layer_norm", "torch.nn.functional.embedding"} <= collapsed, collapsed
    assert per_step[1] >= per_step[2] == per_step[3] > 0
    assert [r["step"] for r in op] == sorted(r["step"] for r in op)


def test_record_noise_restores_property_reads_and_protocol_calls(tmp_path: Path) -> None:
    recs, meta, _, _ = nanogpt(tmp_path, "noise", record_noise="1")
    fns = {r["fn"] for r in ops(recs)}
    assert {"Tensor.grad", "Tensor.__index__", "Tensor.to"} <= fns and meta["record_noise"] is True
    index = next(r for r in ops(recs) if r["fn"] == "Tensor.__index__")
    assert index["file"] == NANOGPT and index["func"] in ("get_batch", "<listcomp>")  # not numpy's memmap.py


def test_step_selection_works_without_markers_and_an_empty_one_is_a_warning(tmp_path: Path) -> None:
    recs, meta, _, err = nanogpt(tmp_path, "sel", steps="2")
    op = ops(recs)
    assert op and {r["step"] for r in op} == {2} and meta["notes"] == []
    recs, meta, _, err = nanogpt(tmp_path, "none", steps="5-6")
    assert ops(recs) == []
    assert "warning: the selection OPGUARD_CAPTURE_STEPS=5-6 matched no call" in err
    assert len(meta["notes"]) == 1 and "steps seen 0-4, advanced at each Optimizer.step()" in meta["notes"][0]


def test_step_auto_off_keeps_step_zero(tmp_path: Path) -> None:
    recs, meta, _, _ = nanogpt(tmp_path, "off", step_auto="0")
    assert {r["step"] for r in ops(recs)} == {0} and meta["step_source"] == "none"
    assert not [r for r in recs if r["kind"] == "step"]


# ---- in-process: the re-entry fix, markers win, injected failures ----------------------------------
def test_multihead_attention_does_not_reenter_the_call_being_handled(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    ref = mha(x, x, x)[0]
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        y = mha(x, x, x)[0]
    assert torch.equal(ref, y)
    unflatten = [r for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.unflatten"]
    assert len(unflatten) == 1 and unflatten[0]["depth"] == 1   # recorded once, inside the MHA forward


def test_markers_take_over_from_the_optimizer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        for i in range(3):
            oc.step(10 * i)
            model(x).sum().backward()
            opt.step()
    recs = read_trace(cap.path)
    assert [(r["step"], r["source"]) for r in recs if r["kind"] == "step"] == [(0, "marker"), (10, "marker"),
                                                                             (20, "marker")]
    assert json.loads((cap.path / "meta.json").read_text())["step_source"] == "marker"


def _train(env: dict[str, str] | None) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    if env is None:
        return calls.mlp_train(model, x, y, 3), None
    with oc.capture(env=env, buffer=4) as cap:
        losses = calls.mlp_train(model, x, y, 3)
    return losses, cap


def _boom(*_a: Any, **_k: Any) -> Any:
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("stage", ["recording", "digest", "statistics", "writing", "dead tensor"])
def test_a_failure_in_each_capture_stage_leaves_the_program_unchanged(
        stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    expected, _ = _train(None)
    if stage == "recording":
        monkeypatch.setattr(records, "arg_entry", _boom)
    elif stage == "digest":
        monkeypatch.setattr(session, "finish", _boom)
    elif stage == "statistics":
        monkeypatch.setattr(session, "_moments_json", _boom)
    elif stage == "writing":
        monkeypatch.setattr(records, "encode", _boom)
    else:  # the weak-reference callback that drops a dead tensor's cache entry (§3.12)
        monkeypatch.setattr(session.Session, "_drop_dead", _boom)
    losses, cap = _train({"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)})
    monkeypatch.undo()
    assert [v.view(torch.int32).item() for v in losses] == [v.view(torch.int32).item() for v in expected]
    err = capfd.readouterr().err
    assert "Exception ignored" not in err
    if stage == "dead tensor":  # said once; the records are complete
        assert err.count("capture's own recording failed (recording: RuntimeError: injected failure)") == 1
        assert ops(read_trace(cap.path)) and not [r for r in ops(read_trace(cap.path)) if "capture_error" in r]
        return
    if stage == "writing":  # the records are lost: said once on stderr, counted in meta
        assert err.count("capture's own writing failed (writing: RuntimeError: injected failure)") == 1
        assert "writing the end of the trace failed" in err
        return
    op = ops(read_trace(cap.path))
    assert op
    if stage == "recording":
        bad = [r for r in op if "capture_error" in r]
        assert bad and bad[0]["capture_error"] == "recording: RuntimeError: injected failure"
        assert err.count("capture's own recording failed") == 1
        meta = json.loads((cap.path / "meta.json").read_text())
        assert any("recording failed" in n for n in meta["notes"])
    else:
        entries = [e for r in op for e in r["outputs"]]
        assert entries and all(e["reason"].startswith("summary failed: RuntimeError: injected failure")
                               for e in entries if e.get("digest") is None and "reason" in e)
        assert any(e.get("reason", "").startswith("summary failed") for e in entries)
        assert err.count("summarising a float32 tensor on cpu failed") == 1


# ---- argument records: the canonical forms of schema v2 -------------------------------------------
def test_argument_entries_canonical_forms() -> None:
    import enum
    import hashlib

    class Color(enum.Enum):
        RED = 1

    e = records.arg_entry
    assert e("approximate", "tanh") == {"slot": "approximate", "type": "str", "value": "tanh"}
    assert e("arg1", 6e-4) == {"slot": "arg1", "type": "float", "value": 6e-4}
    assert e("arg1", float("nan"))["value"] == "nan" and e("arg1", float("-inf"))["value"] == "-inf"
    assert e("x", True) == {"slot": "x", "type": "bool", "value": True}
    assert e("x", None) == {"slot": "x", "type": "none", "value": None}
    assert e("x", 3) == {"slot": "x", "type": "int", "value": 3}
    assert e("x", 1 + 2j) == {"slot": "x", "type": "complex", "value": [1.0, 2.0]}
    assert e("dtype", torch.bfloat16) == {"slot": "dtype", "type": "dtype", "value": "bfloat16"}
    assert e("device", torch.device("cpu")) == {"slot": "device", "type": "device", "value": "cpu"}
    assert e("layout", torch.strided)["value"] == "strided"
    assert e("memory_format", torch.channels_last)["value"] == "channels_last"
    assert e("size", torch.Size([2, 3])) == {"slot": "size", "type": "shape", "value": [2, 3]}
    assert e("c", Color.RED) == {"slot": "c", "type": "enum", "value": "Color.RED"}
    assert e("i", slice(1, None, 2)) == {"slot": "i", "type": "slice", "value": [1, None, 2]}
    assert e("i", ...) == {"slot": "i", "type": "ellipsis", "value": None}
    # an index tuple with a slice or ...: Python's own index text, so None, ... and : stay distinct
    assert e("i", (slice(0, 2), ..., None)) == {"slot": "i", "type": "index", "value": "0:2, ..., None"}
    assert e("i", (..., None, 2)) != e("i", (None, None, 2))
    assert e("i", (slice(None), slice(1, 5, 2), -1, True))["value"] == ":, 1:5:2, -1, True"
    assert e("i", (slice(None, None, -1), [0, 2], "a"))["value"] == "::-1, [0, 2], 'a'"
    assert e("i", (None, 2)) == {"slot": "i", "type": "list", "value": [None, 2]}     # unambiguous: a list
    assert e("o", object()) == {"slot": "o", "type": "object", "value": "builtins.object"}
    # NumPy arrays, ranges and small CPU tensors nested in a list (an index, tensor betas) by value:
    # they were their type's name, so an edited one read as "arguments equal" (hand tests)
    import numpy as np
    assert e("i", np.array([0, 2])) == {"slot": "i", "type": "ndarray",
                                        "value": {"dtype": "int64", "shape": [2], "values": [0, 2]}}
    assert e("i", np.array([0, 2])) != e("i", np.array([0, 3])) != e("i", np.array([0.0, 3.0]))
    big = np.arange(1000, dtype=np.float32)
    assert e("i", big)["type"] == "ndarray"          # by a digest of its bytes, not 1000 values
    big2 = big.copy()
    big2[999] = 0
    assert e("i", big) != e("i", big2) and e("i", big) == e("i", big.copy())
    assert e("i", range(2)) == {"slot": "i", "type": "range", "value": [0, 2, 1]}
    assert e("i", (slice(None), np.array([0, 2])))["value"] == ":, array([0, 2], dtype=int64)"
    betas = e("group0.betas", [torch.tensor(0.9), torch.tensor(0.99)])
    assert betas == {"slot": "group0.betas", "type": "list", "value": [0.8999999761581421, 0.9900000095367432]}
    assert e("x", [torch.ones(100)])["value"] == ["torch.Tensor"]     # a large one: by type, as before
    # a function argument by its qualified name (distance_function=): it was "builtins.function" for any
    def cos_dist(a: Any, b: Any) -> Any:
        return a
    assert e("f", cos_dist) == {"slot": "f", "type": "function",
                                "value": f"{__name__}.test_argument_entries_canonical_forms.<locals>.cos_dist"}
    assert e("f", torch.relu)["value"] == "torch.relu" and e("c", torch.nn.Linear)["value"] == \
        "torch.nn.modules.linear.Linear"
    assert e("f", len)["value"] == "builtins.len" and e("f", [].append)["value"] == "?.list.append"
    long = list(range(40))
    text = json.dumps(long, separators=(",", ":"))
    assert len(text) > 64
    assert e("arg1", long) == {"slot": "arg1", "type": "list", "len": len(text),
                               "digest": hashlib.sha256(text.encode()).hexdigest()[:16]}
    s = "x" * 65
    assert e("s", s)["digest"] == hashlib.sha256(json.dumps(s).encode()).hexdigest()[:16]


def test_records_made_with_grad_mode_off_say_so(tmp_path: Path) -> None:
    """An evaluation pass under no_grad / inference_mode runs the training forward's call sites:
    ``"grad": false`` lets compare tell them apart (docs/capture.md §3.1); absent while grad is on."""
    x = torch.randn(3, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        torch.relu(x)
        with torch.no_grad():
            torch.tanh(x)
        with torch.inference_mode():
            torch.sigmoid(x)
        torch.exp(x)
    grad = {r["fn"]: r.get("grad", "absent") for r in ops(read_trace(cap.path))}
    assert grad == {"torch.relu": "absent", "torch.tanh": False, "torch.sigmoid": False, "torch.exp": "absent"}


def test_argument_records_of_real_calls(tmp_path: Path) -> None:
    x = torch.randn(4, 6)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        x[1:3, ...]
        torch.cat([x, x], dim=1)
        x.to(torch.float64)
        torch.nn.functional.gelu(x, approximate="none")
    op = {r["fn"]: r for r in ops(read_trace(cap.path))}
    assert op["Tensor.__getitem__"]["args"] == [{"slot": "arg1", "type": "index", "value": "1:3, ..."}]
    cat = op["torch.cat"]
    assert [i["slot"] for i in cat["inputs"]] == ["arg0.0", "arg0.1"]
    assert cat["args"] == [{"slot": "dim", "type": "int", "value": 1}]
    assert op["Tensor.to"]["args"] == [{"slot": "arg1", "type": "dtype", "value": "float64"}]
    assert op["torch.nn.functional.gelu"]["args"] == [{"slot": "approximate", "type": "str", "value": "none"}]
