"""A zoo of model families that knows nothing about opguard: each family trains (or infers) a few
steps, and its losses/outputs are written as exact bits so a captured and an uncaptured run can be
compared bitwise. Run in one process per mode (CI cost):

    python zoo.py OUT [FAMILY,...]        # writes OUT/zoo.json: {family: [hex bits, ...]}

Every model here is this project's own small version of a family (no third-party code).
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

STEPS = 2


def bits(t: torch.Tensor) -> list[str]:
    """Exact bits of every element (float32/float64/bfloat16 as integers in hex)."""
    t = t.detach().float().reshape(-1)
    return [f"{v:08x}" for v in t.view(torch.int32).tolist()]


def train(model: nn.Module, batch: Callable[[], tuple[tuple[torch.Tensor, ...], torch.Tensor]],
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.mse_loss,
          opt: torch.optim.Optimizer | None = None) -> list[str]:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    out: list[str] = []
    for _ in range(STEPS):
        args, target = batch()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*args), target)
        loss.backward()
        opt.step()
        out += bits(loss)
    return out


# ---- families ----------------------------------------------------------------------------------
def transformer_encoder() -> list[str]:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(3, 10, 32)
    causal = torch.ones(10, 10, dtype=torch.bool).triu(1)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 7:] = True

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = enc

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.enc(x, mask=causal, src_key_padding_mask=pad, is_causal=True)

    return train(M(), lambda: ((x,), torch.zeros(3, 10, 32)))


def transformer() -> list[str]:
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=64, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 9, 32), torch.randn(2, 7, 32)
    tgt_mask = model.generate_square_subsequent_mask(7)
    src_pad = torch.zeros(2, 9, dtype=torch.bool)
    src_pad[0, 6:] = True

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = model

        def forward(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return self.t(s, t, tgt_mask=tgt_mask, src_key_padding_mask=src_pad,
                          memory_key_padding_mask=src_pad)

    return train(M(), lambda: ((src, tgt), torch.zeros(2, 7, 32)))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 32, layers: int = 2, heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], dtype=torch.long)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt() -> list[str]:
    model = TinyGPT()
    idx = torch.randint(0, 50, (4, 16))
    tgt = torch.roll(idx, -1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return train(model, lambda: ((idx, tgt), torch.zeros(())), loss_fn=lambda loss, _t: loss, opt=opt)


def conv_bn_residual() -> list[str]:
    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu(self.b1(self.c1(x)), inplace=True)
            return F.relu(x + self.b2(self.c2(y)))

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Res(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 5))
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 5, (4,))
    return train(model, lambda: ((x,), y), loss_fn=F.cross_entropy)


def rnn_packed() -> list[str]:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(6, 12, batch_first=True)
            self.gru = nn.GRU(12, 8, batch_first=True, bidirectional=True)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            h, _ = self.lstm(packed)
            h, _ = self.gru(h)
            out, _ = pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])
            return out.sum(dim=1)

    x, lengths = torch.randn(4, 7, 6), torch.tensor([7, 3, 5, 2])
    return train(M(), lambda: ((x, lengths), torch.zeros(4, 16)))


def embedding_bag() -> list[str]:
    bag = nn.EmbeddingBag(40, 16, mode="mean")
    lin = nn.Linear(16, 3)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag, self.lin = bag, lin

        def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.lin(self.bag(ids, offsets))

    ids, offsets = torch.randint(0, 40, (20,)), torch.tensor([0, 4, 11, 15])
    return train(M(), lambda: ((ids, offsets), torch.randint(0, 3, (4,))), loss_fn=F.cross_entropy)


def checkpointed() -> list[str]:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

        def inner(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    x = torch.randn(5, 16)
    return train(M(), lambda: ((x,), torch.zeros(5, 16)))


def autocast_bf16() -> list[str]:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(6, 16)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.m(x)

    return train(M(), lambda: ((x,), torch.zeros(6, 4)), loss_fn=loss_fn)


class ScaledSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale  # type: ignore[attr-defined]
        return x * x * scale

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return g * 2 * x * ctx.scale, None  # type: ignore[attr-defined]


def custom_function_inplace() -> list[str]:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            y = ScaledSquare.apply(y, 0.5)
            y.add_(1.0).mul_(0.5)
            y.clamp_(min=-2.0, max=2.0)
            return y

    x = torch.randn(4, 8)
    return train(M(), lambda: ((x,), torch.zeros(4, 8)))


def adamw_clip_sched() -> list[str]:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(s / 10)))
    x, y = torch.randn(8, 10), torch.randn(8, 1)
    out: list[str] = []
    for _ in range(STEPS + 1):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        sched.step()
        out += bits(loss)
    return out


def compiled() -> list[str]:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cmodel = torch.compile(model, backend=os.environ.get("ZOO_COMPILE_BACKEND", "inductor"))
    x = torch.randn(3, 8)
    with torch.no_grad():
        y = cmodel(x)
        y2 = cmodel(x)
    # training through it: PyTorch compiles the backward graph lazily, at the first backward()
    loss = cmodel(x).square().mean()
    loss.backward()
    return bits(y) + bits(y2) + bits(loss) + bits(model[0].weight.grad)


def compiled_graph_break() -> list[str]:
    """Frames Dynamo runs eagerly with its frame callback on (a graph break inside a loop; a helper
    disabled with ``recursive=False``): it compiles each frame they call as a new root."""
    backend = os.environ.get("ZOO_COMPILE_BACKEND", "inductor")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                x = torch.tanh(layer(x))
                if i == 0:
                    print(f"zoo: layer0 mean {x.mean().item():.4f}", file=sys.stderr)  # a graph break in the loop
            return self.head(x)

    @torch.compiler.disable(recursive=False)
    def helper(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t.sum(), t.amax()  # two functions, same argument types

    net = Net()
    cnet = torch.compile(net, backend=backend)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    out: list[str] = []
    for _ in range(3):
        loss = F.cross_entropy(cnet(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out += bits(loss)
    s, m = torch.compile(lambda t: helper(t + 1), backend=backend)(torch.arange(4.0))
    return out + bits(s) + bits(m) + [b for p in net.parameters() for b in bits(p)]


def traced_and_exported() -> list[str]:
    """``torch.jit.trace`` writes each traced call's Python location into its code, graph and saved
    file; strict ``torch.export`` refuses global module hooks: both as without capture."""
    def f(h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, h.shape[-1:]).relu()

    tf = torch.jit.trace(f, torch.randn(2, 4))
    buf = io.BytesIO()
    torch.jit.save(tf, buf)
    lin = nn.Linear(3, 2)
    ep = torch.export.export(lin, (torch.randn(1, 3),), strict=True)
    x = torch.randn(1, 3)
    buf.seek(0)
    # the saved file's bytes differ: its debug call stacks list capture's tracers.py frame (docs/capture.md §10)
    return [tf.code, str(tf.graph), torch.jit.load(buf).code, str(ep.graph), *bits(lin(x)),
            *bits(tf(torch.ones(2, 4)))]


def eval_encoder() -> list[str]:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 6, 32)
    with torch.inference_mode():
        y = enc(x)
    return bits(y)


FAMILIES: dict[str, Callable[[], list[str]]] = {
    "transformer_encoder": transformer_encoder, "transformer": transformer, "gpt": gpt,
    "conv_bn_residual": conv_bn_residual, "rnn_packed": rnn_packed, "embedding_bag": embedding_bag,
    "checkpoint": checkpointed, "autocast_bf16": autocast_bf16, "custom_function_inplace": custom_function_inplace,
    "adamw_clip_sched": adamw_clip_sched, "compiled": compiled, "eval_encoder": eval_encoder,
    "compiled_graph_break": compiled_graph_break, "traced_and_exported": traced_and_exported,
}


def main() -> None:
    out = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(FAMILIES)
    torch.set_num_threads(1)
    results: dict[str, list[str]] = {}
    for name in names:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        results[name] = FAMILIES[name]()
        print(f"zoo: {name} {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    with open(os.path.join(out, "zoo.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
