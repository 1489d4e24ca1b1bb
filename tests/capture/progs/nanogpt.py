"""A nanoGPT-style training script that knows nothing about opguard (this project's own small
version): token + position embeddings, causal self-attention on F.scaled_dot_product_attention,
an MLP with F.gelu(approximate='tanh'), weight tying, AdamW, gradient clipping, batches cut from a
numpy memmap with tensor indices (numpy calls Tensor.__index__), losses kept in a torch.empty buffer.

    python nanogpt.py OUT [STEPS]      # writes OUT/losses.txt (float32 bits as hex)
"""

import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BLOCK, BATCH, VOCAB, WIDTH, HEADS, LAYERS = 16, 4, 64, 32, 4, 2


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn, self.mlp = CausalSelfAttention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.h = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(data: np.memmap, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - BLOCK, (BATCH,), generator=g)
    x = torch.stack([torch.from_numpy(data[i:i + BLOCK].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + BLOCK].astype(np.int64)) for i in ix])
    return x, y


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    torch.set_num_threads(1)
    torch.manual_seed(1337)
    path = os.path.join(out, "train.bin")
    np.random.default_rng(0).integers(0, VOCAB, 2000, dtype=np.uint16).tofile(path)
    data = np.memmap(path, dtype=np.uint16, mode="r")
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    losses = torch.empty(steps)
    for it in range(steps):
        x, y = get_batch(data, g)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses[it] = loss.detach()
    with open(os.path.join(out, "losses.txt"), "w") as f:
        f.write(" ".join(f"{v:08x}" for v in losses.view(torch.int32).tolist()) + "\n")


if __name__ == "__main__":
    main()
