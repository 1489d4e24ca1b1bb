"""Call sites for the capture tests; lines are located by their ``# @name`` markers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.capture.progs.models import MLP


def marker_line(name: str, file: str = __file__) -> int:
    with open(file, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# @{name}"):
                return i
    raise KeyError(name)


def mlp_train(model: MLP, x: torch.Tensor, y: torch.Tensor, steps: int, step_fn=None) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        if step_fn is not None:
            step_fn(i)
        opt.zero_grad(set_to_none=True)
        out = model(x)  # @forward
        loss = F.mse_loss(out, y)  # @loss
        loss.backward()  # @backward
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def nested_and_self(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a.add(b)  # @method
    d = torch.add(torch.mul(a, 2.0), c)  # @nested_expr
    e = F.layer_norm(d, (d.shape[-1],))  # @layer_norm
    e.mul_(3.0)  # @inplace
    return e
