"""Where the per-recorded-op cost of capture goes, on the many-small-ops model of
``bench/capture_ops.py`` (1,250 records per step): thread CPU µs per recorded op over the
uncaptured step, best of 5 steps, for

* ``intercept``: the interception alone (nothing selected);
* ``full``: the default capture;
* ``full-buffer1e6``: no flush during the steps (the flush and write cost drops out);
* ``no-entries``: ``Session.entry`` and ``Session._entry_fast`` replaced by a no-op (the record
  without its tensor work);
* ``no-args``: no argument records.

    .venv/bin/python bench/capture_op_breakdown.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch

    import opguard.capture as oc
    from bench.capture_ops import make
    from opguard.capture import mode as md
    from opguard.capture import session as se

    torch.set_num_threads(1)
    step = make("ops")
    n = 1250

    def best(k: int = 5) -> float:
        out = 1e9
        for _ in range(k):
            c0 = time.thread_time()
            step()
            out = min(out, time.thread_time() - c0)
        return out

    step()
    base = best()
    res: dict[str, float] = {}

    def run(label: str, **kw: Any) -> None:
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": tempfile.mkdtemp()}, **kw):
            step()
            res[label] = round((best() - base) * 1e6 / n, 1)

    run("intercept", functions="-nothing-", digest="none")
    run("full")
    run("full-buffer1e6", buffer=1000000)
    entry, fast = se.Session.entry, se.Session._entry_fast  # the mode tries _entry_fast first
    se.Session.entry = lambda *a, **k: {}  # type: ignore[method-assign,assignment]
    se.Session._entry_fast = lambda *a, **k: {}  # type: ignore[method-assign,assignment]
    try:
        run("no-entries")
    finally:
        se.Session.entry, se.Session._entry_fast = entry, fast  # type: ignore[method-assign]
    split = md.split_args
    md.split_args = lambda a, k, m: (md.input_slots(a, k, m), [])
    try:
        run("no-args")
    finally:
        md.split_args = split
    print(json.dumps({"baseline_us_per_call": round(base * 1e6 / n, 1), "us_per_recorded_op": res,
                      "loadavg_1min": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
