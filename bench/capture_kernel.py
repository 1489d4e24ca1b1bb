"""Digest + statistics of one CPU tensor: the native host kernel vs the PyTorch-ops path, same run.

    .venv/bin/python bench/capture_kernel.py [--sizes 1000,65536,1048576,4194304] [--dtypes float32,bfloat16]
        [--threads 1] [--json out.json]

For each dtype and element count: best-of-N time per tensor of (a) ``hostkernel.summary`` (digest
and statistics in one pass, ``docs/capture.md`` §5.2) and (b) ``Digester("full").compute`` plus
``stats_row`` (the accelerator path run on CPU), both fetched to Python values; the ratio b/a and
the native throughput. Interleaved repetitions, so drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,65536,1048576,4194304")
    ap.add_argument("--dtypes", default="float32,bfloat16,float64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from opguard.capture import hostkernel
    from opguard.capture.digest import Digester, stats_row

    kernel = hostkernel.resolve("native")
    torch.set_num_threads(args.threads)
    dig = Digester("full")
    assert dig.compute is not None
    rows = []
    load0 = os.getloadavg()[0]
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for n in (int(x) for x in args.sizes.split(",")):
            t = torch.randn(n, dtype=torch.float64).to(dtype)
            code = hostkernel.CODES[dtype]

            def native(t: torch.Tensor = t, code: int = code) -> object:
                return hostkernel.summary(kernel, t, True, code)

            def eager(t: torch.Tensor = t) -> object:
                assert dig.compute is not None
                return int(dig.compute(t)), stats_row(t).tolist()

            inner = max(1, int(2e7 // max(n, 1000)))
            best = {"native": float("inf"), "torch": float("inf")}
            for _ in range(args.repeat):
                for label, fn in (("native", native), ("torch", eager)):
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fn()
                    best[label] = min(best[label], (time.perf_counter() - t0) / inner)
            nbytes = n * t.element_size()
            rows.append({"dtype": name, "elements": n, "native_us": round(best["native"] * 1e6, 2),
                         "torch_us": round(best["torch"] * 1e6, 2),
                         "speedup": round(best["torch"] / best["native"], 2),
                         "native_gb_s": round(nbytes / best["native"] / 1e9, 2)})
            print(json.dumps(rows[-1]), flush=True)
    res = {"rows": rows, "threads": args.threads, "loadavg_1min_start_end": [round(load0, 2),
                                                                             round(os.getloadavg()[0], 2)],
           "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
