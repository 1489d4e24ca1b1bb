"""A/B of capture's cost per recorded op: this tree against another copy of ``opguard/`` (e.g. the
code before a change: ``mkdir /tmp/old && git archive HEAD opguard | tar -x -C /tmp/old``; the
native kernel ``opguard/capture/_hostkernel.abi3.so`` copied in).

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/capture_ab.py --old /tmp/old [--rounds 4]
        [--steps 6] [--models ops,gpt,mlp]

Each round runs one fresh process per tree, the order alternating (new/old, old/new, ...); a
process times, per model (the models of ``bench/capture_ops.py``), ``--blocks`` pairs of
``--steps`` uncaptured steps followed at once by ``--steps`` captured steps (a fresh capture per
block), thread CPU time. Per tree and model: ``cpu_ratio`` / ``cpu_us_per_record`` from the
**minimum** over all rounds and steps (captured and uncaptured separately: other processes only
ever add time), and ``paired_ratio_median`` / ``paired_us_per_record_median``: the median over
all block pairs of (captured minimum / uncaptured minimum of the block just before). This
machine's speed drifts by 30 % over seconds (shared cores); a pair is measured within a fraction of
a second, so the paired median is the figure to quote, the minimum its cross-check. Also printed:
the 1-minute load average before every process.

``mean_ratio_median``: the median over block pairs of (captured mean / uncaptured mean): what a
long run pays, the steps that ran a garbage collection included. Minima leave those steps out, and
a block of a few steps rarely holds one: measure it with long blocks (``--steps 400 --blocks 2``).
Until session 14 capture's records and cache entries outlived Python's young collections and set
off a full collection of the whole process every ~300 steps of the MLP (~0.5 ms per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
tree, repo, models, steps, blocks = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])
sys.path[:0] = [tree, repo]
import torch
torch.set_num_threads(1)
import opguard.capture as oc
from bench.capture_ops import count_ops, make
assert oc.__file__.startswith(tree), (oc.__file__, tree)
out = {}
for name in models:
    step = make(name)
    for _ in range(2):
        step()
    base, cap, pairs, records = [], [], [], 0
    for _ in range(blocks):  # an uncaptured block, then a captured one right after it: one pair
        b = []
        for _ in range(steps):
            c0 = time.thread_time(); step(); b.append(time.thread_time() - c0)
        d = Path(tempfile.mkdtemp(prefix="capab-"))
        c = []
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(d)}):
            step()
            for _ in range(steps):
                c0 = time.thread_time(); step(); c.append(time.thread_time() - c0)
        records = count_ops(d) / (steps + 1)
        base += b
        cap += c
        pairs.append([min(b), min(c), sum(b) / len(b), sum(c) / len(c)])
    out[name] = {"base": base, "cap": cap, "pairs": pairs, "records_per_step": records}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="a directory holding the other opguard/")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--models", default="ops,gpt,mlp")
    ap.add_argument("--blocks", type=int, default=3, help="uncaptured/captured block pairs per process and model")
    args = ap.parse_args()
    trees = {"new": str(REPO), "old": str(args.old.resolve())}
    got: dict[str, dict[str, dict[str, Any]]] = {"new": {}, "old": {}}
    loads: list[float] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for rnd in range(args.rounds):
        for tag in (("new", "old") if rnd % 2 == 0 else ("old", "new")):
            loads.append(round(os.getloadavg()[0], 2))
            with tempfile.TemporaryDirectory() as cwd:
                res = subprocess.run([sys.executable, "-c", CHILD, trees[tag], str(REPO), args.models,
                                      str(args.steps), str(args.blocks)], cwd=cwd, env=env, capture_output=True,
                                     text=True, check=True)
            for name, r in json.loads(res.stdout.strip().splitlines()[-1]).items():
                acc = got[tag].setdefault(name, {"base": [], "cap": [], "pairs": [],
                                                 "records_per_step": r["records_per_step"]})
                acc["base"] += r["base"]
                acc["cap"] += r["cap"]
                acc["pairs"] += r["pairs"]
            print(f"round {rnd} {tag} done (load {loads[-1]})", file=sys.stderr, flush=True)
    table: dict[str, Any] = {}
    for tag, models in got.items():
        for name, acc in models.items():
            b, c, n = min(acc["base"]), min(acc["cap"]), acc["records_per_step"]
            ratios = sorted(p[1] / p[0] for p in acc["pairs"])
            per_rec = sorted((p[1] - p[0]) / n * 1e6 for p in acc["pairs"]) if n else []
            means = sorted(p[3] / p[2] for p in acc["pairs"])
            table.setdefault(name, {})[tag] = {
                "cpu_ratio": round(c / b, 3), "cpu_us_per_record": round((c - b) / n * 1e6, 1) if n else None,
                "paired_ratio_median": round(statistics.median(ratios), 3),
                "paired_ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                "paired_us_per_record_median": round(statistics.median(per_rec), 1) if per_rec else None,
                "mean_ratio_median": round(statistics.median(means), 3),
                "mean_ratio_range": [round(means[0], 3), round(means[-1], 3)],
                "base_ms": round(b * 1e3, 3), "cap_ms": round(c * 1e3, 3), "records_per_step": n}
    print(json.dumps({"models": table, "loadavg_1min": loads, "config": {k: str(v) for k, v in vars(args).items()}},
                     indent=1))


if __name__ == "__main__":
    main()
