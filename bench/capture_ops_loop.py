"""µs of capture per recorded op on the ``ops`` loop, one process per tree (a quick A/B).

    for i in 1 2 3 4 5 6 7 8; do
      OMP_NUM_THREADS=1 .venv/bin/python bench/capture_ops_loop.py .          # this tree
      OMP_NUM_THREADS=1 .venv/bin/python bench/capture_ops_loop.py /tmp/old   # another opguard/ (git archive)
    done

The loop is ``bench/capture_ops.py``'s ``ops`` model (250 × ``tanh(x * 0.5 + 0.1)`` then ``x -
x.mean()`` on 64 elements: 1,250 records); prints (minimum captured - minimum uncaptured thread CPU
time over 20 repetitions each) / 1,250 in µs. Compare medians over alternating process pairs: this
machine's speed drifts by tens of percent between processes.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    tree = str(Path(sys.argv[1]).resolve())
    sys.path.insert(0, tree)
    import torch

    torch.set_num_threads(1)
    import opguard.capture as oc

    assert oc.__file__ is not None and oc.__file__.startswith(tree), (oc.__file__, tree)
    x0 = torch.randn(64)

    def loop() -> None:
        x = x0
        for _ in range(250):
            x = torch.tanh(x * 0.5 + 0.1)
            x = x - x.mean()

    def best(n: int) -> float:
        out = []
        for _ in range(n):
            t0 = time.thread_time()
            loop()
            out.append(time.thread_time() - t0)
        return min(out)

    for _ in range(3):
        loop()
    base = best(20)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": tempfile.mkdtemp(prefix="capops-")}):
        loop()
        cap = best(20)
    print(f"{(cap - base) / 1250 * 1e6:.2f}")


if __name__ == "__main__":
    main()
