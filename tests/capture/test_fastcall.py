"""The function mode's common call in C (``opguard.capture._fastcall``, docs/capture.md §3.11): the
same records as the Python handler, byte for byte, on a program that exercises every kind of
argument, result and failure the C path takes or hands back; it takes the common calls; capture's
own failures inside it are contained like the Python handler's; the program's exceptions and
warnings reach it as without capture."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import torch.nn.functional as F  # noqa: E402

import opguard.capture as oc  # noqa: E402
from opguard.capture import mode, records, session  # noqa: E402
from opguard.capture.callsite import SiteTable  # noqa: E402
from tests.capture.helpers import ops, read_trace  # noqa: E402

pytestmark = [pytest.mark.torch]


@pytest.fixture(scope="module")
def fastcall() -> Any:
    return pytest.importorskip("opguard.capture._fastcall",
                               reason="the C handler is not built (pip install -e . needs a C compiler)")


def program() -> list[Any]:
    """Calls of every kind the C handler takes or hands back to Python."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(6, 8, generator=g)
    out: list[Any] = []
    seen = torch.empty(3)  # written one element per step: marked uninitialised all along (§3.7)
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        h = model(x * 0.5 + 1)  # scalars, modules, a collapsed wrapper (F.relu) after two calls
        h = h - h.sum(dim=1, keepdim=True) * 0.1 - h.mean()  # int and bool keywords
        vals, idx = torch.max(h, dim=1)  # a named tuple of tensors
        y = F.layer_norm(h, (4,))  # a tuple argument
        y = F.softmax(y, dim=-1, dtype=torch.float32)  # a dtype keyword
        y = y.clamp(min=-1.0, max=float("inf"))  # a non-finite float
        z = torch.empty(6, 4)  # uninitialised: the Python path
        torch.add(y.detach(), 1.0, out=z)  # out=: a written argument
        z.mul_(2.0)  # in place
        w = z.new_full((2,), 2 ** 60)  # an int beyond 2**53
        r = torch.randn(3, generator=g)  # draws random numbers: "seeded"
        s = torch.cat([z, y], dim=0)  # a list of tensors: the Python path
        t = s[1:3]  # a slice: the Python path
        u = s.to(torch.float64)  # a conversion: the Python path
        loss = F.mse_loss(t.float(), torch.zeros(2, 4), reduction="sum") + vals.sum() + w.float().sum() + r.sum()
        loss = loss + u.sum().float() + idx.sum()
        loss.backward()
        opt.step()
        seen[i] = loss.detach()
        seen[: i + 1].sum()  # a view of the marked buffer: the Python handler
        out.append(loss.detach())
        try:
            x.view(7, 5)  # the program's own exception, from a call the C handler takes
        except RuntimeError:
            pass
    return out


def captured(base: Path, fast: str) -> tuple[list[Any], list[str]]:
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base), "OPGUARD_CAPTURE_FAST_CALL": fast}) as cap:
        result = program()
    lines = [line for f in sorted(cap.path.glob("trace*.jsonl")) for line in f.read_text().splitlines()]
    return result, lines


def bits(ts: list[Any]) -> list[int]:
    return [int(t.view(torch.int32).item()) for t in ts]


def test_the_same_records_byte_for_byte_as_the_python_handler(fastcall: Any, tmp_path: Path) -> None:
    plain = program()
    a, fast = captured(tmp_path / "c", "1")
    b, slow = captured(tmp_path / "py", "0")
    assert bits(a) == bits(plain) == bits(b)
    assert fast == slow
    recs = [json.loads(line) for line in fast]
    names = {r["fn"] for r in recs if r["kind"] == "op"}
    assert {"Tensor.mul", "torch.max", "torch.nn.functional.layer_norm", "torch.add", "Tensor.mul_",
            "Tensor.new_full", "torch.randn", "torch.cat", "Tensor.view"} <= names
    view = [r for r in recs if r.get("fn") == "Tensor.view"]
    assert view and all(r["error"].startswith("RuntimeError: shape '[7, 5]' is invalid") for r in view)


def test_the_c_handler_takes_the_common_calls(fastcall: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    original: Callable[..., Any] = mode.CaptureMode.handle

    def counted(self: Any, caller: Any, func: Any, *rest: Any) -> Any:
        seen.append(getattr(func, "__name__", "?"))
        return original(self, caller, func, *rest)

    monkeypatch.setattr(mode.CaptureMode, "handle", counted)
    x = torch.randn(64)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        buf = torch.empty(8)
        buf[0] = 1.0  # written in part: marked uninitialised while it lives (§3.7)
        for _ in range(50):
            x = torch.tanh(x * 0.5 + 0.1)
            x = x - x.mean()
        buf.sum()
    assert len(ops(read_trace(cap.path))) == 253
    # each function's first call only (it is planned then), and the three calls on the marked buffer:
    # memory marked uninitialised sends only the calls with (a view of) it as an argument to Python
    assert len(seen) <= 8, seen


def test_a_failure_inside_the_c_handler_is_contained(fastcall: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("injected failure")

    expected = program()
    for n, (target, name) in enumerate([(session.Session, "entry"), (SiteTable, "lookup"),
                                        (records, "arg_entry"), (mode, "tensors_in")]):
        with monkeypatch.context() as m:
            m.setattr(target, name, boom)
            if name == "entry":  # the general entry is reached only when the fast one gives up
                m.setattr(session.Session, "_entry_fast", lambda *a, **k: None)
            got, lines = captured(tmp_path / str(n), "1")
        assert bits(got) == bits(expected), name
        err = capfd.readouterr().err
        assert err.count("capture's own recording failed (recording: RuntimeError: injected failure)") == 1, name
        recs = [json.loads(line) for line in lines]
        if name != "lookup":  # the record exists and says what failed
            assert any(r.get("capture_error") == "recording: RuntimeError: injected failure" for r in recs), name


def test_warnings_and_tracebacks_name_the_program_s_line(fastcall: Any, tmp_path: Path) -> None:
    x = torch.randn(4, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                torch.nn.functional.softmax(x)  # a Python-level function warning with stacklevel (implicit dim)
        tracebacks = []
        for fail in (lambda: x.view(3, 3),  # the C handler's record
                     lambda: x @ torch.randn(3, 5),  # handed to the Python handler (its first call)
                     lambda: torch.nn.functional.mse_loss(x, torch.randn(4, 4), reduction="bad")):  # nested
            try:
                fail()
            except (RuntimeError, ValueError) as e:
                tracebacks.append(e.__traceback__)
    assert caught and all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]
    assert len(tracebacks) == 3
    for n, tb in enumerate(tracebacks):
        files = []
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        assert files[0] == __file__
        if n < 2:  # the innermost frame reads as the program's line (frames.py); mse_loss raises in torch
            assert files[-1] == __file__
        # one frame of capture's own (the mode's __torch_function__), not its Python handler's as well
        assert sum(f.endswith("mode.py") and "capture" in f for f in files) == 1, files


class _Counting(torch.Tensor):
    """A tensor subclass whose __torch_function__ logs every call made on its instances."""

    calls: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("fast", ["1", "0", "dispatch"])
def test_a_tensor_subclass_sees_only_the_program_s_calls(fast: str, tmp_path: Path) -> None:
    """Capture's own reads of a tensor subclass (its dtype, shape, data pointer, the digest) went
    through the subclass's ``__torch_function__``: a subclass that counts or logs its calls saw 9-11
    calls for one ``c * 2`` instead of 1 (found by the differential test of the C path; fails on the
    old code). At ``level=dispatch`` it also saw capture's read of each output's ``grad_fn`` (hand
    test: a unit-carrying subclass's call log doubled, and one that raised there was silenced)."""
    def program() -> list[str]:
        c = torch.arange(6.0).as_subclass(_Counting)
        _Counting.calls.clear()
        r = (c * 2).sum() + torch.tanh(c).mean()
        F.relu(c[1:])
        r.item()
        return list(_Counting.calls)

    plain = program()
    env = {"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path), "OPGUARD_CAPTURE_FAST_CALL": "1" if fast == "dispatch" else fast}
    if fast == "dispatch":
        env["OPGUARD_CAPTURE_LEVEL"] = "dispatch"
    with oc.capture(env=env) as cap:
        got = program()
    assert got == plain
    recs = ops(read_trace(cap.path))
    mul = [r for r in recs if r["fn"] == "Tensor.mul"]
    assert mul and mul[0]["outputs"][0]["shape"] == [6]  # read as a Tensor (no digest: a subclass, §3.3)
    assert mul[0]["outputs"][0]["reason"] == "tensor subclass _Counting"


class _Unhashable:
    """A callable a library hands to ``torch.overrides.handle_torch_function`` as its public API,
    with ``__eq__`` and no hash."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return other is self

    def __call__(self, x: Any) -> Any:
        return x * 2


@pytest.mark.parametrize("fast", ["1", "0"])
def test_an_unhashable_torch_function_passes_through(fast: str, tmp_path: Path) -> None:
    """Planning a function for the C handler looked it up in a dict: an unhashable callable reaching
    the mode raised TypeError into the program (fails on the code before this commit)."""
    f = _Unhashable()
    x = torch.ones(3)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path), "OPGUARD_CAPTURE_FAST_CALL": fast}) as cap:
        for _ in range(3):
            r = torch.overrides.handle_torch_function(f, (x,), x)
    assert torch.equal(r, torch.full((3,), 2.0))
    recs = ops(read_trace(cap.path))
    assert len(recs) == 3 and all(r["inputs"][0]["shape"] == [3] for r in recs), recs


def test_an_optimizer_step_s_entries_made_at_once_are_those_made_one_by_one(
        fastcall: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_fastcall.entries`` (an optimizer record's ~100 tensor entries in one call, §3.11) gives the
    record :meth:`Session.entry` gives tensor by tensor, byte for byte; where it raises part-way the
    record is still whole and the same (made again one by one), and the program is unchanged."""
    expected = program()
    real = fastcall.entries
    calls: list[int] = []

    def counted(s: Any, call: Any, pairs: Any, output: bool, fresh: bool) -> Any:
        calls.append(len(pairs))
        return real(s, call, pairs, output, fresh)

    monkeypatch.setattr(fastcall, "entries", counted)
    got, batched = captured(tmp_path / "at-once", "1")
    assert bits(got) == bits(expected)
    assert calls == [12, 24, 30, 24, 30, 24], calls  # 3 steps: inputs and outputs of each

    def half_then_boom(s: Any, call: Any, pairs: Any, output: bool, fresh: bool) -> Any:
        real(s, call, pairs[: len(pairs) // 2], output, fresh)  # its work done, its cache entries made
        raise RuntimeError("injected failure")

    monkeypatch.setattr(fastcall, "entries", half_then_boom)
    got, failed = captured(tmp_path / "fails", "1")
    assert bits(got) == bits(expected)
    monkeypatch.setattr(session.Session, "_entries_at_once", lambda *a: False)
    got, one_by_one = captured(tmp_path / "one-by-one", "1")
    assert bits(got) == bits(expected)
    assert batched == one_by_one == failed
    opt = [json.loads(line) for line in batched if '"kind":"op"' in line and '"api":"optimizer"' in line]
    assert len(opt) == 3 and [(len(r["inputs"]), len(r["outputs"])) for r in opt] == [(12, 24), (30, 24), (30, 24)]
