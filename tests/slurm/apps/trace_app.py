"""A distributed test program that writes traces through opguard's writers API.

Every rank appends one JSON record per step to ``trace.jsonl`` (step, rank, wall time, host,
padding) and every ``--file-every`` steps publishes a whole file ``tensors/step-<N>.bin``
atomically. ``--dist torch`` keeps the ranks in step with a gloo all_reduce (torchrun sets the
rendezvous env), ``--dist mpi`` with an MPI barrier (mpi4py), ``--dist none`` runs ranks alone.
SIGTERM ends the program at once with the default action (as a real training job would die).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import time
from typing import Any

from opguard.staging import writers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sleep", type=float, default=0.2, help="seconds between steps")
    ap.add_argument("--pad", type=int, default=200, help="bytes of padding per record")
    ap.add_argument("--file-every", type=int, default=5)
    ap.add_argument("--file-bytes", type=int, default=4096)
    ap.add_argument("--dist", choices=("torch", "mpi", "none"), default="none")
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--started", default=None, help="append this host's name to this file at start")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to stay alive after the last step")
    a = ap.parse_args()

    barrier: Any = None
    if a.dist == "torch":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def barrier() -> None:
            dist.all_reduce(torch.ones(1))
    elif a.dist == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        barrier = comm.Barrier
    else:
        rank = int(os.environ.get("RANK") or os.environ.get("OPGUARD_RANK") or os.environ.get("SLURM_PROCID") or 0)

    host = socket.gethostname()
    if a.started:
        with open(a.started, "a") as f:
            f.write(f"{host} {rank}\n")
    pad = "x" * a.pad
    with writers.open_jsonl("trace.jsonl", rank=rank) as log:
        for step in range(a.steps):
            if barrier is not None:
                barrier()
            log.write({"rank": rank, "step": step, "t": time.time(), "host": host, "pad": pad})
            log.flush()
            if a.file_every and step % a.file_every == 0:
                seed = f"{rank}:{step}".encode()
                blob = b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest()
                                for i in range(a.file_bytes // 32))
                writers.write_rank_file(f"tensors/step-{step:05d}.bin", blob, rank=rank)
            time.sleep(a.sleep)
    time.sleep(a.hold)
    if a.dist == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    raise SystemExit(a.exit_code)


if __name__ == "__main__":
    main()
