"""A 2-rank DDP program (gloo) with BatchNorm: DDP broadcasts rank 0's running statistics into every
rank's module at each forward (``broadcast_buffers=True``, the default), in C++, without moving
their version counters; the ranks see different data, so rank 1's own statistics differ from the
broadcast ones. Writes each rank's running mean after each step to ``<out>/bn-<rank>.txt``.

    torchrun --nproc-per-node=2 ddp_bn.py OUT STEPS
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = DistributedDataParallel(net)
    g = torch.Generator().manual_seed(10 + rank)
    lines = []
    for _ in range(steps):
        x = torch.randn(5, 3, generator=g) + rank
        model(x).sum().backward()
        lines.append(" ".join(f"{v:.9e}" for v in net[1].running_mean.tolist()))
    with open(os.path.join(out, f"bn-{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
