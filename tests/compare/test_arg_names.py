"""Positional arguments are named in compare's evidence (docs/capture.md §3.4, docs/compare.md §4):
a changed ``nn.Conv1d(padding=...)`` read ``arguments differ: arg4: [1] -> [2]`` and a changed
``nn.MultiheadAttention(dropout=...)`` ``arg10: 0.1 -> 0.2`` (hand test), which leaves the user to
count torch's parameters. Capture writes each recorded function's positional parameter names to
meta.json (``arg_names``); compare shows them beside the slot, which stays the compared identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compare.helpers import run_compare

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import opguard.capture as oc  # noqa: E402
from opguard.capture.argnames import positional_names  # noqa: E402

pytestmark = [pytest.mark.torch]


def _run(base: Path, padding: int, dropout: float) -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(4, 4, 3, padding=padding)
    mha = torch.nn.MultiheadAttention(8, 2, dropout=dropout, batch_first=True)
    x = torch.randn(2, 4, 8)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base)}):
        y = conv(x)[..., :8]
        mha(y, y, y)[0].sum()


def test_names_of_builtins_and_python_functions() -> None:
    F = torch.nn.functional
    assert positional_names(torch.conv1d) == ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
    assert positional_names(F.layer_norm)[:5] == ["input", "normalized_shape", "weight", "bias", "eps"]  # type: ignore[index]
    assert positional_names(torch.Tensor.transpose) == ["self", "dim0", "dim1"]
    assert positional_names(F.max_pool2d)[:3] == ["self", "kernel_size", "stride"]  # type: ignore[index]
    # Python's varargs form of a lone int list: x.view(3, 3), torch.randn(2, 3) have no names there
    assert positional_names(torch.Tensor.view) == ["self"]
    assert positional_names(torch.randn) is None
    assert positional_names(torch.Tensor.__mul__) is None  # a protocol method
    assert positional_names(torch.Tensor.add_)[:2] == ["self", "other"]  # type: ignore[index]  # not t[] b


def test_a_changed_positional_argument_is_named(tmp_path: Path) -> None:
    _run(tmp_path / "a", 1, 0.1)
    _run(tmp_path / "b", 2, 0.1)
    _run(tmp_path / "c", 1, 0.2)
    meta = json.loads(next((tmp_path / "a").rglob("meta.json")).read_text())
    assert meta["arg_names"]["torch.conv1d"][4] == "padding"
    assert meta["arg_names"]["torch.nn.functional.multi_head_attention_forward"][10] == "dropout_p"
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "ab.pftrace")
    assert p.returncode == 0, p.stderr
    first = next(line for line in p.stderr.splitlines() if "first divergence" in line)
    assert "torch.conv1d" in first and "arguments differ: padding (arg4): [1] -> [2]" in first, p.stderr
    p = run_compare(tmp_path / "a", tmp_path / "c", tmp_path / "ac.pftrace")
    first = next(line for line in p.stderr.splitlines() if "first divergence" in line)
    assert "arguments differ: dropout_p (arg10): 0.1 -> 0.2" in first, p.stderr
    for run in ("a", "b"):  # a trace without the table (written before it existed): the slot alone
        path = next((tmp_path / run).rglob("meta.json"))
        meta = json.loads(path.read_text())
        del meta["arg_names"]
        path.write_text(json.dumps(meta))
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "old.pftrace")
    first = next(line for line in p.stderr.splitlines() if "first divergence" in line)
    assert "arguments differ: arg4: [1] -> [2]" in first, p.stderr


def test_the_names_are_in_meta_while_the_run_goes_on(tmp_path: Path) -> None:
    """A run killed before its end keeps the names of what it recorded: meta.json is rewritten at
    the first flush after a function with names is first recorded."""
    x = torch.randn(2, 4, 8)
    conv = torch.nn.Conv1d(4, 4, 3, padding=1)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path), "OPGUARD_CAPTURE_BUFFER": "1"}):
        conv(x)
        torch.relu(x)  # a later call: the records before it are flushed (buffer 1)
        meta = json.loads(next(tmp_path.rglob("meta.json")).read_text())
        assert meta["ended_at"] is None
        assert meta["arg_names"]["torch.conv1d"][3:5] == ["stride", "padding"]
