"""A program run under one opguard-run per rank by Open MPI's own mpirun (no mpi4py): records what
Open MPI (OMPI_*, PMIX_*) and opguard-run (OPGUARD_*) told it, and what the writers resolve, in its
rank directory, plus a few trace records."""

import json
import os

from opguard.staging.identity import process_identity
from opguard.staging.layout import current_rank
from opguard.staging.writers import open_jsonl, write_rank_file

me = process_identity()
assert current_rank() == me.rank
env = {k: v for k, v in os.environ.items() if k.startswith(("OMPI_COMM_WORLD_", "PMIX_RANK", "OPGUARD_"))
       and "DUMP" not in k}
write_rank_file("identity.json", json.dumps({**me.__dict__, "env": env}).encode())
with open_jsonl("trace.jsonl") as t:
    for i in range(20):
        t.write({"rank": me.rank, "i": i})
