"""A tiny 2-rank training program (gloo) used by test_real_capture.py; variants are written from it.

Run through torchrun with capture switched on by the opguard-run bootstrap (child_env); it knows
nothing about opguard. The marked lines are what the variants change.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    w1 = torch.randn(16, 16, requires_grad=True)
    w2 = torch.randn(16, 16, requires_grad=True)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4, 16, generator=g)
    for _step in range(2):
        # <inserted-line>
        h = torch.matmul(x, w1)
        for _ in range(int(os.environ.get("RELU_TIMES", "1"))):
            h = torch.relu(h)
        z = torch.matmul(h, w2)
        a = torch.sigmoid(h)  # <first>
        b = torch.tanh(z)  # <second>
        s = torch.add(z, a)  # <numeric>
        loss = F.mse_loss(s, b)
        loss.backward()
        for p in (w1, w2):
            dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in (w1, w2):
                p -= 0.1 * p.grad
                p.grad = None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
