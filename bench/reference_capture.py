"""The reference implementation's (PyPI opguard 0.1.0) per-op tracer on the capture bench's model.

Run by hand with the REFERENCE's virtualenv, never with the project's (see
tests/fixtures/make_reference_fixtures.py for how /tmp/refvenv is built):

    /tmp/refvenv/bin/python bench/reference_capture.py [--steps 3 --rounds 5] [--json out.json]

The reference captures what its source rewriter wrapped: it rewrites the calls written in the
user's files into ``opguard_wrapped(LINENO)(fn, *args)`` (``opguard.wrapped_ops.make_wrapper``),
choosing the calls from call sites its CUPTI tracer recorded on a GPU. On a CPU there is no CUPTI,
so its own pipeline records no call site and instruments nothing (``opguard run`` on this model
writes no trace). This script applies its runtime wrapper the way the rewriter would (``--coverage
source``, the default), or to every call a torch function mode sees (``--coverage all``: torch's own
nn and optimizer code too, about what opguard's capture records): a torch
function mode sends every call made *directly from the model's source file*
(``tests/capture/progs/models.py``: the model's forward code and the training step) through
``make_wrapper()(line)``; calls inside torch (``nn.Linear`` → ``F.linear``, the optimizer) are not
wrapped, as the rewriter does not touch torch's files. Baseline and traced steps alternate in one
process; the ratio is median traced step / median baseline step, as in bench/capture_bench.py.

Nothing of the reference is imported by opguard or its tests.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "tests" / "capture" / "progs" / "models.py"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--coverage", choices=("source", "all"), default="source",
                    help="source: the calls written in the model's file (what the reference's rewriter wraps); "
                    "all: every call the function mode sees (torch's own nn and optimizer code too: about the "
                    "coverage of opguard's capture)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="refcap-"))
    os.environ.update({"RANK": "0", "OPGUARD_TRACE_OUTPUT_BASE": str(out), "OPGUARD_RUNTIME_CALLSTACK": "1"})
    res: dict[str, object] = {}
    base: list[float] = []
    traced: list[float] = []

    def report() -> None:  # registered before the reference's own exit handler: runs after it wrote its traces
        nbytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        res["trace_bytes_per_step"] = int(nbytes / max(1, len(traced)))
        print(json.dumps(res, indent=1))
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))

    atexit.register(report)

    import torch
    from opguard.runtime_tracer import flush_trace_buffer  # the reference's package (this venv only)
    from opguard.wrapped_ops import make_wrapper
    from torch.overrides import TorchFunctionMode

    spec = importlib.util.spec_from_file_location("bench_models", MODELS)
    assert spec is not None and spec.loader is not None
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    wrap = make_wrapper(tag_prefix="wrapped_op")
    wrapped_calls = [0]

    class RewriterLike(TorchFunctionMode):
        """What the rewritten source would call: the reference wrapper around calls in models.py."""

        def __torch_function__(self, func, types, a=(), k=None):  # type: ignore[no-untyped-def]
            k = k or {}
            caller = sys._getframe(1)
            if args.coverage == "all" or caller.f_code.co_filename == str(MODELS):
                wrapped_calls[0] += 1
                return wrap(caller.f_lineno)(func, *a, **k)
            return func(*a, **k)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = models.Transformer(args.layers, args.width, max(1, args.width // 64), 512, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 512, (args.batch, args.seq), generator=g)
    tgt = torch.randint(0, 512, (args.batch, args.seq), generator=g)
    for _ in range(2):
        models.transformer_step(model, opt, idx, tgt)
    base.clear()
    traced.clear()
    load0 = os.getloadavg()[0]
    for rnd in range(args.rounds):
        for kind in (("base", "traced") if rnd % 2 == 0 else ("traced", "base")):
            for _ in range(args.steps):
                if kind == "base":
                    t0 = time.perf_counter()
                    models.transformer_step(model, opt, idx, tgt)
                    base.append(time.perf_counter() - t0)
                else:
                    before = wrapped_calls[0]
                    with RewriterLike():
                        t0 = time.perf_counter()
                        models.transformer_step(model, opt, idx, tgt)
                        traced.append(time.perf_counter() - t0)
                    per_step = wrapped_calls[0] - before
    t0 = time.perf_counter()
    flush_trace_buffer(force_dump=True)
    flush_s = time.perf_counter() - t0
    b, t = statistics.median(base), statistics.median(traced)
    res.update({"baseline_step_s": b, "traced_step_s": t, "ratio": t / b, "wrapped_calls_per_step": per_step,
                "extra_us_per_wrapped_call": round((t - b) / per_step * 1e6, 1), "final_flush_s": flush_s,
                "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
                "config": {k: v for k, v in vars(args).items() if k != "json"}, "torch": torch.__version__})


if __name__ == "__main__":
    main()
