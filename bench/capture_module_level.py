"""Capture's cost when the training loop runs at a script's module level (tutorials, nanoGPT's
``train.py``): the caller of every call is the script's ``<module>`` code, whose hash covers every
constant of the script, nested function code included (CPython recomputes it on every hash).

    OMP_NUM_THREADS=1 .venv/bin/python bench/capture_module_level.py --old /tmp/old [--rounds 3]
        [--blocks 10] [--helpers 30]

Writes a script of ``--helpers`` small functions (about 10 lines each, the bulk of a real training
script: logging, schedules, config) followed by a module-level loop: a 6-layer width-128 MLP with
AdamW plus a few tensor ops per step, the loop timed per step (thread CPU time), ``--blocks`` pairs of
6 uncaptured then 6 captured steps (a fresh capture per block). Each round runs one process per tree
(this one and ``--old``, a copy of ``opguard/`` with its extensions built), the order alternating.
Per tree: the minimum captured and uncaptured step over all rounds, their ratio, the records per
step and the added µs per record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HELPER = '''def helper_{i}(x, scale={i}.0):
    """A helper a real training script would have (logging, schedules, config parsing)."""
    values = [x * scale, x + scale, x - scale, "label_{i}", ("tuple", {i}, {i}.5)]
    if isinstance(x, float) and x > {i}:
        return {{"name": "helper_{i}", "values": values, "scale": scale}}
    for j in range({i} % 5 + 1):
        values.append(j * 0.5 + {i})
    return values
'''

SCRIPT = '''import json, sys, tempfile, time
from pathlib import Path
TREE, BLOCKS = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, TREE)
import torch
import torch.nn as nn
import torch.nn.functional as F
import opguard.capture as oc
assert oc.__file__.startswith(TREE), oc.__file__
torch.set_num_threads(1)

{helpers}

torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.ReLU())])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 128), torch.randn(64, 128)
times = {{"plain": [], "cap": []}}
records = 0
for block in range(BLOCKS):
    for kind in ("plain", "cap"):
        out = Path(tempfile.mkdtemp(prefix="capml-"))
        ctx = oc.capture(env={{"OPGUARD_TRACE_OUTPUT_BASE": str(out)}}) if kind == "cap" else None
        if ctx is not None:
            ctx.__enter__()
        for step in range(6):
            t0 = time.thread_time()
            opt.zero_grad(set_to_none=True)
            h = model(x)
            a = torch.relu(h)
            b = a * 2.0
            c = b.sum(dim=1)
            d = torch.tanh(c)
            loss = F.mse_loss(h, y) + d.mean()
            loss.backward()
            opt.step()
            times[kind].append(time.thread_time() - t0)
        if ctx is not None:
            ctx.__exit__(None, None, None)
            trace = next(out.rglob("trace.jsonl"))
            records = sum(1 for line in trace.open() if '"kind":"op"' in line.replace(" ", "")) / 6
print(json.dumps({{"plain_ms": min(times["plain"]) * 1e3, "cap_ms": min(times["cap"]) * 1e3,
                   "records_per_step": records}}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="a copy of the tree to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--helpers", type=int, default=30)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="capml-script-"))
    script = tmp / "train.py"
    script.write_text(SCRIPT.format(helpers="\n\n".join(HELPER.format(i=i) for i in range(a.helpers))))
    trees = {"new": str(REPO), "old": str(a.old.resolve())}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("OPGUARD_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    got: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
    for r in range(a.rounds):
        for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
            p = subprocess.run([sys.executable, str(script), trees[name], str(a.blocks)], env=env,
                               capture_output=True, text=True, timeout=900, check=True)
            got[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: {got[name][-1]} (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    out = {"script_lines": len(script.read_text().splitlines())}
    for name, runs in got.items():
        plain = min(x["plain_ms"] for x in runs)
        cap = min(x["cap_ms"] for x in runs)
        recs = runs[-1]["records_per_step"]
        out[name] = {"plain_ms": round(plain, 3), "cap_ms": round(cap, 3), "ratio": round(cap / plain, 3),
                     "records_per_step": recs, "us_per_record": round((cap - plain) * 1e3 / recs, 1) if recs else None}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
