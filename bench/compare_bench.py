"""Benchmark: `opguard compare` of N operations per side (default 1,000,000), capture schema v1.

    .venv/bin/python bench/compare_bench.py [--ops 1000000] [--ranks 1] [--workdir DIR] [--repeat N]

Writes two synthetic runs in the documented capture schema (docs/capture.md §3): run B equals
run A except for one inserted call in the middle of every rank (so the whole stream goes through
the anchor path, not the equal-sequence fast path) and a numerical change shortly after it. Then it
runs `opguard compare A B -o OUT` as a child process and reports wall time, CPU time, peak RSS of
the process tree, export size, trace GB/s, the load average before and after, and the ratios to
two baselines measured in the same run: reading and JSON-parsing both runs' trace lines with
`json.loads` and with `orjson.loads` (the parser compare uses) — the least any compare of these
files must do (compare reads every line twice: once to pair, once to export).
Goals (docs/benchmarks.md): <= 60 s and <= 2 GB peak RSS for 1,000,000 operations per side.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
FUNCS = ["torch.nn.functional.linear", "torch.relu", "torch.add", "Tensor.mul", "torch.matmul",
         "torch.nn.functional.layer_norm", "torch.softmax", "Tensor.sum"]


def _d(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def _src(line: int) -> str:
    return hashlib.sha256(f"y{line} = f(x{line})".encode()).hexdigest()


def write_run(base: Path, ranks: int, n: int, variant: str) -> int:
    total = 0
    srcs = {line: _src(line) for line in range(1000)}
    for rank in range(ranks):
        cap = base / "ranks" / f"rank-{rank:06d}" / "capture"
        cap.mkdir(parents=True)
        (cap / "meta.json").write_text(json.dumps({"schema": "opguard-capture", "version": 1, "rank": rank}))
        mid = n // 2
        seq = 0
        with open(cap / "trace.jsonl", "w", buffering=1 << 22) as f:
            prev = _d(rank, "input")
            for i in range(n):
                if variant == "b" and i == mid:     # one inserted call
                    f.write(_record(seq, rank, "torch.clone", 999, srcs[999], prev, _d("x", i), i))
                    seq += 1
                changed = variant == "b" and i == mid + 10
                out = _d(rank, i, "changed") if changed else _d(rank, i)
                line = i % 64                        # 64 lines of a forward, run by 12 layers
                f.write(_record(seq, rank, FUNCS[line % len(FUNCS)], line, srcs[line], prev, out, i))
                seq += 1
                prev = out
            f.write(json.dumps({"v": 1, "kind": "end", "rank": rank, "records": seq, "cap_reached": False}) + "\n")
        total += (cap / "trace.jsonl").stat().st_size
    return total


def _record(seq: int, rank: int, fn: str, line: int, src: str, a: str, out: str, i: int) -> str:
    w = _d("w", i % 64)
    return (f'{{"v":1,"kind":"op","seq":{seq},"step":{i // 10000},"rank":{rank},"api":"function","fn":"{fn}",'
            f'"file":"/work/model.py","line":{line},"func":"forward","src":"{src}","site":{line},'
            f'"module":"model.layers.{(i // 64) % 12}","context":null,"depth":0,"parent":null,"phase":"forward",'
            f'"inputs":[{{"slot":"arg0","dtype":"float32","shape":[8,128,256],"device":"cpu","digest":"{a}"}},'
            f'{{"slot":"arg1","dtype":"float32","shape":[256,256],"device":"cpu","digest":"{w}"}}],'
            f'"outputs":[{{"slot":"out","dtype":"float32","shape":[8,128,256],"device":"cpu","digest":"{out}",'
            f'"stats":{{"min":-4.1,"max":3.9,"mean":0.001,"std":0.99,"absmax":4.1,"nan":0,"inf":0}}}}]}}\n')


def _watch_tree(proc: subprocess.Popen[bytes]) -> tuple[int, int]:
    """Wait for proc; the peak of the summed RSS (and USS) of it and its children, sampled every 0.2 s."""
    import psutil

    peak = uss_peak = 0
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            rss = uss = 0
            for p in [root, *root.children(recursive=True)]:
                try:
                    mi = p.memory_full_info()
                    rss += mi.rss
                    uss += mi.uss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peak, uss_peak = max(peak, rss), max(uss_peak, uss)
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        pass
    proc.wait()
    return peak, uss_peak


def baseline(paths: list[Path], loads: Callable[[bytes], Any] = json.loads) -> tuple[float, float]:
    """(wall s, CPU s) of reading and JSON-parsing every line of both runs."""
    t, c = time.perf_counter(), time.process_time()
    for p in paths:
        with open(p, "rb") as f:
            for line in f:
                loads(line)
    return time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=1, help="run the compare N times; figures are the medians")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opguard-compare-bench-", dir=args.workdir))
    try:
        per_rank = args.ops // args.ranks
        t = time.perf_counter()
        size_a = write_run(work / "a", args.ranks, per_rank, "a")
        size_b = write_run(work / "b", args.ranks, per_rank, "b")
        gen = time.perf_counter() - t
        files = sorted(work.rglob("trace.jsonl"))
        base_s, base_cpu = baseline(files)
        fast_s, fast_cpu = baseline(files, orjson.loads)
        load_start = os.getloadavg()
        out = work / "view.pftrace"
        opguard = Path(sys.executable).parent / "opguard"
        os.sync()  # the generated traces are on disk before any compare (their writeback is not timed)
        walls: list[float] = []
        cpus: list[float] = []
        tree_peak = uss_peak = peak_kib = 0
        cpu_before = 0.0
        for _ in range(max(1, args.repeat)):
            t = time.perf_counter()
            errf = open(work / "stderr.txt", "w+")  # noqa: SIM115
            proc = subprocess.Popen([str(opguard), "compare", str(work / "a"), str(work / "b"), "-o", str(out)],
                                    stdout=subprocess.DEVNULL, stderr=errf)
            tp, up = _watch_tree(proc)
            walls.append(time.perf_counter() - t)
            errf.seek(0)
            p = subprocess.CompletedProcess(proc.args, proc.returncode, "", errf.read())
            ru = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(ru.ru_utime + ru.ru_stime - cpu_before)
            cpu_before = ru.ru_utime + ru.ru_stime
            tree_peak, uss_peak, peak_kib = max(tree_peak, tp), max(uss_peak, up), max(peak_kib, ru.ru_maxrss)
            if p.returncode != 0:
                print(p.stderr, file=sys.stderr)
                raise SystemExit(f"compare failed with exit status {p.returncode}")
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        trace_bytes = size_a + size_b
        result = {
            "ops_per_side": per_rank * args.ranks, "ranks": args.ranks,
            "trace_bytes": trace_bytes, "generate_s": round(gen, 1),
            "baseline_parse_s": round(base_s, 2), "baseline_parse_cpu_s": round(base_cpu, 2),
            "compare_s": round(wall, 2), "compare_cpu_s": round(cpu, 2),
            "compare_s_runs": [round(x, 2) for x in walls], "compare_cpu_s_runs": [round(x, 2) for x in cpus],
            "ratio_to_baseline": round(wall / base_s, 2), "cpu_ratio_to_baseline": round(cpu / base_cpu, 2),
            "baseline_orjson_parse_s": round(fast_s, 2), "baseline_orjson_parse_cpu_s": round(fast_cpu, 2),
            "cpu_ratio_to_orjson_baseline": round(cpu / fast_cpu, 2),
            "load_average_1_5_15min_start": [round(x, 1) for x in load_start],
            "load_average_1_5_15min_end": [round(x, 1) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "trace_GB_per_s": round(trace_bytes / wall / 1e9, 3),
            "peak_rss_MiB_largest_process": round(peak_kib / 1024, 1),
            "peak_rss_MiB_process_tree": round(tree_peak / 2**20, 1),
            "peak_uss_MiB_process_tree": round(uss_peak / 2**20, 1), "export_bytes": out.stat().st_size,
            "export_bytes_per_op": round(out.stat().st_size / (2 * per_rank * args.ranks), 1),
            "goal_s": 60, "goal_rss_MiB": 2048,
        }
        print(json.dumps(result, indent=1))
        print("\n".join(p.stderr.splitlines()[:8]), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
