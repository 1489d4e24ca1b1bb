"""The floor under capture's step ratio: what an empty torch function mode costs on the same models.

    OMP_NUM_THREADS=1 .venv/bin/python bench/capture_floor.py [--models ops,gpt,mlp,bench] [--rounds 4] [--steps 6]

Capture's function mode is a ``TorchFunctionMode``; PyTorch calls its ``__torch_function__`` for every
``torch.*``, ``torch.nn.functional.*`` and ``Tensor`` call, and Python-level torch functions take
their ``handle_torch_function`` path under any mode. This script times each model of
``bench/capture_ops.py`` uncaptured and under a mode that only calls the function
(``return func(*args, **kwargs)``), blocks alternating, and prints per model the minimum step time
(thread CPU) of each, their ratio (the floor no capture built on a function mode can go below),
the intercepted calls per step and the µs each costs. ``floor_ratio_optimizer_off`` is the same with
the empty mode taken off the stack during every ``Optimizer.step()`` (as capture does with its
mode, ``docs/capture.md`` §3.8). ``floor_ratio_design`` adds what capture's module paths need: a
global forward pre-hook and a global forward hook (``torch.nn.modules.module``), both empty, which
alone send every module call through PyTorch's hook-running path of ``Module._call_impl``: the floor
under capture's whole design, before any of capture's own work. Same process, same models, one
thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="ops,gpt,mlp,bench")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()

    import torch
    from torch.overrides import TorchFunctionMode

    from bench.capture_ops import make

    torch.set_num_threads(1)

    class Empty(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func: Any, types: Any, a: Any = (), kw: Any = None) -> Any:
            Empty.calls += 1
            return func(*a, **(kw or {}))

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    off: list[Any] = []
    skip = {"on": False}

    def pre(*_: Any) -> None:
        if skip["on"] and torch._C._len_torch_function_stack():
            off.append(torch._C._pop_torch_function_stack())

    def post(*_: Any) -> None:
        if off:
            torch._C._push_on_torch_function_stack(off.pop())

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    def timed(step: Any, mode: bool, optimizer_off: bool = False, hooks: bool = False) -> tuple[float, int]:
        if hooks:
            handles = [register_module_forward_pre_hook(lambda m, a: None),
                       register_module_forward_hook(lambda m, a, o: None)]
            try:
                return timed(step, mode, optimizer_off)
            finally:
                for h in handles:
                    h.remove()
        best = 1e9
        if not mode:
            for _ in range(args.steps):
                c0 = time.thread_time()
                step()
                best = min(best, time.thread_time() - c0)
            return best, 0
        skip["on"] = optimizer_off
        with Empty():
            step()
            Empty.calls = 0
            for _ in range(args.steps):
                c0 = time.thread_time()
                step()
                best = min(best, time.thread_time() - c0)
        skip["on"] = False
        return best, Empty.calls // args.steps

    out: dict[str, Any] = {}
    load = [round(os.getloadavg()[0], 2)]
    for name in args.models.split(","):
        step = make(name)
        step()
        step()
        base, moded, moff, design = 1e9, 1e9, 1e9, 1e9
        calls = calls_off = 0
        for _ in range(args.rounds):
            base = min(base, timed(step, False)[0])
            m, calls = timed(step, True)
            moded = min(moded, m)
            m, calls_off = timed(step, True, optimizer_off=True)
            moff = min(moff, m)
            design = min(design, timed(step, True, optimizer_off=True, hooks=True)[0])
        out[name] = {"base_ms": round(base * 1e3, 3), "empty_mode_ms": round(moded * 1e3, 3),
                     "floor_ratio": round(moded / base, 3), "calls_per_step": calls,
                     "us_per_call": round((moded - base) * 1e6 / max(calls, 1), 2),
                     "floor_ratio_optimizer_off": round(moff / base, 3), "calls_per_step_optimizer_off": calls_off,
                     "floor_ratio_design": round(design / base, 3)}
        print(f"{name}: done", file=sys.stderr, flush=True)
    load.append(round(os.getloadavg()[0], 2))
    print(json.dumps({"models": out, "loadavg_1min_start_end": load, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
