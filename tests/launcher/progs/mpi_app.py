"""An mpi4py program run under one opguard-run per rank: checks its identity with the MPI helper
and records it (and a few trace records) in its rank directory."""

import json
import os

from mpi4py import MPI

from opguard.launcher.mpi import mpi_identity
from opguard.staging.layout import current_rank
from opguard.staging.writers import open_jsonl, write_rank_file

ident = mpi_identity()
assert current_rank() == ident.rank
env = {k: os.environ.get(k) for k in os.environ if k.startswith("OPGUARD_") and "DUMP" not in k}
write_rank_file("identity.json", json.dumps({**ident.__dict__, "notes": list(ident.notes), "env": env}).encode())
with open_jsonl("trace.jsonl") as t:
    for i in range(20):
        t.write({"rank": ident.rank, "i": i, "sum": MPI.COMM_WORLD.allreduce(i)})
MPI.COMM_WORLD.Barrier()
