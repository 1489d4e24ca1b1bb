"""Capture cost per recorded op, and the step ratio on op-bound models (issue 12, point 6).

    .venv/bin/python bench/capture_ops.py [--rounds 3] [--steps 4] [--models ops,bench,gpt,mlp]
        [--profile MODEL] [--json out.json]

* ``ops``: a chain of many small ops (elementwise ops on a 64-element tensor): µs per recorded op =
  (captured time - uncaptured time) / records written.
* ``bench``: the project's bench model (``bench/capture_bench.py``: 4 layers, width 256, seq 128,
  batch 8, AdamW); ``gpt``: a tiny GPT (2 layers, width 64, seq 64, batch 8, AdamW, weight tying);
  ``mlp``: a 6-layer width-128 MLP (batch 64, AdamW). Training steps without step markers (steps
  advance at ``Optimizer.step()``), digest ``full``, default options.

Every model is timed with and without capture in the same process, blocks alternating each round;
ratios are medians of captured / medians of uncaptured steps, wall and thread CPU time. The 1-minute
load average at start and end is printed: the machine is shared.
``--profile MODEL`` prints the top of a cProfile of captured steps of that model instead.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make(name: str) -> Callable[[], None]:
    """A closure running one step of model ``name``."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "ops":
        x0 = torch.randn(64, generator=g)

        def ops_step() -> None:
            x = x0
            for _ in range(250):
                x = torch.tanh(x * 0.5 + 0.1)
                x = x - x.mean()
        return ops_step
    if name == "bench":
        from tests.capture.progs.models import Transformer, transformer_step

        model = Transformer(4, 256, 4, 512, 128)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(0, 512, (8, 128), generator=g)
        tgt = torch.randint(0, 512, (8, 128), generator=g)
        return lambda: transformer_step(model, opt, idx, tgt)
    if name == "gpt":
        from tests.capture.progs.zoo import TinyGPT

        gpt = TinyGPT(vocab=65, width=64, layers=2, heads=4, seq=64)
        gopt = torch.optim.AdamW(gpt.parameters(), lr=1e-3, weight_decay=0.1)
        idx = torch.randint(0, 65, (8, 64), generator=g)
        tgt = torch.roll(idx, -1, 1)

        def gpt_step() -> None:
            gopt.zero_grad(set_to_none=True)
            gpt(idx, tgt).backward()
            gopt.step()
        return gpt_step
    if name == "mlp":
        layers: list[torch.nn.Module] = []
        for _ in range(6):
            layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
        mlp = torch.nn.Sequential(*layers)
        mopt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
        x, y = torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g)

        def mlp_step() -> None:
            mopt.zero_grad(set_to_none=True)
            F.mse_loss(mlp(x), y).backward()
            mopt.step()
        return mlp_step
    raise SystemExit(f"unknown model {name!r}: use ops, bench, gpt, mlp")


def timed(step: Callable[[], None], n: int, wall: list[float], cpu: list[float]) -> None:
    for _ in range(n):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)


def count_ops(base: Path) -> int:
    n = 0
    for seg in base.rglob("trace*.jsonl"):
        with open(seg, "rb") as f:
            n += sum(1 for line in f if b'"kind":"op"' in line)
    return n


def measure(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import opguard.capture as oc

    step = make(name)
    timed(step, 2, [], [])  # warm-up
    bw: list[float] = []
    bc: list[float] = []
    cw: list[float] = []
    cc: list[float] = []
    records = 0
    captured_steps = 0
    for rnd in range(args.rounds):
        for captured in ((False, True) if rnd % 2 == 0 else (True, False)):
            if not captured:
                timed(step, args.steps, bw, bc)
                continue
            out = tmp / f"{name}-{rnd}"
            w: list[float] = []
            c: list[float] = []
            with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(out)}):
                timed(step, args.steps, w, c)
                t_exit, c_exit = time.perf_counter(), time.thread_time()
            exit_w, exit_c = time.perf_counter() - t_exit, time.thread_time() - c_exit
            cw += [t + exit_w / args.steps for t in w]
            cc += [t + exit_c / args.steps for t in c]
            records += count_ops(out)
            captured_steps += args.steps
    base_w, base_c = statistics.median(bw), statistics.median(bc)
    cap_w, cap_c = statistics.median(cw), statistics.median(cc)
    per_step = records / captured_steps
    return {"baseline_step_s": round(base_w, 6), "captured_step_s": round(cap_w, 6),
            "ratio": round(cap_w / base_w, 3), "cpu_ratio": round(cap_c / base_c, 3),
            "records_per_step": per_step,
            "us_per_record": round((cap_w - base_w) / per_step * 1e6, 2) if per_step else None,
            "cpu_us_per_record": round((cap_c - base_c) / per_step * 1e6, 2) if per_step else None}


def profile(name: str, args: argparse.Namespace, tmp: Path) -> None:
    import opguard.capture as oc

    step = make(name)
    timed(step, 2, [], [])
    prof = cProfile.Profile()
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp / "profile")}):
        step()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="ops,bench,gpt,mlp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="capops-"))
    if args.profile:
        profile(args.profile, args, tmp)
        return
    load0 = os.getloadavg()[0]
    res: dict[str, Any] = {"models": {}}
    for name in args.models.split(","):
        res["models"][name] = measure(name, args, tmp)
        print(name, json.dumps(res["models"][name]), file=sys.stderr, flush=True)
    res["loadavg_1min_start_end"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    res["config"] = {k: str(v) for k, v in vars(args).items()}
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
