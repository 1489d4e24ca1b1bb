"""Where a captured 6-layer MLP step's added time goes, part by part (docs/benchmarks.md run Q).

    OMP_NUM_THREADS=1 .venv/bin/python bench/capture_parts.py [--fast-call 1|0]

* ``optimizer_step``: ``AdamW.step()`` alone in a loop (the gradients of one backward kept), thread
  CPU µs per step, without and with capture (one record of 108 tensor entries per step).
* ``optimizer_step_one_by_one``: the same, captured, with the record's tensor entries made one
  ``Session.entry`` call each instead of in one call into C (``_fastcall.entries``, docs/capture.md
  §3.11); the two captured variants alternate, 6 blocks each, and the figure is each one's best block.
* ``F.relu`` / ``torch.relu`` / ``x * 2``: µs per call on a 64×128 float32 tensor, without and with
  capture (``F.relu`` is Python-level: PyTorch reaches the mode through
  ``torch.overrides.handle_torch_function``; ``torch.relu`` and ``Tensor.__mul__`` are builtins).

Best of 5 loops each; the machine is shared, so compare figures of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast-call", default="1")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import opguard.capture as oc

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    F.mse_loss(mlp(x), y).backward()

    def steps(n: int = 50) -> float:
        best = 1e9
        for _ in range(5):
            c = time.thread_time()
            for _ in range(n):
                opt.step()
            best = min(best, (time.thread_time() - c) / n)
        return best * 1e6

    def per_call(f: object, n: int) -> float:
        return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6  # type: ignore[arg-type]

    calls = {"F.relu": lambda: F.relu(x), "torch.relu": lambda: torch.relu(x), "x * 2": lambda: x * 2}
    out: dict[str, dict[str, float]] = {"uncaptured": {}, "captured": {}}
    out["uncaptured"]["optimizer_step"] = steps()
    with torch.no_grad():
        for k, f in calls.items():
            out["uncaptured"][k] = per_call(f, 2000)
    env = {"OPGUARD_TRACE_OUTPUT_BASE": tempfile.mkdtemp(prefix="capparts-"),
           "OPGUARD_CAPTURE_FAST_CALL": args.fast_call}
    with oc.capture(env=env) as cap:
        opt.step()
        at_once = cap.session.c_entries
        best = {True: 1e9, False: 1e9}
        for i in range(12):  # alternating: the machine's drift hits both alike
            cap.session.c_entries = at_once if i % 2 == 0 else None
            best[i % 2 == 0] = min(best[i % 2 == 0], steps())
        cap.session.c_entries = at_once
        out["captured"]["optimizer_step"] = best[True]
        out["captured"]["optimizer_step_one_by_one"] = best[False]
        with torch.no_grad():
            for k, f in calls.items():
                out["captured"][k] = per_call(f, 500)
    print(json.dumps({"us": {w: {k: round(v, 1) for k, v in d.items()} for w, d in out.items()},
                      "fast_call": args.fast_call, "loadavg_1min": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
