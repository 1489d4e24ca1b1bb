#!/usr/bin/env python3
"""What builds the streams of one ``opguard sync --all``: forked worker processes vs threads.

    .venv/bin/python bench/staging_workers.py --rounds 5          # (b)'s and (a)'s trees, ~3 min

The same tree is synced from scratch (target and uploader state reset, then a global ``sync()``)
with ``OPGUARD_SYNC_WORKERS=processes`` and ``=threads`` in alternating rounds, so both see the same
machine; the figure is the median of the per-round ratios processes / threads (wall and CPU).
Trees: ``files`` = (b) 8 ranks x 5,000 files of 16 KiB, ``mixed`` = (a) ~1 GiB of mixed trace data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import staging_bench as sb


def rounds(ws: sb.Workspace, n: int, args: list[str]) -> dict[str, object]:
    out: dict[str, list[sb.Run]] = {"processes": [], "threads": []}
    for i in range(n):
        for kind in (("processes", "threads") if i % 2 == 0 else ("threads", "processes")):
            ws.reset_target()
            os.sync()
            out[kind].append(sb.sync({**ws.env, "OPGUARD_SYNC_WORKERS": kind}, *args))
    p, t = out["processes"], out["threads"]
    return {"processes_s": [round(r.wall, 3) for r in p], "threads_s": [round(r.wall, 3) for r in t],
            "processes_cpu_s": [round(r.cpu, 3) for r in p], "threads_cpu_s": [round(r.cpu, 3) for r in t],
            "wall_ratio": round(statistics.median(a.wall / b.wall for a, b in zip(p, t, strict=True)), 3),
            "cpu_ratio": round(statistics.median(a.cpu / b.cpu for a, b in zip(p, t, strict=True)), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", default=["files", "mixed"], help="files and/or mixed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="opguard-workers-") as tmp:
        work = Path(tmp)
        for tree in a.trees:
            ws = sb.Workspace(work, tree)
            if tree == "files":
                sb.small_files_tree(ws)
                res = rounds(ws, a.rounds, ["--all", "-q"])
            elif tree == "mixed":
                sb.mixed_tree(ws, 1 << 30)
                res = rounds(ws, a.rounds, ["--all", "--final", "-q"])
            else:
                ap.error(f"unknown tree {tree!r}: files or mixed")
            res = {"tree": tree, **res, "loadavg_1m": round(os.getloadavg()[0], 2)}
            results.append(res)
            print(json.dumps(res), flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
