"""A 2-rank training program (gloo) that knows nothing about opguard: a transformer block,
forward and backward, gradients all-reduced by hand, SGD. Writes each rank's losses (float32
bits as hex) to ``<out>/loss-<rank>.txt``.

    torchrun --nproc-per-node=2 dist_app.py OUT STEPS
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from tests.capture.progs.models import Block


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)                      # same weights on every rank
    block = Block(32, 4)
    opt = torch.optim.SGD(block.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)   # a different data shard per rank
    x = torch.randn(2, 8, 32, generator=g)
    y = torch.randn(2, 8, 32, generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(block(x), y)
        loss.backward()
        for p in block.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        opt.step()
        losses.append(loss.detach())
    with open(os.path.join(out, f"loss-{rank}.txt"), "w") as f:
        f.write(" ".join(f"{v.view(torch.int32).item():08x}" for v in losses) + "\n")
    # before leaving: gloo's worker threads free each finished all_reduce's gradients after the
    # call returned, taking the GIL; one still waiting for it when the interpreter finalizes aborts
    # the process (pytorch/pytorch#190489). The barrier waits for every earlier collective with the
    # GIL released, which lets them finish first: a mitigation, not a guarantee (plain torchrun on
    # this 2-core machine, session 13: 0 aborts in 60 runs with it, 8 in 65 without).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
