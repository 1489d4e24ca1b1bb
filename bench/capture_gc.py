"""What capture costs in Python's garbage collector over a long capture (docs/capture.md §3.12),
this tree against another copy of ``opguard/`` (``--old``, as for ``bench/capture_ab.py``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/capture_gc.py --old /tmp/old [--models mlp,ops]
        [--kernels native,torch] [--steps 300]

Per tree, model (``bench/capture_ops.py``) and host kernel, one fresh process: warm-up steps
uncaptured, then ``--steps`` captured steps in one capture, with a ``gc.callbacks`` hook timing
every collection. Reported per captured step: collections of each generation, the wall time they
took (µs), and the net growth of the oldest generation (objects promoted there and still alive:
the promotions are what set off a full collection of every object in the process), plus thread
CPU time per step; also the uncaptured
step's thread CPU time in the same process. The trees run alternately; figures of one run only
compare with each other (a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.capture_child import REPO, run_child

CHILD = r"""
import gc, json, tempfile, time
kernel, steps = args[0], int(args[1])
for _ in range(3):
    step()
c0 = time.thread_time()
for _ in range(min(steps, 50)):
    step()
base = (time.thread_time() - c0) / min(steps, 50)
counts, spent, t0 = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]
promoted = [0]
old_ids = set()

def hook(phase, info):
    g = info["generation"]
    if phase == "start":
        t0[0] = time.perf_counter()
        return
    spent[g] += time.perf_counter() - t0[0]
    counts[g] += 1

env = {"OPGUARD_TRACE_OUTPUT_BASE": tempfile.mkdtemp(prefix="capgc-"), "OPGUARD_CAPTURE_HOST_KERNEL": kernel}
with oc.capture(env=env):
    step()
    gc.collect()
    old = len(gc.get_objects(generation=2))
    gc.callbacks.append(hook)
    c0 = time.thread_time()
    for _ in range(steps):
        step()
    cpu = (time.thread_time() - c0) / steps
    gc.callbacks.remove(hook)
    grown = len(gc.get_objects(generation=2)) - old
print(json.dumps({"collections_per_step": [round(c / steps, 4) for c in counts],
                  "gc_us_per_step": [round(t / steps * 1e6, 1) for t in spent],
                  "oldest_generation_net_growth_per_step": round(grown / steps, 2),
                  "cpu_us_per_step": round(cpu * 1e6), "uncaptured_cpu_us_per_step": round(base * 1e6)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="a directory holding the other opguard/")
    ap.add_argument("--models", default="mlp,ops")
    ap.add_argument("--kernels", default="native,torch")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    trees = {"new": str(REPO), "old": str(args.old.resolve())}
    out: dict[str, dict[str, dict[str, object]]] = {}
    for model in args.models.split(","):
        for kernel in args.kernels.split(","):
            key = f"{model}/{kernel}"
            for tag in ("new", "old"):
                got = run_child(CHILD, trees[tag], model, kernel, str(args.steps))
                got["loadavg_1min"] = round(os.getloadavg()[0], 2)
                out.setdefault(key, {})[tag] = got
                print(f"{key} {tag}: {got}", file=sys.stderr, flush=True)
    print(json.dumps({"results": out, "config": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
