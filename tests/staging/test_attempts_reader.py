"""Reading a published attempts.json back from a target that others can write (docs/format.md §11):
bounded, and a valid one is read."""

from __future__ import annotations

import json
from pathlib import Path

from opguard.staging.attempts import ATTEMPTS_FILE, ATTEMPTS_MAX_BYTES, published_attempts
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
