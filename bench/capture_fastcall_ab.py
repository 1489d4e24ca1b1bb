"""What the C handler and the C tensor entry (docs/capture.md §3.11) each save, measured in one
process and one capture, the three variants alternating step by step (so all see the same machine).

    OMP_NUM_THREADS=1 .venv/bin/python bench/capture_fastcall_ab.py [--models ops,gpt,mlp] [--rounds 30]

Variants, switched between steps of one capture:

* ``c``: the default (``fast_call=1``): the C handler and the C entry;
* ``c_handler``: the C handler, tensor entries by ``Session._entry_fast`` in Python (a copy of the
  function: the C entry stands in only for ``session.py``'s own);
* ``python``: the Python handler and Python entries (what ``fast_call=0`` runs).

Prints, per model, the median and minimum thread CPU time per step of each variant and of the
uncaptured step (measured before the capture), in µs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="ops,gpt,mlp")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    import torch

    import opguard.capture as oc
    from bench.capture_ops import make
    from opguard.capture import session as S

    torch.set_num_threads(1)
    own = S.Session._entry_fast
    copy = types.FunctionType(own.__code__, own.__globals__, own.__name__, own.__defaults__, own.__closure__)
    res: dict[str, dict[str, list[float]]] = {}
    for name in args.models.split(","):
        step = make(name)
        for _ in range(2):
            step()
        times: dict[str, list[float]] = {"uncaptured": [], "c": [], "c_handler": [], "python": []}
        for _ in range(args.rounds):
            c0 = time.thread_time()
            step()
            times["uncaptured"].append(time.thread_time() - c0)
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": tempfile.mkdtemp(prefix="capfc-")}) as cap:
            s = cap.session
            mode = torch.overrides._get_current_function_mode()
            handler, entry = getattr(mode, "fast", None), s.c_entry
            if handler is None or entry is None:
                raise SystemExit("the C extension opguard.capture._fastcall is not built (pip install -e .)")
            step()
            order = ["c", "c_handler", "python"]
            for r in range(args.rounds):
                for v in order[r % 3:] + order[:r % 3]:
                    mode.fast = None if v == "python" else handler
                    s.c_entry = None if v == "python" else entry
                    S.Session._entry_fast = own if v == "c" else copy  # type: ignore[method-assign]
                    c0 = time.thread_time()
                    step()
                    times[v].append(time.thread_time() - c0)
            mode.fast, s.c_entry = handler, entry
            S.Session._entry_fast = own  # type: ignore[method-assign]
        res[name] = times
        print(name, json.dumps({v: {"median_us": round(statistics.median(x) * 1e6), "min_us": round(min(x) * 1e6)}
                                for v, x in times.items()}), file=sys.stderr, flush=True)
    print(json.dumps({"models": {m: {v: {"median_us": round(statistics.median(x) * 1e6), "min_us": round(min(x) * 1e6)}
                                      for v, x in t.items()} for m, t in res.items()},
                      "loadavg_1min": round(os.getloadavg()[0], 2), "rounds": args.rounds}))


if __name__ == "__main__":
    main()
