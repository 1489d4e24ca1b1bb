"""A 2-rank FSDP2 training program (``fully_shard``, gloo, CPU) that knows nothing about opguard: a
small residual MLP language model, each block sharded on its own and the whole model once, AdamW,
gradient clipping, each rank on its own data. FSDP2 frees each block's unsharded parameters after
its forward and backward (``untyped_storage().resize_(0)``) and re-allocates them before the next
all-gather (``resize_(n)``). Writes each rank's losses (float32 bits as hex) to
``<out>/loss-<rank>.txt``.

    torchrun --nproc-per-node=2 fsdp2_app.py OUT STEPS [LR]
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    lr = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 50, (4, 8), generator=g)
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), torch.roll(idx, -1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach().view(torch.int32).item() & 0xFFFFFFFF)
    with open(os.path.join(out, f"loss-{rank}.txt"), "w") as f:
        f.write("".join(f"{v:08x}\n" for v in losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
