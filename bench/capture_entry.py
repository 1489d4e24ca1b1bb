"""The cost of one tensor entry (``Session._entry_fast``), the hot path of every recorded op.

    .venv/bin/python bench/capture_entry.py [--numel 64] [--calls 20000]

In an active capture (nothing selected, so nothing else runs), with torch functions disabled as in
the mode's handler: best of 5 × ``--calls`` of

* ``cached_input``: the same tensor object again as an input (the same-object path, ``docs/capture.md`` §5.3);
* ``new_output``: a new tensor's output entry (kernel pass, statistics, cache entry);
* ``tensor_reads``: the nine tensor attribute reads the key path makes (dtype, is_cpu, layout,
  is_contiguous, is_neg, numel, _version, data_ptr, shape), for scale;
* ``kernel_entry``: the native ``entry()`` call alone;
* ``rewritten_output``: the same tensor again as a written output (``fresh``: digested from memory,
  the storage's other cached contents dropped), as an optimizer step's parameters are;
* ``c_cached_input``, ``c_rewritten_output``: the same through the C entry (``_fastcall.entry``,
  ``docs/capture.md`` §3.11) when it is built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()

    import torch

    import opguard.capture as oc
    from opguard.capture.session import Call

    n, k = args.calls, args.numel
    out: dict[str, float] = {}
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": tempfile.mkdtemp()}, functions="-nothing-") as cap:
        s = cap.session
        t = torch.randn(k)
        call = Call({"inputs": [], "outputs": []})
        fast = s._entry_fast
        with torch._C.DisableTorchFunction():
            fast(call, "arg0", t, True, False)  # t's entry made once: later inputs are cached
            out["cached_input"] = min(timeit.repeat(lambda: fast(call, "arg0", t, False, False),
                                                    number=n, repeat=5)) / n
            fresh = iter([torch.randn(k) for _ in range(n)])
            m = n // 5
            out["new_output"] = min(timeit.repeat(lambda: fast(call, "out", next(fresh), True, False),
                                                  number=m, repeat=5)) / m
            out["tensor_reads"] = min(timeit.repeat(
                lambda: (t.dtype, t.is_cpu, t.layout, t.is_contiguous(), t.is_neg(), t.numel(), t._version,
                         t.data_ptr(), list(t.shape)), number=n, repeat=5)) / n
            # a rewritten output (an input object as output: fresh, the storage's other contents dropped)
            out["rewritten_output"] = min(timeit.repeat(lambda: fast(call, "out", t, True, True),
                                                        number=n // 5, repeat=5)) / (n // 5)
            c = s.c_entry  # the same two cases in C (docs/capture.md §3.11), when built
            if c is not None:
                out["c_cached_input"] = min(timeit.repeat(lambda: c(s, call, "arg0", t, False, False),
                                                          number=n, repeat=5)) / n
                out["c_rewritten_output"] = min(timeit.repeat(lambda: c(s, call, "out", t, True, True),
                                                              number=n // 5, repeat=5)) / (n // 5)
            native, ptr = s.host_entry, t.data_ptr()
            if native is not None:
                out["kernel_entry"] = min(timeit.repeat(lambda: native(ptr, k, 0, True), number=n, repeat=5)) / n
    print(json.dumps({"numel": k, "us": {key: round(v * 1e6, 2) for key, v in out.items()},
                      "loadavg_1min": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
