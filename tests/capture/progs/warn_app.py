"""Warnings raised inside torch calls, as a user sees them (issue 12: capture never changes the program).

Writes ``warnings.json`` into the directory given as argument: every warning shown (category, message
start, file, line, in order), the de-duplication counts under the default filters and under a
module-specific filter, a traceback of an op that fails, and ``inspect.stack()`` from a backward hook.
"""

import inspect
import json
import os
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

shown: list[list[object]] = []


def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    shown.append([category.__name__, str(message)[:50], os.path.basename(filename), lineno])


warnings.showwarning = show


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout2d(0.0)  # a 3-D input: torch's own module warns (stacklevel=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.softmax(self.lin(x))  # implicit dim: F.softmax warns at this line (stacklevel=3)
        return self.drop(y.unsqueeze(0))


torch.manual_seed(0)
x = torch.randn(3, 4)
net = Net()
out: dict[str, object] = {}


def phase() -> None:
    for _ in range(3):
        F.softmax(x)  # a Python-level torch function warning (stacklevel=3)
        torch.tensor(x)  # a warning raised by C++ (TORCH_WARN) in a builtin
        torch.tensor(x)  # the same warning from another line: another location
        net(x)


phase()
out["default"] = list(shown)
shown.clear()
warnings.filterwarnings("always", category=UserWarning, module="__main__")  # once per location -> every time
phase()
out["always_main"] = list(shown)
try:
    torch.cat([x, torch.randn(2, 5)])
except RuntimeError:
    tb = traceback.extract_tb(sys.exc_info()[2])
    out["traceback_first"] = [os.path.basename(tb[0].filename), tb[0].lineno, tb[0].line]
    out["traceback_text_ok"] = "torch.cat([x, torch.randn(2, 5)])" in traceback.format_exc()
stacks: list[list[str]] = []
w = torch.randn(4, requires_grad=True)
w.register_hook(lambda g: stacks.append([f"{os.path.basename(f.filename)}:{f.function}" for f in inspect.stack()]))
(w * 2).sum().backward()
out["hook_stack_has_script"] = any(e.endswith(":<module>") and e.startswith("warn_app.py") for e in stacks[0])
# a warning whose stacklevel reaches through two Python-level torch functions capture re-enters
# (Tensor.backward -> torch.autograd.backward): a full backward hook on a module none of whose inputs
# requires grad warns from inside the engine with stacklevel=5, at the line that called backward()
shown.clear()
hooked = nn.Linear(4, 2)
hooked.register_full_backward_hook(lambda mod, grad_in, grad_out: None)
for _ in range(3):
    hooked(x).sum().backward()  # <nested>
out["nested"] = list(shown)
with open(os.path.join(sys.argv[1], "warnings.json"), "w") as f:
    json.dump(out, f)
