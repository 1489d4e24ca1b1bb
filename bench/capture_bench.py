"""Capture overhead on a small transformer training step (CPU): step time with capture vs without
in the same process (alternating blocks), trace bytes per step, peak extra RSS (separate processes).

    .venv/bin/python bench/capture_bench.py [--layers 4 --width 256 --seq 128 --batch 8 --steps 6]
        [--modes full,sample,xor,none,full@torch] [--level function] [--threads 1] [--json out.json]

A mode is a digest mode (``docs/capture.md`` §5), optionally ``@torch`` (CPU tensors summarised
with PyTorch ops instead of the native host kernel, §5.2) or ``@native``; ``intercept`` is the
interception alone (no call selected).

Ratios: median captured step / median baseline step, for wall time (``ratio``) and for the main
thread's CPU time (``cpu_ratio``, less disturbed by other processes on a shared machine); the
1-minute load average at the start and end of the timed part is in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def setup(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import torch

    from tests.capture.progs.models import Transformer

    torch.manual_seed(0)
    vocab = 512
    model = Transformer(args.layers, args.width, max(1, args.width // 64), vocab, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    tgt = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    return model, opt, idx, tgt


def timed_steps(model, opt, idx, tgt, n: int, cpu: list[float]) -> list[float]:  # type: ignore[no-untyped-def]
    """Wall time per step; the thread's CPU time per step is appended to ``cpu`` (less sensitive
    to other processes on a loaded machine than wall time)."""
    from tests.capture.progs.models import transformer_step

    out = []
    for _ in range(n):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        transformer_step(model, opt, idx, tgt)
        out.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return out


def mode_kwargs(mode: str) -> dict[str, str]:
    """capture() keywords of a bench mode (``full``, ``none@torch``, ``intercept``)."""
    if mode == "intercept":  # the function mode, call-site lookup and selection only (nothing matches)
        return {"digest": "none", "functions": "-nothing-"}
    digest, _, kernel = mode.partition("@")
    return {"digest": digest, "host_kernel": kernel or "auto"}


def trace_bytes(base: Path) -> int:
    return sum(p.stat().st_size for p in base.rglob("*") if p.is_file())


def run_times(args: argparse.Namespace) -> dict[str, object]:
    import torch

    import opguard.capture as oc
    from tests.capture.progs.models import transformer_step

    torch.set_num_threads(args.threads)
    model, opt, idx, tgt = setup(args)
    timed_steps(model, opt, idx, tgt, 2, [])  # warm-up (allocator, kernels)
    load_start = os.getloadavg()
    base_times: list[float] = []
    base_cpu: list[float] = []
    cap_times: dict[str, list[float]] = {m: [] for m in args.modes}
    cap_cpu: dict[str, list[float]] = {m: [] for m in args.modes}
    bytes_per_step: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="capbench-"))
    for rnd in range(args.rounds):
        # rotate the order every round (baseline included) so drift and warm-up hit every mode alike
        order: list[str | None] = [None, *args.modes]
        k = rnd % len(order)
        for mode in order[k:] + order[:k]:
            if mode is None:
                base_times += timed_steps(model, opt, idx, tgt, args.steps, base_cpu)
                continue
            out = tmp / f"{mode.replace('@', '-')}-{rnd}"
            env = {"OPGUARD_TRACE_OUTPUT_BASE": str(out)}
            kw = mode_kwargs(mode)
            times = []
            cpus = []
            cap = oc.capture(env=env, level=args.level, buffer=args.buffer, **kw)
            with cap:
                for i in range(args.steps):
                    oc.step(i)
                    c0 = time.thread_time()
                    t0 = time.perf_counter()
                    transformer_step(model, opt, idx, tgt)
                    times.append(time.perf_counter() - t0)
                    cpus.append(time.thread_time() - c0)
                t_exit = time.perf_counter()
                c_exit = time.thread_time()
            exit_s = time.perf_counter() - t_exit  # the final flush and tables: spread over the steps
            exit_cpu = time.thread_time() - c_exit
            cap_times[mode] += [t + exit_s / args.steps for t in times]
            cap_cpu[mode] += [t + exit_cpu / args.steps for t in cpus]
            bytes_per_step[mode] = trace_bytes(out) / args.steps
    base = statistics.median(base_times)
    base_c = statistics.median(base_cpu)
    res: dict[str, object] = {"baseline_step_s": base, "baseline_cpu_step_s": base_c,
                              "loadavg_1min_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
                              "modes": {}}
    for mode in args.modes:
        med = statistics.median(cap_times[mode])
        med_c = statistics.median(cap_cpu[mode])
        res["modes"][mode] = {"step_s": med, "ratio": med / base,  # type: ignore[index]
                              "cpu_step_s": med_c, "cpu_ratio": med_c / base_c,
                              "trace_bytes_per_step": int(bytes_per_step[mode])}
    return res


def breakdown(args: argparse.Namespace) -> dict[str, float]:
    """One captured step (digest full) with the tensor work timed: where the cost is. With the
    native host kernel (``--host-kernel native``, the default where built) its calls (the
    one-call path for new contiguous tensors included) are ``host_kernel_s``; with ``torch`` the
    PyTorch-ops digest and statistics are timed."""
    import torch

    import opguard.capture as oc
    from opguard.capture import digest as dg
    from opguard.capture import hostkernel as hk
    from opguard.capture import session as se
    from tests.capture.progs.models import transformer_step

    torch.set_num_threads(args.threads)
    model, opt, idx, tgt = setup(args)
    transformer_step(model, opt, idx, tgt)
    acc = {"digest_s": 0.0, "stats_s": 0.0, "host_kernel_s": 0.0, "tensors": 0.0, "elements": 0.0}
    full, row, native, fast = dg.Digester._full, se.stats_row, hk.summary, se.Session._fast_host

    def timed_fast(self: se.Session, t: torch.Tensor, key: object, n: int, code: int | None) -> object:
        t0 = time.perf_counter()
        r = fast(self, t, key, n, code)  # type: ignore[arg-type]
        acc["host_kernel_s"] += time.perf_counter() - t0
        acc["tensors"] += 1
        acc["elements"] += n
        return r

    def timed_native(kernel: object, d: torch.Tensor, digest: bool, code: int | None) -> object:
        t0 = time.perf_counter()
        r = native(kernel, d, digest, code)
        acc["host_kernel_s"] += time.perf_counter() - t0
        acc["tensors"] += 1
        acc["elements"] += d.numel()
        return r

    def timed_full(self: dg.Digester, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        r = full(self, t)
        acc["digest_s"] += time.perf_counter() - t0
        acc["tensors"] += 1
        acc["elements"] += t.numel()
        return r

    def timed_row(t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        r = row(t)
        acc["stats_s"] += time.perf_counter() - t0
        return r

    dg.Digester._full = timed_full  # type: ignore[method-assign]
    se.stats_row = timed_row
    hk.summary = timed_native  # type: ignore[assignment]
    se.Session._fast_host = timed_fast  # type: ignore[method-assign,assignment]
    try:
        with tempfile.TemporaryDirectory() as d, oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": d},
                                                            host_kernel=args.host_kernel):
            oc.step(0)
            transformer_step(model, opt, idx, tgt)
            for k in acc:
                acc[k] = 0.0
            oc.step(1)
            t0 = time.perf_counter()
            transformer_step(model, opt, idx, tgt)
            acc["captured_step_s"] = time.perf_counter() - t0
    finally:
        dg.Digester._full = full  # type: ignore[method-assign]
        hk.summary = native
        se.stats_row = row
        se.Session._fast_host = fast  # type: ignore[method-assign]
    t0 = time.perf_counter()
    transformer_step(model, opt, idx, tgt)
    acc["baseline_step_s"] = time.perf_counter() - t0
    return acc


def peak_rss(args: argparse.Namespace, mode: str | None) -> int:
    """Peak RSS (bytes) of a fresh process running the same steps (``mode`` None: no capture)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-rss", mode or "off",
           "--layers", str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
           "--batch", str(args.batch), "--steps", str(args.steps), "--threads", str(args.threads),
           "--level", args.level]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def child_rss(args: argparse.Namespace) -> None:
    import torch

    import opguard.capture as oc
    from tests.capture.progs.models import transformer_step

    torch.set_num_threads(args.threads)
    model, opt, idx, tgt = setup(args)
    if args.child_rss != "off":
        with tempfile.TemporaryDirectory() as d, oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": d},
                                                            level=args.level, **mode_kwargs(args.child_rss)):
            for i in range(args.steps):
                oc.step(i)
                transformer_step(model, opt, idx, tgt)
    else:
        for _ in range(args.steps):
            transformer_step(model, opt, idx, tgt)
    # VmHWM: this process's own peak RSS (ru_maxrss would include the parent's RSS at fork)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(hwm * 1024)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--buffer", type=int, default=256)
    ap.add_argument("--level", default="function")
    ap.add_argument("--modes", default="full,sample,xor,none,intercept,full@torch,none@torch",
                    help="digest modes to time (MODE or MODE@torch|MODE@native for the CPU kernel); "
                    "'intercept' = interception only (no call selected)")
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="time the digest and statistics work of one step")
    ap.add_argument("--host-kernel", default="auto", help="--breakdown: auto, native or torch")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child-rss", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if args.child_rss is not None:
        child_rss(args)
        return
    if args.breakdown:
        print(json.dumps(breakdown(args), indent=1))
        return
    res = run_times(args)
    print(json.dumps(res, indent=1, default=str), flush=True)
    if not args.no_rss:
        base_rss = peak_rss(args, None)
        res["baseline_peak_rss_mib"] = round(base_rss / 2**20, 1)
        for mode in [m for m in args.modes if m != "intercept"]:
            extra = peak_rss(args, mode) - base_rss
            res["modes"][mode]["peak_extra_rss_mib"] = round(extra / 2**20, 1)  # type: ignore[index]
    res["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "child_rss")}
    res["cpu_count"] = os.cpu_count()
    print(json.dumps(res, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
