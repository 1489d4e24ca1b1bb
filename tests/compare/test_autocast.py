"""The autocast state a call ran under is evidence (docs/capture.md §3.1, docs/compare.md §4): two
captures of one program under ``torch.autocast("cpu", dtype=...)`` with bfloat16 against float16
compared with "outputs differ, inputs and arguments equal" at the first linear, which reads as a
kernel computing differently from the same inputs (hand test: gradient accumulation under autocast).
Now the first divergence says what changed; a call autocast does not cast (equal outputs) is ok."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compare.helpers import run_compare

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import opguard.capture as oc  # noqa: E402

pytestmark = [pytest.mark.torch]


def _run(base: Path, dtype: object) -> float:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base)}):
        y = torch.tanh(x)  # before autocast: no autocast field
        with torch.autocast("cpu", dtype=dtype):  # type: ignore[arg-type]
            y = torch.sigmoid(y)  # not cast by autocast: computes the same under both
            h = lin(y)
        loss = h.float().sum()
    return float(loss.detach())


def test_a_changed_autocast_type_is_named_as_the_difference(tmp_path: Path) -> None:
    _run(tmp_path / "a", torch.bfloat16)
    _run(tmp_path / "a2", torch.bfloat16)
    _run(tmp_path / "b", torch.float16)
    recs = [json.loads(line) for f in sorted((tmp_path / "a").rglob("trace*.jsonl")) for line in f.open()]
    by_fn = {r["fn"]: r for r in recs if r.get("kind") == "op"}
    assert "autocast" not in by_fn["torch.tanh"]
    assert by_fn["torch.nn.functional.linear"]["autocast"] == "cpu:bfloat16"
    same = run_compare(tmp_path / "a", tmp_path / "a2", tmp_path / "same.pftrace")
    assert same.returncode == 0, same.stderr
    assert "no divergence: every pair's compared fields agree" in same.stderr
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "mismatch 3" in p.stderr, p.stderr  # linear, Tensor.float, Tensor.sum; sigmoid is ok
    first = next(line for line in p.stderr.splitlines() if "first divergence" in line)
    assert "torch.nn.functional.linear" in first, p.stderr
    assert "arguments differ: (autocast): 'cpu:bfloat16' -> 'cpu:float16'" in first, p.stderr
