"""What the capture benches that compare two trees share: a fresh child process per tree and model,
importing ``opguard`` from that tree (``bench/capture_gc.py``, ``bench/capture_passes.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# the child's first lines: argv = tree, repo, model, then the bench's own; `step` runs one step of
# `model` (bench/capture_ops.py) with the tree's opguard imported as `oc`
PREAMBLE = r"""
import sys
tree, repo, model, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
sys.path[:0] = [tree, repo]
import torch
torch.set_num_threads(1)
import opguard.capture as oc
from bench.capture_ops import make
assert oc.__file__.startswith(tree), (oc.__file__, tree)
step = make(model)
"""


def run_child(body: str, tree: str, model: str, *args: str) -> dict[str, Any]:
    """Run ``PREAMBLE + body`` in a fresh process (one CPU thread, a temporary working directory);
    the JSON object it prints last."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as cwd:
        res = subprocess.run([sys.executable, "-c", PREAMBLE + body, tree, str(REPO), model, *args],
                             cwd=cwd, env=env, capture_output=True, text=True, check=True)
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out
