#!/usr/bin/env python3
"""Restore and verify of hostile targets (issue 14): bombs refused in bounded memory and time, and
the restore speed of a normal target against the code before the change, in the same run.

    .venv/bin/python bench/restore_hostile.py                 # ~2 min
    .venv/bin/python bench/restore_hostile.py --base 7fdaa0a --rounds 5
    .venv/bin/python bench/restore_hostile.py --only-normal --workdir /dev/shm --rounds 7   # quieter ratio

Items (one JSON line each):

* ``manifest-bomb``: a batch whose 16 KiB manifest frame declares (and holds) 512 MiB;
* ``gnu-long-name`` / ``pax-header``: a ~260 KiB legacy ``sync.tar.gz`` whose first member is a
  256 MiB GNU long-name / pax extended header;
* ``conflicts``: one batch of 8,000 pairs ``p<i>/f`` then ``p<i>`` (was quadratic: 43-52 s);

  each run through the real CLI (``verify`` and ``materialize``): exit status, wall seconds and the
  process's peak RSS. Goal: RSS <= 256 MiB, refused (exit 5) within seconds.
* ``normal-restore``: ``materialize`` of a normal format-2 target (4 rank streams x 6 batches x
  500 files of 4 KiB, a JSON-lines file appended in every batch, a node stream), this tree's code
  vs the code of ``--base`` (extracted with ``git archive``), both run as ``python -c`` with
  ``PYTHONPATH`` set, in alternating rounds; figure: the median ratio new / base of wall time.
  Goal: <= 1.1x (unchanged within noise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers.hostile import (  # noqa: E402
    bomb_manifest_frame,
    oversized_header_archive,
    split_batch,
    write_batch,
)
from tests.helpers.restore import add_batch, batches, make_target, seal  # noqa: E402

RSS_GOAL = 256 << 20
_MEASURE = ("import resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
            "w = time.perf_counter() - t\n"
            "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(r.returncode, w, u.ru_maxrss, u.ru_utime + u.ru_stime)\n")
_CLI = "import sys; from opguard.cli import main; sys.argv[0] = 'opguard'; main()"


def measured(code_root: Path, *args: str) -> dict[str, float]:
    """Run the opguard CLI of ``code_root`` in a fresh helper process: exit, wall s, peak RSS, CPU s."""
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    out = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-c", _CLI, *args], env=env,
                         cwd=code_root, capture_output=True, text=True, check=True).stdout.split()
    return {"exit": int(out[0]), "wall_s": round(float(out[1]), 3), "rss_mib": round(int(out[2]) / 1024, 1),
            "cpu_s": round(float(out[3]), 3)}


def bombs(work: Path) -> dict[str, Path]:
    out = {}
    src = make_target(work / "manifest-bomb")
    add_batch(src, "rank-000000", [("file", "a.txt", 1, 0, b"A")])
    b = batches(src, "rank-000000")[0]
    header, payload, _m = split_batch(b)
    write_batch(b, header, payload, bomb_manifest_frame(512 << 20))
    seal(src, "rank-000000")
    out["manifest-bomb"] = src
    for kind, name in ((b"L", "gnu-long-name"), (b"x", "pax-header")):
        src = work / name
        oversized_header_archive(src / "exec_trace" / "gpu_000" / "sync.tar.gz", kind, 256 << 20)
        out[name] = src
    src = make_target(work / "conflicts")
    add_batch(src, "rank-000000", [("file", f"p{i}/f", 1, 0, b"") for i in range(8000)]
              + [("file", f"p{i}", 1, 0, b"") for i in range(8000)])
    seal(src, "rank-000000")
    out["conflicts"] = src
    return out


def normal_target(root: Path) -> Path:
    src = make_target(root)
    for r in range(4):
        stream = f"rank-{r:06d}"
        log = 0
        for k in range(6):
            line = f'{{"batch":{k},"rank":{r}}}\n'.encode() * 50
            entries = [("append", "trace.jsonl", 1, log, line)]
            log += len(line)
            entries += [("file", f"tensors/b{k}/t{i}.pt", 1, 0, os.urandom(2048) + bytes(2048)) for i in range(500)]
            add_batch(src, stream, entries)
        seal(src, stream)
    add_batch(src, "node-node-a", [("file", f"source_files/m{i}.py", 1, 0, b"x = 1\n" * 20) for i in range(50)],
              rank=None)
    seal(src, "node-node-a")
    return src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="7fdaa0a", help="baseline commit (default: branch point)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="scratch parent (e.g. /dev/shm: no disk contention, syncfs cheap); default /tmp")
    ap.add_argument("--only-normal", action="store_true", help="skip the bombs")
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="opguard-hostile-", dir=a.workdir) as tmp:
        work = Path(tmp)
        for name, src in ({} if a.only_normal else bombs(work)).items():
            for cmd in ("verify", "materialize"):
                args = [cmd, str(src)] + ([str(work / f"out-{name}")] if cmd == "materialize" else [])
                m = measured(REPO, *args)
                res = {"item": name, "command": cmd, **m, "goal": "exit 5, rss <= 256 MiB, within seconds",
                       "ok": m["exit"] == 5 and m["rss_mib"] * (1 << 20) <= RSS_GOAL and m["wall_s"] < 10,
                       "loadavg_1m": round(os.getloadavg()[0], 2)}
                results.append(res)
                print(json.dumps(res), flush=True)
        base = work / "base"
        base.mkdir()
        subprocess.run(f"git -C {REPO} archive {a.base} opguard | tar -x -C {base}", shell=True, check=True)
        src = normal_target(work / "normal")
        new_t, old_t = [], []
        for i in range(a.rounds):
            for which in (("new", "old") if i % 2 == 0 else ("old", "new")):
                dest = work / f"restored-{which}"
                shutil.rmtree(dest, ignore_errors=True)
                os.sync()
                m = measured(REPO if which == "new" else base, "materialize", str(src), str(dest))
                assert m["exit"] == 0, (which, m)
                (new_t if which == "new" else old_t).append(m)
        ratio = statistics.median(n["wall_s"] / o["wall_s"] for n, o in zip(new_t, old_t, strict=True))
        cpu_ratio = statistics.median(n["cpu_s"] / o["cpu_s"] for n, o in zip(new_t, old_t, strict=True))
        res = {"item": "normal-restore", "base": a.base, "new_s": [n["wall_s"] for n in new_t],
               "base_s": [o["wall_s"] for o in old_t], "new_cpu_s": [n["cpu_s"] for n in new_t],
               "base_cpu_s": [o["cpu_s"] for o in old_t], "wall_ratio": round(ratio, 3),
               "cpu_ratio": round(cpu_ratio, 3), "new_rss_mib": max(n["rss_mib"] for n in new_t),
               "base_rss_mib": max(o["rss_mib"] for o in old_t), "goal": "wall_ratio <= 1.1",
               "ok": ratio <= 1.1, "loadavg_1m": round(os.getloadavg()[0], 2)}
        results.append(res)
        print(json.dumps(res), flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
