"""Capture of real PyTorch programs in this process: every field, digests, nesting, numerics,
dumps, the size cap, refusals."""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import opguard.capture as oc  # noqa: E402
from opguard.capture import records  # noqa: E402
from opguard.errors import ConfigError  # noqa: E402
from tests.capture.helpers import ops, read_trace  # noqa: E402
from tests.capture.progs import calls, models  # noqa: E402
from tests.capture.progs.models import MLP  # noqa: E402

pytestmark = [pytest.mark.torch]
CALLS = calls.__file__
MODELS = models.__file__


@pytest.fixture
def out_env(tmp_path: Path) -> dict[str, str]:
    return {"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "out")}


def data() -> tuple[MLP, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def src_sha(line: int, file: str = CALLS) -> str:
    text = Path(file).read_text().splitlines()[line - 1].strip()
    return hashlib.sha256(text.encode()).hexdigest()


def test_mlp_forward_backward_every_field(out_env: dict[str, str], tmp_path: Path) -> None:
    model, x, y = data()
    oc.name_modules(model, "model")
    with oc.capture(env=out_env, buffer=8) as cap, oc.context("train"):
        losses = calls.mlp_train(model, x, y, 3, step_fn=oc.step)
    recs = read_trace(cap.path)
    assert recs[-1]["kind"] == "end" and recs[-1]["records"] == len(recs) - 1
    op = ops(recs)
    assert [r["seq"] for r in op] == list(range(len(op)))                   # contiguous, in order
    for r in op:
        assert set(r) >= {"v", "seq", "step", "rank", "api", "fn", "file", "line", "func", "src", "site",
                          "module", "context", "depth", "parent", "phase", "inputs", "outputs"}
        assert r["v"] == 2 and r["rank"] == 0 and r["context"] == "train"
        for e in r["inputs"] + r["outputs"]:
            assert set(e) >= {"slot", "dtype", "shape", "device", "digest"} and e["device"] == "cpu"
            assert e["digest"] is not None and len(e["digest"]) == 16
        for e in r["outputs"]:
            assert set(e["stats"]) == {"min", "max", "mean", "std", "absmax", "nan", "inf"}
    # the forward linear layers: module path, call site = the user's line, src = its stripped line digest
    # (inside nn.Linear.forward, torch's code: the first user frame is MLP.forward)
    fwd_line = calls.marker_line("mlp_forward", MODELS)
    lin = [r for r in op if r["fn"] == "torch.nn.functional.linear"]
    assert [r["module"] for r in lin] == ["model.fc1", "model.fc2"] * 3
    assert [r["step"] for r in lin] == [0, 0, 1, 1, 2, 2]
    for r in lin:
        assert (r["file"], r["line"], r["func"]) == (MODELS, fwd_line, "forward")
        assert r["src"] == src_sha(fwd_line, MODELS) and r["phase"] == "forward"
        assert [e["slot"] for e in r["inputs"]] == ["arg0", "arg1", "arg2"]
        assert r["inputs"][0]["shape"] == [8, 16] or r["inputs"][0]["shape"] == [8, 32]
    # digests: the first linear's input is x; the second linear's input is the GELU output
    assert lin[0]["inputs"][0]["digest"] == lin[2]["inputs"][0]["digest"]          # same x every step
    gelu = [r for r in op if r["fn"] == "torch.nn.functional.gelu"]
    assert gelu[0]["module"] == "model.act"
    assert gelu[0]["inputs"][0]["digest"] == lin[0]["outputs"][0]["digest"]
    assert lin[1]["inputs"][0]["digest"] == gelu[0]["outputs"][0]["digest"]
    assert lin[0]["inputs"][1]["digest"] != lin[2]["inputs"][1]["digest"]          # weight updated by SGD
    # statistics of the loss equal the loss
    loss_recs = [r for r in op if r["fn"] == "torch.nn.functional.mse_loss" and r["depth"] == 0]
    assert [r["line"] for r in loss_recs] == [calls.marker_line("loss")] * 3
    for r, loss in zip(loss_recs, losses, strict=True):
        st = r["outputs"][0]["stats"]
        assert st["min"] == st["max"] == st["mean"] == loss.item() and st["std"] == 0.0
    # backward() is recorded at its line with self = the loss, and the gradients are read by the optimizer
    bwd = [r for r in op if r["fn"] == "Tensor.backward" and r["depth"] == 0]
    assert len(bwd) == 3 and bwd[0]["line"] == calls.marker_line("backward")
    assert bwd[0]["inputs"][0]["slot"] == "self"
    assert bwd[0]["inputs"][0]["digest"] == loss_recs[0]["outputs"][0]["digest"]
    assert not any(r["fn"] == "Tensor.grad" for r in op)   # a property read: noise, not recorded by default
    # tables written beside the trace
    sites = json.loads((cap.path / "callsites.json").read_text())["sites"]
    for r in op:
        s = sites[r["site"]]
        assert (s["file"], s["line"], s["func"], s["src"]) == (r["file"], r["line"], r["func"], r["src"])
    files = json.loads((cap.path / "sources.json").read_text())["files"]
    entry = next(f for f in files if f["path"] == CALLS)
    assert entry["sha256"] == hashlib.sha256(Path(CALLS).read_bytes()).hexdigest()
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["version"] == 2 and meta["step_source"] == "marker"
    assert meta["digest"]["mode"] == "full" and meta["ended_at"] is not None
    assert meta["records"] == len(recs) - 1 and not meta["cap_reached"]


def test_self_nested_inplace(out_env: dict[str, str]) -> None:
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    with oc.capture(env=out_env) as cap:
        e = calls.nested_and_self(a, b)
    op = ops(read_trace(cap.path))
    by_line: dict[int, list[dict]] = {}  # type: ignore[type-arg]
    for r in op:
        by_line.setdefault(r["line"], []).append(r)
    add = by_line[calls.marker_line("method")][0]
    assert add["fn"] == "Tensor.add" and [i["slot"] for i in add["inputs"]] == ["self", "arg1"]
    ref = oc_digest(a)
    assert add["inputs"][0]["digest"] == ref and add["inputs"][1]["digest"] == oc_digest(b)
    # torch.add(torch.mul(a, 2.0), c): both calls of the expression are recorded, inner first
    expr = by_line[calls.marker_line("nested_expr")]
    assert [r["fn"] for r in expr] == ["torch.mul", "torch.add"]
    assert expr[1]["inputs"][0]["digest"] == expr[0]["outputs"][0]["digest"]
    # F.layer_norm is Python calling torch.layer_norm: the inner call is recorded as a child
    ln = by_line[calls.marker_line("layer_norm")]
    outer = next(r for r in ln if r["fn"] == "torch.nn.functional.layer_norm")
    inner = next(r for r in ln if r["fn"] == "torch.layer_norm")
    assert outer["depth"] == 0 and inner["depth"] == 1 and inner["parent"] == outer["seq"]
    assert inner["seq"] > outer["seq"] and inner["outputs"][0]["digest"] == outer["outputs"][0]["digest"]
    # in-place: self is read before the call, the output is self after it
    ip = by_line[calls.marker_line("inplace")][0]
    assert ip["fn"] == "Tensor.mul_"
    assert ip["inputs"][0]["digest"] == outer["outputs"][0]["digest"]
    assert ip["outputs"][0]["digest"] == oc_digest(e) != ip["inputs"][0]["digest"]


def oc_digest(t: torch.Tensor) -> str:
    from opguard.capture.digest import Digester, finish

    d = Digester("full")
    assert d.compute is not None
    return finish(int(d.compute(t)), t.numel())


def test_losses_bitwise_identical_with_and_without_capture(out_env: dict[str, str]) -> None:
    model, x, y = data()
    rng = torch.get_rng_state()
    plain = calls.mlp_train(model, x, y, 4)
    rng_after_plain = torch.get_rng_state()
    model, x, y = data()
    torch.set_rng_state(rng)
    with oc.capture(env=out_env, level="dispatch", dump_steps="0-1"):
        captured = calls.mlp_train(model, x, y, 4, step_fn=oc.step)
    assert torch.equal(torch.get_rng_state(), rng_after_plain)
    for p, c in zip(plain, captured, strict=True):
        assert p.view(torch.int32).item() == c.view(torch.int32).item()


def test_dispatch_level_ties_backward_to_forward_sites(out_env: dict[str, str]) -> None:
    model, x, y = data()
    oc.name_modules(model, "model")
    with oc.capture(env=out_env, level="dispatch") as cap:
        calls.mlp_train(model, x, y, 1)
    op = ops(read_trace(cap.path))
    fwd_lin = [r for r in op if r["fn"] == "torch.nn.functional.linear"]
    addmm = [r for r in op if r["fn"] == "aten::addmm.default"]
    assert addmm and all(r["api"] == "aten" and r["parent"] in {f["seq"] for f in fwd_lin} for r in addmm)
    back = [r for r in op if r["phase"] == "backward"]
    assert back, "no backward aten ops recorded"
    tied = [r for r in back if r.get("fwd")]
    mm = [r for r in tied if r["fn"] == "aten::mm.default"]
    assert mm and all(r["fwd"]["fn"] == "torch.nn.functional.linear" for r in mm)
    assert {r["module"] for r in mm} == {"model.fc1", "model.fc2"} or {r["module"] for r in mm} == {"model.fc2"}
    assert all(r["line"] == calls.marker_line("mlp_forward", MODELS) and r["fwd"]["seq"] in {f["seq"] for f in fwd_lin}
               for r in mm)
    bwd_call = next(r for r in op if r["fn"] == "Tensor.backward")
    assert all(r["seq"] > bwd_call["seq"] for r in back)
    gelu_back = [r for r in tied if r["fn"] == "aten::gelu_backward.default"]
    assert gelu_back and gelu_back[0]["module"] == "model.act"
    # capture's own reads of the tensors it summarises (t.is_neg(), t.is_conj()) are not the
    # program's: they were 68 % of a dispatch-level trace of a GRU, as Tensor.is_neg records under
    # torch.autograd.backward (the function mode is on the stack inside the dispatch handler)
    assert not [r for r in op if r["fn"].startswith("Tensor.is_")]


def test_a_tensor_bound_of_a_slice_is_an_input(out_env: dict[str, str]) -> None:
    """``x[:k]`` with a 0-d tensor ``k`` (an MoE's capacity cut) recorded only ``self``: the bound was
    the type name in ``args``, so a run whose ``k`` differed showed an 'introduced' divergence there."""
    x = torch.arange(10.0)
    k = torch.tensor(4)
    with oc.capture(env=out_env) as cap:
        x[:k]
        x[(slice(1, k), Ellipsis)]
        x[k]
    gets = [r for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.__getitem__"]
    assert [[e["slot"] for e in r["inputs"]] for r in gets] == [["self", "arg1.stop"], ["self", "arg1.0.stop"],
                                                                 ["self", "arg1"]]
    assert len({r["inputs"][1]["digest"] for r in gets}) == 1  # k's digest, every time
    assert gets[0]["args"] == [{"slot": "arg1", "type": "slice", "value": [None, "torch.Tensor", None]}]


@pytest.mark.parametrize("level", ["function", "dispatch"])
def test_calls_that_draw_random_numbers_are_marked_seeded(out_env: dict[str, str], level: str) -> None:
    """From the ATen tag nondeterministic_seeded: compare's 'why' for equal inputs and other outputs."""
    with oc.capture(env=out_env, level=level) as cap:
        x = torch.randn(4, 4)
        torch.nn.functional.dropout(x, 0.5, training=True)
        x.normal_()
        torch.add(x, 1)
        # a Python function drawing in a nested call compare may leave out (a seed change read as
        # "outputs differ, inputs and arguments equal" at the first kaiming_uniform_, hand test)
        torch.nn.init.kaiming_uniform_(x)
        torch.nn.init.constant_(x, 0.5)
    recs = ops(read_trace(cap.path))
    marked = {r["fn"] for r in recs if r.get("seeded") is True}
    assert {"torch.randn", "torch.nn.functional.dropout", "Tensor.normal_", "torch.nn.init.kaiming_uniform_"} <= marked
    assert "torch.add" not in marked and "torch.nn.init.constant_" not in marked
    assert all(r.get("seeded") in (None, True) for r in recs)
    if level == "dispatch":
        assert any(f.startswith("aten::normal_") for f in marked), marked


@pytest.mark.parametrize("case", ["bool_mask", "float_mask", "float_mask_positional", "switched_off", "grad"])
def test_an_attention_that_may_take_the_fast_path_keeps_it_as_one_record(out_env: dict[str, str], case: str) -> None:
    """PyTorch runs an eval-mode MultiheadAttention on its fused fast path only without a torch
    function mode: under capture it ran its standard path (other kernels, other last bits), said in a
    notice. Capture now takes its mode off for such a module's forward, which runs exactly as without
    capture, recorded as one ``api: "module"`` record. Where PyTorch refuses the fast path anyway (a
    floating-point mask, the fast path switched off, autograd needed) the calls are recorded one by
    one as before."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    bool_mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    float_mask = torch.nn.Transformer.generate_square_subsequent_mask(5)

    def run() -> torch.Tensor:
        with torch.set_grad_enabled(case == "grad"):
            if case == "float_mask_positional":
                return mha(x, x, x, None, False, float_mask)[0]
            return mha(x, x, x, attn_mask=float_mask if case.startswith("float") else bool_mask,
                       need_weights=False)[0]

    prev = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(case != "switched_off")
        plain = run()
        with oc.capture(env=out_env) as cap:
            got = run()
    finally:
        torch.backends.mha.set_fastpath_enabled(prev)
    assert torch.equal(plain.view(torch.int32), got.view(torch.int32))
    recs = ops(read_trace(cap.path))
    fused = [r for r in recs if r["api"] == "module"]
    if case == "bool_mask":
        assert [r["fn"] for r in recs] == ["torch.nn.MultiheadAttention"]
        r = fused[0]
        assert r["module"] == "MultiheadAttention" and r["file"] == __file__
        assert [i["slot"] for i in r["inputs"]][:4] == ["arg0", "arg1", "arg2", "attn_mask"]
        assert {"in_proj_weight", "out_proj.weight"} <= {i["slot"] for i in r["inputs"]}
        assert {"slot": "need_weights", "type": "bool", "value": False} in r["args"]
        assert {"slot": "config.MultiheadAttention.num_heads", "type": "int", "value": 2} in r["args"]
        assert [o["slot"] for o in r["outputs"]] == ["out.0"]
    else:
        assert not fused and "torch.nn.functional.multi_head_attention_forward" in {r["fn"] for r in recs}
    assert json.loads((cap.path / "meta.json").read_text())["fast_path_off"] == []


def test_an_eval_encoder_with_a_padding_mask_computes_as_without_capture(out_env: dict[str, str]) -> None:
    """An eval-mode TransformerEncoder given a ``src_key_padding_mask`` converts the batch to a nested
    tensor on its fast path: the output's padded positions are zeros. Under capture's mode it ran
    its standard path, where they hold computed values — not a last-bit difference (a program
    pooling over every position got another result), though the notice said so (hand test)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with torch.no_grad():
        plain = enc(x, src_key_padding_mask=pad)
        with oc.capture(env=out_env) as cap:
            got = enc(x, src_key_padding_mask=pad)
    assert torch.equal(plain.view(torch.int32), got.view(torch.int32))
    assert float(got[1, 3:].abs().sum()) == 0.0  # the fast path's padded positions
    recs = ops(read_trace(cap.path))
    assert [r["fn"] for r in recs] == ["torch.nn.TransformerEncoder"], [r["fn"] for r in recs]
    assert "src_key_padding_mask" in {i["slot"] for i in recs[0]["inputs"]}


def test_mode_switches_are_not_recorded(out_env: dict[str, str]) -> None:
    """torch.compile's runtime wrapper switches view replay on and off around every compiled call:
    two tensor-less records per compiled forward."""
    with oc.capture(env=out_env) as cap:
        prev = torch._C._is_view_replay_enabled()
        torch._C._set_view_replay_enabled(True)
        torch._C._set_view_replay_enabled(prev)
        torch.ones(2).sum()
    assert [r["fn"] for r in ops(read_trace(cap.path))] == ["torch.ones", "Tensor.sum"]


def _eager_compiled(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    y = lin(x).sin()  # the line of linear and sin
    return y.cos() + 0.25  # the line of cos and add


def test_calls_of_an_eager_compiled_graph_have_their_own_lines(out_env: dict[str, str]) -> None:
    """``torch.compile(backend="eager")`` runs Dynamo's graph as PyTorch calls, which capture records;
    they all read as the compiled function's ``def`` line, where Dynamo's frame stands, so an edit
    inside it was named at that line (hand test). Each call now has the line Dynamo recorded for
    its graph node, through an inlined module too."""
    import inspect

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    f = torch.compile(_eager_compiled, backend="eager")
    x = torch.randn(2, 4)
    with oc.capture(env=out_env) as cap:
        f(x, lin)
    first = inspect.getsourcelines(_eager_compiled)[1]
    got = [(r["fn"], r["line"]) for r in ops(read_trace(cap.path)) if r["file"] == __file__]
    assert got == [("torch.nn.functional.linear", first + 1), ("Tensor.sin", first + 1),
                   ("Tensor.cos", first + 2), ("Tensor.add", first + 2)], got


def test_torch_export_tracing_is_not_recorded_and_symbolic_shapes_are_written(
        out_env: dict[str, str], capfd: pytest.CaptureFixture[str]) -> None:
    """``torch.export.export(..., dynamic_shapes=...)`` traces the model on FakeTensors with symbolic
    sizes: its calls were recorded, and the records whose shapes held a ``SymInt`` could not be
    written (dropped, 'capture's own writing failed' on stderr; compare then read a crash) (hand
    test). While torch.export traces (``torch.compiler``'s compiling flag) capture records nothing;
    a symbolic size reaching a record anyway (export's fake inputs) is written as its text."""
    class Flat(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.flatten(1).sum(1)

    x = torch.randn(4, 3, 2)
    with oc.capture(env=out_env) as cap:
        ep = torch.export.export(Flat(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("b")}})
        got = ep.module()(torch.randn(6, 3, 2))
    assert got.shape == (6,)
    assert "failed" not in capfd.readouterr().err
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["dropped"] == 0 and not any("failed" in n for n in meta["notes"]), meta
    fns = [r["fn"] for r in ops(read_trace(cap.path))]
    assert "Tensor.flatten" not in fns and "Tensor.sum" not in fns, fns  # the traced model: not recorded


def test_efficient_zero_tensors_are_named_not_failures(out_env: dict[str, str],
                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """Forward-mode AD gives parameters without a tangent an efficient zero tensor (no memory): at
    ``level=dispatch`` summarising one said 'summarising a float32 tensor on cpu failed (... null
    data pointer)' (hand test). Its entries say what it is instead, and meta notes it once."""
    import torch.autograd.forward_ad as fwAD

    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with oc.capture(env=out_env, level="dispatch") as cap, fwAD.dual_level():
        y = lin(fwAD.make_dual(x, torch.ones_like(x)))
        fwAD.unpack_dual(y).tangent.sum()
    assert "failed" not in capfd.readouterr().err
    reasons = [e.get("reason") for r in ops(read_trace(cap.path)) for e in r["inputs"] + r["outputs"]]
    assert "efficient zero tensor: no memory (every element is zero)" in reasons
    assert not any(r and r.startswith("summary failed") for r in reasons)
    meta = json.loads((cap.path / "meta.json").read_text())
    assert any("efficient zero tensors" in n for n in meta["notes"])


@torch.library.custom_op("opguard_test::scale", mutates_args=())
def _scale_op(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.tanh(x) * k  # the implementation: the operator's kernel, not recorded


@_scale_op.register_fake
def _(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("opguard_test::ema_into", mutates_args=("out",))
def _ema_into(out: torch.Tensor, x: torch.Tensor, decay: float) -> None:
    out.mul_(decay).add_(x, alpha=1 - decay)


def test_the_program_s_custom_operators_are_recorded(tmp_path: Path) -> None:
    """An operator the program defines with ``torch.library.custom_op`` is a ``torch.ops`` call, which
    the function level does not record: its call left no record (nor did its implementation's calls),
    and an edit of its argument was named downstream or not at all (hand test). It is recorded as a
    builtin: named ``torch.ops.<namespace>.<name>``, its arguments by position with their schema
    names, what it mutates as outputs; PyTorch's own operators made the same way stay unrecorded."""
    from tests.compare.helpers import run_compare

    def run(base: Path, k: float) -> Any:
        torch.manual_seed(0)
        x = torch.randn(4)
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base)}) as cap:
            acc = torch.zeros(4)
            y = _scale_op(x, k)
            _ema_into(acc, y, 0.9)
            acc.sum()
        return cap

    cap = run(tmp_path / "a", 2.0)
    run(tmp_path / "b", 3.0)
    recs = ops(read_trace(cap.path))
    by_fn = {r["fn"]: r for r in recs}
    assert "torch.tanh" not in by_fn  # the kernel's calls
    scale = by_fn["torch.ops.opguard_test.scale"]
    assert scale["file"] == __file__ and scale["args"] == [{"slot": "arg1", "type": "float", "value": 2.0}]
    ema = by_fn["torch.ops.opguard_test.ema_into"]
    assert [e["slot"] for e in ema["outputs"]] == ["arg0"]  # mutates_args: what it wrote
    assert ema["outputs"][0]["digest"] == by_fn["Tensor.sum"]["inputs"][0]["digest"]
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["arg_names"]["torch.ops.opguard_test.scale"] == ["x", "k"]
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    first = next(line for line in p.stderr.splitlines() if "first divergence" in line)
    assert "torch.ops.opguard_test.scale" in first and "k (arg1): 2.0 -> 3.0" in first, p.stderr


def test_dispatch_level_unwritten_memory_of_a_growing_resize_and_ctc_s_lattice(out_env: dict[str, str]) -> None:
    """At ``level=dispatch`` two identical runs compared with false introduced divergences (hand
    tests): ``aten::resize_`` growing a buffer (its new elements are whatever the allocator left;
    the function level marked it, the aten level did not) and ``aten::_ctc_loss``'s second output,
    ``log_alpha``, which the CPU kernel writes only in part. Both are uninitialised memory now."""
    torch.manual_seed(0)
    log_probs = torch.randn(6, 2, 5).log_softmax(2)
    targets = torch.tensor([[1, 2], [3, 1]])
    with oc.capture(env=out_env, level="dispatch") as cap:
        buf = torch.zeros(2)
        buf.resize_(64)
        torch.nn.functional.ctc_loss(log_probs, targets, torch.tensor([6, 5]), torch.tensor([2, 2]))
    aten = [r for r in ops(read_trace(cap.path)) if r["api"] == "aten"]
    resize = next(r for r in aten if r["fn"] == "aten::resize_.default")
    assert all(e.get("uninitialized") for e in resize["outputs"]), resize["outputs"]
    ctc = next(r for r in aten if r["fn"].startswith("aten::_ctc_loss"))
    assert [bool(e.get("uninitialized")) for e in ctc["outputs"]] == [False, True], ctc["outputs"]
    assert ctc["outputs"][0]["digest"] is not None


def test_dispatch_level_a_write_to_a_column_leaves_the_rest_uninitialized(out_env: dict[str, str]) -> None:
    """At ``level=dispatch`` identical runs of ``F.affine_grid`` + ``grid_sample`` compared with 8
    false mismatches (hand test): the CPU backward of ``affine_grid`` builds its base grid as
    ``aten::empty`` filled column by column (``select`` + ``copy_``); the ``copy_`` into the first
    column, at the buffer's own address, cleared the whole buffer's mark, and the next ``select``
    digested the unwritten columns. A whole write of a view now leaves the rest of the buffer marked
    (as at the function level); the aten level sees the write before autograd moves the version
    counter, which the mark allows for (docs/capture.md §3.7)."""
    torch.manual_seed(0)
    theta = torch.randn(2, 2, 3, requires_grad=True)
    with oc.capture(env=out_env, level="dispatch") as cap:
        torch.nn.functional.affine_grid(theta, [2, 1, 4, 5], align_corners=False).sum().backward()
    aten = [r for r in ops(read_trace(cap.path)) if r["api"] == "aten" and r.get("phase") == "backward"]
    empty = next(i for i, r in enumerate(aten) if r["fn"] == "aten::empty.memory_format")
    after = aten[empty + 1:]
    copies = [r for r in after if r["fn"] == "aten::copy_.default"]
    assert copies and all(c["inputs"][0].get("uninitialized") for c in copies), copies
    assert all(c["outputs"][0]["digest"] for c in copies)  # what each copy wrote is a result
    first_copy = after.index(copies[0])
    selects = [r for r in after[first_copy + 1:] if r["fn"] == "aten::select.int"]
    assert selects, [r["fn"] for r in after]
    # the buffer after writes to some of its columns: never digested while some are unwritten
    assert selects[0]["inputs"][0].get("uninitialized") is True, selects[0]["inputs"]
    assert selects[0]["inputs"][0]["digest"] is None


def test_a_copy_from_unwritten_memory_writes_nothing_known(out_env: dict[str, str]) -> None:
    """``F.pad(mode="circular")`` fills an ``empty`` buffer, then copies its edge columns and rows
    from other parts of the same buffer, some not written yet: at ``level=dispatch`` those
    ``copy_`` outputs were digested and identical runs compared with 2 mismatches per pad (hand
    test, 8 with a circular-padded Conv2d). A whole write from uninitialised memory is a partial one:
    its output stays uninitialised and the mark stays, at either level (docs/capture.md §3.7)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    with oc.capture(env=out_env, level="dispatch") as cap:
        y = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="circular")
        buf = torch.empty(4, 3)
        buf[0].copy_(x[0, 0, 0, :3])
        buf[1].copy_(buf[2])  # from a row nothing wrote
        buf[2].copy_(x[0, 0, 1, :3])
    op = ops(read_trace(cap.path))
    copies = [r for r in op if r["fn"] == "aten::copy_.default" and r["parent"] is not None
              and op[r["parent"]]["fn"] == "torch.nn.functional.pad"]
    assert len(copies) == 5, [r["fn"] for r in op]
    assert copies[0]["outputs"][0]["digest"] == oc_digest(x)  # the centre, from x
    assert all(c["outputs"][0].get("uninitialized") is True for c in copies[1:]), [c["outputs"] for c in copies]
    pad = next(r for r in op if r["fn"] == "torch.nn.functional.pad" and r.get("parent") is None)
    assert pad["outputs"][0]["digest"] == oc_digest(y)  # the function's result is a result
    fn = [r for r in op if r["fn"] == "Tensor.copy_"]
    assert [bool(r["outputs"][0].get("uninitialized")) for r in fn] == [False, True, False], [r["outputs"] for r in fn]


@pytest.mark.parametrize("fast", ["1", "0"])
def test_an_out_argument_s_content_is_not_an_input(tmp_path: Path, fast: str) -> None:
    """Compiled code (inductor) calls ``extern_kernels.addmm(..., out=buf)`` with a buffer it
    allocated uninitialised where capture does not see it: the ``out`` input was digested, and
    identical runs compared with mismatches there ('inputs differ (inherited): inputs.out.digest',
    hand test). An ``out=`` tensor's content before the call is not read: its input entry has no
    digest and is never compared; its output entry is the result."""
    from tests.compare.helpers import run_compare

    def run(base: Path, garbage: float) -> Any:
        torch.manual_seed(0)
        x, w = torch.randn(3, 4), torch.randn(4, 2)
        buf = torch.full((3, 2), garbage)  # before capture: what the allocator left, as capture sees it
        env = {"OPGUARD_TRACE_OUTPUT_BASE": str(base), "OPGUARD_CAPTURE_FAST_CALL": fast}
        with oc.capture(env=env) as cap:
            for _ in range(2):  # the second call: the C handler's, when it takes planned functions
                torch.mm(x, w, out=buf)
            buf.sum()
        return cap

    cap = run(tmp_path / "a", 1.0)
    run(tmp_path / "b", 7.0)
    mm = [r for r in ops(read_trace(cap.path)) if r["fn"] == "torch.mm"]
    for r in mm:
        out_in = next(e for e in r["inputs"] if e["slot"] == "out")
        assert out_in["digest"] is None and out_in["uninitialized"] is True
        assert out_in["reason"].startswith("out= argument")
        assert r["outputs"][0]["digest"] is not None and not r["outputs"][0].get("uninitialized")
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0 and "no divergence: every pair's compared fields agree" in p.stderr, p.stderr


class _Interrupted(torch.nn.Module):
    def __init__(self, exc: type[BaseException]) -> None:
        super().__init__()
        self.exc = exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.relu(x)
        raise self.exc  # what a Ctrl-C arriving in a forward looks like


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_forward_left_by_keyboard_interrupt_leaves_the_module_path(out_env: dict[str, str],
                                                                      exc: type[BaseException]) -> None:
    """PyTorch runs a module's forward post-hooks when its forward raises an ``Exception``, not a
    ``KeyboardInterrupt`` or ``SystemExit``: a program catching a Ctrl-C and going on had every
    later record under the interrupted module's path (hand test: 16 of 30 records of a training
    step under ``Sequential.0``). The next module call finds the interrupted forward gone."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _Interrupted(exc))
    other = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)
    with oc.capture(env=out_env) as cap:
        with contextlib.suppress(exc):
            net(x)
        other(x).sum()
        net[0](x)
    recs = [(r["fn"], r["module"]) for r in ops(read_trace(cap.path))]
    assert recs[-3:] == [("torch.nn.functional.linear", "Linear"), ("Tensor.sum", None),
                         ("torch.nn.functional.linear", "Sequential.0")], recs


def test_future_callbacks_are_never_recorded(out_env: dict[str, str]) -> None:
    """A ``Future.then`` callback runs on the attaching thread when the future is already complete,
    else on the backend's thread: its calls were recorded in the first case only, a race, and
    identical runs differed by such records (hand test: DDP's ``fp16_compress_hook``, 2 ranks).
    They are never recorded; what the callback wrote is read anew at its next recorded use."""
    t = torch.ones(3)
    then = torch._C.Future.then
    with oc.capture(env=out_env) as cap:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(t)
        got = done.then(lambda f: f.value().div_(2)).wait()  # already complete: runs here, now
        seen = []
        done.add_done_callback(lambda f: seen.append(f.value().mul(3)))
        t.sum()
    assert torch.equal(got, torch.full((3,), 0.5)) and torch.equal(seen[0], torch.full((3,), 1.5))
    fns = [r["fn"] for r in ops(read_trace(cap.path))]
    assert "Tensor.div_" not in fns and "Tensor.mul" not in fns, fns
    total = next(r for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.sum")
    assert total["inputs"][0]["digest"] == oc_digest(torch.full((3,), 0.5))
    assert torch._C.Future.then is then  # put back after the capture


def test_public_names_of_fft_linalg_and_special_functions(out_env: dict[str, str]) -> None:
    """The builtins' own names are ``fft_rfft``, ``linalg_vector_norm``, ``special_erf``: records
    named ``torch.fft.fft_rfft``, and OPGUARD_CAPTURE_FUNCTIONS=torch.fft.rfft matched nothing."""
    x = torch.randn(16)
    with oc.capture(env=out_env, functions="torch.fft.*,torch.linalg.*,torch.special.*") as cap:
        torch.fft.irfft(torch.fft.rfft(x))
        torch.linalg.vector_norm(x)
        torch.special.erf(x)
    assert [r["fn"] for r in ops(read_trace(cap.path))] == [
        "torch.fft.rfft", "torch.fft.irfft", "torch.linalg.vector_norm", "torch.special.erf"]


def test_builtins_without_a_public_name_keep_their_own_module(out_env: dict[str, str]) -> None:
    """``torch._C._nn`` builtins that ``torch.nn.functional`` does not publish (``Module.to``'s
    ``_parse_to``, ``F.hardswish(inplace=True)``'s ``hardswish_``) were named
    ``torch.nn.functional._parse_to``, a function that does not exist (hand test); published ones
    (``F.gelu`` is ``torch._C._nn.gelu``) keep the public name."""
    x = torch.randn(4)
    with oc.capture(env=out_env) as cap:
        torch.nn.Linear(2, 2).to(torch.float64)
        torch.nn.functional.hardswish(x.clone(), inplace=True)
        torch.nn.functional.gelu(x)
    fns = {r["fn"] for r in ops(read_trace(cap.path))}
    assert {"torch._C._nn._parse_to", "torch._C._nn.hardswish_", "torch.nn.functional.gelu"} <= fns, fns
    assert not any(f.startswith("torch.nn.functional.") and not hasattr(torch.nn.functional, f.rpartition(".")[2])
                   for f in fns), fns


def test_functions_made_by_boolean_dispatch_have_their_public_names(out_env: dict[str, str]) -> None:
    """``F.max_pool2d`` (``nn.MaxPool2d``'s call) is made by ``boolean_dispatch``: its qualified name is
    ``boolean_dispatch.<locals>.fn``, and its records were named
    ``torch.nn.functional.boolean_dispatch.<locals>.fn`` (hand test, a conv encoder)."""
    x = torch.randn(1, 1, 4, 4)
    with oc.capture(env=out_env) as cap:
        torch.nn.functional.max_pool2d(x, 2)
        torch.nn.MaxPool1d(2)(x[0])
        torch.nn.functional.adaptive_max_pool2d(x, 1, return_indices=True)
    assert [r["fn"] for r in ops(read_trace(cap.path)) if r["depth"] == 0] == [
        "torch.nn.functional.max_pool2d", "Tensor.__getitem__", "torch.nn.functional.max_pool1d",
        "torch.nn.functional.adaptive_max_pool2d_with_indices"]


def test_dumps_land_in_the_rank_directory_only(out_env: dict[str, str]) -> None:
    model, x, y = data()
    before = set(Path(CALLS).parent.iterdir())
    line = calls.marker_line("loss")
    with oc.capture(env=out_env, dump_sites=f"calls.py:{line}", dump_steps="1", dump_filter="*.gelu") as cap:
        calls.mlp_train(model, x, y, 2, step_fn=oc.step)
    assert set(Path(CALLS).parent.iterdir()) == before
    recs = read_trace(cap.path)
    dumps = [r for r in recs if r["kind"] == "dump"]
    op = {r["seq"]: r for r in ops(recs)}
    dumped_fns = {(op[d["seq"]]["fn"], op[d["seq"]]["step"]) for d in dumps}
    assert dumped_fns == {("torch.nn.functional.mse_loss", 0), ("torch.nn.functional.mse_loss", 1),
                          ("torch.nn.functional.gelu", 1)}
    rank_dir = cap.path.parent
    for d in dumps:
        f = rank_dir / d["path"]
        assert f.is_file() and d["path"].startswith("capture/tensors/")
        assert hashlib.sha256(f.read_bytes()).hexdigest() == d["sha256"]
        t = torch.load(f)
        entry = next(e for e in op[d["seq"]]["inputs"] + op[d["seq"]]["outputs"] if e["slot"] == d["slot"])
        assert oc_digest(t) == entry["digest"]
    assert not list(cap.path.rglob(".opguard-tmp-*"))


def test_size_cap_is_loud_and_stops_recording(out_env: dict[str, str], capfd: pytest.CaptureFixture[str]) -> None:
    model, x, y = data()
    with oc.capture(env=out_env, max_mb=0.02, buffer=4) as cap:
        losses = calls.mlp_train(model, x, y, 5, step_fn=oc.step)
    assert len(losses) == 5                                   # the program ran on
    err = capfd.readouterr().err
    assert "reached the size cap OPGUARD_CAPTURE_MAX_MB=0.02" in err and "rank 0" in err
    recs = read_trace(cap.path)
    kinds = [r["kind"] for r in recs]
    assert kinds.count("cap") == 1 and kinds[-1] == "end" and kinds.index("cap") == len(kinds) - 2
    # the cap names the first record not written: seq numbers stay contiguous up to it
    mark = recs[-2]
    assert [r["seq"] for r in recs if r["kind"] == "op"] == list(range(mark["seq"]))
    assert f"at step {mark['step']} (seq {mark['seq']})" in err and f"(seq {mark['seq']})" in mark["message"]
    size = sum(p.stat().st_size for p in cap.path.rglob("*") if p.is_file())
    assert size < 0.02 * 2**20 + 4096
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["cap_reached"] is True


def test_buffer_bounds_what_is_held(out_env: dict[str, str]) -> None:
    model, x, y = data()
    seen: list[int] = []
    with oc.capture(env=out_env, buffer=5) as cap:
        def probe(i: int) -> None:
            oc.step(i)
            seen.append(len(cap.session.pending))
        calls.mlp_train(model, x, y, 4, step_fn=probe)
        written_before_end = len(read_trace(cap.path))
    assert max(seen) <= 5 + 20                                  # flushed at the first top-level call past 5
    assert written_before_end > 0


def test_selection_by_steps_and_functions(out_env: dict[str, str]) -> None:
    model, x, y = data()
    with oc.capture(env=out_env, steps="1-2", functions="torch.nn.functional.*") as cap:
        calls.mlp_train(model, x, y, 4, step_fn=oc.step)
    op = ops(read_trace(cap.path))
    assert op and {r["step"] for r in op} == {1, 2}
    assert all(r["fn"].startswith("torch.nn.functional.") for r in op)


def _collectives_with(op: str, tmp_path: Path, base: Path) -> Path:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / ('pg-' + base.name)}", rank=0, world_size=1)
    try:
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base)}) as cap:
            t = torch.arange(4.0)
            # the default group, named as None in one run and as WORLD in the other: one group
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=dist.group.WORLD if op == "MAX" else None)
            dist.broadcast(t, src=0)
            out = torch.empty(4)
            dist.all_to_all_single(out, t, output_split_sizes=[4], input_split_sizes=[4])
            (out * 2).sum()
    finally:
        dist.destroy_process_group()
    return cap.path


def test_a_collective_s_settings_are_arguments_compare_names(tmp_path: Path) -> None:
    """A reduce op edited ``SUM`` -> ``MAX`` was reported on every rank as "outputs differ, inputs
    and arguments equal, in a collective (another rank sent other data)", each rank pointing at the
    others, and an edited split size or broadcast root was not named anywhere (hand test): capture
    kept only ``op`` (a field compare does not compare) and no other setting. A tensor collective's
    non-tensor arguments are now ``args`` (``op`` by name, ``group`` as its ranks)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    from tests.compare.helpers import run_compare

    a = _collectives_with("SUM", tmp_path, tmp_path / "a")
    _collectives_with("MAX", tmp_path, tmp_path / "b")
    op = ops(read_trace(a))
    settings = {r["fn"]: {x["slot"]: x.get("value") for x in r.get("args", [])} for r in op if r["api"] == "collective"}
    assert settings["torch.distributed.all_reduce"] == {"op": "SUM", "group": None, "async_op": False}
    assert settings["torch.distributed.broadcast"]["src"] == 0
    a2a = settings["torch.distributed.all_to_all_single"]
    assert a2a["output_split_sizes"] == [4] and a2a["input_split_sizes"] == [4]
    text = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "ab.pftrace").stderr
    first = next(line for line in text.splitlines() if "first divergence" in line)
    assert "torch.distributed.all_reduce" in first and "arguments differ: op: 'SUM' -> 'MAX'" in first, text
    assert "group" not in first, text


def test_collective_recorded_as_such(out_env: dict[str, str], tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        t = torch.arange(4.0)
        before = oc_digest(t)
        original = dist.all_reduce
        with oc.capture(env=out_env) as cap:
            dist.all_reduce(t)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    op = ops(read_trace(cap.path))
    ar = next(r for r in op if r["fn"] == "torch.distributed.all_reduce")
    assert ar["api"] == "collective" and ar["group_size"] == 1 and ar["op"] == "SUM"
    assert ar["inputs"][0]["slot"] == "tensor" and ar["inputs"][0]["digest"] == before
    assert ar["outputs"][0]["digest"] == oc_digest(t)
    assert any(r["fn"] == "torch.distributed.barrier" for r in op)
    # the collective is one record: torch.distributed dispatching the same call again through
    # handle_torch_function, and the torch.device the barrier builds, are not the program's calls
    assert [r["fn"] for r in op] == ["torch.distributed.all_reduce", "torch.distributed.barrier"]
    assert dist.all_reduce is original                          # restored after capture


def test_refusals(tmp_path: Path, out_env: dict[str, str]) -> None:
    # staging enabled but unusable: refuse, never fall back
    bad = {"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t"), "OPGUARD_LOCAL_DUMP_ENABLED": "1",
           "OPGUARD_LOCAL_DUMP_TARGET": str(tmp_path / "t"),
           "OPGUARD_LOCAL_DUMP_BASE": str(tmp_path / "missing" / "base")}
    with pytest.raises(ConfigError, match="OPGUARD_LOCAL_DUMP_BASE"), oc.capture(env=bad):
        pass
    assert not (tmp_path / "t").exists() or not any((tmp_path / "t").rglob("*.jsonl"))
    with pytest.raises(ConfigError, match="OPGUARD_TRACE_OUTPUT_BASE"), oc.capture(env={}):
        pass
    with oc.capture(env=out_env):
        torch.ones(2).sum()
    with pytest.raises(ConfigError, match=r"already captured into .* in an earlier capture\(\) block"), \
            oc.capture(env=out_env):
        pass
    with pytest.raises(ConfigError, match="OPGUARD_CAPTURE_DIGEST"):
        oc.capture(env={**out_env, "OPGUARD_CAPTURE_DIGEST": "md5"}).__enter__()
    # a block inside a running capture records into it (docs/capture.md §1): before, "already active"
    with oc.capture(env=out_env | {"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "o2")}) as outer, oc.capture(env={
            "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "o3")}) as inner:
        assert inner is outer
        torch.ones(2).sum()
    assert not (tmp_path / "o3").exists() and any((tmp_path / "o2").rglob("trace.jsonl"))
    assert torch.overrides._get_current_function_mode_stack() == []


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_views_and_reused_memory_get_exact_summaries(out_env: dict[str, str], kernel: str) -> None:
    """The digest cache is keyed by memory range for contiguous tensors: views share the cached
    digest and statistics, a transpose gets its own digest (logical order) and the statistics of
    its range, an in-place update makes a new version, and memory freed and reused by a new tensor
    at the same address is never served a stale result."""
    from opguard.capture.digest import finish_stats, stats_row

    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 8, generator=g)
    with oc.capture(env=out_env, host_kernel=kernel) as cap:
        a = base.mul(1.0)
        v = a.view(8, 6)
        t = a.t()
        a.add_(1.0)
        w = a.view(48)
        x = torch.ones(16)
        del x  # its memory is free for the next allocation of the same size
        torch.zeros(16)
    op = ops(read_trace(cap.path))
    out: dict[str, dict] = {}  # type: ignore[type-arg]
    for r in op:
        out.setdefault(r["fn"], r["outputs"][0])  # the first record of each function
    before, after = base.mul(1.0), base.mul(1.0).add_(1.0)
    assert out["Tensor.view"]["digest"] == oc_digest(before) == out["Tensor.mul"]["digest"]
    assert out["Tensor.view"]["shape"] == [8, 6] and v.shape == (8, 6)
    assert out["Tensor.t"]["digest"] == oc_digest(before.t().contiguous()) != oc_digest(before)
    expect = finish_stats(stats_row(before).tolist(), before.numel())
    for fn in ("Tensor.mul", "Tensor.view", "Tensor.t"):
        got = out[fn]["stats"]
        assert got["min"] == expect["min"] and got["max"] == expect["max"] and got["nan"] == 0
        assert got["mean"] == pytest.approx(expect["mean"], abs=1e-6)
        assert got["std"] == pytest.approx(expect["std"], rel=1e-6)
    views = [r for r in op if r["fn"] == "Tensor.view"]
    assert [r["outputs"][0]["digest"] for r in views] == [oc_digest(before), oc_digest(after)]
    assert out["Tensor.add_"]["digest"] == oc_digest(after) and w.shape == (48,) and t.shape == (8, 6)
    # a new tensor in (probably) the same memory, same element count and version 0: its own digest
    assert out["torch.zeros"]["digest"] == oc_digest(torch.zeros(16)) != out["torch.ones"]["digest"]


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_a_write_through_data_is_never_served_the_stale_digest(out_env: dict[str, str], kernel: str) -> None:
    """``p.data.mul_(3)`` writes p's memory through an alias with a version counter of its own:
    ``p._version`` stays as it was, so p's cached digest (same address, count, dtype, version)
    would be stale; the recorded write drops every other cached version at that address."""
    p = torch.nn.Parameter(torch.ones(4))
    x = torch.ones(4)
    with oc.capture(env=out_env, host_kernel=kernel) as cap:
        torch.mul(x, p)
        version = p._version
        p.data.mul_(3.0)
        assert p._version == version            # the hazard: same cache key as before the write
        torch.mul(x, p)
    muls = [r for r in ops(read_trace(cap.path)) if r["fn"] == "torch.mul"]
    write = next(r for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.mul_")
    assert muls[0]["inputs"][1]["digest"] == oc_digest(torch.ones(4))
    assert muls[1]["inputs"][1]["digest"] == write["outputs"][0]["digest"] == oc_digest(torch.full((4,), 3.0))


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("write", ["fill_row", "setitem", "copy_column", "twice"])
def test_a_write_through_data_at_an_offset_is_seen(out_env: dict[str, str], kernel: str, write: str) -> None:
    """Writes through ``p.data`` into part of p's memory (a row, a column, an assignment): the alias
    starts at another address than p, and its own version counter can reach the value of p's (the
    keys then collide). Every such recorded write is a write into p's storage: p's next use is
    digested from memory. Found on a script that edits parameter rows under ``no_grad``: the
    linear's weight digest stayed the one before the edit (compare would miss the change)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    expect = []
    with oc.capture(env=out_env, host_kernel=kernel) as cap:
        for i in range(3):
            lin(x)
            expect.append(oc_digest(lin.weight.detach().clone()))
            with torch.no_grad():
                if write == "fill_row":
                    lin.weight.data[i].fill_(float(i))
                elif write == "setitem":
                    lin.weight.data[i] = float(i + 1)
                elif write == "copy_column":
                    lin.weight.data[:, i].copy_(torch.full((4,), 7.0))
                else:  # the alias written twice: its counter passes the value of p's
                    d = lin.weight.data
                    d[i].add_(1.0)
                    d[i].add_(1.0)
        lin(x)
        expect.append(oc_digest(lin.weight.detach().clone()))
    recs = ops(read_trace(cap.path))
    got = [r["inputs"][1]["digest"] for r in recs if r["fn"] == "torch.nn.functional.linear"]
    assert got == expect and len(set(expect)) == 4
    if write == "setitem":  # the assignment's record says what it wrote
        sets = [r for r in recs if r["fn"] == "Tensor.__setitem__"]
        assert [r["outputs"][0]["slot"] for r in sets] == ["self"] * 3
        assert [r["outputs"][0]["digest"] for r in sets] == expect[1:]


@pytest.mark.parametrize("share", ["numpy", "asarray"])
def test_a_tensor_shared_with_numpy_is_digested_at_every_use(out_env: dict[str, str], share: str) -> None:
    """A reused input buffer refilled by numpy (``arr = buf.numpy()``; ``arr[:] = batch``) changes
    without a version change: once capture has seen the sharing call, the buffer's contents are
    never served from the digest cache (before: every use had the first batch's digest)."""
    import numpy as np

    buf, w = torch.zeros(8), torch.ones(8)
    with oc.capture(env=out_env) as cap:
        arr = buf.numpy() if share == "numpy" else np.asarray(buf)
        expect = []
        for i in range(3):
            arr[:] = i
            torch.mul(buf, w)
            expect.append(oc_digest(torch.full((8,), float(i))))
    got = [r["inputs"][0]["digest"] for r in ops(read_trace(cap.path)) if r["fn"] == "torch.mul"]
    assert got == expect and len(set(got)) == 3


@pytest.mark.parametrize("level", ["function", "dispatch"])
def test_arguments_written_in_place_without_a_version_change_are_outputs(out_env: dict[str, str],
                                                                         level: str) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler.unscale_, scaler.step) writes
    the gradients and ``found_inf``, returns nothing and moves no version counter: before, it had no
    outputs and every later use (the optimizer step record's gradients, ``found_inf.item()``) was
    recorded with the scaled, pre-unscale digests. Every argument an in-place op's schema marks as
    written is an output, digested from memory."""
    g = torch.tensor([0.0, 1.0, 2.0, float("inf")])
    found_inf, inv_scale = torch.zeros(1), torch.full((1,), 0.25)
    with oc.capture(env=out_env, level=level) as cap:
        torch.neg(g)
        torch.neg(found_inf)
        torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, inv_scale)
        assert g._version == found_inf._version == 0  # the hazard: the cache keys are unchanged
        torch.neg(g)
        torch.neg(found_inf)
    recs = [r for r in ops(read_trace(cap.path)) if r["depth"] == 0]
    negs = [r["inputs"][0]["digest"] for r in recs if r["fn"] == "torch.neg"]
    after = oc_digest(torch.tensor([0.0, 0.25, 0.5, float("inf")]))
    assert negs == [oc_digest(torch.tensor([0.0, 1.0, 2.0, float("inf")])), oc_digest(torch.zeros(1)),
                    after, oc_digest(torch.ones(1))]
    unscale = next(r for r in recs if r["fn"] == "torch._amp_foreach_non_finite_check_and_unscale_")
    assert [(e["slot"], e["digest"]) for e in unscale["outputs"]] == [("arg0.0", after), ("arg1", negs[3])]


@torch.library.custom_op("opguard_test::fill_out", mutates_args=("out",))
def _fill_out(out: torch.Tensor, value: float) -> None:
    out.fill_(value)


def test_what_an_unrecorded_custom_op_writes_is_digested_from_memory(out_env: dict[str, str]) -> None:
    """A ``torch.ops`` custom op writing its ``out`` argument under ``_unsafe_preserve_version_counter``
    (FSDP2's ``fsdp::split_with_sizes_copy`` fills the unsharded parameters so): no version moves.
    Before, the torch.empty buffer stayed 'uninitialized' (every FSDP2 forward linear had no weight
    digest) and a cached tensor kept its old digest; now the op's written arguments (from its
    schema) are read from memory at their next use."""
    preserve = torch.autograd._unsafe_preserve_version_counter
    x = torch.ones(4)
    with oc.capture(env=out_env) as cap:
        buf = torch.empty(4)
        with preserve(buf):
            torch.ops.opguard_test.fill_out(buf, 3.0)
        torch.neg(buf)
        torch.neg(x)
        with preserve(x):
            torch.ops.opguard_test.fill_out(x, 5.0)
        torch.neg(x)
    negs = [r["inputs"][0] for r in ops(read_trace(cap.path)) if r["fn"] == "torch.neg"]
    assert [e.get("uninitialized") for e in negs] == [None, None, None]
    assert [e["digest"] for e in negs] == [oc_digest(torch.full((4,), 3.0)), oc_digest(torch.ones(4)),
                                           oc_digest(torch.full((4,), 5.0))]


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_lazy_conjugate_and_negative_views_get_their_own_content(out_env: dict[str, str], kernel: str) -> None:
    """``torch.conj(x)`` and ``torch._neg_view(t)`` share their base's memory with a conj/neg bit set:
    their cache key was the base's, so they (and every use of them) were recorded with the base's
    digest (found on a rotary-embedding script: every ``conj`` entry wrong)."""
    x = torch.complex(torch.tensor([1.0, 2.0]), torch.tensor([3.0, -4.0]))
    t = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    with oc.capture(env=out_env, host_kernel=kernel) as cap:
        torch.neg(x)
        y = torch.conj(x)
        y.abs()
        torch.neg(t)
        n = torch._neg_view(t)
        n.t().sum()        # a non-contiguous negative view: no statistics of the range it spans
    recs = {r["fn"]: r for r in ops(read_trace(cap.path))}
    conj = oc_digest(torch.view_as_real(x.conj().resolve_conj()))  # complex: its float pairs (§5)
    assert recs["torch.conj"]["outputs"][0]["digest"] == recs["Tensor.abs"]["inputs"][0]["digest"] == conj
    assert conj != oc_digest(torch.view_as_real(x))
    assert recs["torch._neg_view"]["outputs"][0]["digest"] == oc_digest(-t) != oc_digest(t)
    assert recs["Tensor.t"]["outputs"][0]["digest"] == oc_digest((-t).t().contiguous())
    assert recs["Tensor.t"]["outputs"][0]["stats"]["max"] == 2.0


@pytest.mark.parametrize("level", ["function", "dispatch"])
def test_batch_norm_running_statistics_are_outputs(out_env: dict[str, str], level: str) -> None:
    """A training BatchNorm forward updates ``running_mean``/``running_var`` in place without a
    version change, and ``native_batch_norm``'s schema does not mark them as written: every later
    read had the initial zeros' digest. They are outputs of the batch-norm calls now."""
    torch.manual_seed(0)
    bn, xs = torch.nn.BatchNorm1d(3), [torch.randn(4, 3) for _ in range(3)]
    ref = torch.nn.BatchNorm1d(3)
    expect = [oc_digest(ref.running_mean)]
    for x in xs:
        ref(x)
        expect.append(oc_digest(ref.running_mean))
    with oc.capture(env=out_env, level=level) as cap:
        for x in xs:
            bn(x)
        bn.running_mean * 1
    recs = ops(read_trace(cap.path))
    bns = [r for r in recs if r["fn"] == "torch.nn.functional.batch_norm"]
    assert [r["inputs"][1]["digest"] for r in bns] == expect[:3]
    assert [next(e["digest"] for e in r["outputs"] if e["slot"] == "arg1") for r in bns] == expect[1:]
    assert next(r for r in recs if r["fn"] == "Tensor.mul")["inputs"][0]["digest"] == expect[3]


def test_jit_trace_under_capture_loses_nothing(out_env: dict[str, str]) -> None:
    """``torch.jit.trace`` under capture: capture's own reads entered the tracer (TracerWarnings naming
    opguard's files) and a record with traced sizes made the whole batch unwritable ('records: 0,
    dropped: 31'). The mode records nothing while tracing; every other record is written."""
    import warnings

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    with warnings.catch_warnings(record=True) as caught, oc.capture(env=out_env) as cap:
        warnings.simplefilter("always")
        traced = torch.jit.trace(lin, (torch.randn(4, 3),))
        traced(torch.randn(4, 3)) * 2
    assert not [w for w in caught if "opguard" in str(w.filename)], [str(w.message) for w in caught]
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["dropped"] == 0 and meta["records"] > 0
    assert "Tensor.mul" in {r["fn"] for r in ops(read_trace(cap.path))}


def test_a_record_that_cannot_be_encoded_loses_only_itself(out_env: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing: one record JSON cannot hold (capture's own bug) is dropped and said once; the rest of
    its batch is written (before, the whole batch was dropped). Encoding fails when the record is
    sealed (it stays a record) and again at the flush."""
    encode = records.encode

    def failing(obj: dict[str, Any]) -> bytes:
        if obj.get("fn") == "Tensor.neg":
            raise TypeError("Type is not JSON serializable: object")
        return encode(obj)

    monkeypatch.setattr(records, "encode", failing)
    with oc.capture(env=out_env, buffer=64) as cap:
        torch.ones(2).neg()
        torch.ones(2).exp()
    meta = json.loads((cap.path / "meta.json").read_text())
    fns = [r["fn"] for r in ops(read_trace(cap.path))]
    assert meta["dropped"] == 1 and "Tensor.exp" in fns and "Tensor.neg" not in fns


def test_the_same_tensor_used_again_gets_its_current_shape_and_content(out_env: dict[str, str]) -> None:
    """The same tensor object used again unchanged costs one lookup (Session._seen); a reshape
    through ``.data`` (same memory, same version) and a swap of ``.data`` are seen."""
    p = torch.nn.Parameter(torch.arange(6.0))
    with oc.capture(env=out_env) as cap:
        torch.neg(p)
        torch.neg(p)                      # served by the same-object path
        p.data = p.data.view(2, 3)        # same address and version, another shape
        torch.neg(p)
        p.data = torch.ones(2, 3)         # another address
        torch.neg(p)
    negs = [r["inputs"][0] for r in ops(read_trace(cap.path)) if r["fn"] == "torch.neg"]
    assert [e["shape"] for e in negs] == [[6], [6], [2, 3], [2, 3]]
    assert negs[0]["digest"] == negs[1]["digest"] == negs[2]["digest"] == oc_digest(torch.arange(6.0))
    assert negs[3]["digest"] == oc_digest(torch.ones(2, 3))


def test_views_of_a_slice_reuse_its_summary(out_env: dict[str, str]) -> None:
    """Attention's head split: a ``view`` of a non-contiguous slice has the slice's elements in the
    same order (the same coalesced key: its digest and statistics are the slice's, no pass over
    memory); a ``transpose`` of that view has the same elements in another order (its statistics
    are the slice's, only its digest is computed). The entries equal those computed from memory."""
    g = torch.Generator().manual_seed(0)
    qkv0 = torch.randn(4, 8, 48, generator=g)
    with oc.capture(env=out_env) as cap:
        s: Any = cap.session
        qkv = qkv0 * 1.0
        q, _k, _v = qkv.split(16, dim=2)
        calls: list[tuple[Any, ...]] = []
        strided = s.host_strided
        s.host_strided = lambda *a: calls.append(a) or strided(*a)
        heads = q.view(4, 8, 2, 8)
        assert not calls, "the view's entry is the slice's: no pass over memory"
        ht = heads.transpose(1, 2)
        assert len(calls) == 1 and calls[0][4] == -1 and calls[0][6] is False, \
            "digest only: the statistics are the slice's"
        s.host_strided = strided
        (ht * 2.0).sum()
    recs = {r["fn"]: r for r in ops(read_trace(cap.path))}
    split_q = recs["Tensor.split"]["outputs"][0]
    view, tr = recs["Tensor.view"]["outputs"][0], recs["Tensor.transpose"]["outputs"][0]
    assert view["digest"] == split_q["digest"] == oc_digest(q.contiguous())
    assert tr["digest"] == oc_digest(ht.contiguous()) != view["digest"]
    assert view["stats"] == split_q["stats"] == tr["stats"]
    assert recs["Tensor.mul"]["inputs"][0]["digest"] == tr["digest"]


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_dead_cache_entry_is_not_served_to_a_new_tensor_at_the_same_address(out_env: dict[str, str],
                                                                            kernel: str) -> None:
    """A new tensor at the address, element count, dtype and version of a dead cached one (the
    allocator reused the memory) is summarised afresh, never served the old tensor's digest."""
    from opguard.capture.digest import finish
    from opguard.capture.options import CaptureOptions
    from opguard.capture.session import Session

    s = Session(CaptureOptions.from_env({}, host_kernel=kernel), out_env)
    try:
        mem = torch.ones(16)

        def alias() -> torch.Tensor:  # a new tensor object over mem's memory, fresh version counter
            return torch.empty(0).set_(mem.untyped_storage(), 0, (16,))

        x = alias()
        first = s.summarize(x, True)
        version = x._version
        del x
        mem.zero_()
        y = alias()
        assert (y.data_ptr(), y._version) == (mem.data_ptr(), version)  # the same cache key
        second = s.summarize(y, True)
        assert not isinstance(first, str) and not isinstance(second, str)
        assert second is not first and second.has_digest
        printed = second.hex if second.hex is not None else finish(int(second.digest), 16)  # native / torch
        assert printed == oc_digest(torch.zeros(16)) != oc_digest(torch.ones(16))
    finally:
        s.close()


@pytest.mark.parametrize("noise", [False, True])
def test_a_conversion_that_returned_its_input_is_not_recorded(tmp_path: Path, noise: bool) -> None:
    """``x.to(x.device)``, ``x.float()`` of float32, ``x.contiguous()`` of a contiguous tensor return
    ``x`` itself: no computation, no record (seq numbers stay contiguous); a conversion that made a
    new tensor is recorded; ``record_noise`` records them all."""
    x = torch.randn(4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}, record_noise=noise) as cap:
        x.to("cpu")
        x.float()
        x.to(torch.float64)
        x.contiguous()
        x.view(2, 2).t().contiguous()
        x.add(1)
    op = ops(read_trace(cap.path))
    assert [r["seq"] for r in op] == list(range(len(op)))
    fns = [r["fn"] for r in op]
    if noise:
        assert fns == ["Tensor.to", "Tensor.float", "Tensor.to", "Tensor.contiguous", "Tensor.view", "Tensor.t",
                       "Tensor.contiguous", "Tensor.add"]
    else:
        assert fns == ["Tensor.to", "Tensor.view", "Tensor.t", "Tensor.contiguous", "Tensor.add"]
        assert op[0]["outputs"][0]["dtype"] == "float64"


class _Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each item computed with torch ops (in the DataLoader worker)."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g).mul(2.0).add(1.0)


def _load(n_workers: int) -> list[torch.Tensor]:
    loader = torch.utils.data.DataLoader(_Items(), batch_size=4, num_workers=n_workers)
    return [batch.sum(0) for batch in loader]


def test_a_forked_dataloader_worker_writes_nothing_into_the_ranks_trace(tmp_path: Path) -> None:
    """DataLoader workers (fork start method) inherit the capture: their calls run unrecorded, nothing
    of theirs reaches the rank's trace (it would interleave under the same seq numbers); the rank's
    meta says that forked processes are not captured; the program's results are unchanged."""
    import multiprocessing

    if multiprocessing.get_start_method(allow_none=True) not in (None, "fork"):
        pytest.skip("the default start method here is not fork")
    expected = _load(1)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        got = _load(1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    recs = read_trace(cap.path)
    op = ops(recs)
    assert len(op) >= 150  # the parent's batch.sum(0) calls and the loader's own
    assert len({r["seq"] for r in op}) == len(op)
    assert not any(r["func"] == "__getitem__" for r in op)
    assert recs[-1]["kind"] == "end" and recs[-1]["records"] == len(recs) - 1
    meta = json.loads((cap.path / "meta.json").read_text())
    assert any("forked from this rank" in n for n in meta["notes"])


def test_torch_func_wrappers_and_sparse_tensors_are_entries_with_a_reason(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Tensors without storage of their own (torch.func's vmap/grad wrappers, sparse COO) once the
    program has made an uninitialised tensor (capture then checks every output's address): every
    record keeps all its entries, each says why it has no digest; nothing is reported as a failure."""
    from torch.func import grad, vmap

    def f(w: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        return (xi @ w).sin().sum()

    w, x = torch.randn(6, 3), torch.randn(5, 6)
    want = vmap(grad(f), in_dims=(None, 0))(w, x)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        torch.empty(3)
        got = vmap(grad(f), in_dims=(None, 0))(w, x)
        sp = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
        dense = sp @ torch.ones(2, 2)
    assert torch.equal(got, want) and torch.equal(dense, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    op = ops(read_trace(cap.path))
    assert not any("capture_error" in r for r in op)
    sin = next(r for r in op if r["fn"] == "Tensor.sin")
    why = "torch.func wrapper: no storage of its own"
    assert [(e["slot"], e["digest"], e["reason"]) for e in sin["inputs"] + sin["outputs"]] == [
        ("self", None, why), ("out", None, why)]
    coo = next(r for r in op if r["fn"] == "torch.sparse_coo_tensor")
    assert [e["slot"] for e in coo["inputs"]] == ["arg0", "arg1"] and all(e["digest"] for e in coo["inputs"])
    assert coo["outputs"][0]["reason"] == "layout torch.sparse_coo"
    mm = next(r for r in op if r["fn"] == "Tensor.matmul" and r["inputs"][0].get("reason") == "layout torch.sparse_coo")
    assert mm["outputs"][0]["digest"]
    assert "failed" not in capfd.readouterr().err
    meta = json.loads((cap.path / "meta.json").read_text())
    assert any("torch.func transforms" in n for n in meta["notes"])


def test_another_threads_module_forward_leaves_this_threads_module_paths_alone(tmp_path: Path) -> None:
    """Module hooks are global; capture is the starting thread's. A forward running in another thread
    (an EMA or evaluation thread) does not become the module of this thread's records."""
    import threading

    inside, release = threading.Event(), threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inside.set()
            release.wait(30)
            return x * 2

    other, mine = Slow(), torch.nn.Linear(2, 2)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        worker = threading.Thread(target=other, args=(torch.ones(2),))
        worker.start()
        assert inside.wait(30)
        torch.ones(2).add(1)            # no module of this thread is running
        mine(torch.ones(2))             # Linear
        release.set()
        worker.join(30)
        torch.ones(2).mul(3)
    op = ops(read_trace(cap.path))
    mods = {r["fn"]: r["module"] for r in op if r["fn"] in ("Tensor.add", "torch.nn.functional.linear", "Tensor.mul")}
    assert mods == {"Tensor.add": None, "torch.nn.functional.linear": "Linear", "Tensor.mul": None}


def test_a_dtensor_is_summarised_by_its_local_shard(tmp_path: Path) -> None:
    """FSDP2 and tensor parallelism hand the optimizer DTensors: the entry carries the local shard's
    digest and statistics, the global shape, the local shape and the placements (a tensor subclass
    had no digest at all, and an empty marked tensor at address 0 made it 'uninitialized memory')."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        opt = torch.optim.SGD([p], lr=0.5)
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")}) as cap:
            torch.empty(0)  # an uninitialised output at address 0
            opt.step()
        after = p.detach().to_local().clone()
    finally:
        dist.destroy_process_group()
    step = next(r for r in ops(read_trace(cap.path)) if r["api"] == "optimizer")
    ins = {e["slot"]: e for e in step["inputs"]}
    w, g = ins["group0.params.0"], ins["group0.params.0.grad"]
    assert w["digest"] == oc_digest(torch.arange(8.0).reshape(4, 2)) and g["digest"] == oc_digest(torch.ones(4, 2))
    assert (w["shape"], w["local_shape"], w["placements"]) == ([4, 2], [4, 2], ["S(0)"])
    assert "reason" not in w and "uninitialized" not in w
    out = step["outputs"][0]
    assert out["digest"] == oc_digest(after) and out["stats"]["max"] == 7.0 - 0.5


def test_object_collectives_are_one_record_each_with_their_objects_by_type(tmp_path: Path) -> None:
    """``all_gather_object`` / ``broadcast_object_list`` / ``gather_object`` pickle their objects into
    byte tensors and run tensor collectives on them. Those were recorded as library-code collectives
    with the pickles' digests, and a pickle can differ between two identical runs
    (``torch.distributed.checkpoint`` gathers a uuid-stamped plan at every save): two identical
    TP + DCP runs compared with a false first divergence at ``dcp.save``. Now each object collective
    is one ``collective`` record whose objects are described by their type only; what it does inside
    is not recorded (docs/capture.md §3.2; found hand-testing)."""
    import uuid

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        stamp = {"id": uuid.uuid4().hex, "step": 3}
        sub = dist.new_group([0])
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")}) as cap:
            gathered: list[Any] = [None]
            dist.all_gather_object(gathered, stamp)
            box: list[Any] = [stamp, torch.ones(2)]
            dist.broadcast_object_list(box, src=0)
            into: list[Any] = [None]
            dist.gather_object(stamp, into, dst=0, group=sub)
            torch.ones(2).add(1)
    finally:
        dist.destroy_process_group()
    assert gathered == [stamp] and box[0] == stamp and into == [stamp]  # the program's results as without capture
    op = ops(read_trace(cap.path))
    assert [r["fn"] for r in op] == ["torch.distributed.all_gather_object", "torch.ones",
                                     "torch.distributed.broadcast_object_list", "torch.distributed.gather_object",
                                     "torch.ones", "Tensor.add"]
    ag = op[0]
    assert ag["api"] == "collective" and ag["inputs"] == [] and ag["outputs"] == [] and ag["group_size"] == 1
    assert {"slot": "obj", "type": "object", "value": "builtins.dict"} in ag["args"]
    assert {"slot": "object_list", "type": "object", "value": "builtins.list"} in ag["args"]
    assert {"slot": "group", "type": "none", "value": None} in ag["args"]
    # a group as its global ranks, as for a tensor collective (it was its type: an edited group unseen)
    assert {"slot": "group", "type": "list", "value": [0]} in op[3]["args"]
    assert stamp["id"] not in json.dumps(op)  # the objects' content is never recorded


def test_fsdp2s_collectives_and_ones_capture_does_not_know_are_recorded_with_what_they_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``all_gather_single`` (FSDP2's all-gather) writes its output buffer: the record has the buffer
    after the call, and the next use of the buffer is digested from what was written (not from the
    cache of its uninitialised or earlier content). A collective capture has no table entry for
    (any public ``torch.distributed`` function with ``async_op``) has every tensor argument before and
    after the call."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    if not hasattr(dist, "all_gather_single"):
        pytest.skip("this PyTorch has no torch.distributed.all_gather_single")

    def future_collective(tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
        tensor.mul_(3)  # stands in for a collective a later PyTorch adds

    monkeypatch.setattr(dist, "future_collective", future_collective, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        src = torch.arange(4.0)
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")}) as cap:
            buf = torch.zeros(4)
            buf.view(2, 2)                      # cached before the collective writes it
            dist.all_gather_single(buf, src)
            buf.view(2, 2)
            t = torch.ones(2)
            dist.future_collective(t)
    finally:
        dist.destroy_process_group()
    op = ops(read_trace(cap.path))
    ag = next(r for r in op if r["fn"] == "torch.distributed.all_gather_single")
    assert ag["api"] == "collective" and [e["slot"] for e in ag["inputs"]] == ["input_tensor"]
    assert ag["outputs"][0]["slot"] == "output_tensor" and ag["outputs"][0]["digest"] == oc_digest(src)
    views = [r for r in op if r["fn"] == "Tensor.view"]
    assert views[1]["inputs"][0]["digest"] == oc_digest(src) != views[0]["inputs"][0]["digest"]
    assert not any(r["fn"].startswith("torch.distributed.distributed_c10d.") for r in op)
    fc = next(r for r in op if r["fn"] == "torch.distributed.future_collective")
    assert fc["api"] == "collective"
    assert fc["inputs"][0]["digest"] == oc_digest(torch.ones(2))
    assert fc["outputs"][0]["digest"] == oc_digest(torch.full((2,), 3.0))


def test_a_library_collective_writing_uninitialized_memory_writes_it_whole(tmp_path: Path) -> None:
    """A collective called through ``distributed_c10d``'s own globals (DTensor, FSDP) into a
    ``torch.empty`` buffer left the buffer marked uninitialised: what it received was never
    compared, and compare named the first use of it (hand test, 2 ranks: "first divergence:
    Tensor.mul ... outputs differ, inputs and arguments equal"). The parameters it writes are
    written whole. And a deprecated public collective forwarding to its successor
    (``all_gather_into_tensor`` -> ``all_gather_single``) recorded that call as a nested child."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    import warnings

    from torch.distributed import distributed_c10d as c10d

    gather = "all_gather_single" if hasattr(c10d, "all_gather_single") else "all_gather_into_tensor"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        src = torch.arange(4.0)
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")}) as cap:
            buf = torch.empty(4)
            getattr(c10d, gather)(buf, src)
            buf.mul(2)
            out = torch.empty(4)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of all_gather_single
                dist.all_gather_into_tensor(out, src)
            out.mul(3)
    finally:
        dist.destroy_process_group()
    op = ops(read_trace(cap.path))
    lib = next(r for r in op if r["fn"] == f"torch.distributed.distributed_c10d.{gather}")
    written = next(e for e in lib["outputs"] if e["slot"] == "arg0")
    assert "uninitialized" not in written and written["digest"] == oc_digest(src)
    muls = [r for r in op if r["fn"] == "Tensor.mul"]
    assert [m["inputs"][0]["digest"] for m in muls] == [oc_digest(src)] * 2
    assert not any(m["inputs"][0].get("uninitialized") for m in muls)
    pub = next(r for r in op if r["fn"] == "torch.distributed.all_gather_into_tensor")
    assert not [r for r in op if r.get("parent") == pub["seq"]]  # its implementation: no nested record


def test_views_of_unwritten_memory_stay_uninitialized(tmp_path: Path) -> None:
    """A view (``view``, ``narrow`` at an offset, ``chunk``) of a ``torch.empty`` output nothing wrote
    is still whatever the allocator left: its output entry and its use as an input are marked, never
    digested (two identical runs compared equal); after a write through the base it is content."""
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        b = torch.empty(8)
        b.view(2, 4)
        part = b.narrow(0, 4, 4)
        part.add(1)
        b.chunk(2)
        b.fill_(1.0)
        b.view(2, 4)
    op = ops(read_trace(cap.path))
    views = [r for r in op if r["fn"] == "Tensor.view"]
    assert views[0]["outputs"][0]["uninitialized"] is True and views[0]["outputs"][0]["digest"] is None
    nar = next(r for r in op if r["fn"] == "Tensor.narrow")
    assert nar["outputs"][0]["uninitialized"] is True
    add = next(r for r in op if r["fn"] == "Tensor.add")
    assert add["inputs"][0]["uninitialized"] is True and add["outputs"][0]["digest"]
    chunk = next(r for r in op if r["fn"] == "Tensor.chunk")
    assert [e.get("uninitialized") for e in chunk["outputs"]] == [True, True]
    after = views[1]["outputs"][0]
    assert after["digest"] == oc_digest(torch.ones(8)) and "uninitialized" not in after


def test_a_module_first_called_outside_any_forward_gets_its_path_inside_its_parent(tmp_path: Path) -> None:
    """``spectral_norm`` runs its parametrization once when it is built (no module running): that
    first sight must not fix its path (and its child's) to the class name for the rest of the run;
    the optimizer names its parameters by the path it has inside the model."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        model = torch.nn.Sequential(parametrizations.spectral_norm(torch.nn.Linear(3, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.zeros(1)  # the end of construction
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    op = ops(read_trace(cap.path))
    mark = next(r["seq"] for r in op if r["fn"] == "torch.zeros")
    built = {r["module"] for r in op if r["seq"] < mark and r["module"]}
    assert built == {"ParametrizationList.0"}  # no module was running: the class name, for now
    ran = {r["module"] for r in op if r["seq"] > mark and r["module"] and "arametriz" in r["module"]}
    assert ran == {"Sequential.0.parametrizations.weight.0"}, ran
    step = next(r for r in op if r["api"] == "optimizer")
    assert "Sequential.0.parametrizations.weight.original" in [e["slot"] for e in step["inputs"]]


def test_two_root_modules_of_one_class_get_distinct_paths(out_env: dict[str, str]) -> None:
    """A GAN's generator and discriminator, both ``nn.Sequential`` roots: both were ``Sequential.*``, so
    their records (and compare's call-site keys, which hold the module) could not be told apart. The
    second root of a class is ``Sequential#2``; a module made anew per call keeps one number."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh())
    disc = torch.nn.Sequential(torch.nn.Linear(4, 1))
    with oc.capture(env=out_env) as cap:
        for _ in range(2):
            disc(gen(torch.ones(1, 2)))
            torch.nn.Softmax(dim=1)(torch.ones(1, 3))  # a root made and dropped per call
    mods = [r["module"] for r in ops(read_trace(cap.path)) if r["fn"] in ("torch.nn.functional.linear",
                                                                           "torch.nn.functional.softmax")]
    assert mods == ["Sequential.0", "Sequential#2.0", "Softmax"] * 2


def test_a_root_module_made_per_iteration_is_not_kept_alive(out_env: dict[str, str]) -> None:
    """A root ``Sequential`` made anew per iteration (a sweep, k-fold) stayed alive under capture: the
    provisional path of its child held the parent strongly (the parent holds the child, the weak
    key). The program printed 'modules still alive: 4' only under capture, with every model's
    parameters in memory; and each got a new number (``Sequential#4``) instead of reusing one."""
    import gc
    import weakref

    x = torch.randn(4, 3)
    refs = []
    with oc.capture(env=out_env) as cap:
        for _ in range(4):
            head = torch.nn.Sequential(torch.nn.Linear(3, 2))
            head(x)
            refs.append(weakref.ref(head))
            del head
            gc.collect()
        alive = sum(r() is not None for r in refs)
    assert alive == 0
    mods = [r["module"] for r in ops(read_trace(cap.path)) if r["fn"] == "torch.nn.functional.linear"]
    assert mods == ["Sequential.0"] * 4


def test_swap_tensors_works_under_capture(out_env: dict[str, str]) -> None:
    """``torch.utils.swap_tensors`` refuses a tensor with weak references, and capture's digest cache
    held one to every tensor it summarised: swapping failed only under capture ('Cannot swap t1
    because it has weakref associated with it'), and so did ``model.to(torch.float64)`` with
    ``set_swap_module_params_on_conversion(True)``. Capture drops its references first; after the
    capture, it holds none."""
    a, b = torch.ones(3), torch.zeros(3)
    m = torch.nn.Linear(4, 2)
    prev = torch.__future__.get_swap_module_params_on_conversion()
    try:
        with oc.capture(env=out_env) as cap:
            a.sum() + b.sum()
            torch.utils.swap_tensors(a, b)
            m(torch.ones(1, 4)).sum()
            torch.__future__.set_swap_module_params_on_conversion(True)
            m.to(torch.float64)
            m(torch.ones(1, 4, dtype=torch.float64)).sum()
            c, d = torch.ones(2), torch.zeros(2)
            c.neg(), d.neg()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(prev)
    assert a.tolist() == [0.0] * 3 and m.weight.dtype == torch.float64
    torch.utils.swap_tensors(c, d)  # after the capture: nothing of capture's is left on them
    assert c.tolist() == [0.0, 0.0]
    assert json.loads((cap.path / "meta.json").read_text())["dropped"] == 0


def test_a_data_swap_is_seen_by_the_same_object_path(out_env: dict[str, str]) -> None:
    """``w.data = w.data.T`` (square ``w``: same address, shape and version, other strides) and
    ``u.data = <int32 view>`` (other dtype): the same-object path served the old entry (the
    untransposed digest; dtype float32)."""
    torch.manual_seed(0)
    w, x = torch.nn.Parameter(torch.randn(3, 3)), torch.randn(2, 3)
    u = torch.randn(4)
    with oc.capture(env=out_env) as cap:
        x @ w
        w.data = w.data.T
        x @ w
        alias = u.view(torch.int32)
        u.neg()
        u.data = alias
        u.abs()
    recs = ops(read_trace(cap.path))
    mm = [r["inputs"][1]["digest"] for r in recs if r["fn"] == "Tensor.matmul"]
    assert mm == [oc_digest(w.detach().T.contiguous()), oc_digest(w.detach())]
    assert next(r for r in recs if r["fn"] == "Tensor.abs")["inputs"][0]["dtype"] == "int32"


def test_a_round_trip_through_another_dtype_is_digested_again(out_env: dict[str, str]) -> None:
    """``m.half(); m.float()`` (``param.data = ...`` twice): the rounded weight came back at the old
    address with the old version, and the old cached content — still tied to the live parameter —
    was served for it: every later use of the weight had its pre-round-trip digest (10 dump
    mismatches on a Linear(256, 256)), and compare called the next layer 'introduced'."""
    torch.manual_seed(0)
    m = torch.nn.Linear(256, 256)
    with oc.capture(env=out_env, dump_steps="0", dump_filter="torch.nn.functional.linear") as cap:
        m(torch.ones(1, 256)).sum().item()
        for _ in range(3):
            m.half()
            m.float()
            m(torch.ones(1, 256)).sum().item()
    recs = read_trace(cap.path)
    lin = [r for r in ops(recs) if r["fn"] == "torch.nn.functional.linear"]
    dumped = {r["seq"]: torch.load(cap.path.parent / r["path"]) for r in recs
              if r["kind"] == "dump" and r["slot"] == "arg1"}
    assert len(lin) == len(dumped) == 4
    assert [r["inputs"][1]["digest"] for r in lin] == [oc_digest(dumped[r["seq"]]) for r in lin]
    assert lin[0]["inputs"][1]["digest"] != lin[1]["inputs"][1]["digest"]  # rounded through float16


def test_to_empty_leaves_parameters_marked_uninitialised(out_env: dict[str, str]) -> None:
    """``module.to_empty()`` on a built CPU module sets ``param.data = torch.empty_like(param)``: the
    parameters hold garbage under their own version counters (1, from init), and the first write
    read that garbage as a result (identical runs compared with 2 inherited mismatches)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    with oc.capture(env=out_env) as cap:
        lin.to_empty(device="cpu")
        with torch.no_grad():
            lin.weight.copy_(torch.ones(64, 64))
            lin.bias.zero_()
        lin(torch.ones(2, 64)).sum()
    recs = ops(read_trace(cap.path))
    # Module._apply's test of each parameter's tensor type reads metadata only: not recorded
    assert "torch._has_compatible_shallow_copy_type" not in {r["fn"] for r in recs}
    copy = next(r for r in recs if r["fn"] == "Tensor.copy_")
    zero = next(r for r in recs if r["fn"] == "Tensor.zero_")
    assert copy["inputs"][0]["uninitialized"] is True and zero["inputs"][0]["uninitialized"] is True
    lin_rec = next(r for r in recs if r["fn"] == "torch.nn.functional.linear")
    assert not any(e.get("uninitialized") for e in lin_rec["inputs"])  # written since: results


def test_a_growing_resize_is_uninitialised(out_env: dict[str, str]) -> None:
    """``resize_`` that grows a tensor leaves its new elements uninitialised: its output is marked so
    (identical runs compared with an 'introduced' divergence on it); written in part (``c[4:] = 1``:
    capture does not track which elements) it stays so; once written whole it is a result."""
    c = torch.arange(4.0)
    with oc.capture(env=out_env) as cap:
        c.resize_(64)
        c[4:] = 1.0
        c.resize_(8)
        c[:] = torch.tensor([0, 1, 2, 3, 1, 1, 1, 1.0])
        c.resize_(6)
        c.sum()
    recs = ops(read_trace(cap.path))
    grow, shrink, shrunk = [r["outputs"][0] for r in recs if r["fn"] == "Tensor.resize_"]
    assert grow.get("uninitialized") is True and grow["digest"] is None
    assert shrink.get("uninitialized") is True and shrink["digest"] is None
    assert shrunk.get("uninitialized") is None
    assert shrunk["digest"] == oc_digest(torch.tensor([0, 1, 2, 3, 1, 1.0]))


@pytest.mark.parametrize("how", ["torch.chunk", "torch.split", "Tensor.chunk", "Tensor.unbind"])
def test_every_view_of_a_regrown_storage_is_uninitialised(out_env: dict[str, str], how: str) -> None:
    """FSDP1 frees its flat parameter's storage after each use (``untyped_storage().resize_(0)``) and
    grows it again before the next (``resize_(n)``), then takes views of it: ``torch.chunk`` marked
    its first output uninitialised and digested the second (whatever the allocator left), and every
    identical rerun of an FSDP1 program compared with ~62 false mismatches per rank (hand test). The
    first view's own mark replaced the storage's; every view of the regrown memory stays marked."""
    x = torch.zeros(1000)
    with oc.capture(env=out_env) as cap:
        x.untyped_storage().resize_(0)
        x.untyped_storage().resize_(1000 * 4)
        if how == "torch.chunk":
            parts = torch.chunk(x, 2)
        elif how == "torch.split":
            parts = torch.split(x, 500)
        elif how == "Tensor.chunk":
            parts = x.chunk(2)
        else:
            parts = x.view(2, 500).unbind(0)
        parts[1].sum()
        x.fill_(2.0)
        parts[1].sum()
    op = ops(read_trace(cap.path))
    views = [r for r in op if r["fn"] == how]
    assert views and all(e.get("uninitialized") is True for r in views for e in r["outputs"]), \
        [r["outputs"] for r in views]
    sums = [r for r in op if r["fn"] == "Tensor.sum"]
    assert sums[0]["inputs"][0].get("uninitialized") is True
    assert sums[1]["inputs"][0]["digest"] == oc_digest(torch.full((500,), 2.0))  # written whole since


def test_an_output_named_like_an_input_has_its_own_dump(out_env: dict[str, str]) -> None:
    """``F.batch_norm``'s ``arg1`` (running_mean) is an input and, written, an output (§3.1): both were
    dumped to ``<seq>-arg1.pt``, the output overwriting the input's value from before the call (its
    dump record's sha256 no longer matched the file). The output's dump is ``out.arg1``."""
    import hashlib

    torch.manual_seed(0)
    bn, x = torch.nn.BatchNorm1d(3), torch.randn(4, 3)
    with oc.capture(env=out_env, dump_steps="0", dump_filter="*.batch_norm") as cap:
        bn(x)
    recs = read_trace(cap.path)
    seq = next(r["seq"] for r in ops(recs) if r["fn"] == "torch.nn.functional.batch_norm")
    dumps = {r["slot"]: r for r in recs if r["kind"] == "dump" and r["seq"] == seq}
    assert {"arg1", "out.arg1", "arg2", "out.arg2", "out"} <= set(dumps)
    for d in dumps.values():
        assert hashlib.sha256((cap.path.parent / d["path"]).read_bytes()).hexdigest() == d["sha256"], d
    before = torch.load(cap.path.parent / dumps["arg1"]["path"])
    after = torch.load(cap.path.parent / dumps["out.arg1"]["path"])
    assert torch.equal(before, torch.zeros(3)) and torch.equal(after, bn.running_mean)


def test_a_plain_tensor_is_dumped_inside_a_torch_func_transform(out_env: dict[str, str],
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """``torch.func.jvp`` with dumps on: the plain tensors ``_make_dual`` took were copied for the
    dump under the transform, which made the copy its wrapper, and saving it failed ("Cannot access
    storage of TensorWrapper", a capture_error and a stderr notice; hand test). The copy is made
    with the transforms set aside; the transform's own wrappers are still not dumped."""
    from torch.func import jvp

    x = torch.linspace(0, 1, 5)
    with oc.capture(env=out_env, dump_steps="0") as cap:
        jvp(torch.sin, (x,), (torch.ones(5),))
    recs = read_trace(cap.path)
    make = next(r for r in ops(recs) if r["fn"] == "torch._make_dual")
    assert "capture_error" not in make
    dumps = {r["slot"]: r for r in recs if r["kind"] == "dump" and r["seq"] == make["seq"]}
    assert set(dumps) == {"arg0", "arg1"}, dumps
    assert torch.equal(torch.load(cap.path.parent / dumps["arg0"]["path"]), x)
    assert "failed" not in capfd.readouterr().err


def test_an_out_argument_and_the_output_have_their_own_dumps(out_env: dict[str, str]) -> None:
    """``torch.add(a, b, out=c)``: the input ``out`` (its value before the call) and the output ``out``
    both went to ``<seq>-out.pt``; the input's dump is ``in.out`` now (§7)."""
    import hashlib

    a, b, c = torch.ones(3), torch.full((3,), 2.0), torch.zeros(3)
    with oc.capture(env=out_env, dump_steps="0", dump_filter="torch.add") as cap:
        torch.add(a, b, out=c)
    recs = read_trace(cap.path)
    dumps = {r["slot"]: r for r in recs if r["kind"] == "dump"}
    assert set(dumps) == {"arg0", "arg1", "in.out", "out"}
    for d in dumps.values():
        assert hashlib.sha256((cap.path.parent / d["path"]).read_bytes()).hexdigest() == d["sha256"], d
    assert torch.equal(torch.load(cap.path.parent / dumps["in.out"]["path"]), torch.zeros(3))
    assert torch.equal(torch.load(cap.path.parent / dumps["out"]["path"]), torch.full((3,), 3.0))


def test_torch_func_and_batched_tensors_are_no_capture_failure(out_env: dict[str, str],
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    """Inside ``jacrev`` with dumps on, and for batched gradients (``jacobian(vectorize=True)``), capture
    reported its own failures ('Cannot access storage of TensorWrapper', 'summarising ... failed'):
    such tensors have no storage of their own; they get the torch.func reason and no dump."""
    from opguard.capture.session import FUNCTORCH_REASON

    x = torch.ones(3)
    with oc.capture(env=out_env, dump_steps="0") as cap:
        torch.func.jacrev(lambda v: v.sin())(x)
        torch.autograd.functional.jacobian(lambda v: v.exp(), x, vectorize=True)
    recs = read_trace(cap.path)
    assert not [r["capture_error"] for r in recs if r.get("capture_error")]
    reasons = {e.get("reason") for r in ops(recs) for e in (*r["inputs"], *r["outputs"]) if e.get("digest") is None}
    assert "summary failed" not in str(reasons) and FUNCTORCH_REASON in reasons
    assert "failed" not in capfd.readouterr().err


def test_dispatch_level_writes_to_no_grad_views_are_no_capture_failure(out_env: dict[str, str],
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    """At the dispatch level, reading ``grad_fn`` of a view made under no_grad of a tensor that
    requires grad raises: ``nn.Embedding(padding_idx=0)`` (its init fills the row through such a
    view) made capture report its own recording failure on every such record."""
    with oc.capture(env=out_env, level="dispatch") as cap:
        torch.nn.Embedding(5, 3, padding_idx=0)
        p = torch.nn.Parameter(torch.zeros(8))
        with torch.no_grad():
            p[0:4].copy_(torch.ones(4))
    assert not [r for r in read_trace(cap.path) if r.get("capture_error")]
    assert "failed" not in capfd.readouterr().err


def test_shared_memory_is_read_at_every_use(out_env: dict[str, str]) -> None:
    """``t.share_memory_()``: other processes (Hogwild, spawned workers) write that memory without any
    torch op capture sees; it is never served from the digest cache (a write through the storage
    stands in for another process's here)."""
    t = torch.zeros(4)
    with oc.capture(env=out_env) as cap:
        t.share_memory_()
        t.neg()
        t.untyped_storage().fill_(1)   # not a torch function: not seen, like another process's write
        t.neg()
    negs = [r["inputs"][0]["digest"] for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.neg"]
    ones_bytes = torch.frombuffer(bytearray(b"\x01" * 16), dtype=torch.float32)
    assert negs == [oc_digest(torch.zeros(4)), oc_digest(ones_bytes)]


def test_a_tensor_pickled_for_another_process_is_read_at_every_use(out_env: dict[str, str]) -> None:
    """Sending a tensor to another process (``Queue.put``, a spawned ``Process``'s arguments) pickles
    it, which moves its storage into shared memory without ``share_memory_()``; the other process's
    writes were then never seen and the second ``t * 3`` was recorded with the first one's input
    digest (hand test: compare blamed "outputs differ, inputs equal"). The pickling is done here
    with multiprocessing's own pickler, the other process's write through the storage."""
    from multiprocessing import resource_sharer
    from multiprocessing.reduction import ForkingPickler

    t = torch.zeros(4)
    try:
        with oc.capture(env=out_env) as cap:
            t.mul(3)
            ForkingPickler.dumps(t)        # what Queue.put / Process(args=...) do: t is in shared memory now
            t.mul(3)
            t.untyped_storage().fill_(1)   # another process's write: no torch function, no version change
            t.mul(3)
    finally:  # pickling a descriptor outside a spawning Popen started multiprocessing's sharer thread:
        resource_sharer._resource_sharer.stop(timeout=10)  # type: ignore[attr-defined]  (forks need one thread)
    muls = [r["inputs"][0]["digest"] for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.mul"]
    ones_bytes = torch.frombuffer(bytearray(b"\x01" * 16), dtype=torch.float32)
    assert muls == [oc_digest(torch.zeros(4))] * 2 + [oc_digest(ones_bytes)]
    from multiprocessing.reduction import ForkingPickler as Fp
    assert all(getattr(f, "__module__", "") != "opguard.capture.sent" for f in Fp._extra_reducers.values())


def _mm_at(a: torch.Tensor, b: torch.Tensor, at: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``torch.mm(a, b)`` until an output lands at address ``at`` (the allocator reuses a freed
    block), and the outputs before it (kept alive, so that their addresses are not given again)."""
    held: list[torch.Tensor] = []
    for _ in range(4):
        c = torch.mm(a, b)
        if c.data_ptr() == at:
            return c, held
        held.append(c)
    raise AssertionError("the allocator never reused the freed block: the case is not exercised")


def test_storage_resize_drops_cached_digests_and_marks_regrown_memory(tmp_path: Path) -> None:
    """FSDP2 frees its unsharded parameters' memory with ``untyped_storage().resize_(0)`` while the
    parameter objects live on, and re-allocates it with ``resize_(n)`` before the next all-gather.
    Before, capture's digest cache kept serving a freed parameter's digest (its tensor was alive) to
    a new tensor the allocator put at that address with the same key: an identical FSDP2 rerun
    compared with a false "first divergence: linear, outputs differ, inputs equal". Now a storage
    resize drops the cached contents of the old and the new memory, and memory re-grown from
    nothing is uninitialised until something writes it (docs/capture.md §3.7, §5.3)."""
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        shape = (2048, 5120)  # 40 MiB: mmap'd, so the allocator gives the freed address back at once
        w = torch.randn(shape)
        a, b = torch.ones(2048, 1), torch.ones(1, 5120)
        w.mul(1.0)  # w's content cached (an input): alive, keyed by its address
        at = w.data_ptr()
        w.untyped_storage().resize_(0)  # freed; the tensor object lives on
        o, _held = _mm_at(a, b, at)  # a new output at w's old address
        o.add(0.0)  # o as an input: its digest must be its own content's
        w.untyped_storage().resize_(2048 * 5120 * 4)  # re-grown: whatever the allocator left
        w.view(-1)  # a view of unwritten memory: uninitialised as input and output
        w.copy_(torch.full(shape, 2.0))  # written: content again
        w.view(-1)
    op = ops(read_trace(cap.path))
    mms = [r for r in op if r["fn"] == "torch.mm"]
    assert mms[-1]["outputs"][0]["digest"] == oc_digest(torch.ones(shape))
    add = next(r for r in op if r["fn"] == "Tensor.add")
    assert add["inputs"][0]["digest"] == oc_digest(torch.ones(shape))
    views = [r for r in op if r["fn"] == "Tensor.view"]
    assert views[0]["inputs"][0].get("uninitialized") is True and views[0]["inputs"][0]["digest"] is None
    assert views[0]["outputs"][0].get("uninitialized") is True
    assert views[1]["inputs"][0]["digest"] == oc_digest(torch.full(shape, 2.0))
    assert "uninitialized" not in views[1]["outputs"][0]


@pytest.mark.parametrize("fast_call", ["1", "0"])
def test_a_cached_digest_is_not_served_once_its_tensor_moved_to_other_memory(tmp_path: Path, fast_call: str) -> None:
    """``Tensor.set_`` gives a tensor another memory, and no torch function mode sees it (PyTorch does
    not dispatch it): the tensor lives on, so its cached content was served to the next tensor the
    allocator put at its old address with the same key. A cached entry is now served only while its
    tensor is alive *and still at that address*, in the C entry and the Python one
    (docs/capture.md §5.3; fails on the previous commit)."""
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path), "OPGUARD_CAPTURE_FAST_CALL": fast_call}) as cap:
        shape = (2048, 5120)  # 40 MiB: mmap'd, so the allocator gives the freed address back at once
        w = torch.randn(shape)
        a, b = torch.ones(2048, 1), torch.ones(1, 5120)
        w.mul(1.0)  # w's content cached
        at = w.data_ptr()
        w.set_(torch.zeros(3).untyped_storage())  # w's memory freed; w lives on elsewhere
        o, _held = _mm_at(a, b, at)
        o.add(0.0)
    op = ops(read_trace(cap.path))
    assert [r for r in op if r["fn"] == "torch.mm"][-1]["outputs"][0]["digest"] == oc_digest(torch.ones(shape))
    assert next(r for r in op if r["fn"] == "Tensor.add")["inputs"][0]["digest"] == oc_digest(torch.ones(shape))


def test_optimizers_stepped_inside_a_backward_advance_the_step_once_when_it_ends(tmp_path: Path) -> None:
    """The optimizer in backward (one optimizer per parameter, stepped from
    ``register_post_accumulate_grad_hook``, a pattern PyTorch documents to save memory): before, each
    parameter's ``step()`` advanced the step, so 3 iterations of a 4-parameter model were steps 0-12
    and a step selection picked single optimizer records. Now the steps taken inside one backward
    pass advance the step once, when that backward finishes (docs/capture.md §3.6)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in net.parameters()}

    def hook(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(hook)
    x = torch.randn(5, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        for _ in range(3):
            net(x).square().mean().backward()
    recs = read_trace(cap.path)
    op = ops(recs)
    steps = [r for r in op if r["fn"] == "torch.optim.AdamW.step"]
    assert [r["step"] for r in steps] == [0] * 4 + [1] * 4 + [2] * 4
    assert [r["step"] for r in op if r["fn"] == "torch.nn.functional.linear"] == [0, 0, 1, 1, 2, 2]
    assert [r["step"] for r in recs if r["kind"] == "step"] == [1, 2, 3]
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["step_source"] == "optimizer"


def test_a_partial_write_leaves_the_rest_uninitialized(tmp_path: Path) -> None:
    """``out = torch.empty(4, 3); out[i] = x[i]`` row by row (a crop loop, a preallocated batch):
    after each write ``out`` still holds what the allocator left in the other rows, and its entry as
    the write's output was digested whole: identical runs compared with a false first divergence
    ("outputs differ, inputs and arguments equal") that came before a real edit (hand test, a
    SimCLR crop loop). A write through a view of the first row cleared the whole buffer's mark.
    Now a partial write's output stays uninitialised and the mark stays; a whole write (``copy_``,
    ``fill_``, ``out=``, ``t[:] = v``) makes what it wrote content (docs/capture.md §3.7)."""
    x = torch.arange(12.0).view(4, 3)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        rows = torch.empty(4, 3)
        for i in range(4):
            rows[i] = x[i]
        rows.sum()
        full = torch.empty(4, 3)
        full[:] = x
        full.sum()
        half = torch.empty(4, 3)
        half[0].copy_(x[0])  # a whole write of a view at the buffer's own address
        half[1].copy_(x[1])
        half.narrow(0, 2, 2).fill_(1.0)
        half.sum()
        some = torch.empty(4, 3)
        some.index_copy_(0, torch.tensor([0, 1]), x[:2])
        z = torch.empty(4, 3)
        torch.add(x, 1, out=z)
        z.sum()
    op = ops(read_trace(cap.path))
    sets = [r for r in op if r["fn"] == "Tensor.__setitem__"]
    assert len(sets) == 5
    for r in sets[:4]:
        assert r["inputs"][0]["slot"] == "self" and r["inputs"][0]["uninitialized"] is True
        assert r["outputs"][0]["uninitialized"] is True and r["outputs"][0]["digest"] is None, r
    sums = [r for r in op if r["fn"] == "Tensor.sum"]
    assert sums[0]["inputs"][0]["uninitialized"] is True  # not known to be written whole
    assert sums[0]["outputs"][0]["digest"] == oc_digest(x.sum())  # what it computed is a result
    assert sets[4]["outputs"][0]["digest"] == oc_digest(x) and "uninitialized" not in sets[4]["outputs"][0]
    assert sums[1]["inputs"][0]["digest"] == oc_digest(x)
    copies = [r for r in op if r["fn"] == "Tensor.copy_"]
    assert [c["inputs"][0].get("uninitialized") for c in copies] == [True, True]
    assert [c["outputs"][0]["digest"] for c in copies] == [oc_digest(x[0]), oc_digest(x[1])]
    fill = next(r for r in op if r["fn"] == "Tensor.fill_")
    assert fill["inputs"][0]["uninitialized"] is True and fill["outputs"][0]["digest"] == oc_digest(torch.ones(2, 3))
    # every byte of ``half`` written whole through its views (rows 0, 1, then 2-3): content now
    assert sums[2]["inputs"][0]["digest"] == oc_digest(torch.cat([x[:2], torch.ones(2, 3)]))
    assert "uninitialized" not in sums[2]["inputs"][0]
    ic = next(r for r in op if r["fn"] == "Tensor.index_copy_")
    assert ic["outputs"][0]["uninitialized"] is True and ic["outputs"][0]["digest"] is None
    add = next(r for r in op if r["fn"] == "torch.add")
    assert add["outputs"][0]["digest"] == oc_digest(x + 1) and sums[3]["inputs"][0]["digest"] == oc_digest(x + 1)


def test_views_made_before_a_write_keep_their_own_state(tmp_path: Path) -> None:
    """PowerSGD's pattern: every view of one ``torch.empty`` buffer is made first, then written one
    by one. After ``a.copy_(...)`` wrote the first view whole, ``a`` (at the buffer's own address)
    still read as uninitialised, so its content was never compared; and its sibling ``b``, marked on
    its own when made, lost that mark at the first write through any view (the version counter is
    shared), so its never-written bytes were digested: identical runs of DDP with ``powerSGD_hook``
    compared with 6 false mismatches per rank (hand test). Now the buffer's mark keeps the byte
    ranges written whole through dense views (docs/capture.md §3.7)."""
    x = torch.arange(8.0)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        buf = torch.empty(16)
        a, b, c = buf[0:8], buf[8:12], buf[12:16]
        a.copy_(x)
        a.div_(2)        # written again, at the buffer's own address: the rest stays unwritten
        a.sum()          # written whole: content
        b.sum()          # never written: uninitialised
        b.zero_()
        b.sum()
        c.mul(2)         # still unwritten
        c.fill_(1.0)     # the last part: every byte of buf written
        buf.sum()
    op = ops(read_trace(cap.path))
    sums = [r["inputs"][0] for r in op if r["fn"] == "Tensor.sum"]
    assert sums[0]["digest"] == oc_digest(x / 2) and "uninitialized" not in sums[0]
    assert sums[1]["uninitialized"] is True and sums[1]["digest"] is None
    assert sums[2]["digest"] == oc_digest(torch.zeros(4)) and "uninitialized" not in sums[2]
    mul = next(r for r in op if r["fn"] == "Tensor.mul")
    assert mul["inputs"][0]["uninitialized"] is True
    assert sums[3]["digest"] == oc_digest(torch.cat([x / 2, torch.zeros(4), torch.ones(4)]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_calls_on_fake_tensors_are_not_recorded(tmp_path: Path, dynamic: bool) -> None:
    """AOTAutograd run directly (``aot_function``; ``torch.library.opcheck``), outside
    ``torch.compile``: its tracing calls run on FakeTensors under a FakeTensorMode and compute nothing.
    They were recorded (``Tensor.mul`` with FakeTensor inputs), a SymInt argument failed the record
    (``capture's own recording failed: ... SymInt is not JSON serializable``), and capture's storage
    ``resize_`` wrapper read a FakeTensor's data pointer: a PyTorch ``UserWarning`` only under
    capture (hand test). Now capture stands aside while a FakeTensorMode is active."""
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_function

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    g = aot_function(f, fw_compiler=nop, dynamic=dynamic)
    x = torch.randn(3, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
            y = g(x).sum()
    assert y.item() == (x.detach() * 2).sum().item()
    assert not [w for w in caught if "FakeTensor" in str(w.message)]
    op = ops(read_trace(cap.path))
    assert not any(r.get("capture_error") for r in op)
    assert "Tensor.mul" not in {r["fn"] for r in op}  # the tracing run's call, on FakeTensors
    assert "Tensor.sum" in {r["fn"] for r in op}


def test_a_lazy_backward_compile_is_not_recorded(out_env: dict[str, str]) -> None:
    """``torch.compile`` compiles a graph's backward at its first backward call, outside Dynamo's
    compile session; inductor's lowering there makes torch calls (dtype promotions, constants):
    ~1,000 records under the program's ``backward()`` in a run that compiled, none in a rerun that
    found the graph in PyTorch's compile cache, so identical runs did not align (hand test, a
    compiled Llama-style model). A backward compiler that calls torch stands in for inductor."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    compiled_bw = []

    def fw(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        return make_boxed_func(gm)

    def bw(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        torch.promote_types(torch.float32, torch.float16)  # what a compiler's lowering might call
        torch.zeros(1).add_(1)
        compiled_bw.append(gm)
        return make_boxed_func(gm)

    lin = torch.nn.Linear(4, 2)
    f = torch.compile(lambda x: lin(x).relu().sum(), backend=aot_autograd(fw_compiler=fw, bw_compiler=bw))
    x = torch.randn(3, 4)
    with oc.capture(env=out_env) as cap:
        f(x).backward()
        torch.ones(2).sum()
    assert compiled_bw, "the backward was not compiled lazily inside the capture"
    fns = [r["fn"] for r in ops(read_trace(cap.path))]
    assert "torch.promote_types" not in fns and "torch.zeros" not in fns and "Tensor.add_" not in fns, fns
    assert fns[-2:] == ["torch.ones", "Tensor.sum"], fns


def test_capture_s_module_hooks_do_not_make_torch_compile_warn(
        out_env: dict[str, str], recwarn: pytest.WarningsRecorder) -> None:
    """Calling a ``torch.compile(module)`` warns when global module hooks exist ("... will cause the
    hooks to fire an extra time ..."): capture's own hooks made every compiled module call of a
    captured program warn, which its plain run never did (hand test). The program's own global hooks
    still make it warn."""
    import warnings

    warnings.simplefilter("always")
    cm = torch.compile(torch.nn.Linear(4, 2), backend="eager")
    x = torch.randn(3, 4)
    with oc.capture(env=out_env):
        cm(x)
        assert not [w for w in recwarn if "global hooks" in str(w.message)]
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        try:
            cm(x)
        finally:
            handle.remove()
    assert [w for w in recwarn if "global hooks" in str(w.message)]


class _Recursive(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        x = self.lin(x).relu()
        return self(x, depth - 1) if depth > 0 else x


def test_a_module_that_calls_itself_keeps_its_path(out_env: dict[str, str]) -> None:
    """A module whose forward calls the module itself (``self(x, depth - 1)``) was resolved again
    under itself, where it is no child: its path became its class name (``_Recursive``), and stayed
    so for every later call from its real parent (hand test)."""
    net = torch.nn.Sequential(_Recursive())
    x = torch.randn(2, 4)
    with oc.capture(env=out_env) as cap:
        net(x)
        net(x)
    mods = [r["module"] for r in ops(read_trace(cap.path)) if r["fn"] == "torch.nn.functional.linear"]
    assert mods == ["Sequential.0.lin"] * 4, mods


class _MyEncoder(torch.nn.TransformerEncoder):
    pass


def _fused_case(case: str) -> tuple[Any, Any]:
    """(module, call) of one fast-path case (hand tests that broke the first version)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    cls = _MyEncoder if case == "subclass" else torch.nn.TransformerEncoder
    enc = cls(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    if case == "keywords":
        return enc, lambda: enc(src=x, src_key_padding_mask=pad)
    if case == "mha_keywords":
        mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
        return mha, lambda: mha(query=x, key=x, value=x, need_weights=False)[0]
    if case == "layers_eval":  # PyTorch judges the encoder's conversion by its first layer
        enc.train()
        enc.layers.eval()
    if case == "grad_first_layer_frozen":
        enc.layers[0].requires_grad_(False)
    return enc, lambda: enc(x, src_key_padding_mask=pad)


@pytest.mark.parametrize("case", ["keywords", "mha_keywords", "subclass", "layers_eval", "grad_first_layer_frozen"])
def test_fast_path_decisions_follow_pytorch_s(out_env: dict[str, str], case: str) -> None:
    """Where capture judged the fast path otherwise than PyTorch does — the input by keyword, a
    subclass, an encoder in training mode with its layers in eval, grad needed only past the first
    layer — the module ran its standard path under capture and the fast path without (padded
    positions computed instead of zeros, or other last bits; hand test)."""
    _, call = _fused_case(case)
    if case == "grad_first_layer_frozen":  # PyTorch's fast path then fails in MultiheadAttention: so must capture's
        with pytest.raises(AssertionError) as plain_err:
            call()
        with oc.capture(env=out_env) as cap, pytest.raises(AssertionError) as got_err:
            call()
        assert str(got_err.value) == str(plain_err.value)
    else:
        with torch.no_grad():
            plain = call()
            with oc.capture(env=out_env) as cap:
                got = call()
        assert torch.equal(plain.view(torch.int32), got.view(torch.int32))
    recs = ops(read_trace(cap.path))
    assert [r["api"] for r in recs][:1] == ["module"], [(r["api"], r["fn"]) for r in recs][:3]


def test_the_fast_path_check_is_unseen_by_the_program_s_mode_and_keeps_its_mode_stack(out_env: dict[str, str]) -> None:
    """Capture's fast-path check read the input's ``dim()`` through the program's own torch function
    modes (a counting mode saw extra calls); and a mode the program entered in a module's pre-hook
    and left in its post-hook popped capture's mode instead of its own (capture's mode was put back
    on top): the program's mode stayed on, and nothing more was recorded (hand tests)."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.n += 1
            return func(*args, **(kwargs or {}))

    enc, call = _fused_case("plain")
    with torch.no_grad():
        with Count() as c:
            call()
        plain = c.n
        with oc.capture(env=out_env) as cap:
            with Count() as c:
                call()
            assert c.n == plain
            entered = Count()
            h1 = enc.register_forward_pre_hook(lambda *a: (entered.__enter__(), None)[1])
            h2 = enc.register_forward_hook(lambda *a: entered.__exit__(None, None, None))
            call()
            h1.remove()
            h2.remove()
            assert torch._C._len_torch_function_stack() == 1  # capture's mode alone, the program's left
            torch.ones(2).sum()
    assert [r["fn"] for r in ops(read_trace(cap.path))][-2:] == ["torch.ones", "Tensor.sum"]


def test_a_fused_record_says_what_raised_and_a_nested_tensor_entry_why(out_env: dict[str, str],
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    enc, _ = _fused_case("plain")
    x = torch.randn(2, 5, 8)
    nt = torch.nested.nested_tensor([torch.ones(4, 8), torch.ones(2, 8)])
    with torch.no_grad(), oc.capture(env=out_env) as cap:
        with pytest.raises(RuntimeError):
            enc(x, src_key_padding_mask=torch.zeros(3, 3, dtype=torch.bool))
        nt.to_padded_tensor(0.0)
    recs = ops(read_trace(cap.path))
    fused = next(r for r in recs if r["api"] == "module")
    assert fused["error"].startswith("the forward raised RuntimeError: "), fused["error"]
    assert {"slot": "config.TransformerEncoder.use_nested_tensor", "type": "bool", "value": True} in fused["args"]
    pad = next(r for r in recs if r["fn"] == "Tensor.to_padded_tensor")
    assert pad["inputs"][0]["reason"] == "nested tensor" and pad["inputs"][0]["shape"] is None
    assert "failed" not in capfd.readouterr().err


def _scale(x: torch.Tensor, t: float) -> torch.Tensor:
    return x * t


def test_torchscript_in_the_process_is_noted(out_env: dict[str, str]) -> None:
    """A TorchScript function's calls are not recorded; an edited argument of one (a scripted
    post-processing step) showed only as an 'inherited' difference at a later call, with nothing
    pointing to the scripted call (hand test). meta.json notes now say TorchScript ran."""
    scripted = torch.jit.script(_scale)
    with oc.capture(env=out_env) as cap:
        scripted(torch.ones(2), 0.5).sum()
    notes = json.loads((cap.path / "meta.json").read_text())["notes"]
    assert any(n.startswith("torch.jit: 1 ") and "not recorded" in n for n in notes), notes


def test_pytorch_s_own_torchscript_is_not_noted_as_the_program_s(tmp_path: Path) -> None:
    """Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``) makes PyTorch script its own jvp
    decompositions (14 functions of ``torch._decomp``): meta.json said TorchScript functions' calls
    were not recorded in a program that scripted nothing (hand test). Only the program's count."""
    from torch.func import jvp

    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        jvp(lambda x: torch.nn.functional.layer_norm(x, (3,)).sin(), (torch.randn(2, 3),), (torch.ones(2, 3),))
    unit = torch.jit._state._python_cu.get_functions()
    own = sum(1 for f in unit if not f.qualified_name.startswith("__torch__.torch."))
    assert len(unit) > own  # PyTorch scripted its own (other tests in this process may have scripted some)
    notes = [n for n in json.loads((cap.path / "meta.json").read_text())["notes"] if n.startswith("torch.jit: ")]
    assert notes == ([f"torch.jit: {own} " + notes[0].split(" ", 2)[2]] if own else []), notes


def test_a_tangent_traced_from_uninitialised_memory_is_uninitialised(tmp_path: Path) -> None:
    """``torch.func.linearize`` attaches ``new_empty(()).expand_as(p)`` (uninitialised memory) as the
    tangents it traces with: the tangent ``torch._unpack_dual`` returned was digested, and identical
    runs compared with "outputs differ, inputs and arguments equal" at ``_unpack_dual`` (hand test).
    A tangent unpacked at a dual level where one of uninitialised memory was attached is now
    uninitialised; a ``jvp`` with the program's own tangents is digested as before (§3.7)."""
    import torch.autograd.forward_ad as fwad
    from torch.func import jvp, linearize

    x = torch.randn(5)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        _, jvp_fn = linearize(lambda z: torch.sin(z) * z.cumsum(0), x)
        got = jvp_fn(torch.ones(5))
        with fwad.dual_level():  # the program's own tangent, after linearize's level ended
            fwad.unpack_dual(torch.sin(fwad.make_dual(x, torch.ones(5))) * 2)
    op = ops(read_trace(cap.path))
    unpacks = [r for r in op if r["fn"] == "torch._unpack_dual"]
    assert len(unpacks) == 2, [r["fn"] for r in op]
    assert unpacks[0]["outputs"][1]["uninitialized"] is True and unpacks[0]["outputs"][1]["digest"] is None
    assert unpacks[0]["outputs"][0]["digest"] is not None  # the primal is a result
    own = unpacks[1]["outputs"][1]
    assert own["digest"] == oc_digest(torch.cos(x) * 2) and "uninitialized" not in own
    assert torch.equal(got, jvp(lambda z: torch.sin(z) * z.cumsum(0), (x,), (torch.ones(5),))[1])


def test_a_recursion_limit_that_suffices_without_capture_suffices_with_it(tmp_path: Path) -> None:
    """A tree-structured model 60 modules deep under ``sys.setrecursionlimit(300)`` ran plain and
    raised RecursionError under capture (its module hooks add a frame per nested module; hand test:
    plain needed 246, captured 316). While capture runs the limit the program sets gets headroom for
    capture's frames, and ``sys.getrecursionlimit()`` still returns what the program set."""
    import sys

    class Node(torch.nn.Module):
        def __init__(self, child: torch.nn.Module | None) -> None:
            super().__init__()
            self.lin, self.child = torch.nn.Linear(2, 2), child

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.lin(x).tanh()
            return self.child(x) if self.child is not None else x

    torch.manual_seed(0)
    model: torch.nn.Module | None = None
    for _ in range(60):
        model = Node(model)
    assert model is not None
    x = torch.ones(1, 2)
    original = sys.getrecursionlimit()

    def runs(limit: int) -> bool:
        sys.setrecursionlimit(limit)
        try:
            model(x)
            return True
        except RecursionError:
            return False
        finally:
            sys.setrecursionlimit(original)

    lo, hi = 50, original  # the least limit the forward runs under, without capture
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if runs(mid) else (mid + 1, hi)
    expected = model(x)
    raw_get = sys.getrecursionlimit  # a reference taken before capture starts (from sys import ...)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        assert sys.getrecursionlimit() == original and raw_get() > original  # headroom from the start
        sys.setrecursionlimit(lo)
        try:
            assert sys.getrecursionlimit() == lo
            got = model(x)
        finally:
            sys.setrecursionlimit(original)
    assert sys.getrecursionlimit() == original and sys.setrecursionlimit.__module__ == "sys"
    assert torch.equal(got, expected)
    sys.setrecursionlimit(lo)  # the limit in force when capture starts (the default, for most programs)
    try:
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "start")}):
            assert sys.getrecursionlimit() == lo
            again = model(x)
        assert sys.getrecursionlimit() == lo
    finally:
        sys.setrecursionlimit(original)
    assert torch.equal(again, expected)
    assert sum(1 for r in ops(read_trace(cap.path)) if r["fn"] == "torch.nn.functional.linear") == 60


def test_a_process_that_recorded_nothing_says_where_the_work_may_have_gone(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A program that does its work in processes it starts itself (``torch.multiprocessing.spawn``)
    under ``opguard-run --capture``: the launching process recorded no operation, silently, and
    compare said only "check that capture was on" (it was; hand test). A capture that recorded no
    operation now says so, on stderr and in meta, with where the work may have gone."""
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        pass
    notes = json.loads((cap.path / "meta.json").read_text())["notes"]
    assert any(n.startswith("this process recorded no operation") and "torch.multiprocessing.spawn" in n
               for n in notes), notes
    assert "warning: this process recorded no operation" in capfd.readouterr().err


def test_dispatch_level_deepcopy_of_a_tensor_digests_the_copy(out_env: dict[str, str]) -> None:
    """``copy.deepcopy`` of a tensor clones its storage (``UntypedStorage.copy_``, which PyTorch makes
    of ``aten::set_`` onto the new, uninitialised storage and ``aten::copy_``) and points a new tensor
    at it with ``aten::set_``. At ``level=dispatch`` the new storage's leftover bytes were digested
    (identical runs: 8 mismatches with an AveragedModel EMA copy, 474 converting a QAT model) and
    the copy stayed marked uninitialised, so its uses had no digest (hand test). The storage copy
    is not recorded; ``set_`` writes nothing, and the copy's content is its digest."""
    import copy

    buf = torch.arange(256.0)
    with oc.capture(env=out_env, level="dispatch") as cap:
        dup = copy.deepcopy(buf)
        dup.sum()
    aten = [r for r in ops(read_trace(cap.path)) if r["api"] == "aten"]
    assert [r["fn"] for r in aten][:2] == ["aten::new_empty.default", "aten::set_.source_Storage_storage_offset"]
    assert aten[1]["outputs"][0]["digest"] == oc_digest(buf) and "uninitialized" not in aten[1]["outputs"][0]
    total = next(r for r in aten if r["fn"] == "aten::sum.default")
    assert total["inputs"][0]["digest"] == oc_digest(buf)
    assert torch.equal(dup, buf) and "copy_" not in torch.UntypedStorage.__dict__  # restored after capture


def test_a_copy_of_uninitialised_memory_is_uninitialised(tmp_path: Path) -> None:
    """``torch.empty(8, 8).clone()``, ``torch.empty(8, 8).t().contiguous()`` and ``t.new(64)`` (sizes
    only) were digested with whatever the allocator left: identical runs compared with an
    "introduced" divergence there (hand test). A copy of uninitialised memory, and ``Tensor.new``
    given sizes, are uninitialised outputs; ``t.new([1.0, 2.0])`` (data) is a result."""
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        d = torch.empty(8, 8).clone()
        e = torch.empty(8, 8).t().contiguous()
        f = torch.empty(4).to(torch.float64)
        b = torch.ones(2).new(64)
        data = torch.ones(2).new([1.0, 2.0])
        for t in (d, e, f, b):
            t.fill_(1.0)
        torch.ones(3).clone()
    op = ops(read_trace(cap.path))
    out = {r["fn"]: r["outputs"][0] for r in op if r["fn"] in ("Tensor.contiguous", "Tensor.to")}
    clones = [r["outputs"][0] for r in op if r["fn"] == "Tensor.clone"]
    news = [r["outputs"][0] for r in op if r["fn"] == "Tensor.new"]
    assert clones[0].get("uninitialized") is True and clones[0]["digest"] is None
    assert out["Tensor.contiguous"].get("uninitialized") is True and out["Tensor.to"].get("uninitialized") is True
    assert news[0].get("uninitialized") is True and news[1]["digest"] == oc_digest(data)
    assert clones[1]["digest"] == oc_digest(torch.ones(3))  # a copy of content is a result
    fills = [r["outputs"][0] for r in op if r["fn"] == "Tensor.fill_"]
    assert len(fills) == 4 and all(f["digest"] for f in fills)  # written whole: content from then on


class _Square(torch.autograd.Function):
    """x * x with its own backward and vmap rule: under torch.func it runs as the higher-order
    operator ``custom_function_call``."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g

    @staticmethod
    def vmap(info: Any, in_dims: Any, x: torch.Tensor) -> Any:
        return x * x, in_dims[0]


def test_calls_inside_higher_order_operators_are_recorded_and_results_unchanged(tmp_path: Path) -> None:
    """A custom autograd.Function under vmap/grad/jacrev runs as ``custom_function_call``, a
    higher-order operator: its calls (the program's own forward) were not recorded, so an edit there
    had no record. The operator is re-entered now, its calls nested under it; eager ``torch.cond``,
    ``while_loop``, ``scan`` and ``flex_attention`` (higher-order operators too) give the same results."""
    from torch._higher_order_ops.scan import scan
    from torch._higher_order_ops.while_loop import while_loop
    from torch.func import grad, jacrev, vmap

    def program() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 3, generator=g)
        out = [vmap(_Square.apply)(x), grad(lambda v: _Square.apply(v).sum())(x),
               jacrev(lambda v: _Square.apply(v).sum(0))(x[0]),
               torch.cond(x.sum() > 0, lambda v: v.sin() * 2, lambda v: v.cos() + 1, (x,)),
               while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 1.5), (torch.tensor(0), x))[1],
               scan(lambda c, xs: (c + xs, (c + xs) * 2), torch.zeros(3), x)[1]]
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:  # an older torch
            return out
        q = torch.randn(1, 2, 8, 4, generator=g)
        return [*out, flex_attention(q, q, q)]

    want = program()
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        got = program()
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    op = ops(read_trace(cap.path))
    assert not any("capture_error" in r for r in op)
    hops = [r for r in op if r["fn"] == "torch.ops.higher_order.custom_function_call"]
    assert len(hops) == 3, [r["fn"] for r in op]
    for h in hops:  # x * x of _Square.forward (or its vmap rule), nested under the operator's record
        inner = [r for r in op if r["parent"] == h["seq"]]
        assert [r["fn"] for r in inner] == ["Tensor.mul"], inner
        assert inner[0]["depth"] == h["depth"] + 1 and inner[0]["func"] in ("forward", "vmap")


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_capture_s_tensor_work_is_never_traced_nor_counted_by_the_program_s_dispatch_modes(
        tmp_path: Path, kernel: str) -> None:
    """With the PyTorch-ops host path (the path accelerator tensors take), capture's hashing ops ran
    under the program's TorchDispatchModes: ``make_fx(f, tracing_mode="real")`` of ``sin(x) * w``
    got 71 graph nodes instead of 5 (``bitwise_xor``, shifts, ...), ``torch.func.linearize``'s graph
    grew, a ``FlopCounterMode`` would count them. They now run outside every dispatch mode; and a
    one-element view with stride 2 (``z[:1, 0]``, jacrev's basis of a scalar output) is summarised
    on that path too (it failed: "self.stride(-1) must be 1 to view Float as Long")."""
    from torch.func import jacrev, linearize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    w = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) @ w

    def program() -> tuple[str, int, list[float], int, torch.Tensor]:
        x = torch.ones(2, 3)
        gm = make_fx(f, tracing_mode="real")(x)
        _, jvp_fn = linearize(lambda t: torch.sin(t) * 2.0, x[0])
        tangent = jvp_fn(torch.ones(3)).tolist()
        with FlopCounterMode(display=False) as counter:
            f(x)
        z = torch.zeros(2, 2)
        z[:1, 0].fill_(1.0)
        return gm.code, len(list(gm.graph.nodes)), tangent, counter.get_total_flops(), \
            jacrev(lambda v: (v * v).sum())(x[0])

    want = program()
    env = {"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path), "OPGUARD_CAPTURE_HOST_KERNEL": kernel}
    with oc.capture(env=env) as cap:
        got = program()
    assert got[:4] == want[:4] and torch.equal(got[4], want[4])
    op = ops(read_trace(cap.path))
    assert not any("capture_error" in r for r in op)
    assert not any(str(e.get("reason", "")).startswith("summary failed") for r in op for e in r["outputs"]), \
        [e for r in op for e in r["outputs"] if e.get("reason")]
    fill = next(r for r in op if r["fn"] == "Tensor.fill_")
    assert fill["outputs"][0]["digest"]


def test_a_python_function_whose_nested_call_draws_is_a_random_draw(tmp_path: Path) -> None:
    """``F.dropout2d`` (-> ``torch.feature_dropout``) and ``F.gumbel_softmax`` (->
    ``Tensor.exponential_``) were not ``seeded``, although the call inside them that draws was: a
    changed seed read as "outputs differ, inputs and arguments equal" at the wrapper, without the
    random-draw explanation, and once the wrapper was collapsed (§3.10) its draw was in no record."""
    import torch.nn.functional as F

    x = torch.ones(1, 4, 3, 3)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        for _ in range(4):  # collapsed after its first calls: still seeded
            F.dropout2d(x, 0.5, training=True)
            F.gumbel_softmax(torch.zeros(5), tau=1.0)
    op = [r for r in ops(read_trace(cap.path)) if r["depth"] == 0]
    for fn in ("torch.nn.functional.dropout2d", "torch.nn.functional.gumbel_softmax"):
        calls = [r for r in op if r["fn"] == fn]
        assert len(calls) == 4 and all(r.get("seeded") is True for r in calls), (fn, calls)
    assert not any(r.get("seeded") for r in op if r["fn"] == "torch.zeros")


def test_aten_calls_of_an_exported_module_are_said_in_the_meta(tmp_path: Path) -> None:
    """``torch.export.export(m, (x,)).module()`` computes with ``torch.ops.aten.*`` calls from its
    generated code: unrecorded at the function level (the dispatch level's), and nothing said so, so
    an edited ``softplus`` beta inside it read as "inputs differ ... loaded from a file ...". The
    meta notes now count them (PyTorch's own aten calls, in its Python code, are not counted)."""
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.softplus(self.lin(x), beta=2.0)

    torch.manual_seed(0)
    m, x = M(), torch.randn(2, 4)
    gm = torch.export.export(m, (x,)).module()
    want = gm(x)
    mha = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    for sub, exported in (("plain", False), ("exported", True)):
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / sub)}) as cap:
            mha(x[None], x[None], x[None])
            torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])
            if exported:
                got = gm(x)
        notes = json.loads((cap.path / "meta.json").read_text())["notes"]
        said = [n for n in notes if "ATen operators (torch.ops.aten.*) made by the program's own code" in n]
        if exported:
            assert torch.equal(got, want)
            assert len(said) == 1 and said[0].startswith("2 call(s)") and "aten.linear.default" in said[0], notes
        else:
            assert not said, notes


def test_backward_is_never_collapsed_so_hooks_added_later_are_recorded(tmp_path: Path) -> None:
    """Two ``h.sum().backward(torch.tensor(1.0))`` calls that ran no Python code each forwarded to
    ``torch.autograd.backward``: ``Tensor.backward`` was collapsed (§3.10), and from then on the
    calls of a tensor hook, a full-backward hook or a custom Function's backward ran unrecorded, so
    an edit there read "no divergence". A call that forwards to a re-entered function that is no
    pass-through itself (the engine runs the program's code) is not forwarding: never collapsed."""
    import torch.nn.functional as F

    w = torch.ones(3, requires_grad=True)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        for step in range(3):
            h = F.relu(w * 2)
            if step == 2:
                h.register_hook(lambda g: g * 5.0)
            h.sum().backward(torch.tensor(1.0))
    assert torch.equal(w.grad, torch.full((3,), 14.0))
    meta = json.loads((cap.path / "meta.json").read_text())
    collapsed = [c["fn"] for c in meta.get("collapsed_wrappers", [])]
    assert "Tensor.backward" not in collapsed and "torch.nn.functional.relu" in collapsed, collapsed
    op = ops(read_trace(cap.path))
    hook = [r for r in op if r["fn"] == "Tensor.mul" and r["depth"] > 0]
    assert len(hook) == 1 and hook[0]["args"] == [{"slot": "arg1", "type": "float", "value": 5.0}], hook


def test_a_custom_function_under_two_transform_levels_records_its_forward(tmp_path: Path) -> None:
    """Under ``grad(grad(...))``, ``vmap(grad(...))``, ``jacrev(jacrev(...))``, ``custom_function_call`` comes
    back to the mode once per level with the same Function as first argument: the re-entry rule
    took the inner call for the outer one and ran it unrecorded, so the forward's calls (an edit
    there) were in no record. A higher-order operator's calls are told apart by their tensor."""
    from torch.func import grad, jacrev, vmap

    x = torch.tensor([0.5, -1.0, 2.0])

    def program() -> list[torch.Tensor]:
        f = lambda v: _Square.apply(v).sum()  # noqa: E731
        return [grad(grad(lambda v: _Square.apply(v).sum()))(x[0]), vmap(grad(f))(x[:, None]),
                jacrev(jacrev(f))(x)]

    want = program()
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        got = program()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    op = ops(read_trace(cap.path))
    top = [r for r in op if r["fn"] == "torch.ops.higher_order.custom_function_call" and r["depth"] == 0]
    assert len(top) == 3, [r["fn"] for r in op]
    for h in top:  # x * x of _Square.forward below it, at some depth
        below, seqs = [], {h["seq"]}
        for r in op:
            if r["parent"] in seqs:
                seqs.add(r["seq"])
                below.append(r)
        assert any(r["fn"] == "Tensor.mul" and r["func"] in ("forward", "vmap") for r in below), below


def test_capture_blocks_entered_by_several_threads_at_once_start_one_capture(tmp_path: Path,
                                                                            capfd: pytest.CaptureFixture[str]) -> None:
    """Four threads entering ``oc.capture()`` at once: two could each start a capture writing the same
    ``trace.jsonl`` (seq 0.. twice, two ``end`` records, read by compare as one stream), the others
    were refused with "already active ... capture() blocks inside a running capture record into it".
    One start at a time now; a block in another thread than the capturing one runs uncaptured and
    says so (capture records the thread that started it)."""
    import threading

    from opguard.capture import api

    api._said.discard("thread")  # said once per process
    barrier, got, lock = threading.Barrier(4), [], threading.Lock()
    env = {"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}
    others_done = threading.Semaphore(0)

    def work() -> None:
        barrier.wait(30)
        with oc.capture(env=env) as cap:
            with lock:
                got.append(cap)
            for _ in range(10):
                torch.ones(3).sin()
            if cap is not None:  # the capturing thread stays in its block until the other three are done
                for _ in range(3):
                    assert others_done.acquire(timeout=30)
        if cap is None:
            others_done.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and sum(c is not None for c in got) == 1, got
    lines = [json.loads(x) for x in (tmp_path / "ranks" / "rank-000000" / "capture" / "trace.jsonl").read_text()
             .splitlines()]
    assert sum(r["kind"] == "end" for r in lines) == 1
    seqs = [r["seq"] for r in lines if r["kind"] == "op"]
    assert seqs == sorted(set(seqs)) and len(seqs) == 20, seqs
    err = capfd.readouterr().err
    assert err.count("a capture() block in another thread than the one capturing this process runs "
                     "uncaptured") == 1, err


@pytest.mark.parametrize("options", [{"host_kernel": "torch"}, {"dump_steps": "0"}, {"digest": "sample"}])
def test_capture_s_flush_and_dumps_run_outside_the_program_s_dispatch_mode(tmp_path: Path,
                                                                          options: dict[str, str]) -> None:
    """A counting TorchDispatchMode around 600 ops: capture's flush (one ``torch.stack`` per device
    and kind, every 256 records) and its tensor dumps' copies ran inside it: the program counted
    ``aten.stack`` and 1200 ``_to_copy``/``detach`` it never called, and a ``make_fx`` graph grew."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.c: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.c[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}, **options):
        x = torch.ones(3)
        with Count() as m:
            for _ in range(600):
                x = torch.sin(x)
    assert dict(m.c) == {"aten.sin.default": 600}, m.c


def test_dispatch_level_runs_eager_higher_order_operators_and_forward_ad_on_the_torch_path(tmp_path: Path) -> None:
    """At level=dispatch, eager ``torch.cond`` raised NotImplementedError ("no rule registered for
    HigherOrderOperator cond and mode AtenMode"), and with ``host_kernel=torch`` a forward-mode AD
    dual tensor crashed the process (segfault in the digest's out= kernels) — run in a child."""
    import subprocess
    import sys

    code = ("import torch, sys\nimport torch.autograd.forward_ad as fwAD\nimport opguard.capture as oc\n"
            "x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))\n"
            "with oc.capture(env={'OPGUARD_TRACE_OUTPUT_BASE': sys.argv[1]}, level='dispatch', host_kernel='torch'):\n"
            "    y = torch.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))\n"
            "    with fwAD.dual_level():\n"
            "        d = fwAD.make_dual(x, torch.ones_like(x))\n"
            "        t = fwAD.unpack_dual(d * 2).tangent\n"
            "print(float(y.sum()), float(t.sum()))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split()[1] == "48.0", r.stdout
    op = ops(read_trace(tmp_path / "ranks" / "rank-000000" / "capture"))
    assert any(r["fn"] == "torch.ops.higher_order.cond" for r in op)
    mul = next(r for r in op if r["fn"] == "aten::mul.Tensor")
    assert mul["outputs"][0]["reason"] == "forward-mode AD below autograd: not summarised on the PyTorch-ops path"
