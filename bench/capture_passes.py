"""How many passes over tensor memory a captured step makes, per kind (docs/capture.md §5.2-§5.3),
this tree and optionally another copy of ``opguard/`` (``--old``, as for ``bench/capture_ab.py``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/capture_passes.py [--old /tmp/old] [--models gpt,mlp] [--steps 5]

Per tree and model (``bench/capture_ops.py``), one fresh process: one captured step to warm up,
then ``--steps`` steps with the session's native kernel entry points wrapped to count calls:
``contiguous`` (the kernel's ``entry()``: a contiguous CPU tensor's digest and statistics),
``strided`` (its ``strided()``: a non-contiguous one, gathered piecewise), and ``general`` (tensor
entries that reached ``Session.summarize``, the general path). Counts are per step. A count, not a
time: it does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.capture_child import REPO, run_child

CHILD = r"""
import collections, json, tempfile
from opguard.capture import session as S
steps = int(args[0])
for _ in range(2):
    step()
counts = collections.Counter()

def counted(kind, fn):
    def call(*a, **k):
        counts[kind] += 1
        return fn(*a, **k)
    return call

with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": tempfile.mkdtemp(prefix="cappasses-")}) as cap:
    s = cap.session
    step()
    if s.host_entry is not None:
        s.host_entry = counted("contiguous", s.host_entry)
    if s.host_strided is not None:
        s.host_strided = counted("strided", s.host_strided)
    S.Session.summarize = counted("general", S.Session.summarize)
    for _ in range(steps):
        step()
print(json.dumps({k: counts[k] / steps for k in ("contiguous", "strided", "general")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, help="a directory holding the other opguard/")
    ap.add_argument("--models", default="gpt,mlp,ops")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    trees = {"new": str(REPO)}
    if args.old is not None:
        trees["old"] = str(args.old.resolve())
    out: dict[str, dict[str, object]] = {}
    for model in args.models.split(","):
        for tag, tree in trees.items():
            out.setdefault(model, {})[tag] = run_child(CHILD, tree, model, str(args.steps))
    print(json.dumps({"passes_per_step": out, "config": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
