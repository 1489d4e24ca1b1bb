"""A 2-rank DDP training program (gloo) that knows nothing about opguard: a small MLP wrapped in
DistributedDataParallel, SGD, each rank on its own data shard. Writes each rank's losses (float32
bits as hex) to ``<out>/loss-<rank>.txt``.

    torchrun --nproc-per-node=2 ddp_app.py OUT STEPS
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
    model = DistributedDataParallel(nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(6, 12, generator=g), torch.randn(6, 3, generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    with open(os.path.join(out, f"loss-{rank}.txt"), "w") as f:
        f.write(" ".join(f"{v.view(torch.int32).item():08x}" for v in losses) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
