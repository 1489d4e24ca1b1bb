"""Reading a published attempts.json back from a target that others can write (docs/format.md §11):
bounded, and a valid one is read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from opguard.staging.attempts import ATTEMPTS_FILE, ATTEMPTS_MAX_BYTES, published_attempts
from tests.conftest import BIN
from tests.helpers.restore import add_batch, make_target, seal

NODE = "node-node-a"


def test_a_valid_attempts_file_is_read(tmp_path: Path) -> None:
    src = make_target(tmp_path / "shared")
    doc = {"version": 1, "attempts": [{"attempt": 1, "job_id": "7", "how": "first"}]}
    add_batch(src, NODE, [("file", ATTEMPTS_FILE, 1, 0, json.dumps(doc).encode())])
    seal(src, NODE)
    assert published_attempts(src) == {"node-a": doc["attempts"]}


def test_an_oversized_attempts_file_is_ignored_without_reading_it_whole(tmp_path: Path) -> None:
    """A forged node batch whose attempts.json is 64 MiB (a few KiB compressed): ignored, never
    joined in memory (it was read whole by b''.join before)."""
    src = make_target(tmp_path / "shared")
    big = b'{"version": 1, "attempts": [' + b" " * (64 << 20) + b"]}"
    assert len(big) > ATTEMPTS_MAX_BYTES
    add_batch(src, NODE, [("file", ATTEMPTS_FILE, 1, 0, big)])
    seal(src, NODE)
    assert published_attempts(src) == {}


@pytest.mark.parametrize("forged", [{"started_at": 1e300}, {"started_at": float("nan")}, {"ended_at": -1e18},
                                    {"attempt": [1]}, {"hostname": "x\nsealed    rank-000099: FORGED LINE"}])
def test_a_forged_attempt_never_fails_a_restore_nor_prints_a_line_of_its_own(tmp_path: Path,
                                                                             forged: dict[str, Any]) -> None:
    """A valid, sealed node stream whose attempts.json holds values no launcher writes: verify and
    materialize ended with a traceback (exit 1) after materialize had published DEST (a retry then
    found DEST existing), and a hostname holding a newline printed a forged report line."""
    a = {"attempt": 1, "job_id": "1", "how": "first", "hostname": "node-a", "started_at": 1.0, "ended_at": 2.0,
         "exit_status": 0, "first_sequence": {"rank-000000": 1}, **forged}
    src = make_target(tmp_path / "shared")
    add_batch(src, "rank-000000", [("file", "a.txt", 1, 0, b"A")])
    seal(src, "rank-000000")
    add_batch(src, NODE, [("file", ATTEMPTS_FILE, 1, 0, json.dumps({"version": 1, "attempts": [a]}).encode())])
    seal(src, NODE)
    for cmd in (["verify", str(src)], ["verify", "--json", str(src)], ["materialize", str(src), str(tmp_path / "out")]):
        r = subprocess.run([str(BIN / "opguard"), *cmd], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.stderr)
        if "--json" in cmd:  # strict JSON (the newline is escaped in its string)
            json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        else:
            assert "FORGED" not in "".join(line for line in (r.stdout + r.stderr).splitlines()
                                           if not line.startswith(("node ", "opguard: node "))), r.stdout + r.stderr
    assert (tmp_path / "out" / "ranks" / "rank-000000" / "a.txt").read_bytes() == b"A"


def test_a_node_stream_swapped_for_a_link_is_not_read_through(tmp_path: Path) -> None:
    """verify reads the attempts a second time after checking the streams; it read them by path, so
    a node stream directory replaced by a link to another target in between made verify print that
    target's attempts (found with a 1.2-1.6 s delay). Now they are read through directory
    descriptors without following links: the swapped stream yields nothing."""
    from tests.helpers.restore import stream_dir

    def target(at: Path, host: str) -> Path:
        src = make_target(at)
        doc = {"version": 1, "attempts": [{"attempt": 1, "job_id": "7", "how": "first", "hostname": host}]}
        add_batch(src, NODE, [("file", ATTEMPTS_FILE, 1, 0, json.dumps(doc).encode())])
        seal(src, NODE)
        return src

    src = target(tmp_path / "shared", "node-a")
    other = target(tmp_path / "outside", "READ-FROM-OUTSIDE")
    assert published_attempts(src)["node-a"][0]["hostname"] == "node-a"
    sd = stream_dir(src, NODE)
    sd.rename(tmp_path / "moved")
    sd.symlink_to(stream_dir(other, NODE))
    assert published_attempts(src) == {}
