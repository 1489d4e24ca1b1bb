"""Wrappers that only forward their call are collapsed after their first calls (docs/capture.md §3.10)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import torch.nn.functional as F  # noqa: E402
from torch.overrides import handle_torch_function, has_torch_function  # noqa: E402

import opguard.capture as oc  # noqa: E402
from opguard.capture.wrappers import FORWARDED_CALLS  # noqa: E402
from tests.capture.helpers import ops, read_trace, trace_dir  # noqa: E402
from tests.compare.helpers import run_compare  # noqa: E402

pytestmark = [pytest.mark.torch]


def twice_or_once(x: torch.Tensor, twice: bool = False) -> torch.Tensor:
    """A torch function of the user's own (the __torch_function__ protocol): one call, or two."""
    if has_torch_function((x,)):
        return handle_torch_function(twice_or_once, (x,), x, twice=twice)  # type: ignore[no-any-return]
    y = torch.relu(x)
    return torch.sigmoid(y) if twice else y


def other_tensor(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Forwards one call, but on a tensor it made itself: not a pass-through."""
    if has_torch_function((x,)):
        return handle_torch_function(other_tensor, (x,), x, w)  # type: ignore[no-any-return]
    return torch.mul(x, w + 0)


def run(base: Path, body: Any, **env: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base), **env}):
        body()
    d = trace_dir(base)
    return ops(read_trace(d)), json.loads((d / "meta.json").read_text())


def children(recs: list[dict[str, Any]], fn: str) -> list[list[str]]:
    """Per top-level record of ``fn``: the names of the records directly below it."""
    return [[k["fn"] for k in recs if k["parent"] == r["seq"]] for r in recs if r["fn"] == fn and not r["depth"]]


def test_a_pass_through_is_collapsed_after_its_first_calls(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    got: list[torch.Tensor] = []

    def body() -> None:
        for i in range(5):
            got.append(F.relu(x - i * 0.1))

    recs, meta = run(tmp_path / "on", body)
    relu = "torch.nn.functional.relu"
    assert children(recs, relu) == [["torch.relu"]] * FORWARDED_CALLS + [[]] * (5 - FORWARDED_CALLS)
    firsts = [r for r in recs if r["fn"] == relu]
    assert meta["collapsed_wrappers"] == [{"fn": relu, "after_seq": firsts[FORWARDED_CALLS - 1]["seq"]}]
    # the collapsed record keeps what the nested one said: its input, its output's digest
    nested_out = next(r for r in recs if r["fn"] == "torch.relu")["outputs"][0]["digest"]
    assert firsts[0]["outputs"][0]["digest"] == nested_out
    for r, y in zip(firsts, got, strict=True):
        assert r["outputs"][0]["shape"] == list(y.shape) and r["depth"] == 0
    assert len({r["outputs"][0]["digest"] for r in firsts}) == 5  # every call's own result
    # the same results as without capture, and as with every nested call recorded
    plain = [F.relu(x - i * 0.1) for i in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))
    got.clear()
    recs_off, meta_off = run(tmp_path / "off", body, OPGUARD_CAPTURE_COLLAPSE_WRAPPERS="0")
    assert children(recs_off, relu) == [["torch.relu"]] * 5 and "collapsed_wrappers" not in meta_off
    assert [r["outputs"][0]["digest"] for r in recs_off if r["fn"] == relu] == [
        r["outputs"][0]["digest"] for r in firsts]
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


def test_compare_sees_no_difference_between_collapsed_and_full_nesting(tmp_path: Path) -> None:
    def body() -> None:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(4, 8)), torch.tensor([0, 1, 1, 0])).backward()
            opt.step()

    run(tmp_path / "a", body)
    run(tmp_path / "b", body, OPGUARD_CAPTURE_COLLAPSE_WRAPPERS="0")
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "no divergence: every pair's compared fields agree" in p.stderr, p.stderr
    assert "the runs collapsed different wrapper functions" in p.stderr  # and which


def test_a_function_that_does_more_than_forward_stays_nested(tmp_path: Path) -> None:
    x = torch.randn(4, 3)
    w = torch.randn(4, 3)

    def body() -> None:
        twice_or_once(x, twice=True)  # two calls on its first call: never collapsed
        for _ in range(4):
            twice_or_once(x)
            other_tensor(x, w)
            F.mse_loss(x, w)  # two nested calls, every time

    recs, meta = run(tmp_path / "t", body)
    fns = {r["fn"] for r in recs}
    name = next(f for f in fns if f.endswith("twice_or_once"))
    assert children(recs, name) == [["torch.relu", "torch.sigmoid"]] + [["torch.relu"]] * 4
    other = next(f for f in fns if f.endswith("other_tensor"))
    assert all(len(k) == 2 for k in children(recs, other))  # Tensor.add, torch.mul: re-entered every time
    assert all(len(k) == 2 for k in children(recs, "torch.nn.functional.mse_loss"))
    assert [w["fn"] for w in meta.get("collapsed_wrappers", [])] == ["torch.broadcast_tensors"]


def test_an_in_place_wrapper_is_collapsed_with_its_write_seen(tmp_path: Path) -> None:
    torch.manual_seed(0)
    xs = [torch.randn(16) for _ in range(4)]
    before = [x.clone() for x in xs]

    def body() -> None:
        for x in xs:
            x.mul_(1.0)  # a recorded use of x before the in-place relu
            F.relu(x, inplace=True)
            x.sum()

    recs, meta = run(tmp_path / "i", body)
    assert [w["fn"] for w in meta["collapsed_wrappers"]] == ["torch.nn.functional.relu"]
    relu = [r for r in recs if r["fn"] == "torch.nn.functional.relu"]
    sums = [r for r in recs if r["fn"] == "Tensor.sum"]
    for r, s, b, x in zip(relu, sums, before, xs, strict=True):
        assert torch.equal(b.relu(), x)
        assert r["outputs"][0]["digest"] != r["inputs"][0]["digest"]  # the write, not the cached input
        assert s["inputs"][0]["digest"] == r["outputs"][0]["digest"]  # the next use sees the written content


def test_a_function_filter_collapses_nothing(tmp_path: Path) -> None:
    x = torch.randn(4)

    def body() -> None:
        for _ in range(4):
            F.relu(x)

    recs, meta = run(tmp_path / "f", body, OPGUARD_CAPTURE_FUNCTIONS="torch.nn.functional.*,torch.relu")
    assert children(recs, "torch.nn.functional.relu") == [["torch.relu"]] * 4
    assert "collapsed_wrappers" not in meta


def test_a_wrapper_that_raises_is_never_collapsed(tmp_path: Path) -> None:
    x = torch.randn(4)

    def body() -> None:
        with pytest.raises(IndexError):
            F.softmax(x, dim=3)
        for _ in range(4):
            F.softmax(x, dim=0)

    recs, meta = run(tmp_path / "r", body)
    kids = children(recs, "torch.nn.functional.softmax")
    assert len(kids) == 5 and all(k == ["Tensor.softmax"] for k in kids)
    assert "collapsed_wrappers" not in meta
