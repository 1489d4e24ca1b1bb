"""A small training program fed by a multi-worker DataLoader, with a checkpoint saved and loaded back
(``torch.save`` / ``torch.load`` / ``load_state_dict``); it knows nothing about opguard. Writes its
losses (float32 bits as hex) to ``<out>/losses.txt``.

    python loader_app.py OUT [EPOCHS]

The batches arrive from 2 worker processes: the main process rebuilds each batch's tensors from
shared memory when it unpickles them, at a moment that depends on when the worker delivered it.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    out, epochs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(1))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _epoch in range(epochs):
        for x, y in loader:  # <batches>
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    path = os.path.join(out, "model.pt")
    torch.save(model.state_dict(), path)
    state = torch.load(path)  # <load>
    restored = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    restored.load_state_dict(state)  # <restore>
    losses.append(F.mse_loss(restored(data.tensors[0]), data.tensors[1]).detach())
    with open(os.path.join(out, "losses.txt"), "w") as f:
        f.write(" ".join(f"{v.view(torch.int32).item():08x}" for v in losses) + "\n")


if __name__ == "__main__":
    main()
