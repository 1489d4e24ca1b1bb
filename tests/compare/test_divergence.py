"""The first introduced divergence, schema-v2 arguments and uninitialised entries, --json, --pairs,
filters and --show (docs/compare.md §4, §6), over synthetic v2 traces through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from opguard.compare.perfetto_export import read_export
from tests.compare import synth
from tests.compare.helpers import OPGUARD, ops_of, run_compare

D = synth.digest_of


def _gpt_like(run: str, *, gelu_args: list[dict[str, Any]] | None = None, steps: int = 2,
              empty_digest: str | None = None) -> list[dict[str, Any]]:
    """Per step: an uninitialised buffer (torch.empty), a linear, a gelu, a loss; outputs depend on
    the inputs and on what the gelu computed (which its arguments decide)."""
    recs: list[dict[str, Any]] = []
    w = D("w")
    for step in range(steps):
        x = D("x", step)
        buf = synth.op(0, "torch.empty", 10, "buf = torch.empty(4, 4)", [], [empty_digest or D("garbage", run, step)],
                       step=step, module=None)
        buf["outputs"][0]["uninitialized"] = True
        h = D("linear", x, w)
        lin = synth.op(0, "torch.nn.functional.linear", 20, "h = F.linear(x, w)", [x, w], [h], step=step,
                       module="blocks.0.mlp.fc")
        g = D("gelu", h, json.dumps(gelu_args, sort_keys=True))
        gelu = synth.op(0, "torch.nn.functional.gelu", 21, "g = F.gelu(h)", [h], [g], step=step,
                        module="blocks.0.mlp")
        if gelu_args:
            gelu["args"] = gelu_args
        fill = synth.op(0, "torch.Tensor.copy_", 22, "buf.copy_(g)", [D("garbage", run, step), g], [g], step=step,
                        module="blocks.0.mlp")
        fill["inputs"][0]["uninitialized"] = True
        loss = synth.op(0, "torch.sum", 30, "loss = g.sum()", [g], [D("sum", g)], step=step)
        recs += [buf, lin, gelu, fill, loss]
    return [dict(r, seq=k) for k, r in enumerate(recs)]


def _write(tmp: Path, run: str, recs: list[dict[str, Any]], ranks: tuple[int, ...] = (0,)) -> Path:
    for rank in ranks:
        synth.write_rank(tmp / run, rank, [dict(r, rank=rank) for r in recs], version=2)
    return tmp / run


def _gelu_to_silu(recs: list[dict[str, Any]], other_input: bool = False) -> None:
    """B's edit: the gelu's line calls F.silu (another output; with ``other_input``, another input too,
    so nothing establishes that the two calls correspond)."""
    for r in recs:
        if r["fn"] == "torch.nn.functional.gelu":
            r["fn"] = "torch.nn.functional.silu"
            r["outputs"][0]["digest"] = D("silu", r["step"])
            if other_input:
                r["inputs"][0]["digest"] = D("another input", r["step"])


def test_changed_argument_is_the_first_divergence_uninitialised_entries_never_compared(tmp_path: Path) -> None:
    a = _write(tmp_path, "a", _gpt_like("a"))
    b = _write(tmp_path, "b", _gpt_like("b", gelu_args=[synth.arg("approximate", "str", "tanh")]))
    out = tmp_path / "v.pftrace"
    p = run_compare(a, b, out)
    assert p.returncode == 0, p.stderr
    err = p.stderr
    assert ("first divergence: torch.nn.functional.gelu at /work/train.py:21, module blocks.0.mlp, step 0 "
            "(A/rank0/capture/2 <-> B/rank0/capture/2): arguments differ: approximate: absent -> 'tanh'") in err
    # the buffer's garbage differs in every step, and the copy_ reads it: neither is a mismatch
    assert "mismatches: 2 introduced, 4 inherited (inputs differ)" in err
    assert "4 entries marked uninitialized differ in content: never compared" in err
    ops = ops_of(read_export(out), "B")
    assert ops[0].args["status"] == "ok" and ops[0].args["outputs"]["out"]["uninitialized"] is True
    assert ops[2].args["args"] == {"approximate": "'tanh'"}
    assert ops[2].args["diff"]["args"] == "approximate: absent -> 'tanh'"
    assert ops[2].args["diff"]["introduced"] is True
    assert ops[3].args["diff"]["introduced"] is False


def test_digest_of_a_long_argument_and_other_kinds(tmp_path: Path) -> None:
    long_a = synth.arg("weight_list", "list", list(range(40)))
    long_b = synth.arg("weight_list", "list", list(range(1, 41)))
    assert "digest" in long_a and "value" not in long_a
    recs_a = _gpt_like("a", gelu_args=[synth.arg("approximate", "str", "none"), long_a])
    recs_b = _gpt_like("b", gelu_args=[synth.arg("approximate", "str", "none"), long_b])
    for r in recs_b:        # identical outputs: only the argument differs
        r["outputs"] = next(x for x in recs_a if x["seq"] == r["seq"])["outputs"]
    p = run_compare(_write(tmp_path, "a", recs_a), _write(tmp_path, "b", recs_b), tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert f"weight_list: <sha256:{long_a['digest']}/{long_a['len']}> -> <sha256:{long_b['digest']}/" in p.stderr
    assert "arguments differ" in p.stderr


def test_a_changed_slice_reads_as_a_slice(tmp_path: Path) -> None:
    """``x[:80]`` against ``x[:48]`` (a capacity factor edited): the slice, not its JSON list."""
    recs_a = _gpt_like("a", gelu_args=[synth.arg("arg1", "slice", [None, 80, None])])
    recs_b = _gpt_like("b", gelu_args=[synth.arg("arg1", "slice", [None, 48, 2])])
    p = run_compare(_write(tmp_path, "a", recs_a), _write(tmp_path, "b", recs_b), tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "arguments differ: arg1: slice(None, 80, None) -> slice(None, 48, 2)" in p.stderr


def test_a_changed_index_tuple_reads_as_python_writes_it(tmp_path: Path) -> None:
    """``x[:, 1:5:2]`` against ``x[:, 1:6:2]``: the index as written, not nested JSON lists."""
    recs_a = _gpt_like("a", gelu_args=[synth.arg("arg1", "index", ":, 1:5:2")])
    recs_b = _gpt_like("b", gelu_args=[synth.arg("arg1", "index", ":, 1:6:2")])
    p = run_compare(_write(tmp_path, "a", recs_a), _write(tmp_path, "b", recs_b), tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "arguments differ: arg1: [:, 1:5:2] -> [:, 1:6:2]" in p.stderr


def test_identical_rerun_reports_no_divergence(tmp_path: Path) -> None:
    a = _write(tmp_path, "a", _gpt_like("a"))
    b = _write(tmp_path, "b", _gpt_like("b"))         # only the uninitialised garbage differs
    p = run_compare(a, b, tmp_path / "v.pftrace", )
    assert p.returncode == 0, p.stderr
    assert "no divergence: every pair's compared fields agree" in p.stderr
    assert "first divergence" not in p.stderr and "mismatch 0" in p.stderr


def _cli(*args: str) -> Any:
    import subprocess

    return subprocess.run([*OPGUARD, "compare", *args], capture_output=True, text=True, timeout=300)


def test_json_summary_pairs_filters_and_show(tmp_path: Path) -> None:
    a = _write(tmp_path, "a", _gpt_like("a", steps=3), ranks=(0, 1))
    b = _write(tmp_path, "b", _gpt_like("b", steps=3, gelu_args=[synth.arg("approximate", "str", "tanh")]),
               ranks=(0, 1))
    out, js, pairs = tmp_path / "v.pftrace", tmp_path / "s.json", tmp_path / "p.jsonl"
    p = _cli(str(a), str(b), "-o", str(out), "--json", str(js), "--pairs", str(pairs))
    assert p.returncode == 0, p.stderr
    doc = json.loads(js.read_text())
    assert doc["version"] == 1 and doc["pairs"] == 30 and doc["mismatch"] == 18
    r0 = doc["ranks"][0]
    assert (r0["rank"], r0["introduced"], r0["inherited"], r0["uninitialized_not_compared"]) == (0, 3, 6, 6)
    fd = r0["first_divergence"]
    assert fd["function"] == "torch.nn.functional.gelu" and fd["step"] == 0 and fd["module"] == "blocks.0.mlp"
    assert fd["kind"] == "arguments differ" and fd["args"] == ["approximate: absent -> 'tanh'"]
    assert fd["record_b"] == "B/rank0/capture/2" and fd["where"] == "/work/train.py:21"
    lines = [json.loads(x) for x in pairs.read_text().splitlines()]
    assert len(lines) == 30 and {x["rank"] for x in lines} == {0, 1}
    gelu = lines[2]
    assert gelu["status"] == "mismatch" and gelu["introduced"] is True
    assert gelu["a"]["record"] == "A/rank0/capture/2" and gelu["b"]["line"] == 21
    assert gelu["differs"] == ["args.approximate", "outputs.out.digest"]
    assert lines[0]["status"] == "ok" and lines[0]["uninitialized_not_compared"] == 1

    # which ops differ on rank 1 in step 2
    p = _cli(str(a), str(b), "-o", str(out), "--rank", "1", "--step", "2", "--pairs", str(pairs), "--json", str(js))
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in pairs.read_text().splitlines()]
    assert len(lines) == 5 and all(x["rank"] == 1 and x["a"]["step"] == 2 for x in lines)
    assert [x["a"]["function"] for x in lines if x["status"] == "mismatch"] == \
        ["torch.nn.functional.gelu", "torch.Tensor.copy_", "torch.sum"]
    doc = json.loads(js.read_text())
    assert doc["filters"] == {"rank": [1], "step": [2]} and [r["rank"] for r in doc["ranks"]] == [1]
    assert doc["ranks"][0]["first_divergence"]["record_a"] == "A/rank1/capture/12"

    p = _cli(str(a), str(b), "-o", str(out), "--function", "torch.sum", "--pairs", str(pairs))
    assert p.returncode == 0, p.stderr
    assert {json.loads(x)["a"]["function"] for x in pairs.read_text().splitlines()} == {"torch.sum"}
    assert "no introduced divergence among the pairs" in p.stderr

    p = _cli(str(a), str(b), "-o", str(out), "--show", "B/rank0/capture/2")
    assert p.returncode == 0, p.stderr
    shown = json.loads(p.stdout)
    assert shown["status"] == "mismatch" and shown["a"]["record"] == "A/rank0/capture/2"
    assert shown["b"]["args"] == {"approximate": {"type": "str", "value": "'tanh'"}}
    assert shown["a"]["callsite"]["line"] == 21 and shown["b"]["module"] == "blocks.0.mlp"
    assert shown["diff"]["args"] == ["approximate: absent -> 'tanh'"] and shown["diff"]["introduced"] is True
    assert set(shown["a"]["inputs"]) == {"arg0"}

    p = _cli(str(a), str(b), "-o", str(out), "--show", "B/rank0/capture/999")
    assert p.returncode == 2 and "--show: no operation with record_id B/rank0/capture/999" in p.stderr
    p = _cli(str(a), str(b), "-o", str(out), "--rank", "7")
    assert p.returncode == 2 and "--rank 7: no such rank in A or B (they have ranks 0, 1)" in p.stderr
    p = _cli(str(a), str(b), "-o", str(out), "--step", "x")
    assert p.returncode == 2 and "--step 'x': not an integer or a range" in p.stderr


def test_meta_notes_of_schema_v2_reach_the_summary(tmp_path: Path) -> None:
    recs = _gpt_like("a")
    synth.write_rank(tmp_path / "a", 0, recs, version=2, meta={"notes": ["step filter 7 matched nothing"],
                                                               "step_source": "marker"})
    synth.write_rank(tmp_path / "b", 0, recs, version=2)
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "note: run A: capture: step filter 7 matched nothing" in p.stderr


def test_a_run_without_records_is_named(tmp_path: Path) -> None:
    a = _write(tmp_path, "a", _gpt_like("a"))
    synth.write_rank(tmp_path / "b", 0, [], version=2)
    p = run_compare(a, tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 2
    assert "nothing was paired: run B recorded no operations" in p.stderr
    assert "every operation is undetermined" not in p.stderr


def test_a_function_that_differs_on_the_same_line_is_the_divergence(tmp_path: Path) -> None:
    """B calls another function on the gelu's line (F.gelu -> F.silu) with the same inputs: the two
    calls pair (basis function-differs, docs/compare.md §2 rule 5) and are the first introduced
    divergence; everything else pairs as before. (It stayed unpaired before: segment-differs.)"""
    a_recs = _gpt_like("a", empty_digest=D("same"))
    b_recs = _gpt_like("b", empty_digest=D("same"))
    _gelu_to_silu(b_recs)
    a = _write(tmp_path, "a", a_recs)
    b = _write(tmp_path, "b", b_recs)
    p = run_compare(a, b, tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json"),
                                                         "--pairs", str(tmp_path / "p.jsonl")])
    assert p.returncode == 0, p.stderr
    assert "unaligned 0" in p.stderr and ": function differs: torch.nn.functional.gelu -> " \
        "torch.nn.functional.silu; outputs.out.digest" in p.stderr, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert (fd["record_a"], fd["kind"], fd["function"], fd["function_b"]) == \
        ("A/rank0/capture/2", "function differs", "torch.nn.functional.gelu", "torch.nn.functional.silu")
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(lines) == 10 and all(x["status"] != "unaligned" for x in lines)
    fn = [x for x in lines if x["basis"] == "function-differs"]
    assert [x["a"]["record"] for x in fn] == ["A/rank0/capture/2", "A/rank0/capture/7"]
    assert all(x["function"] == "torch.nn.functional.gelu -> torch.nn.functional.silu" and x["introduced"]
               for x in fn)
    assert all(x["a"]["function"] == x["b"]["function"] for x in lines if x not in fn)


def test_unpaired_operations_are_never_reported_as_no_divergence(tmp_path: Path) -> None:
    """B calls another function on the gelu's line (F.gelu -> F.silu) and its input differs too (so
    nothing establishes that the two calls correspond): the pairs agree, but the ops in the changed
    segment stay unpaired; the summary names the first of them instead of claiming 'no divergence'
    (it did before: every pair agreed)."""
    a_recs = _gpt_like("a", empty_digest=D("same"))
    b_recs = _gpt_like("b", empty_digest=D("same"))
    _gelu_to_silu(b_recs, other_input=True)
    a = _write(tmp_path, "a", a_recs)
    b = _write(tmp_path, "b", b_recs)
    p = run_compare(a, b, tmp_path / "v.pftrace")
    err = p.stderr
    assert "no divergence: every pair" not in err, err
    assert "operations could not be paired, so the runs may differ there; the first: run " in err, err
    first = err.split("the first: ", 1)[1].splitlines()[0]
    assert "torch.nn.functional.gelu" in first or "torch.nn.functional.silu" in first, first


def test_an_inherited_first_mismatch_after_unpaired_operations_names_the_first_unpaired_one(tmp_path: Path) -> None:
    """B calls another function on the gelu's line with another input (nothing establishes that the
    two calls correspond), and the loss that consumes its output pairs with different inputs. The
    first mismatch is then inherited; the summary also names the first operation that could not be
    paired — where the runs may first differ (a hand test: F.binary_cross_entropy -> F.mse_loss on
    one line of a VAE pointed only at an optimizer op before)."""
    a_recs = _gpt_like("a", empty_digest=D("same"))
    b_recs = _gpt_like("b", empty_digest=D("same"))
    for r in a_recs + b_recs:  # the copy_ after it is an input anchor on both sides
        if r["fn"] == "torch.Tensor.copy_":
            r["inputs"][0]["digest"] = D("same garbage", r["step"])
    _gelu_to_silu(b_recs, other_input=True)
    for r in b_recs:
        if r["fn"] == "torch.sum":
            r["inputs"][0]["digest"] = D("silu", r["step"])
            r["outputs"][0]["digest"] = D("sum of silu", r["step"])
    p = run_compare(_write(tmp_path, "a", a_recs), _write(tmp_path, "b", b_recs), tmp_path / "v.pftrace")
    err = p.stderr
    assert "no introduced divergence among the pairs" in err and "the first: torch.sum" in err, err
    first = err.split("the first unresolved operation: ", 1)[1].splitlines()[0]
    assert first.startswith("run A torch.nn.functional.gelu at ") and "segment-differs" in first, first


_SWAP = """import torch
import torch.nn.functional as F

torch.manual_seed(0)
w = torch.randn(4, 4)
x = torch.randn(3, 4)
for i in range(2):
    h = x @ w
    h = F.{act}(h)
    x = torch.tanh(h)
print(x.sum().item().hex())
"""


def _captured_pair(tmp_path: Path, source_a: str, source_b: str, **extra: str) -> dict[str, Path]:
    """Two real captures (opguard-run --capture python) of two versions of one script, ``swap.py``
    (``extra``: more environment variables for both)."""
    import os
    import subprocess

    from tests.conftest import BIN

    runs = {}
    for run, text in (("a", source_a), ("b", source_b)):
        src = tmp_path / f"src_{run}" / "swap.py"
        src.parent.mkdir()
        src.write_text(text)
        runs[run] = tmp_path / f"run_{run}"
        env = dict(os.environ, OPGUARD_TRACE_OUTPUT_BASE=str(runs[run]), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
                   **extra)
        p = subprocess.run([str(BIN / "opguard-run"), "--capture", "python", str(src)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    return runs


@pytest.mark.parametrize("collapse", ["1", "0"])
def test_a_swapped_function_with_other_nested_calls_is_the_divergence(tmp_path: Path, collapse: str) -> None:
    """Real captures of a one-line swap ``F.relu(h)`` -> ``F.gelu(h)`` (opguard-run --capture): F.relu
    records a nested torch.relu, F.gelu nothing, so the loop's segment has other lengths. It used to
    end with 'no divergence among the 3 pairs, but 16 operations could not be paired'; now the
    top-level calls pair (§2 rule 5, nested calls set aside) and the swap is the first divergence.
    With wrappers collapsed (the default, docs/capture.md §3.10) A's F.relu is collapsed after its
    second call, and its nested torch.relu records are left out of the pairing: nothing is unresolved."""
    runs = _captured_pair(tmp_path, _SWAP.format(act="relu"), _SWAP.format(act="gelu"),
                          OPGUARD_CAPTURE_COLLAPSE_WRAPPERS=collapse)
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert (fd["kind"], fd["function"], fd["function_b"]) == \
        ("function differs", "torch.nn.functional.relu", "torch.nn.functional.gelu"), fd
    assert fd["where"].endswith("swap.py:9"), fd
    if collapse == "0":
        assert "undetermined in A: nested-calls-differ 2" in p.stderr, p.stderr
    else:
        assert "0 unaligned operations" in p.stderr and "undetermined" not in p.stderr, p.stderr
        assert "the runs collapsed different wrapper functions (docs/capture.md §3.10; only A: " \
               "torch.nn.functional.relu; only B: none)" in p.stderr, p.stderr


def test_a_line_edited_to_make_one_more_call_names_that_call(tmp_path: Path) -> None:
    """Real captures, ``x = torch.tanh(h)`` -> ``x = torch.tanh(h) * 0.5`` (the line edited in place:
    same identity, one more call). Every later operation stayed unpaired (segment-differs) and the
    summary named A's matmul; now the rest pairs (§2 rule 6), B's Tensor.mul at that line is
    unresolved (not-in-other-segment) and named as B's first operation A does not make."""
    runs = _captured_pair(tmp_path, _SWAP.format(act="relu"),
                          _SWAP.format(act="relu").replace("x = torch.tanh(h)", "x = torch.tanh(h) * 0.5"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    assert rank["first_new_in_b"].startswith("run B Tensor.mul at ") and "swap.py:10 " in rank["first_new_in_b"]
    assert rank["first_new_in_b"].endswith(", not-in-other-segment)")
    assert "undetermined in B: not-in-other-segment 2" in p.stderr and "undetermined in A" not in p.stderr, p.stderr
    assert rank["first_missing_in_b"] is None


def test_a_call_removed_from_a_line_is_named(tmp_path: Path) -> None:
    """The reverse edit, ``x = torch.tanh(h) * 0.5`` -> ``x = torch.tanh(h)``: A's Tensor.mul has no
    counterpart; it was named only as 'the last unresolved operation before' a later mismatch.
    Now the summary names it as A's first operation B does not make."""
    runs = _captured_pair(tmp_path, _SWAP.format(act="relu").replace("x = torch.tanh(h)", "x = torch.tanh(h) * 0.5"),
                          _SWAP.format(act="relu"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    assert rank["first_missing_in_b"].startswith("run A Tensor.mul at ") and "swap.py:10 " in rank["first_missing_in_b"]
    assert ("A's first operation B does not make (a call B's run does not make there): run A Tensor.mul"
            in p.stderr), p.stderr
    assert rank["first_new_in_b"] is None


_LOOP = """import torch
torch.manual_seed(0)
x = torch.randn(8)
iters = {iters}
for i in range(iters):
    y = torch.sin(x)
    x = x * 0.5
z = torch.cos(torch.sin(x))
print(z.sum().item())
"""


def test_equal_inputs_at_two_unchanged_lines_are_not_one_call(tmp_path: Path) -> None:
    """A loop run 3 times in A, 2 in B (the count is a Python int, never recorded): A's third
    ``torch.sin`` at line 6 reads what B's ``torch.sin`` after the loop, at line 8, reads, and the
    input anchor paired the two although the source diff keeps both lines; the summary then named
    A's ``Tensor.mul`` at line 7 as the first call B does not make (hand test). Anchors no longer
    cross call sites the diff keeps: A's extra ``torch.sin`` at line 6 is named (§2 rule 2)."""
    runs = _captured_pair(tmp_path, _LOOP.format(iters=3), _LOOP.format(iters=2))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    missing = rank["first_missing_in_b"]
    assert missing.startswith("run A torch.sin at ") and "swap.py:6 " in missing, missing
    assert rank["first_new_in_b"] is None


def test_a_changed_seed_is_named_at_the_first_draw_into_new_memory(tmp_path: Path) -> None:
    """``torch.manual_seed(0)`` -> ``(1)`` before ``nn.Linear(4, 3)``: its weight is ``torch.empty``
    filled by ``kaiming_uniform_``, and compare said "outputs differ, inputs equal where recorded;
    not recorded, so the difference can come from there: tensor (uninitialised memory)", an
    inherited mismatch, although the record draws random numbers (hand test; in a nanoGPT-style
    script the seed edit was then named at a later ``torch.randint``). A random draw does not read
    the uninitialised memory it fills: the first draw is the divergence, in a random draw."""
    src = "import torch\ntorch.manual_seed({seed})\nlin = torch.nn.Linear(4, 3)\nprint(lin(torch.ones(2, 4)).sum())\n"
    runs = _captured_pair(tmp_path, src.format(seed=0), src.format(seed=1))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["function"] == "torch.nn.init.kaiming_uniform_" and "in a random draw" in fd["kind"], fd


_BLOCKS = """import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        h = F.{act}(h){extra}
        return torch.tanh(x + h)


net = nn.Sequential(Block(), Block(), Block())
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(4, 8)
for step in range(2):
    loss = net(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(loss.item())
"""


def test_a_swapped_function_in_every_block_is_the_divergence(tmp_path: Path) -> None:
    """``F.gelu(h)`` -> ``F.silu(h)`` in a block used three times: block 0's call has equal inputs and
    establishes the edited line, but blocks 1 and 2 (other module contexts, inputs already different)
    were not, so the segment stayed unpaired and no 'function differs' was reported in any model of
    more than one layer. The line is established for every module that runs it (§2 rule 5)."""
    runs = _captured_pair(tmp_path, _BLOCKS.format(act="gelu", extra=""), _BLOCKS.format(act="silu", extra=""))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    fd = rank["first_divergence"]
    assert (fd["kind"], fd["function"], fd["function_b"]) == \
        ("function differs", "torch.nn.functional.gelu", "torch.nn.functional.silu"), fd
    assert fd["where"].endswith("swap.py:15") and fd["module"] == "Sequential.0", fd
    assert rank["basis"]["function-differs"] >= 3 * 2, rank["basis"]  # every block, both steps


def test_one_more_call_on_an_edited_line_leaves_the_rest_paired(tmp_path: Path) -> None:
    """``h = F.gelu(h) + 0.5`` -> ``h = F.gelu(h) + 0.5 + h``: the edited line makes one more
    ``Tensor.add`` than before, a key both runs have (rule 6 does not apply). Every later operation stayed unpaired
    (segment-differs) and the summary named A's next unchanged call; now the extra calls on the
    edited line are set aside (edited-line-calls, §2 rule 7), the rest pairs, and the summary names
    B's first of them."""
    runs = _captured_pair(tmp_path, _BLOCKS.format(act="gelu", extra=" + 0.5"),
                          _BLOCKS.format(act="gelu", extra=" + 0.5 + h"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    assert rank["undetermined_b"] == {"edited-line-calls": 3 * 2} and rank["undetermined_a"] == {}, rank
    assert rank["unaligned"] == 6 and rank["pairs"] == rank["ops_a"], rank
    assert "run B Tensor.add at" in rank["first_new_in_b"] and "swap.py:15" in rank["first_new_in_b"], rank


def test_two_independent_calls_swapped_are_an_order_conflict_not_a_new_call(tmp_path: Path) -> None:
    """``tok(idx) + pos(ar)`` -> ``pos(ar) + tok(idx)``: both runs make both calls with equal inputs.
    The one whose anchor the order filter dropped was named 'B's first operation A does not make'
    (not-in-other-segment); it is an anchor-order-conflict (§3)."""
    src = """import torch
import torch.nn as nn

torch.manual_seed(0)
tok = nn.Embedding(10, 4)
pos = nn.Embedding(6, 4)
idx = torch.randint(0, 10, (2, 6))
x = {expr}
print(torch.tanh(x).sum().item())
"""
    runs = _captured_pair(tmp_path, src.format(expr="tok(idx) + pos(torch.arange(6))"),
                          src.format(expr="pos(torch.arange(6)) + tok(idx)"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    assert rank["first_new_in_b"] is None, rank
    assert set(rank["undetermined_b"]) == set(rank["undetermined_a"]) == {"anchor-order-conflict"}, rank


def test_another_seed_is_named_as_a_random_draw(tmp_path: Path) -> None:
    """``torch.manual_seed(0)`` -> ``(1)`` is not itself recorded: the first divergence is the first
    random draw, whose inputs and arguments are equal. It was 'outputs differ, inputs and arguments
    equal' with no hint; the kind now says it is a random draw and why it can differ."""
    runs = _captured_pair(tmp_path, _SWAP.format(act="relu"),
                          _SWAP.format(act="relu").replace("torch.manual_seed(0)", "torch.manual_seed(1)"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["function"] == "torch.randn" and fd["kind"].startswith(
        "outputs differ, inputs and arguments equal, in a random draw (the generator's state differs"), fd


_DRAWS = """import torch
import torch.nn.functional as F

torch.manual_seed(0)
x = torch.ones(8)
for it in range(3):
    idx = torch.randint(0, 100, (4,))
    y = x * idx.float().mean()
print(y.sum().item())
"""


def test_a_shifted_draw_names_the_unpaired_call_that_drew_before_it(tmp_path: Path) -> None:
    """B inserts one dropout that draws random numbers: the headline was the next, unchanged draw
    with the generic 'another seed, or another number of draws before it'; the inserted dropout was
    named only two lines below it (hand tests: DDPM, a LLaMA sampler, a char GPT). The kind now names
    the unpaired call that drew before it."""
    b = _DRAWS.replace("x = torch.ones(8)\n", "x = torch.ones(8)\nx = F.dropout(x, 0.5) + 1\n")
    runs = _captured_pair(tmp_path, _DRAWS, b)
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["function"] == "torch.randint", fd
    assert "run B's torch.nn.functional.dropout at " in fd["kind"], fd
    assert "a call the other run does not make, drew random numbers before it" in fd["kind"], fd


_ORDER = """import torch

torch.manual_seed(0)
h = torch.randn(4)
g = torch.randn(4)
s = {expr}
print(torch.tanh(s).sum().item())
"""


@pytest.mark.parametrize("op", ["+", "-"])
def test_operands_swapped_on_a_line_are_introduced_there(tmp_path: Path, op: str) -> None:
    """``h - g`` -> ``g - h``: the inputs are the same tensors in other slots. The pair was 'inputs
    differ (inherited)' with nothing unresolved before it, so compare reported no introduced
    divergence at all; now the swap is the first divergence (kind: the same inputs in another
    order), whether or not the outputs differ (``h + g`` -> ``g + h``: they do not)."""
    runs = _captured_pair(tmp_path, _ORDER.format(expr=f"h {op} g"), _ORDER.format(expr=f"g {op} h"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    fn = "Tensor.add" if op == "+" else "Tensor.sub"
    assert fd["function"] == fn and fd["kind"] == "the same inputs in another order", fd
    assert ("outputs.out.digest" in fd["fields"]) is (op == "-"), fd


def test_a_module_edited_into_another_class_names_its_line(tmp_path: Path) -> None:
    """``nn.GRU(4, 5)`` -> ``nn.LSTM(4, 5)`` inside a model: other parameter shapes at that line,
    another number of calls in every forward (LSTM makes two initial states), no input anchor in
    the stream. Nothing was paired (exit 2, 'nothing was paired'), and the summary named the
    program's first, unchanged, call. The common start and end of the segment now pair (§2 rule 8),
    and the first divergence is the first parameter made on the edited line (found hand-testing)."""
    src = """import torch
import torch.nn as nn
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(3, 4)
        self.rnn = nn.{rnn}(4, 5, batch_first=True)
    def forward(self, x):
        h, _ = self.rnn(self.pre(x))
        return h
net = Net()
for it in range(2):
    print(net(torch.randn(2, 6, 3)).sum().item().hex())
"""
    runs = _captured_pair(tmp_path, src.format(rnn="GRU"), src.format(rnn="LSTM"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    assert rank["pairs"] > 0 and set(rank["undetermined_a"]) == {"segment-differs"}, rank
    fd = rank["first_divergence"]
    assert fd["where"].endswith("swap.py:8") and fd["function"] == "torch.empty", fd


def test_a_transfer_that_received_other_data_points_to_the_other_ranks(tmp_path: Path) -> None:
    """A collective whose result differs while this rank's inputs and arguments are equal read as
    'outputs differ, inputs and arguments equal' (a kernel computing differently, hand test: a
    hand-written pipeline's recv, a library broadcast). What this rank received differs: the kind
    says so and points to the other ranks. (One process: run B's trace is A's with the received
    content changed, as another rank sending other data would.)"""
    torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    dist = pytest.importorskip("torch.distributed")
    import opguard.capture as oc

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "a")}):
            buf = torch.ones(2)
            dist.broadcast(buf, src=0)
            (buf * 2).sum()
    finally:
        dist.destroy_process_group()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    trace = next((tmp_path / "b").rglob("trace.jsonl"))
    lines = []
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("fn") == "torch.distributed.broadcast":
            rec["outputs"][0]["digest"] = "0123456789abcdef"
        lines.append(json.dumps(rec))
    trace.write_text("\n".join(lines) + "\n")
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["function"] == "torch.distributed.broadcast" and fd["kind"].startswith(
        "outputs differ, inputs and arguments equal, in a collective (what this rank received differs"), fd


def test_runs_whose_capture_never_ended_are_told_apart_from_capture_off(tmp_path: Path) -> None:
    """A program that leaves through ``os._exit`` (or a signal) skips capture's exit handler: the
    records it still held (under the buffer) are lost, and compare said 'recorded no operations ...
    check that capture was on', which sent the user the wrong way (hand test)."""
    import subprocess
    import sys

    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    code = ("import os, torch, opguard.capture as oc\n"
            "cap = oc.capture(env={'OPGUARD_TRACE_OUTPUT_BASE': os.environ['OUT']})\ncap.__enter__()\n"
            "x = torch.ones(4) * 1.5\nprint(x.sum().item(), flush=True)\nos._exit(0)\n")
    for run in ("a", "b"):
        p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OUT": str(tmp_path / run)},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and p.stdout.strip() == "6.0", p.stderr
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 2, p.stderr
    assert "the capture of run A and B did not end" in p.stderr and "os._exit" in p.stderr, p.stderr
    assert "check that capture was on" not in p.stderr


@pytest.mark.parametrize("case", ["uninitialized", "subclass"])
def test_outputs_computed_from_an_unrecorded_input_are_not_an_introduced_divergence(tmp_path: Path, case: str) -> None:
    """An input whose content capture did not record (uninitialised memory: a shape probe
    ``lin(torch.empty(4, 24))``, as ``torch.distributed.pipelining`` runs; a tensor subclass such as
    DTensor's ``AsyncCollectiveTensor``) has no digest on either side: compare read the equal
    nulls as equal inputs, and the op's differing outputs as 'outputs differ, inputs and arguments
    equal', the first divergence (hand tests). The kind now says which input was not recorded and
    why, and the pair is not counted as introducing the difference. (One process: B's trace is
    A's with the op's output content changed, as other leftover memory would make it.)"""
    torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    import opguard.capture as oc

    lin = torch.nn.Linear(6, 3)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "a")}):
        if case == "uninitialized":
            lin(torch.empty(4, 6)).sum()
        else:
            x = torch.nested.nested_tensor([torch.ones(2, 6), torch.ones(3, 6)], layout=torch.jagged)
            lin(x)
        torch.ones(2).sum()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    trace = next((tmp_path / "b").rglob("trace.jsonl"))
    lines, changed = [], 0
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("fn") == "torch.nn.functional.linear":
            assert rec["inputs"][0]["digest"] is None, rec["inputs"][0]
            for o in rec["outputs"]:
                o["digest"], changed = "0123456789abcdef", changed + 1
                if o.get("stats"):
                    o["stats"]["max"] += 1.0
        lines.append(json.dumps(rec))
    trace.write_text("\n".join(lines) + "\n")
    assert changed
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    assert rank["first_divergence"] is None and rank["introduced"] == 0, rank
    fm = rank["first_mismatch"]
    why = "uninitialised memory" if case == "uninitialized" else "tensor subclass NestedTensor"
    assert fm["function"] == "torch.nn.functional.linear", fm
    assert fm["kind"].startswith("outputs differ, inputs equal where recorded"), fm
    assert f"input (arg0, {why})" in fm["kind"], fm
    assert "outputs differ, inputs and arguments equal" not in p.stderr
    # --show gives the entry's reason (and a nested tensor's symbolic size) instead of dropping them
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace",
                    extra=["--show", fm["record_a"]])
    shown = json.loads(p.stdout)["a"]["inputs"]["arg0"]
    assert shown.get("reason", "uninitialized memory") == (
        "uninitialized memory" if case == "uninitialized" else "tensor subclass NestedTensor"), shown
    if case == "subclass":
        assert shown["shape"][0] == 2 and isinstance(shown["shape"][1], str), shown


def test_a_tensor_argument_replaced_by_none_reads_as_such(tmp_path: Path) -> None:
    """``F.linear(x, w, bias=b)`` edited to ``bias=None``: the tensor is an input entry in A and the
    None an argument in B, and compare said ``bias: absent -> None`` (hand test)."""
    torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    import opguard.capture as oc

    x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    for run, bias in (("a", b), ("b", None)):
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / run)}):
            torch.nn.functional.linear(x, w, bias=bias)
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["args"] == ["bias: a tensor -> None"], fd
    p = run_compare(tmp_path / "b", tmp_path / "a", tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["args"] == ["bias: None -> a tensor"], fd


_PERIODIC = """import torch
K = {k}
w = torch.zeros(3)
tgt = torch.zeros(3)
for t in range(12):
    w = w + 1.0
    if t % K == 0:
        tgt.copy_(w)
    if t >= 6:
        y = (w * tgt).sum()
print(y.item().hex())
"""


def test_the_first_call_one_run_does_not_make_is_the_earliest(tmp_path: Path) -> None:
    """A periodic call whose period changed (a target network synced every 5 steps, then every 4):
    B's extra syncs fall between anchors where A makes nothing (reason no-counterpart-in-segment),
    and the summary's "B's first operation A does not make" skipped them for a later one of another
    reason, while "the first unresolved operation" named the right one (hand test, a DQN)."""
    runs = _captured_pair(tmp_path, _PERIODIC.format(k=5), "# edited\n\n" + _PERIODIC.format(k=4))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace",
                    extra=["--json", str(tmp_path / "s.json"), "--pairs", str(tmp_path / "p.jsonl")])
    assert p.returncode == 0, p.stderr
    rank = json.loads((tmp_path / "s.json").read_text())["ranks"][0]
    unpaired = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    unpaired = [u for u in unpaired if u.get("status") == "unaligned"]
    first_b = next(u["b"]["record"] for u in unpaired if "b" in u)  # in row order
    first_a = next(u["a"]["record"] for u in unpaired if "a" in u)
    assert first_b == "B/rank0/capture/8" and first_a == "A/rank0/capture/9", (first_a, first_b)
    assert f"({first_b}, no-counterpart-in-segment)" in rank["first_new_in_b"], rank["first_new_in_b"]
    assert f"({first_a}, no-counterpart-in-segment)" in rank["first_missing_in_b"], rank["first_missing_in_b"]


def test_a_difference_inside_a_module_recorded_as_one_call_says_so(tmp_path: Path) -> None:
    """An eval encoder kept on PyTorch's fast path is one record (docs/capture.md §3.13); a
    program hook inside it whose constant changed made its outputs differ with equal inputs and
    arguments, read as a kernel computing differently (hand test, LoRA through forward hooks). The
    kind says the calls inside were not recorded, and the record's configuration counts the hooks."""
    torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    import opguard.capture as oc

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    for run, scale in (("a", 2.0), ("b", 3.0)):
        h = enc.layers[0].linear1.register_forward_hook(lambda m, i, o, s=scale: o * s)
        with torch.no_grad(), oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / run)}) as cap:
            enc(x, src_key_padding_mask=pad)
        h.remove()
        rec = next(json.loads(line) for line in (cap.path / "trace.jsonl").read_text().splitlines()
                   if '"api":"module"' in line)
        assert {"slot": "config.layers.0.linear1.hooks", "type": "int", "value": 1} in rec["args"], rec["args"]
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["function"] == "torch.nn.TransformerEncoder", fd
    assert fd["kind"].startswith("outputs differ, inputs and arguments equal, in a module recorded as one call"), fd


def test_a_call_that_raised_in_one_run_names_the_exception(tmp_path: Path) -> None:
    """A call that raised in B only read 'outputs.error.present': the exception (`Trying to backward
    through the graph a second time` after a removed `detach()`) was visible only with --show (hand
    test). The first divergence now says which run raised what."""
    recs_a = _gpt_like("a", steps=1)
    recs_b = _gpt_like("a", steps=1)
    loss = next(r for r in recs_b if r["fn"] == "torch.sum")
    loss["error"] = "RuntimeError: Trying to backward through the graph a second time"
    loss["outputs"] = []
    a, b = _write(tmp_path, "a", recs_a), _write(tmp_path, "b", recs_b)
    js = tmp_path / "s.json"
    p = _cli(str(a), str(b), "-o", str(tmp_path / "v.pftrace"), "--json", str(js))
    assert p.returncode == 0, p.stderr
    fd = json.loads(js.read_text())["ranks"][0]["first_divergence"]
    assert fd["function"] == "torch.sum", fd
    assert fd["raised"] == "B raised RuntimeError: Trying to backward through the graph a second time; A did not"
    assert "(B raised RuntimeError: Trying to backward through the graph a second time; A did not)" in p.stderr


def test_an_added_evaluation_pass_is_not_paired_with_the_training_forward(tmp_path: Path) -> None:
    """B adds ``model.eval(); with torch.no_grad(): model(x)`` before the training forward: the same
    call sites in the same order. Without the grad mode, A's training forward paired with B's
    evaluation pass (first divergence ``training: True -> False``); with it, B's pass is set aside."""
    def fwd(seq: int, off: bool) -> list[dict[str, Any]]:
        x, h = synth.digest_of("x"), synth.digest_of("h")
        d = synth.digest_of("d", "eval" if off else "train")
        recs = [synth.op(seq, "torch.nn.functional.linear", 14, "h = F.linear(x, w)", [x], [h]),
                synth.op(seq + 1, "torch.nn.functional.dropout", 15, "h = F.dropout(h, 0.5, self.training)", [h],
                         [d]),
                synth.op(seq + 2, "torch.nn.functional.linear", 16, "y = F.linear(h, w2)", [d],
                         [synth.digest_of("y", d)])]
        recs[1]["args"] = [synth.arg("training", "bool", not off)]
        for r in recs:
            if off:
                r["grad"] = False
        return recs
    p = run_compare(_write(tmp_path, "a", fwd(0, False)), _write(tmp_path, "b", [*fwd(0, True), *fwd(3, False)]),
                    tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "mismatch 0" in p.stderr and "training: True -> False" not in p.stderr, p.stderr
    assert "paired 3 (ok 3, mismatch 0" in p.stderr and "undetermined in B: not-in-other-segment 3" in p.stderr


def test_a_call_made_with_grad_mode_off_in_b_is_the_first_divergence(tmp_path: Path) -> None:
    """A forward B wraps in ``torch.no_grad()`` by mistake computes equal values without a graph:
    its grad mode is compared as an argument and is a mismatch by itself (docs/compare.md §4)."""
    recs_a = _gpt_like("a")
    recs_b = _gpt_like("b")
    for r in recs_b:
        r["outputs"] = next(x for x in recs_a if x["seq"] == r["seq"])["outputs"]
    first = next(r for r in recs_b if r["fn"] == "torch.nn.functional.gelu")
    first["grad"] = False
    p = run_compare(_write(tmp_path, "a", recs_a), _write(tmp_path, "b", recs_b), tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "arguments differ: (grad mode): on -> off" in p.stderr and "1 introduced" in p.stderr, p.stderr


def test_runs_with_other_argument_forms_say_so(tmp_path: Path) -> None:
    """Two captures by opguard revisions whose argument forms differ (``x[:, 0]`` was the list
    ``[[null,null,null],0]`` before the ``index`` form): the difference is the form alone, and
    the summary says so (hand tests: 816 false mismatches and no word why)."""
    recs = _gpt_like("a")
    synth.write_rank(tmp_path / "a", 0, recs, version=2)
    synth.write_rank(tmp_path / "b", 0, recs, version=2, meta={"opguard": "0.2.0", "arg_forms": 2})
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert ("note: the runs record arguments in other forms (run A: opguard unknown, argument forms 1; run B: "
            "opguard 0.2.0, argument forms 2)") in p.stderr, p.stderr
    synth.write_rank(tmp_path / "c", 0, recs, version=2, meta={"opguard": "0.2.1", "arg_forms": 2})
    p = run_compare(tmp_path / "b", tmp_path / "c", tmp_path / "w.pftrace")
    assert "other forms" not in p.stderr


def test_inputs_differing_with_nothing_earlier_differing_are_the_first_divergence(tmp_path: Path) -> None:
    """``torch.sin(q)`` edited to ``torch.sin(k)``: the inputs differ, but every earlier operation
    agrees, so nothing recorded passed a difference on. That was "no introduced divergence ...
    every mismatch inherited different inputs", sending the user upstream to nothing."""
    q, k = synth.digest_of("q"), synth.digest_of("k")
    def run(x: str) -> list[dict[str, Any]]:
        return [synth.op(0, "torch.randn", 3, "q = torch.randn(4)", [], [q]),
                synth.op(1, "torch.randn", 4, "k = torch.randn(4)", [], [k]),
                synth.op(2, "torch.sin", 5, "y = torch.sin(q)", [x], [synth.digest_of("sin", x)])]
    a, b = _write(tmp_path, "a", run(q)), _write(tmp_path, "b", run(k))
    p = run_compare(a, b, tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "first divergence: torch.sin at /work/train.py:5" in p.stderr, p.stderr
    assert "inputs differ, although every earlier operation of this stream agrees" in p.stderr
    assert "1 introduced, 0 inherited" in p.stderr
    # with a filter, earlier operations are not all seen: no such claim
    p = run_compare(a, b, tmp_path / "w.pftrace", extra=["--function", "torch.sin"])
    assert "although every earlier" not in p.stderr and "inherited" in p.stderr, p.stderr


def test_a_function_that_differs_with_equal_outputs_says_so(tmp_path: Path) -> None:
    """``x = x + y`` edited to ``x += y``: Tensor.add -> Tensor.add_ with equal inputs and outputs.
    The line read "function differs: Tensor.add -> Tensor.add_; function" (a stray field name) and
    never said that the values agree."""
    a_recs = _gpt_like("a", empty_digest=D("same"))
    b_recs = _gpt_like("b", empty_digest=D("same"))
    for r in b_recs:
        r["outputs"] = next(x for x in a_recs if x["seq"] == r["seq"])["outputs"]
        if r["fn"] == "torch.nn.functional.gelu":
            r["fn"] = "torch.nn.functional.silu"
    p = run_compare(_write(tmp_path, "a", a_recs), _write(tmp_path, "b", b_recs), tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert ": function differs: torch.nn.functional.gelu -> torch.nn.functional.silu; inputs and outputs " \
        "equal" in p.stderr, p.stderr


def test_values_read_as_python_writes_them() -> None:
    """A non-finite float is stored as the string "inf" (docs/capture.md §3.4) and was shown quoted,
    as if it were a string: ``self (arg1): "inf" -> 1000000000.0``; a function argument by name."""
    from opguard.compare.records import Arg

    assert Arg("x", "float", '"inf"').show() == "inf" and Arg("x", "float", '"-inf"').show() == "-inf"
    assert Arg("x", "str", '"inf"').show() == "'inf'"
    assert Arg("f", "function", '"__main__.cos_dist"').show() == "__main__.cos_dist"
    assert Arg("i", "range", "[0,4,1]").show() == "range(0, 4, 1)"
    assert Arg("i", "ndarray", '{"dtype":"int64","shape":[2],"values":[0,2]}').show() == \
        "array([0, 2], dtype=int64)"
    assert Arg("i", "ndarray", '{"dtype":"float64","shape":[3],"values":[1.0,"nan","-inf"]}').show() == \
        "array([1.0, nan, -inf], dtype=float64)"


def _compared(tmp_path: Path, recs_a: list[dict[str, Any]], recs_b: list[dict[str, Any]]) -> Any:
    """``opguard compare`` of two one-rank runs written from these records (exit status 0)."""
    p = run_compare(_write(tmp_path, "a", recs_a), _write(tmp_path, "b", recs_b), tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    return p


def test_other_inputs_name_an_earlier_draw_recorded_without_content(tmp_path: Path) -> None:
    """A seed edited before ``vmap(F.dropout, randomness="different")``: the draw's outputs are
    torch.func wrappers, recorded without content, so its pair is ok, and the first mismatch is the
    ``sum`` reading them. That read "every earlier operation agrees ... loaded from a file or made
    from NumPy, another Python thread, ...": none of which applied. It now names the draw."""
    why = "torch.func wrapper: no storage of its own"

    def run(y: str) -> list[dict[str, Any]]:
        recs = [synth.op(0, "torch.ones", 4, "x = torch.ones(4, 4)", [], [synth.digest_of("ones")]),
                synth.op(1, "torch.dropout", 5, "y = vmap(drop)(x)", [synth.digest_of("ones")], [y]),
                synth.op(2, "Tensor.sum", 6, "print(y.sum())", [y], [synth.digest_of("sum", y)])]
        recs[1]["seeded"] = True
        recs[1]["inputs"][0].update(digest=None, reason=why)
        recs[1]["outputs"][0].update(digest=None, reason=why, stats=None)
        return recs

    p = _compared(tmp_path, run(synth.digest_of("drawn", "a")), run(synth.digest_of("drawn", "b")))
    assert ("first divergence: Tensor.sum at /work/train.py:6, step 0 (A/rank0/capture/2 <-> B/rank0/capture/2): "
            "inputs differ, although every earlier operation of this stream agrees where recorded: before it, "
            "torch.dropout at /work/train.py:5 (A/rank0/capture/1) drew random numbers into outputs capture "
            f"recorded without content ({why}): the difference can come from there; or B's call reads other "
            "tensors than A's") in p.stderr, p.stderr
    assert "1 introduced, 0 inherited" in p.stderr


def test_a_later_draw_names_an_earlier_draw_recorded_without_content(tmp_path: Path) -> None:
    """The vmap draw's result unused: the seed edit shows at a later ``torch.randn``, whose line read
    "another seed, or another number of draws before it" with no hint of the earlier draw."""
    why = "torch.func wrapper: no storage of its own"

    def run(r: str) -> list[dict[str, Any]]:
        recs = [synth.op(0, "torch.dropout", 5, "y = vmap(drop)(x)", [], ["x"]),
                synth.op(1, "torch.randn", 6, "z = torch.randn(4, 4)", [], [r])]
        for rec in recs:
            rec["seeded"] = True
        recs[0]["outputs"][0].update(digest=None, reason=why, stats=None)
        return recs

    p = _compared(tmp_path, run(synth.digest_of("randn", "a")), run(synth.digest_of("randn", "b")))
    assert ("in a random draw (the generator's state differs: another seed, or another number of draws before it; "
            "before it, torch.dropout at /work/train.py:5 (A/rank0/capture/0) drew random numbers into outputs "
            f"capture recorded without content ({why}): it may have drawn differently)") in p.stderr, p.stderr


def test_a_differing_dtype_or_shape_shows_both_values(tmp_path: Path) -> None:
    """A saved-tensors pack hook edited from float16 to bfloat16 (its calls are not recorded): the
    unpack's ``Tensor.to`` read "inputs.self.dtype", a field name without the values."""
    def run(dtype: str, shape: list[int]) -> list[dict[str, Any]]:
        rec = synth.op(0, "Tensor.to", 7, "unpack=lambda t: t.to(torch.float32)", [synth.digest_of("in", dtype)],
                       [synth.digest_of("out", dtype)])
        rec["inputs"][0].update(dtype=dtype, shape=shape)
        return [rec]

    a = _write(tmp_path, "a", run("float16", [3]))
    b = _write(tmp_path, "b", run("bfloat16", [3, 1]))
    p = run_compare(a, b, tmp_path / "v.pftrace", extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    assert ("a saved-tensors pack hook): inputs.arg0.digest, inputs.arg0.dtype (float16 -> bfloat16), "
            "inputs.arg0.shape ([3] -> [3, 1]), outputs.out.digest") in p.stderr, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["values"] == {"inputs.arg0.dtype": "float16 -> bfloat16", "inputs.arg0.shape": "[3] -> [3, 1]"}


_FUNCTION_UNDER_VMAP = """import torch
from torch.func import vmap


class Double(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * {factor}

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * {factor}


x = torch.arange(6.0).view(2, 3)
print(vmap(Double.apply)(x).sum().item())
"""


def test_an_edit_inside_an_autograd_function_under_vmap_is_named(tmp_path: Path) -> None:
    """Real captures: a custom autograd.Function applied under ``vmap`` runs as the higher-order
    operator ``custom_function_call``; the calls of its forward were not recorded, so ``x * 2.0`` ->
    ``x * 3.0`` showed at the ``sum`` after vmap as "inputs differ ... loaded from a file ...". The
    operator is re-entered like a Python-level function now: the edited call is the divergence."""
    runs = _captured_pair(tmp_path, _FUNCTION_UNDER_VMAP.format(factor="2.0"),
                          "# edited\n\n" + _FUNCTION_UNDER_VMAP.format(factor="3.0"))
    p = run_compare(runs["a"], runs["b"], tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "first divergence: Tensor.mul at " in p.stderr and "swap.py:10 (B: " in p.stderr, p.stderr
    assert "arguments differ: other (arg1): 2.0 -> 3.0" in p.stderr, p.stderr


def test_a_capture_of_selected_steps_is_never_read_as_every_earlier_operation_agreeing(tmp_path: Path) -> None:
    """Runs captured with ``OPGUARD_CAPTURE_STEPS=1-2`` and ``w * 2.0`` -> ``w * 3.0``: the first
    record (``loss.item()`` of step 0's loss) reads a tensor step 0 computed, unrecorded. It was
    headlined "inputs differ, although every earlier operation of this stream agrees", counted as
    introduced, and the edited call in step 1 was never named; nothing said what was left out."""
    def run(factor: float) -> list[dict[str, Any]]:
        loss = synth.digest_of("loss", str(factor))
        recs = [synth.op(0, "Tensor.item", 8, "losses.append(loss.item())", [loss], [], step=1),
                synth.op(1, "Tensor.mul", 6, "loss = (w * 2.0).sum()", [synth.digest_of("w")],
                         [synth.digest_of("mul", str(factor))], step=1)]
        recs[1]["args"] = [synth.arg("arg1", "float", factor)]
        return recs

    meta = {"options": {"steps": "1-2", "functions": [], "modules": [], "contexts": []}}
    synth.write_rank(tmp_path / "a", 0, run(2.0), version=2, meta=meta)
    synth.write_rank(tmp_path / "b", 0, run(3.0), version=2, meta=meta)
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert "first divergence: Tensor.mul at /work/train.py:6" in p.stderr, p.stderr
    assert "although every earlier" not in p.stderr, p.stderr
    assert ("note: capture recorded a selection only (run A: steps 1-2; run B: steps 1-2): the calls it left out "
            "were not compared") in p.stderr, p.stderr
    synth.write_rank(tmp_path / "c", 0, run(3.0), version=2,
                     meta={"options": {"steps": "all", "functions": ["torch.mm"], "modules": [], "contexts": []}})
    p = run_compare(tmp_path / "a", tmp_path / "c", tmp_path / "w.pftrace")
    assert "(run A: steps 1-2; run B: functions torch.mm)" in p.stderr, p.stderr


def test_an_output_of_another_dtype_is_not_blamed_on_the_generator(tmp_path: Path) -> None:
    """``torch.set_default_dtype(torch.float64)`` edited to float32 before ``torch.rand(4)``: the
    draw's output dtype differs, which read "in a random draw (the generator's state differs:
    another seed ...)"; the call was asked for another dtype."""
    def run(dtype: str) -> list[dict[str, Any]]:
        rec = synth.op(0, "torch.rand", 4, "x = torch.rand(4)", [], [synth.digest_of("rand", dtype)])
        rec["outputs"][0]["dtype"] = dtype
        rec["seeded"] = True
        return [rec]

    p = run_compare(_write(tmp_path, "a", run("float64")), _write(tmp_path, "b", run("float32")),
                    tmp_path / "v.pftrace")
    assert p.returncode == 0, p.stderr
    assert ("outputs differ in dtype or shape, inputs and arguments equal (another default dtype, "
            "torch.set_default_dtype; ") in p.stderr, p.stderr
    assert "outputs.out.dtype (float64 -> float32)" in p.stderr and "generator" not in p.stderr, p.stderr


def test_dumped_complex_and_non_finite_values_are_compared_whole_and_quietly(tmp_path: Path) -> None:
    """Element-wise errors of tensor dumps: a complex output differing only in its imaginary part
    read ``max_abs_err=0.0, cosine=1.0`` (the imaginary part dropped, with PyTorch's warning on
    stderr), and dumps holding inf printed NumPy's "invalid value encountered in subtract"."""
    import warnings

    import numpy as np
    torch = pytest.importorskip("torch", reason="the .pt dump format needs torch")

    from opguard.compare.diff import dump_errors

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(torch.complex(torch.ones(4), torch.full((4,), 0.5)), a)
    torch.save(torch.complex(torch.ones(4), torch.full((4,), 0.7)), b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        errs = dump_errors(str(a), str(b))
        assert errs["max_abs_err"] == pytest.approx(0.2) and errs["cosine"] < 1.0, errs
        np.save(tmp_path / "c.npy", np.array([1.0, np.inf, -np.inf, np.nan]))
        np.save(tmp_path / "d.npy", np.array([2.0, np.inf, np.inf, np.nan]))
        errs = dump_errors(str(tmp_path / "c.npy"), str(tmp_path / "d.npy"))
    assert errs["max_abs_err"] == np.inf and "cosine" not in errs, errs


def test_a_call_nested_in_the_first_divergence_that_introduced_its_own_difference_is_named(tmp_path: Path) -> None:
    """``torch.autograd.grad`` running a custom Function's backward whose factor was edited 0.5 ->
    0.3: the ``grad`` record (outputs differ, inputs and arguments equal) read like nondeterminism,
    and the nested ``Tensor.mul`` whose argument changed, introduced too, was never named."""
    def run(factor: float) -> list[dict[str, Any]]:
        g = synth.digest_of("grad", str(factor))
        recs = [synth.op(0, "torch.autograd.grad", 13, "(gw,) = torch.autograd.grad(out, w)", [synth.digest_of("o")],
                         [g]),
                synth.op(1, "Tensor.neg", 6, "return g.neg() * ctx.lam, None", [synth.digest_of("g")],
                         [synth.digest_of("n")]),
                synth.op(2, "Tensor.mul", 6, "return g.neg() * ctx.lam, None", [synth.digest_of("n")],
                         [synth.digest_of("m", str(factor))]),
                synth.op(3, "Tensor.add", 14, "y = gw + 1", [g], [synth.digest_of("y", str(factor))])]
        for r in recs[1:3]:
            r.update(parent=0, depth=1)
        recs[2]["args"] = [synth.arg("arg1", "float", factor)]
        return recs

    p = run_compare(_write(tmp_path, "a", run(0.5)), _write(tmp_path, "b", run(0.3)), tmp_path / "v.pftrace",
                    extra=["--json", str(tmp_path / "s.json")])
    assert p.returncode == 0, p.stderr
    assert ("first divergence: Tensor.mul at /work/train.py:6, step 0 (A/rank0/capture/2 <-> B/rank0/capture/2): "
            "arguments differ: arg1: 0.5 -> 0.3") in p.stderr, p.stderr
    assert ("[a call inside torch.autograd.grad at /work/train.py:13 (A/rank0/capture/0 <-> B/rank0/capture/0), "
            "whose outputs differ with inputs and arguments equal]") in p.stderr, p.stderr
    fd = json.loads((tmp_path / "s.json").read_text())["ranks"][0]["first_divergence"]
    assert fd["inside"].startswith("torch.autograd.grad at /work/train.py:13"), fd


def test_an_argument_passed_by_keyword_instead_of_position_is_the_same_argument(tmp_path: Path) -> None:
    """``torch.clamp(x, 0, 1)`` refactored to ``torch.clamp(x, min=0, max=1)``: the same call, read
    as "arguments differ: min (arg1): 0 -> absent; max (arg2): 1 -> absent; min: absent -> 0; ..."
    and counted as introduced. A positional slot whose parameter name is known is that keyword."""
    def run(args: list[dict[str, Any]], out: str = "c") -> list[dict[str, Any]]:
        rec = synth.op(0, "torch.clamp", 5, "y = torch.clamp(x, 0, 1)", [synth.digest_of("x")],
                       [synth.digest_of(out)])
        rec["args"] = args
        return [rec]

    meta = {"arg_names": {"torch.clamp": ["input", "min", "max"]}}
    positional = [synth.arg("arg1", "int", 0), synth.arg("arg2", "int", 1)]
    synth.write_rank(tmp_path / "a", 0, run(positional), version=2, meta=meta)
    synth.write_rank(tmp_path / "b", 0, run([synth.arg("min", "int", 0), synth.arg("max", "int", 1)]),
                     version=2, meta=meta)
    synth.write_rank(tmp_path / "c", 0, run([synth.arg("min", "int", 0), synth.arg("max", "float", 0.5)], "d"),
                     version=2, meta=meta)
    p = run_compare(tmp_path / "a", tmp_path / "b", tmp_path / "v.pftrace")
    assert p.returncode == 0 and "no divergence" in p.stderr and "mismatch 0" in p.stderr, p.stderr
    p = run_compare(tmp_path / "a", tmp_path / "c", tmp_path / "w.pftrace")
    assert "arguments differ: max (arg2): 1 (int) -> 0.5 (float)" in p.stderr, p.stderr
    assert "absent" not in p.stderr, p.stderr
