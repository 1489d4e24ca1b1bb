"""Tiny gloo DDP job: a few steps, an all_reduce and an all_gather across every rank; each rank
writes ``<out>/rank<R>.txt`` with its rank, world size, hostname and the all_reduce result."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(8, 4) + rank).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{rank} {world} {socket.gethostname()} {t.item():g} {','.join(str(h) for h in hosts)}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
