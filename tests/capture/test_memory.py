"""What a long capture leaves for Python's garbage collector (docs/capture.md §3.12): finished
records wait for their flush encoded (bytes, which the collector does not track), and a dead
tensor's same-object record goes with it. Kept as dicts, lists and tuples, capture's records and
stale entries outlived the collector's young generations by the hundred per step of a small model,
and their promotion into the oldest generation set off full collections of the whole process (every
object the program and its libraries hold) every few hundred steps."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import torch.nn.functional as F  # noqa: E402

import opguard.capture as oc  # noqa: E402
from opguard.capture import session  # noqa: E402
from tests.capture.helpers import ops, read_trace  # noqa: E402
from tests.capture.progs.models import MLP  # noqa: E402

pytestmark = [pytest.mark.torch]


def mlp_steps() -> Iterator[torch.Tensor]:
    """Training steps of the suite's small MLP (AdamW): 12 records and an optimizer record each."""
    torch.manual_seed(0)
    model = MLP(16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    while True:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(torch.tanh(model(x) * 0.5), y)
        loss.backward()
        opt.step()
        yield loss.detach()


@pytest.fixture
def collector_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_a_long_capture_keeps_nothing_per_step_for_the_collector(tmp_path: Path, collector_off: None) -> None:
    steps = mlp_steps()
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        for _ in range(20):  # the call sites, tables, caches, optimizer state of the first steps
            next(steps)
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(80):  # 80 x 12 records: several flushes of the 256-record buffer
            next(steps)
        grown = len(gc.get_objects()) - before
        s: Any = cap.session
        sealed = sum(type(c) is bytes for c in s.pending)
        waiting = sum(type(c) is bytes or c.rec["kind"] == "op" for c in s.pending)  # and step records
    # 80 steps of dicts per record and tuples per dead activation would be thousands
    assert grown < 40, f"{grown} objects more for the collector after 80 captured steps"
    assert waiting and sealed == waiting, "finished CPU op records wait for the flush encoded"
    assert len(ops(read_trace(cap.path))) >= 80 * 10


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_sealed_records_are_the_records_the_flush_would_have_encoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      kernel: str) -> None:
    """``torch``: every digest and statistics row is a torch op on the tensor's device, fetched at the
    flush (the CUDA path's way): the records are sealed with placeholders the flush fills in."""
    seen: list[int] = []
    seal = session.Session._seal

    def counted(self: Any) -> None:
        seal(self)
        seen.append(sum(type(c) is bytes for c in self.pending))

    def run(base: Path) -> tuple[list[int], list[str]]:
        steps = mlp_steps()
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(base), "OPGUARD_CAPTURE_BUFFER": "40",
                             "OPGUARD_CAPTURE_HOST_KERNEL": kernel}) as cap:
            losses = [next(steps) for _ in range(12)]
            h = (torch.ones(3) * float("nan")).sum()  # a non-finite statistics row
            h + torch.tensor([float("inf"), 1.0])
            torch.tensor([2, 3], dtype=torch.int64) * 7  # integer statistics
        lines = [line for f in sorted(cap.path.glob("trace*.jsonl")) for line in f.read_text().splitlines()]
        return [int(t.view(torch.int32).item()) for t in losses], lines

    monkeypatch.setattr(session.Session, "_seal", counted)
    sealed = run(tmp_path / "sealed")
    assert max(seen) > 30, "the records were sealed"
    monkeypatch.setattr(session.Session, "_seal", lambda self: None)  # every record encoded at the flush
    unsealed = run(tmp_path / "unsealed")
    assert sealed[0] == unsealed[0]
    assert len(sealed[1]) > 12 * 10
    assert sealed[1] == unsealed[1]
    assert "\\u0000" not in "".join(sealed[1])
    nan = [r for r in ops([json.loads(x) for x in sealed[1]]) if r["fn"] == "Tensor.sum"][-1]
    assert nan["outputs"][0]["stats"]["nan"] == 1 and len(nan["outputs"][0]["digest"]) == 16


def test_a_dead_tensor_s_same_object_record_goes_with_it(tmp_path: Path) -> None:
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        s: Any = cap.session
        base = torch.ones(64)
        kept = base * 2
        for _ in range(200):  # 200 results, each read once more, then dropped
            t = base + 1.0
            (t * 3).sum()
        del t
        assert len(s._seen) < 20, "the dead results' same-object records are gone"
        (kept * 2).sum()
    assert cap.path.exists()
