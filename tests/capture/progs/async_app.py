"""Two gloo ranks: collectives issued with async_op=True (and irecv), their results read after
wait(), and a collective called the way library code calls it; gloo writes them without moving any
version counter (tests/capture/test_torchrun.py)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.full((4,), float(rank + 1))
t.sum()                                    # digested (and cached) before the collective
dist.all_reduce(t, async_op=True).wait()
t.neg()                                    # must read 1 + 2 = 3 on both ranks
c = torch.full((3,), float(rank))
c.sum()
dist.broadcast(c, src=1, async_op=True).wait()
c.neg()                                    # rank 1's 1.0 on both ranks
buf = torch.zeros(2)
buf.sum()
if rank == 0:
    dist.irecv(buf, src=1).wait()
else:
    dist.isend(torch.full((2,), 7.0), dst=0).wait()
buf.neg()                                  # 7.0 on rank 0 after the receive
# library code (DTensor, DCP, object collectives) calls distributed_c10d's functions directly, not
# through the torch.distributed attributes capture wraps
from torch.distributed import distributed_c10d  # noqa: E402

w = torch.full((2,), float(rank))
w.sum()
distributed_c10d.broadcast(w, src=1)
w.neg()                                    # rank 1's 1.0 on both ranks
# torch.distributed.pipelining's way: P2POp(dist.isend / dist.irecv) run by batch_isend_irecv, which
# checks by identity that the op is torch.distributed's isend or irecv
p = torch.full((2,), 5.0) if rank == 1 else torch.zeros(2)
p.sum()
for work in dist.batch_isend_irecv([dist.P2POp(dist.isend if rank == 1 else dist.irecv, p, 1 - rank)]):
    work.wait()
p.neg()                                    # rank 1's 5.0 on both ranks
dist.destroy_process_group()
