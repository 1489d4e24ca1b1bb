"""Call-site identity by aligning the two versions of each source file (docs/compare.md §2, §2.1)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from opguard.compare.engine import compare
from opguard.compare.linemap import line_correspondence, recover_original, unwrap
from opguard.compare.perfetto_export import read_export
from tests.compare import synth
from tests.compare.helpers import ops_of

F = "/abs/train.py"


def test_equal_lines_shift_edited_hunks_map_in_place_insertions_have_no_counterpart() -> None:
    a = ["import torch", "x = f()", "y = g(x)", "z = h(y)", "w = k(z)", "v = m(w)"]
    b = ["import torch", "NEW = 1", "x = f()", "y = g(x, 2)", "z = h(y)", "q = 1", "r = 2", "v = m(w)"]
    to_a, how = line_correspondence(a, b)
    assert list(to_a) == [1, 0, 2, 3, 4, 0, 0, 6]
    assert how == ["same", "no counterpart", "shifted A:2", "edited A:3", "shifted A:4", "no counterpart",
                   "no counterpart", "shifted A:6"]      # w = k(z) -> two lines: unequal hunk, no counterpart


def test_a_moved_line_keeps_no_counterpart_but_says_where_it_came_from() -> None:
    # two swapped lines: difflib keeps one as equal; the other is deleted in A and inserted in B
    a = ["h = lin(x)", "a = h.sin()", "b = h.cos()", "loss = a * b"]
    b = ["h = lin(x)", "b = h.cos()", "a = h.sin()", "loss = a * b"]
    to_a, how = line_correspondence(a, b)
    moved = [j for j, m in enumerate(how) if m.startswith("moved")]
    assert len(moved) == 1 and to_a[moved[0]] == 0     # still no counterpart: identity, pairing unchanged
    j = moved[0]
    assert how[j] == f"moved from A:{a.index(b[j]) + 1}"
    # a text that is ambiguous (twice among A's unmatched lines), blank or only a comment is not "moved"
    a2 = ["x = 1", "y = f(x)", "x = 1", "z = 2", "# c", ""]
    b2 = ["w = 0", "# c", "", "x = 1", "z = 2", "y = f(x)"]
    _, how2 = line_correspondence(a2, b2)
    assert not any(m.startswith("moved") for i, m in enumerate(how2) if b2[i] in ("x = 1", "# c", "")), how2


def test_the_summary_names_where_a_moved_line_was_in_a(tmp_path: Path) -> None:
    """Two swapped lines (B's cos reads another input, so no anchor pairs it): the call on the line
    difflib calls inserted is not on "a line A does not have" -- the summary says which line of A
    it was."""
    a_lines = ["x = torch.randn(4)", "a = torch.sin(x)", "b = torch.cos(x)"]
    b_lines = ["x = torch.randn(4)", "b = torch.cos(x)", "a = torch.sin(x)"]
    for run, lines in (("a", a_lines), ("b", b_lines)):
        recs = [synth.op(0, "torch.randn", 1, lines[0], [], [synth.digest_of("x")], file=F)]
        for k, text in enumerate(lines[1:], start=1):
            fn = "torch.sin" if "sin" in text else "torch.cos"
            x = synth.digest_of("x", "moved" if run == "b" and fn == "torch.cos" else "")
            recs.append(synth.op(k, fn, k + 1, text, [x], [synth.digest_of(fn)], file=F))
        _run(tmp_path, run, "\n".join(lines) + "\n", recs)
    summary = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    s = summary.streams[(0, "capture")]
    assert s.first_new_b is not None and s.first_new_b.startswith("run B torch.cos at /abs/train.py:2 ")
    assert s.first_new_b.endswith("[B's line: moved from A:3]"), s.first_new_b
    assert "on a line A does not have or has elsewhere" in summary.render()


def test_identical_files_map_every_line_to_itself_white_space_ignored() -> None:
    to_a, how = line_correspondence(["a", "  b"], ["a", "b  "])
    assert list(to_a) == [1, 2] and how == ["same", "same"]


def _run(tmp: Path, run: str, body: str, recs: list[dict[str, object]], *, node: bool = True) -> None:
    cap = synth.write_rank(tmp / run, 0, recs)
    (cap / "sources.json").write_text(json.dumps({"version": 1, "rank": 0, "files": [
        {"path": F, "sha256": hashlib.sha256(body.encode()).hexdigest(), "size": len(body)}]}))
    if node:
        d = cap.parent / "_node" / "sources"
        d.mkdir(parents=True)
        (d / "train.py").write_text(body)


def test_edited_and_shifted_lines_keep_their_identity_with_restored_sources(tmp_path: Path) -> None:
    """A line inserted above and the op's own line edited: both runs' ops get A's line as identity,
    the order pairs them (equal sequences), and B's mapping is evidence."""
    a_lines = ["import torch", "x = torch.randn(4)", "h = torch.relu(x)"]
    b_lines = ["import torch", "SCALE = 2", "x = torch.randn(4)", "h = torch.relu(x * SCALE)"]
    for run, lines in (("a", a_lines), ("b", b_lines)):
        off = 0 if run == "a" else 1
        recs = [synth.op(0, "torch.randn", 2 + off, lines[1 + off], [], [synth.digest_of("x")], file=F),
                synth.op(1, "torch.relu", 3 + off, lines[2 + off], [synth.digest_of("x", run)],
                         [synth.digest_of("r", run)], file=F)]
        _run(tmp_path, run, "\n".join(lines) + "\n", recs)
    summary = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    export = read_export(tmp_path / "v.pftrace")
    a, b = ops_of(export, "A"), ops_of(export, "B")
    assert [op.args["callsite"]["identity"] for op in a] == ["train.py:2", "train.py:3"]
    assert [op.args["callsite"]["identity"] for op in b] == ["train.py:2", "train.py:3"]
    assert [op.args["callsite"]["line_map"] for op in b] == ["shifted A:2", "edited A:3"]
    assert "line_map" not in a[0].args["callsite"]
    assert all(op.args["correspondence"]["basis"] == "equal-sequence" for op in a)
    assert summary.streams[(0, "capture")].notes == []


def test_without_a_source_on_one_side_line_numbers_and_the_summary_says_so(tmp_path: Path) -> None:
    body = "import torch\nx = torch.randn(4)\n"
    for run, node in (("a", True), ("b", False)):
        _run(tmp_path, run, body, [synth.op(0, "torch.randn", 2, "x = torch.randn(4)", [], ["d"], file=F)],
             node=node)
    summary = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    a = ops_of(read_export(tmp_path / "v.pftrace"), "A")
    assert a[0].args["callsite"]["identity"] == "train.py:line=2"
    notes = summary.streams[(0, "capture")].notes
    assert any("identified by file name and line number in train.py: run B has no source" in n for n in notes)
    assert "run B has no source" in summary.render()


def test_listed_source_file_is_used_while_its_sha256_is_unchanged(tmp_path: Path) -> None:
    """A trace directory compared where it was captured: sources.json's own paths serve as copies,
    unless the file changed since (then it is not the file that ran)."""
    src_a, src_b = tmp_path / "src-a" / "train.py", tmp_path / "src-b" / "train.py"
    for src, body in ((src_a, "x = torch.randn(4)\n"), (src_b, "import os\nx = torch.randn(4)\n")):
        src.parent.mkdir()
        src.write_text(body)
    for run, src, line in (("a", src_a, 1), ("b", src_b, 2)):
        cap = synth.write_rank(tmp_path / run, 0, [synth.op(0, "torch.randn", line, "x = torch.randn(4)", [], ["d"],
                                                            file=str(src))])
        (cap / "sources.json").write_text(json.dumps({"version": 1, "rank": 0, "files": [
            {"path": str(src), "sha256": hashlib.sha256(src.read_bytes()).hexdigest()}]}))
    compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    b = ops_of(read_export(tmp_path / "v.pftrace"), "B")
    assert b[0].args["callsite"]["identity"] == "train.py:1"
    src_b.write_text("import os\n\nx = torch.randn(4)\n")        # edited after the run: not used
    summary = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v2.pftrace")
    b = ops_of(read_export(tmp_path / "v2.pftrace"), "B")
    assert b[0].args["callsite"]["identity"] == "train.py:line=2"
    assert "run B has no source" in summary.render()


def test_reference_rewritten_copy_gives_back_the_original_lines() -> None:
    copy = [
        "from opguard.runtime_tracer import flush_trace_buffer",
        "from opguard.wrapped_ops import make_wrapper",
        "opguard_wrapped__torch_relu = make_wrapper(tag_prefix = '/t/train.py')",
        "import torch",
        "",
        "def f(x):",
        "    h = opguard_wrapped__torch_relu(4)(torch.relu, g(x))",
        "    flush_trace_buffer()",
        "    return h",
        "y = opguard_wrapped__torch_randn(7)(torch.randn)",
    ]
    assert recover_original(copy) == ["import torch", "", "def f(x):", "    h = torch.relu(g(x))", "    return h",
                                      "", "y = torch.randn()"]
    assert unwrap("z = opguard_wrapped_x(3)(a.b[0], 1)") == "z = (a.b[0], 1)"     # not a plain callee
    assert recover_original(["import torch", "x = 1"]) == ["import torch", "x = 1"]    # not rewritten


def test_no_source_on_either_side_is_one_note(tmp_path: Path) -> None:
    for run in ("a", "b"):
        synth.write_rank(tmp_path / run, 0, [synth.op(0, "torch.randn", 2, "x = torch.randn(4)", [], ["d"], file=F)])
    summary = compare(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "v.pftrace")
    assert summary.streams[(0, "capture")].notes == [
        "call sites identified by file name and line number in train.py: run A and B have no source of it (a line "
        "inserted above a call site changes its identity)"]
