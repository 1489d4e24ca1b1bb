#!/usr/bin/env python3
"""One stream as fast as ``tar | zstd`` (issue 15, item 6): single-stream and 8-stream sync vs the baseline.

    .venv/bin/python bench/staging_single.py [--rounds 5] [--src TREE] [--before OLD_TREE] [--json FILE]

(s) ``opguard sync --rank 0 --final`` of one rank's 196 MiB tree (4 JSON-lines files of 24 MiB,
    100 float32 binaries of 1 MiB: the issue's 197 MiB tree, one batch at the default 256 MiB)
    vs ``tar -cf - DIR | zstd -3 -T1 > FILE && sync FILE``                                   [<= 1.25x]
    and its peak RSS                                                                         [<= 128 MiB]
(n) ``opguard sync --rank 0 --node --final`` (the per-rank wrapper's command on the node's first rank):
    (s)'s tree plus a small node-metadata file, vs the same baseline                       [<= 1.25x]
(m) ``opguard sync --all --final`` of 192 MiB over 8 ranks (4 x 3 MiB JSON lines, 12 x 1 MiB each)
    vs the same baseline of that tree                                                        [not worse]

Rounds are interleaved (baseline, opguard, baseline, opguard, ...), the target is reset before each
sync, and the figure is the median of the per-round ratios. ``--before DIR`` runs a second opguard
package (DIR as for ``--src``) in the same rounds, right after the same baseline, the two in an order
that rotates each round: the before/after comparison then sees the same load. ``--src DIR`` runs the opguard package
found in DIR (e.g. ``git archive <commit> opguard | tar -x -C DIR``) instead of this checkout's, so
the before/after ratios are measured with the same data, in the same session. The 1-minute load
average is printed with each round: the CPU is shared, wall times are noisy.

Compiled bytecode: the children get ``PYTHONPYCACHEPREFIX`` (a directory in the scratch space), and
one untimed sync with bytecode writing enabled fills it before the rounds, so an environment with
``PYTHONDONTWRITEBYTECODE=1`` (this VM's) does not charge every round ~0.1-0.2 s of compiling
opguard's modules from source — an installed opguard has its ``.pyc`` files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import staging_bench as sb


def cli(src: Path | None) -> list[str]:
    if src is None:
        return [sb.OPGUARD]
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(src)!r}); from opguard.cli import main; "
            "sys.argv = ['opguard'] + sys.argv[1:]; main()"]


def single_tree(ws: sb.Workspace, rank: int = 0, jsonl_mib: int = 24, jsonl_files: int = 4, bins: int = 100,
                bin_bytes: int = sb.MiB) -> int:
    d = ws.rank(rank)
    rng = random.Random(15 + rank)
    n = 0
    for i in range(jsonl_files):
        n += sb.write_jsonl(d / f"trace.{i}.jsonl", jsonl_mib * sb.MiB, rng)
    for i in range(bins):
        n += sb.write_tensor(d / "tensors" / f"t{i:03d}.bin", bin_bytes, seed=rank * 1000 + i)
    return n


def warm_bytecode(ws: sb.Workspace, args: list[str], srcs: list[Path | None], prefix: Path) -> None:
    """One untimed sync per variant that writes the bytecode of everything it imports under ``prefix``."""
    ws.env["PYTHONPYCACHEPREFIX"] = str(prefix)
    env = {k: v for k, v in ws.env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for src in srcs:
        ws.reset_target()
        sb.check(sb.run([*cli(src), "sync", *args, "--final", "-q"], env), "opguard sync (bytecode warm-up)")


def rounds(ws: sb.Workspace, args: list[str], variants: dict[str, Path | None], archive: Path, n: int,
           tag: str) -> dict[str, object]:
    """Each round: the baseline, then every variant (their order rotating); ratios to that round's baseline."""
    warm_bytecode(ws, args, list(variants.values()), archive.parent / "pycache")
    names = list(variants)
    res: dict[str, dict[str, list[float]]] = {v: {"ratio": [], "wall": [], "cpu": []} for v in names}
    base_w, loads = [], []
    for i in range(n):
        base = sb.check(sb.run_shell_tree(f"tar -cf - -C {ws.local} ranks | zstd -q -3 -T1 > {archive} && "
                                          f"sync {archive}"), "tar | zstd")
        base_w.append(base.wall)
        line = [f"tar|zstd+fsync {base.wall:.2f} s ({base.cpu:.2f} s CPU)"]
        for v in names[i % len(names):] + names[:i % len(names)]:
            ws.reset_target()
            ours = sb.check(sb.run([*cli(variants[v]), "sync", *args, "--final", "-q"], ws.env), f"opguard sync ({v})")
            res[v]["ratio"].append(ours.wall / base.wall)
            res[v]["wall"].append(ours.wall)
            res[v]["cpu"].append(ours.cpu)
            line.append(f"{v} {ours.wall:.2f} s ({ours.cpu:.2f} s CPU) ratio {ours.wall / base.wall:.2f}")
        loads.append(os.getloadavg()[0])
        print(f"  ({tag}) round {i + 1}: {'; '.join(line)}; load {loads[-1]:.1f}", file=sys.stderr)
    out: dict[str, object] = {"baseline_s_median": round(statistics.median(base_w), 3),
                              "loads": [round(x, 1) for x in loads]}
    for v in names:
        r = res[v]
        out[v] = {"ratio_median": round(statistics.median(r["ratio"]), 3), "ratios": [round(x, 3) for x in r["ratio"]],
                  "opguard_s_median": round(statistics.median(r["wall"]), 3),
                  "opguard_cpu_s_median": round(statistics.median(r["cpu"]), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--src", type=Path, default=None, help="run the opguard package under this directory")
    ap.add_argument("--before", type=Path, default=None,
                    help="also run the opguard package under this directory, in the same rounds ('before')")
    ap.add_argument("--only", choices=("s", "n", "m"), nargs="+", default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    variants: dict[str, Path | None] = {"after" if a.before else "opguard": a.src}
    if a.before:
        variants["before"] = a.before
    work = Path(tempfile.mkdtemp(prefix="opguard-single-"))
    out: dict[str, object] = {"src": str(a.src) if a.src else "checkout", "before": str(a.before) if a.before else None,
                              "load_start": os.getloadavg()[0]}
    try:
        only = set(a.only or ("s", "n", "m"))
        if "n" in only:
            ws = sb.Workspace(work, "n")
            size = single_tree(ws)
            (ws.local / "node").mkdir()
            (ws.local / "node" / "attempts.json").write_text('{"version": 1, "attempts": []}\n')
            out["n"] = {"data_MiB": round(size / sb.MiB, 1),
                        **rounds(ws, ["--rank", "0", "--node"], variants, work / "n.tar.zst", a.rounds, "n")}
            shutil.rmtree(ws.root)
        if "s" in only:
            ws = sb.Workspace(work, "s")
            size = single_tree(ws)
            res = rounds(ws, ["--rank", "0"], variants, work / "s.tar.zst", a.rounds, "s")
            for v, src in variants.items():
                ws.reset_target()
                rss = sb.check(sb.run_rss([*cli(src), "sync", "--rank", "0", "--final", "-q"], ws.env), "sync")
                res[v]["peak_rss_MiB"] = round(rss.maxrss_kib / 1024, 1)  # type: ignore[index]
            out["s"] = {"data_MiB": round(size / sb.MiB, 1), **res}
            shutil.rmtree(ws.root)
        if "m" in only:
            ws = sb.Workspace(work, "m")
            size = sum(single_tree(ws, r, jsonl_mib=3, bins=12) for r in range(8))
            out["m"] = {"data_MiB": round(size / sb.MiB, 1),
                        **rounds(ws, ["--all"], variants, work / "m.tar.zst", a.rounds, "m")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_end"] = os.getloadavg()[0]
    line = json.dumps(out, sort_keys=True)
    print(line)
    if a.json:
        a.json.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
