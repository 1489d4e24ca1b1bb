"""The files a capture's call sites name (capture/sources.json, docs/capture.md §9) reach the node
metadata: local rank 0's wrapper copies them before the final drain, and a comparison of the
restored run finds them (opguard.compare.sources)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from opguard.compare.sources import _capture_sources
from opguard.launcher.nodeinfo import add_capture_sources
from tests.launcher.helpers import OPGUARD, OPGUARD_RUN, PY


def _sources_doc(*paths: Path, digest: str | None = None) -> bytes:
    files = [{"path": str(p), "sha256": digest or hashlib.sha256(p.read_bytes()).hexdigest(),
              "size": p.stat().st_size, "mtime_ns": 0} for p in paths]
    return json.dumps({"version": 1, "rank": 0, "files": files}).encode()


def test_add_capture_sources_copies_what_ran_and_says_why_not(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    same, edited, gone = lib / "model.py", lib / "edited.py", lib / "gone.py"
    same.write_text("x = 1\n")
    edited.write_text("y = 1\n")
    gone.write_text("z = 1\n")
    ranks = tmp_path / "ranks"
    (ranks / "rank-000000" / "capture").mkdir(parents=True)
    (ranks / "rank-000000" / "capture" / "sources.json").write_bytes(_sources_doc(same, edited, gone))
    edited.write_text("y = 2\n")  # edited after the run: its bytes are not what ran
    gone.unlink()
    node = tmp_path / "node"
    copied, problems = add_capture_sources(node, ranks)
    assert copied == 1
    assert len(problems) == 2 and any(str(edited) in p and "changed since" in p for p in problems), problems
    index = json.loads((node / "capture-source-index.json").read_text())["files"]
    by_path = {e["path"]: e for e in index.values()}
    assert (node / by_path[str(same)]["copy"]).read_bytes() == same.read_bytes()
    assert by_path[str(edited)]["copy"] is None and "changed since" in by_path[str(edited)]["error"]
    assert by_path[str(gone)]["copy"] is None and by_path[str(gone)]["error"]
    before = sorted(p for p in node.rglob("*"))
    assert add_capture_sources(node, ranks) == (0, [])  # already listed: nothing copied or said again
    assert sorted(p for p in node.rglob("*")) == before


CHILD = """
import hashlib, json, sys
from pathlib import Path
from opguard.staging.writers import write_rank_file
src = Path(sys.argv[1])
doc = {"version": 1, "rank": 0, "files": [{"path": str(src), "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
       "size": src.stat().st_size, "mtime_ns": 0}]}
write_rank_file("capture/sources.json", json.dumps(doc).encode())
"""


def test_opguard_run_publishes_the_capture_sources_with_the_node(staging_env: dict[str, str], tmp_path: Path) -> None:
    elsewhere = tmp_path / "site" / "mylib"
    elsewhere.mkdir(parents=True)
    src = elsewhere / "layers.py"  # outside the program's directory: only the capture's index names it
    src.write_text("def f(x):\n    return x * 2\n")
    r = subprocess.run([OPGUARD_RUN, PY, "-c", CHILD, str(src)], env=staging_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    dest = tmp_path / "restored"
    m = subprocess.run([OPGUARD, "materialize", staging_env["OPGUARD_LOCAL_DUMP_TARGET"], str(dest)],
                       env=staging_env, capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    rank = dest / "ranks" / "rank-000000"
    ran = src.read_bytes()
    copies = list((rank / "_node").rglob("layers.py"))
    assert len(copies) == 1 and copies[0].read_bytes() == ran, sorted(map(str, dest.rglob("*")))
    # the original edited after the run: compare may no longer use it (its SHA-256 changed), so what
    # it finds must be the copy in _node/, with the bytes that ran
    src.write_text("def f(x):\n    return x * 3\n")
    found = _capture_sources(rank)
    assert found.files[str(src)] == copies[0] and found.files[str(src)].read_bytes() == ran
    src.unlink()  # and gone altogether
    again = _capture_sources(rank)
    assert again.files[str(src)] == copies[0] and again.lines(str(src)) == ["def f(x):", "    return x * 2"]
