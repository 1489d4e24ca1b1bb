"""A 2-rank DDP training program (gloo) that knows nothing about opguard: a small MLP wrapped in
DistributedDataParallel, SGD, each rank on its own data shard. Writes each rank's losses (float32
bits as hex) to ``<out>/loss-<rank>.txt``. With ``bn`` the MLP has a BatchNorm layer: DDP
broadcasts rank 0's running statistics into every rank's module at each forward
(``broadcast_buffers=True``, the default), in C++, without moving their version counters; each
rank's running mean after each step goes to ``<out>/bn-<rank>.txt``.

    torchrun --nproc-per-node=2 ddp_app.py OUT STEPS [bn]
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    bn = sys.argv[3:] == ["bn"]
    net = nn.Sequential(nn.Linear(12, 24), *([nn.BatchNorm1d(24)] if bn else []), nn.Tanh(), nn.Linear(24, 3))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(6, 12, generator=g), torch.randn(6, 3, generator=g)
    losses, means = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x + rank), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if bn:
            means.append(" ".join(f"{v:.9e}" for v in net[1].running_mean.tolist()))
    with open(os.path.join(out, f"loss-{rank}.txt"), "w") as f:
        f.write(" ".join(f"{v.view(torch.int32).item():08x}" for v in losses) + "\n")
    if bn:
        with open(os.path.join(out, f"bn-{rank}.txt"), "w") as f:
            f.write("\n".join(means) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
