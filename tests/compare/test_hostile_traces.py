"""compare on capture directories that others could write (a trace restored from a shared target, a
crashed run's half-written one): a clear refusal or a bounded, correct answer — never a traceback, a
hang, a read of a device or FIFO, or a file outside the run directory (docs/compare.md §1, §8;
docs/format.md §11)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.compare import synth
from tests.compare.helpers import run_compare

CAP = Path("ranks") / "rank-000000" / "capture"


def _pair(tmp: Path) -> tuple[Path, Path]:
    recs = synth.program("base")
    a = tmp / "a"
    synth.write_rank(a, 0, recs, version=2)
    b = tmp / "b"
    shutil.copytree(a, b)
    return a, b


def _records(b: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (b / CAP / "trace.jsonl").read_text().splitlines()]


def _write(b: Path, recs: list[dict[str, Any]]) -> None:
    (b / CAP / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _edit_op(b: Path, **fields: Any) -> None:
    recs = _records(b)
    next(r for r in recs if r["kind"] == "op" and r["seq"] == 2).update(fields)
    _write(b, recs)


def _add_dump(b: Path, path: str) -> None:
    recs = _records(b)
    op = next(r for r in recs if r["kind"] == "op" and r["seq"] == 2)
    op["outputs"][0]["digest"] = "ffff"  # a mismatch there, so compare reads the dumps
    i = recs.index(op)
    recs.insert(i + 1, {"v": 2, "kind": "dump", "seq": 2, "slot": "out", "path": path, "sha256": "0" * 64})
    _write(b, recs)


def _sources(b: Path, listed: str) -> None:
    (b / CAP / "sources.json").write_text(json.dumps(
        {"version": 1, "rank": 0, "files": [{"path": listed, "sha256": "0" * 64, "size": 10}]}))


def _fifo(p: Path) -> Path:
    if p.exists():
        p.unlink()
    os.mkfifo(p)
    return p


CASES = {
    # sources.json lists a device or a FIFO: was an unbounded read (200 MB/s) or a hang
    "source-is-dev-zero": (lambda b, t: _sources(b, "/dev/zero"), 0),
    "source-is-fifo": (lambda b, t: _sources(b, str(_fifo(t / "fifo"))), 0),
    # a dump record naming a file outside its rank directory, or a FIFO: was read (or hung)
    "dump-absolute": (lambda b, t: _add_dump(b, "/etc/passwd"), 2),
    "dump-dotdot": (lambda b, t: _add_dump(b, "../../../../etc/passwd"), 2),
    "dump-fifo": (lambda b, t: (_add_dump(b, "tensors/x.pt"), (b / CAP / "tensors").mkdir(),
                                _fifo(b / CAP / "tensors" / "x.pt")), 0),
    "dump-corrupt": (lambda b, t: (_add_dump(b, "tensors/x.pt"), (b / CAP / "tensors").mkdir(),
                                   (b / CAP / "tensors" / "x.pt").write_bytes(b"\x80\x02garbage")), 0),
    "dump-seq-not-int": (lambda b, t: _write(b, [*_records(b), {"v": 2, "kind": "dump", "seq": "x", "slot": "o",
                                                                "path": "a"}]), 2),
    # wrong types in an op record: were tracebacks in pass 2 (int(seq), the line map)
    "seq-not-int": (lambda b, t: _edit_op(b, seq="x"), 2),
    "line-not-int": (lambda b, t: _edit_op(b, line="x"), 2),
    "deep-nesting": (lambda b, t: (b / CAP / "trace.jsonl").write_bytes(
        b'{"v":2,"kind":"op","x":' + b"[" * 100000 + b"]" * 100000 + b"}\n"
        + (b / CAP / "trace.jsonl").read_bytes()), 2),
    # meta.json: wrong types, no version (was 'upgrade opguard', exit 6), a FIFO (was a hang)
    "meta-notes-int": (lambda b, t: (b / CAP / "meta.json").write_text(json.dumps(
        {**json.loads((b / CAP / "meta.json").read_text()), "notes": 5})), 0),
    "meta-empty-object": (lambda b, t: (b / CAP / "meta.json").write_text("{}"), 2),
    "meta-version-string": (lambda b, t: (b / CAP / "meta.json").write_text('{"version": "2", "rank": 0}'), 2),
    "meta-fifo": (lambda b, t: _fifo(b / CAP / "meta.json"), 2),
    # the trace itself a link to a file outside, or a FIFO
    "trace-link": (lambda b, t: ((b / CAP / "trace.jsonl").unlink(), (b / CAP / "trace.jsonl").symlink_to(
        t / "a" / CAP / "trace.jsonl")), 2),
    "trace-fifo": (lambda b, t: _fifo(b / CAP / "trace.jsonl"), 2),
    # a rank's own output named sync.tar.gz beside the traces: compared as a legacy snapshot instead
    "archive-beside-traces": (lambda b, t: (b / CAP.parent / "sync.tar.gz").write_bytes(b"garbage"), 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_capture_directory_is_refused_or_read_safely(tmp_path: Path, case: str) -> None:
    a, b = _pair(tmp_path)
    make, want = CASES[case]
    make(b, tmp_path)
    p = run_compare(a, b, tmp_path / "v.pftrace")  # timeout: a hang fails the test
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == want, p.stderr
    if want == 2:
        assert "fix:" in p.stderr, p.stderr
    if case.startswith("dump-"):
        assert "max_abs_err" not in p.stderr, p.stderr  # nothing was read as a dump
