"""An optimizer step as one record (docs/capture.md §3.8): what it holds, that the program runs as
without capture, the step that raises, closures, another mode above capture's, ``optimizer=ops``,
and compare naming the changed learning rate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import opguard.capture as oc  # noqa: E402
from tests.capture.helpers import ops, read_trace  # noqa: E402
from tests.compare.helpers import run_compare  # noqa: E402

OPT_FNS = {"Tensor.addcdiv_", "Tensor.lerp_", "Tensor.addcmul_", "Tensor.mul_", "Tensor.sqrt", "Tensor.add_"}


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _train(model: Any, opt: Any, steps: int = 3) -> list[str]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.detach().view(torch.int32).item())
    return [f"{v:08x}" for v in out] + [p.detach().double().sum().item().hex() for p in model.parameters()]


def _captured(tmp: Path, lr: float = 1e-3, **options: Any) -> tuple[list[str], list[dict[str, Any]]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    depth = torch._C._len_torch_function_stack()
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp)}, **options) as cap:
        result = _train(model, opt)
        assert torch._C._len_torch_function_stack() == depth + 1  # capture's mode is back after every step
    assert torch._C._len_torch_function_stack() == depth
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["options"]["optimizer"] == options.get("optimizer", "step")
    return result, read_trace(cap.path)


def test_each_step_is_one_record_with_settings_parameters_gradients_and_state(tmp_path: Path) -> None:
    model = _model()
    plain = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    result, recs = _captured(tmp_path)
    assert result == plain   # bitwise: losses and parameters
    op = ops(recs)
    steps = [r for r in op if r["api"] == "optimizer"]
    assert [(r["fn"], r["step"], r["depth"]) for r in steps] == [("torch.optim.AdamW.step", s, 0) for s in range(3)]
    assert all(r["file"] == __file__ and r["func"] == "_train" for r in steps)   # the program's step() line
    assert not {r["fn"] for r in op} & OPT_FNS                                     # nothing inside the step
    assert not any(r["parent"] in {s["seq"] for s in steps} for r in op)
    args = {a["slot"]: a for a in steps[1]["args"]}
    assert args["group0.lr"] == {"slot": "group0.lr", "type": "float", "value": 1e-3}
    assert args["group0.weight_decay"]["value"] == 0.01 and args["group0.betas"]["value"] == [0.9, 0.999]
    names = ["Sequential.0.weight", "Sequential.0.bias", "Sequential.2.weight", "Sequential.2.bias"]
    # step 0: no state yet; later steps: the state the step reads
    assert [e["slot"] for e in steps[0]["inputs"]] == [s for n in names for s in (n, f"{n}.grad")]
    state = ("step", "exp_avg", "exp_avg_sq")
    assert [e["slot"] for e in steps[1]["inputs"]] == [
        s for n in names for s in (n, f"{n}.grad", *(f"{n}.{k}" for k in state))]
    assert [e["slot"] for e in steps[1]["outputs"]] == [s for n in names for s in (n, *(f"{n}.{k}" for k in state))]
    assert all(e["digest"] and e["stats"] is not None for e in steps[1]["outputs"])
    # the evidence chains: step 0's updated weight is the next forward's input, and step 1 reads it
    lin = [r for r in op if r["fn"] == "torch.nn.functional.linear" and r["module"] == "Sequential.0"]
    w_after = {e["slot"]: e["digest"] for e in steps[0]["outputs"]}["Sequential.0.weight"]
    assert lin[1]["inputs"][1]["digest"] == w_after == steps[1]["inputs"][0]["digest"]
    assert lin[0]["inputs"][1]["digest"] != w_after
    # the gradient read by the step is the one backward produced (differs from step to step)
    grads = [{e["slot"]: e["digest"] for e in r["inputs"]}["Sequential.0.weight.grad"] for r in steps]
    assert len(set(grads)) == 3


def test_optimizer_ops_records_every_op_inside_the_step(tmp_path: Path) -> None:
    result, recs = _captured(tmp_path, optimizer="ops")
    fns = [r["fn"] for r in ops(recs)]
    assert "torch.optim.AdamW.step" not in fns and {"Tensor.addcdiv_", "Tensor.lerp_"} <= set(fns)
    model = _model()
    assert result == _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))


def test_bad_optimizer_option_names_the_variable_and_the_choices() -> None:
    from opguard.capture.options import CaptureOptions
    from opguard.errors import ConfigError

    with pytest.raises(ConfigError, match="OPGUARD_CAPTURE_OPTIMIZER") as e:
        CaptureOptions.from_env({"OPGUARD_CAPTURE_OPTIMIZER": "fused"})
    assert "'fused'" in str(e.value) and "step" in str(e.value) and "ops" in str(e.value)


def _sparse_step(opt: Any, model: Any, x: Any) -> str:
    model(x).sum().backward()
    model.weight.grad = model.weight.grad.to_sparse()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_step_that_raises_is_recorded_with_error_and_capture_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(5, 4)
    depth = torch._C._len_torch_function_stack()
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        msg = _sparse_step(opt, model, x)
        model.weight.grad = None
        model(x).sum().backward()   # the next forward finds the step gone and puts the mode back
        opt.step()
        torch.ones(2).add(1)
    assert "sparse" in msg and torch._C._len_torch_function_stack() == depth
    steps = [r for r in ops(read_trace(cap.path)) if r["api"] == "optimizer"]
    assert len(steps) == 2 and "the step raised" in steps[0]["error"] and "error" not in steps[1]
    assert steps[1]["outputs"] and any(r["fn"] == "Tensor.add" for r in ops(read_trace(cap.path)))


class _Outer(torch.overrides.TorchFunctionMode):
    """The program's own mode, entered inside capture: capture's mode is not the innermost."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_under_another_mode_the_step_is_one_record_and_a_raise_is_seen_at_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(5, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap, _Outer():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        msg = _sparse_step(opt, model, x)
        torch.ones(2).mul(3)       # recorded: the raise closed the step when its profiler range closed
    assert "sparse" in msg
    op = ops(read_trace(cap.path))
    steps = [r for r in op if r["api"] == "optimizer"]
    assert len(steps) == 2 and "error" not in steps[0] and "Sparse" in steps[1]["error"]
    assert not {r["fn"] for r in op} & OPT_FNS and any(r["fn"] == "Tensor.mul" for r in op)


def test_a_step_with_a_closure_is_recorded_op_by_op(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x, y = torch.randn(4, 3), torch.randn(4, 1)

    def closure() -> Any:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        opt.step(closure)
    op = ops(read_trace(cap.path))
    steps = [r for r in op if r["api"] == "optimizer"]
    assert len(steps) == 1 and steps[0]["closure"] is True and op[0] is steps[0]  # the settings, first
    assert steps[0]["fn"] == "torch.optim.LBFGS.step" and not steps[0]["inputs"] and not steps[0]["outputs"]
    settings = {a["slot"]: a for a in steps[0]["args"]}
    assert settings["group0.max_iter"]["value"] == 2 and "group0.history_size" in settings
    assert any(r["fn"] == "torch.nn.functional.mse_loss" and r.get("parent") is None for r in op)  # the closure's


def test_compare_names_a_changed_setting_of_a_step_with_a_closure(tmp_path: Path) -> None:
    """LBFGS's ``history_size`` changed between two runs: its steps are recorded op by op, and no
    record held the settings, so compare named a later ``Tensor.lt`` with a derived value (hand
    test). The step's settings record names the setting."""
    def run(base: Path, history: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=history)
        x, y = torch.randn(8, 3), torch.randn(8, 1)

        def closure() -> Any:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base)}):
            for _ in range(3):
                opt.step(closure)

    run(tmp_path / "a", 3)
    run(tmp_path / "b", 2)
    text = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "ab.pftrace").stderr
    first = next(line for line in text.splitlines() if "first divergence" in line)
    assert "torch.optim.LBFGS.step" in first and "group0.history_size: 3 -> 2" in first, text


class _DataSGD(torch.optim.Optimizer):
    """An optimizer in the old style: it updates parameters through ``.data`` (no version bump)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def test_a_step_writing_through_data_records_the_parameters_it_left(tmp_path: Path) -> None:
    model = _model()
    opt = _DataSGD(model.parameters(), lr=0.1)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        _train(model, opt, steps=2)
    op = ops(read_trace(cap.path))
    steps = [r for r in op if r["api"] == "optimizer"]
    assert [r["fn"] for r in steps] == [f"{__name__}._DataSGD.step"] * 2
    before = {e["slot"]: e["digest"] for e in steps[0]["inputs"]}["Sequential.0.weight"]
    after = {e["slot"]: e["digest"] for e in steps[0]["outputs"]}["Sequential.0.weight"]
    lin = [r for r in op if r["fn"] == "torch.nn.functional.linear" and r["module"] == "Sequential.0"]
    assert before != after == lin[1]["inputs"][1]["digest"]   # the update is seen, and the next forward reads it


class _OldStyleSGD(torch.optim.Optimizer):
    """Weight decay written into the gradient through ``.data`` (``d_p = p.grad.data``): no version change."""

    def __init__(self, params: Any, lr: float, wd: float) -> None:
        super().__init__(params, {"lr": lr, "wd": wd})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                d_p = p.grad.data
                d_p.add_(p.data, alpha=group["wd"])
                p.data.add_(d_p, alpha=-group["lr"])


def test_a_gradient_written_through_data_inside_the_step_is_read_again(tmp_path: Path) -> None:
    """The step record's gradients are inputs; a step that wrote them through ``.data`` left their
    cached digests in place, so the next use (``p.grad.sum()``, ``zero_grad(set_to_none=False)``'s
    ``zero_``) was recorded with the gradient from before the step."""
    model = _model()
    opt = _OldStyleSGD(model.parameters(), lr=0.1, wd=0.5)
    x = torch.randn(6, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        model(x).pow(2).mean().backward()
        g = model[0].weight.grad
        g.sum()
        opt.step()
        g.sum()
        g.clone()  # its output is digested from memory: the content now
    op = ops(read_trace(cap.path))
    sums = [r for r in op if r["fn"] == "Tensor.sum"]
    clone = next(r for r in op if r["fn"] == "Tensor.clone")
    assert sums[0]["inputs"][0]["digest"] != sums[1]["inputs"][0]["digest"]
    assert sums[1]["inputs"][0]["digest"] == clone["outputs"][0]["digest"]


def test_a_step_post_hook_is_recorded_and_its_data_writes_are_seen(tmp_path: Path) -> None:
    """An EMA copy kept by ``register_step_post_hook`` and written through ``.data`` (its version
    does not move): the optimizer's own post-hooks ran inside the step's record, unrecorded, so the
    EMA's cached digests stayed those of step 0 while its outputs changed, and an edit of the decay
    was named as "outputs differ, inputs and arguments equal" at ``F.linear`` (hand test). The step
    record now ends when the step returns, before the optimizer's own post-hooks: their calls are
    recorded as the program's (docs/capture.md §3.8)."""
    import copy

    model = _model()
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def ema_update(_opt: Any, _args: Any, _kwargs: Any) -> None:
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.data.mul_(0.5).add_(p.data, alpha=0.5)

    opt.register_step_post_hook(ema_update)
    x = torch.randn(6, 4)
    plain_model, plain_ema = copy.deepcopy(model), copy.deepcopy(ema)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            with torch.no_grad():
                ema(x)
    op = ops(read_trace(cap.path))
    steps = [r for r in op if r["api"] == "optimizer"]
    assert len(steps) == 3 and [r["step"] for r in steps] == [0, 1, 2]
    muls = [r for r in op if r["fn"] == "Tensor.mul_"]
    assert len(muls) == 12 and [r["step"] for r in muls] == [0] * 4 + [1] * 4 + [2] * 4  # the hook's calls
    assert all(r.get("parent") is None for r in muls)
    lin = [r for r in op if r["fn"] == "torch.nn.functional.linear"]
    ema_in = [r["inputs"][1]["digest"] for r in lin if r.get("module") not in (None, "Sequential.0", "Sequential.2")]
    assert len(ema_in) == 6, [r.get("module") for r in lin]
    assert len({ema_in[0], ema_in[2], ema_in[4]}) == 3, ema_in  # the EMA's first weight after each update
    # and the program is the same: the EMA as without capture
    opt2 = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    for _ in range(3):
        opt2.zero_grad()
        plain_model(x).sum().backward()
        opt2.step()
        for e, p in zip(plain_ema.parameters(), plain_model.parameters(), strict=True):
            e.data.mul_(0.5).add_(p.data, alpha=0.5)
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), plain_ema.parameters(), strict=True))


class _OwnStepCode(torch.optim.SGD):
    """A class that overrides ``_optimizer_step_code`` (the profiler's no-op capture wraps)."""

    def _optimizer_step_code(self) -> None:
        pass


def test_a_class_with_its_own_step_code_ends_the_record_before_its_post_hooks(tmp_path: Path) -> None:
    """For a class that overrides ``Optimizer._optimizer_step_code`` the record ended at capture's
    global post-hook, after the optimizer's own post-hooks: their calls were hidden inside it, and
    one that raised left the record open, "the step raised", so the calls of the program's except
    block were not recorded (hand test). Capture puts a post-hook of its own first among the
    optimizer's, which ends the record."""
    model = _model()
    opt = _OwnStepCode(model.parameters(), lr=0.1)

    def scale(_opt: Any, _args: Any, _kwargs: Any) -> None:
        model[0].weight.data.mul_(0.5)

    def fail(_opt: Any, _args: Any, _kwargs: Any) -> None:
        raise RuntimeError("post-hook failed")

    opt.register_step_post_hook(scale)
    opt.register_step_post_hook(fail)
    x = torch.randn(6, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        model(x).sum().backward()
        try:
            opt.step()
        except RuntimeError:
            torch.full((3,), 2.5)
    assert list(opt._optimizer_step_post_hooks.values()) == [scale, fail]  # capture's own is gone
    op = ops(read_trace(cap.path))
    step = next(r for r in op if r["api"] == "optimizer")
    assert "error" not in step, step.get("error")
    assert [r["fn"] for r in op if r["seq"] > step["seq"]] == ["Tensor.mul_", "torch.full"]


class _DecayAll(torch.optim.Optimizer):
    """Old-style decay of every parameter through ``.data``, those without a gradient too."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.data.mul_(0.5)
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def test_a_parameter_without_gradient_written_by_the_step_is_read_again(tmp_path: Path) -> None:
    """A frozen parameter the step decays through ``.data``: not in the record (no gradient), and
    its cached digest stayed in place, so the next forward read the frozen weight from before the
    step (hand test). Every parameter of the optimizer is read from memory at its next use."""
    model = _model()
    model[2].weight.requires_grad_(False)
    opt = _DecayAll(model.parameters())
    x = torch.randn(6, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    op = ops(read_trace(cap.path))
    frozen = [r["inputs"][1]["digest"] for r in op
              if r["fn"] == "torch.nn.functional.linear" and r.get("module") == "Sequential.2"]
    assert len(frozen) == 2 and frozen[0] != frozen[1]


class _Wrapping(torch.optim.Optimizer):
    """A wrapper optimizer (ZeroRedundancyOptimizer, Lookahead): its step steps an inner one."""

    def __init__(self, params: Any, **kw: Any) -> None:
        self.inner = torch.optim.SGD(params, momentum=0.9, **kw)
        super().__init__(self.inner.param_groups, kw)

    def step(self, closure: Any = None) -> None:
        self.inner.step()


@pytest.mark.parametrize("optimizer", ["step", "ops"])
def test_a_wrapper_optimizer_advances_the_step_once(tmp_path: Path, optimizer: str) -> None:
    """The inner optimizer's post-hook advanced the step too: 3 iterations made steps 0-6, the outer
    record's nested collectives (ZeroRedundancyOptimizer's broadcasts) landed in the next step, and
    OPGUARD_CAPTURE_STEPS=1 matched nothing of iteration 1."""
    model = _model()
    opt = _Wrapping(model.parameters(), lr=0.1)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}, optimizer=optimizer) as cap:
        _train(model, opt, steps=3)
    recs = read_trace(cap.path)
    assert [r["step"] for r in recs if r["kind"] == "step"] == [1, 2, 3]
    lin = [r["step"] for r in ops(recs) if r["fn"] == "torch.nn.functional.linear" and r["module"] == "Sequential.0"]
    assert lin == [0, 1, 2]
    if optimizer == "step":
        steps = [r for r in ops(recs) if r["api"] == "optimizer"]
        assert [r["step"] for r in steps] == [0, 1, 2]
        # the inner optimizer's state (the wrapper keeps none): momentum buffers from the second step on
        assert not any(e["slot"].endswith(".momentum_buffer") for e in steps[0]["inputs"])
        for r in steps[1:]:
            assert {e["slot"] for e in r["inputs"] if e["slot"].endswith(".momentum_buffer")} == {
                f"Sequential.{i}.{n}.momentum_buffer" for i in (0, 2) for n in ("weight", "bias")}
        assert {e["slot"] for e in steps[0]["outputs"] if e["slot"].endswith(".momentum_buffer")}


def test_a_step_in_another_thread_leaves_this_threads_capture_alone(tmp_path: Path) -> None:
    """Capture records the thread that started it (the mode stack is per thread); an optimizer
    stepped by another thread meanwhile must not silence this thread's calls."""
    import threading

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    inside, release = threading.Event(), threading.Event()

    def hold(*_: Any) -> None:  # the other thread's step waits here, after the global pre-hooks ran
        inside.set()
        release.wait(30)

    opt.register_step_pre_hook(hold)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        worker = threading.Thread(target=opt.step)
        worker.start()
        assert inside.wait(30)
        torch.ones(2).add(1)        # this thread, while the other thread's step is open
        release.set()
        worker.join(30)
        torch.ones(2).mul(2)
    op = ops(read_trace(cap.path))
    assert [r["fn"] for r in op if r["fn"] in ("Tensor.add", "Tensor.mul")] == ["Tensor.add", "Tensor.mul"]
    assert not any(r["api"] == "optimizer" for r in op)
    # nor does it advance this thread's step (no marker, steps advance at this thread's Optimizer.step())
    assert [r["step"] for r in op] == [0] * len(op)
    meta = json.loads((cap.path / "meta.json").read_text())
    assert meta["step_source"] == "none"


def test_a_capture_that_ends_inside_a_step_leaves_no_mode_behind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    depth = torch._C._len_torch_function_stack()
    ctx = oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)})
    cap = ctx.__enter__()

    def stop_inside(*_: Any) -> None:  # a step pre-hook of the program's: runs after capture's global one
        ctx.__exit__(None, None, None)

    opt.register_step_pre_hook(stop_inside)
    opt.step()
    assert torch._C._len_torch_function_stack() == depth
    steps = [r for r in ops(read_trace(cap.path)) if r["api"] == "optimizer"]
    assert len(steps) == 1 and "did not return before the capture ended" in steps[0]["error"]


def test_compare_names_the_changed_learning_rate(tmp_path: Path) -> None:
    _captured(tmp_path / "a", lr=1e-3)
    _captured(tmp_path / "b", lr=2e-3)
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    first = p.stderr.split("first divergence: ", 1)[1].splitlines()[0]
    assert first.startswith("torch.optim.AdamW.step at ") and "step 0" in first, first
    assert "group0.lr: 0.001 -> 0.002" in first, first


def _step_slots(tmp: Path, build: Any) -> list[list[str]]:
    """The parameter slots of every optimizer record of ``build()`` (SGD without momentum: no state)."""
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp)}) as cap:
        build()
    return [[e["slot"] for e in r["inputs"] if not e["slot"].endswith(".grad")]
            for r in read_trace(cap.path) if r.get("api") == "optimizer"]


def test_parameter_names_are_stable_complete_and_unique(tmp_path: Path) -> None:
    """Optimizer record slots (§3.8), as a user's script exposed them: a submodule called on its own
    after its parent's forward kept being renamed to its class (``Net.head.weight`` ->
    ``Linear.weight``); ``MultiheadAttention.out_proj`` (whose forward never runs: the attention reads
    its weight) had no name (``group0.params.2``); two root modules of one class gave the same slot
    twice, and compare kept one of them."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

        def forward(self, x: Any) -> Any:
            return self.head(self.body(x))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def outside() -> None:
        for _ in range(2):
            opt.zero_grad()
            (net(x).sum() + net.head(torch.ones(1, 4)).sum()).backward()  # head called on its own too
            opt.step()

    expect = ["Net.body.weight", "Net.body.bias", "Net.head.weight", "Net.head.bias"]
    assert _step_slots(tmp_path / "a", outside) == [expect, expect]

    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    opt2 = torch.optim.SGD(mha.parameters(), lr=0.1)
    q = torch.randn(2, 3, 8)

    def attention() -> None:
        opt2.zero_grad()
        mha(q, q, q)[0].sum().backward()
        opt2.step()

    got = _step_slots(tmp_path / "b", attention)
    assert got == [["MultiheadAttention.in_proj_weight", "MultiheadAttention.in_proj_bias",
                    "MultiheadAttention.out_proj.weight", "MultiheadAttention.out_proj.bias"]]

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt3 = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)

    def two_roots() -> None:
        opt3.zero_grad()
        (a(torch.ones(1, 2)) + b(torch.ones(1, 2))).sum().backward()
        opt3.step()

    # two roots of one class: the second is Linear#2 (§3.1), so its parameters are Linear#2.*
    assert _step_slots(tmp_path / "c", two_roots) == [["Linear.weight", "Linear.bias", "Linear#2.weight",
                                                       "Linear#2.bias"]]
    # two roots given one name: the record's slots are still unique
    oc.name_modules(a, "net")
    oc.name_modules(b, "net")
    assert _step_slots(tmp_path / "d", two_roots) == [["net.weight", "net.bias", "net.weight#2", "net.bias#2"]]


@pytest.mark.parametrize("select", [{"steps": "0,2"}, {"functions": "torch.nn.functional.*"}])
def test_records_left_out_by_a_filter_do_not_leave_stale_digests(tmp_path: Path, select: dict[str, str]) -> None:
    """A filter that leaves out the optimizer step (or the ``p.data`` writes of one) must not change
    the digests of the records it keeps: the step's writes, which move no version counter, were not
    seen, so step 2's linear was recorded with step 0's weight digest."""
    from tests.capture.test_capture import oc_digest

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    opt = _DataSGD(lin.parameters(), lr=0.5)
    x = torch.randn(4, 3)
    expect = {}
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}, **select) as cap:
        for i in range(3):
            expect[i] = oc_digest(lin.weight.detach().clone())
            opt.zero_grad()
            lin(x).sum().backward()
            opt.step()
    got = {r["step"]: r["inputs"][1]["digest"] for r in ops(read_trace(cap.path))
           if r["fn"] == "torch.nn.functional.linear"}
    assert got == {i: expect[i] for i in got} and len(got) == (2 if "steps" in select else 3)
