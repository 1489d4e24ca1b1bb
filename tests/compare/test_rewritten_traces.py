"""Compare over traces the reference implementation (opguard 0.1.0) wrote the way its users get them:
its source rewriter wrapped every traced call of train.py (fixtures/make_rewritten_traces.py), so the
records name the file in ``fname``, ``source_files`` also holds torch's module.py, and the source copies
are the rewritten file. True pairs are asserted one by one, and nothing else is paired."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from opguard.compare.perfetto_export import read_export
from tests.compare.helpers import FIXTURES, run_compare

RW = FIXTURES / "rewritten"
# (function, original line) of one step of train.py in run A
STEP = [("torch.randn", 23), ("torch.randn", 24), ("torch.relu", 13), ("torch.tanh", 15), ("torch.sub", 27),
        ("torch.sum", 28)]


def _compare(scenario: str, tmp_path: Path) -> tuple[str, list[dict[str, Any]], Any]:
    out, pairs = tmp_path / "v.pftrace", tmp_path / "p.jsonl"
    p = run_compare(RW / scenario / "a", RW / scenario / "b", out, extra=["--pairs", str(pairs)])
    assert p.returncode == 0, p.stderr
    return p.stderr, [json.loads(x) for x in pairs.read_text().splitlines()], read_export(out)


def _pairs(lines: list[dict[str, Any]], rank: int = 0) -> list[tuple[str, str]]:
    return [(x["a"]["record"], x["b"]["record"]) for x in lines if x["rank"] == rank and "basis" in x]


def test_fixture_records_are_what_the_rewriter_writes() -> None:
    rec = json.loads(next((RW / "edited-line" / "a" / "exec_trace" / "gpu_000" / "ops" / "torch.relu")
                          .glob("*.jsonl")).read_text().splitlines()[0])
    assert rec["fname"].endswith("/train.py") and rec["line_num"] == 13
    assert next(iter(rec["source_files"])) == rec["fname"] and len(rec["source_files"]) == 2
    assert any(k.endswith("torch/nn/modules/module.py") for k in rec["source_files"])
    copy = next((RW / "edited-line" / "a" / "exec_trace" / "source_files").glob("*train.py*")).read_text()
    assert "opguard_wrapped__torch_relu(13)(torch.relu, self.fc1(x))" in copy
    assert copy.splitlines()[12] != "        h = torch.relu(self.fc1(x))"      # line 13 of the copy is another


@pytest.mark.parametrize("rank", [0, 1])
def test_edited_line_pairs_everything_in_place(tmp_path: Path, rank: int) -> None:
    err, lines, _export = _compare("edited-line", tmp_path)
    assert _pairs(lines, rank) == [(f"A/rank{rank}/ops/{i}", f"B/rank{rank}/ops/{i}") for i in range(12)]
    for x in lines:
        assert (x["a"]["function"], x["a"]["line"]) == (x["b"]["function"], x["b"]["line"]) == STEP[x["row"] % 6]
        assert x["a"]["file"].endswith("train.py") and x["a"]["identity"] == f"train.py:{x['a']['line']}"
        assert x["b"]["line_map"] == ("edited A:13" if x["a"]["line"] == 13 else "same")
    # the half/float round trip happens in untraced code (self.fc1 is not wrapped): relu's input differs
    assert [x["status"] for x in lines if x["rank"] == rank][:6] == ["ok", "ok"] + ["mismatch"] * 4
    # ... and nothing recorded before it differs: relu is the first divergence, reading other inputs
    assert "first divergence: torch.relu at " in err
    assert "inputs differ, although every earlier operation of this stream agrees" in err
    assert "B's line: edited A:13" in err


def test_inserted_line_shifts_every_call_site_and_all_pair(tmp_path: Path) -> None:
    err, lines, _export = _compare("inserted-line", tmp_path)
    assert _pairs(lines) == [(f"A/rank0/ops/{i}", f"B/rank0/ops/{i}") for i in range(12)]
    for x in lines:
        assert (x["a"]["function"], x["a"]["line"]) == STEP[x["row"] % 6]
        assert x["b"]["line"] == x["a"]["line"] + 2 and x["b"]["line_map"] == f"shifted A:{x['a']['line']}"
        assert x["basis"] == "equal-sequence" and x["status"] == "ok"
    assert "no divergence" in err


def test_extra_call_of_an_existing_call_site_in_one_step(tmp_path: Path) -> None:
    """Step 1 of B runs the tanh line twice: step 0 pairs in order, step 1 up to the first tanh by
    anchors (and the draws between them); B's second tanh is the only call A's segment does not make,
    so it is set aside and the rest of step 1 pairs, with the inherited mismatches it causes
    (docs/compare.md §2 rule 6; before, the rest stayed undetermined). The summary names that tanh."""
    err, lines, _export = _compare("extra-call", tmp_path)
    assert _pairs(lines) == [(f"A/rank0/ops/{i}", f"B/rank0/ops/{i}") for i in range(10)] + [
        ("A/rank0/ops/10", "B/rank0/ops/11"), ("A/rank0/ops/11", "B/rank0/ops/12")]
    for x in lines:
        if "basis" in x:
            assert (x["a"]["function"], x["a"]["line"]) == (x["b"]["function"], x["b"]["line"])
            assert x["a"]["step"] is None and x["status"] == ("ok" if x["row"] < 10 else "mismatch")
    und = [x for x in lines if x["status"] == "unaligned"]
    assert [(x["b"]["record"], x["b"]["function"], x["reason"]) for x in und] == [
        ("B/rank0/ops/10", "torch.tanh", "not-in-other-segment")]
    assert "undetermined in B: not-in-other-segment 1" in err
    assert ("B's first operation A does not make (on a line A does not have or has elsewhere, or a call A's run "
            "does not make there): run B torch.tanh at ") in err
    assert "0 introduced, 2 inherited" in err
