"""A tiny gloo DDP job for the launcher tests: each worker appends a record per step to its rank's
trace (the rank from torchrun's RANK, resolved by opguard's writers) and writes one whole file;
it ends with a barrier and os._exit(0) (see the end for why).

usage: ddp_app.py STEPS [OUT_DIR]   (STEPS 0: run until OUT_DIR/release exists)
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from opguard.staging.layout import current_rank
from opguard.staging.writers import open_jsonl, write_rank_file

steps = int(sys.argv[1])
out = Path(sys.argv[2]) if len(sys.argv) > 2 else None
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert current_rank() == rank, (current_rank(), rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "OPGUARD_NODE_ID", "OPGUARD_NODE_INDEX",
                                      "OPGUARD_NODE_COUNT", "OPGUARD_WORLD_SIZE")}
write_rank_file("identity.json", json.dumps({"rank": rank, "world": world, "pid": os.getpid(), "env": env}).encode())
with open_jsonl("steps.jsonl") as trace:
    step = 0
    while True:
        loss = model(torch.randn(4, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        trace.write({"rank": rank, "step": step, "loss": float(loss)})
        step += 1
        if out is not None and step == 1:
            (out / f"ready-{rank}").write_text(str(os.getpid()))
        if steps and step >= steps:
            break
        if not steps and out is not None and (out / "release").exists():
            break
        if not steps:
            time.sleep(0.05)
# Shutdown without gloo teardown: a barrier followed by the destruction of the gloo context races
# with the peers' pairs (pytorch/gloo#155), and under load a worker then died at exit with
# "terminate called without an active exception" (SIGABRT). After the final barrier every rank has
# written everything (the trace is closed above, identity.json was written atomically), so each rank
# leaves at once with os._exit: no process group destructor, no static destructors, no race; the
# kernel closes the sockets.
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
