#!/usr/bin/env bash
# opguard demo (`make demo`): a small CPU torch job as 2 simulated nodes x 2 ranks, each node
# through `opguard-run torchrun ...`, with node-local staging under ./demo/, periodic syncs every
# 3 s, a final drain, a verified restore, and a summary; then two captured runs of a small seeded
# program, the second with one line changed, and `opguard compare` naming that line as the first
# divergence. `make demo` first creates .venv (CPU torch).
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${VENV:-.venv}
BIN=$ROOT/$VENV/bin
for exe in python torchrun opguard opguard-run; do
  if [ ! -x "$BIN/$exe" ]; then
    echo "demo: $BIN/$exe is missing; run 'make demo' (it creates $VENV with CPU torch and opguard)" >&2
    exit 2
  fi
done

DEMO=$ROOT/demo
rm -rf "$DEMO"
mkdir -p "$DEMO/app" "$DEMO/shared" "$DEMO/node-a/local-ssd" "$DEMO/node-b/local-ssd"
TARGET=$DEMO/shared/demo-run
mkdir -p "$TARGET"

cat > "$DEMO/app/train.py" <<'EOF'
"""A small DDP job (gloo, CPU): every rank appends one record per step and saves its weights every
10 steps through opguard's writers, which put them in this node's local staging directory."""
import io
import os
import time

import torch
import torch.distributed as dist

from opguard.staging.writers import open_jsonl, write_rank_file

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with open_jsonl("train/steps.jsonl") as log:
    for step in range(60):
        x = torch.randn(16, 32)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write({"rank": rank, "step": step, "loss": round(loss.item(), 6),
                   "node": os.environ.get("OPGUARD_NODE_ID")})
        if step % 10 == 9:
            buf = io.BytesIO()
            torch.save(model.module.state_dict(), buf)
            write_rank_file(f"weights/step-{step + 1:04d}.pt", buf.getvalue())
        time.sleep(0.15)
dist.barrier()
dist.destroy_process_group()
EOF

PORT=$("$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export OPGUARD_LOCAL_DUMP_ENABLED=1
export OPGUARD_TRACE_OUTPUT_BASE=$TARGET
export OPGUARD_LOCAL_DUMP_TARGET=$TARGET
export OPGUARD_LOCAL_DUMP_SYNC_INTERVAL=3
export OPGUARD_SYNC_BATCH_MB=16
export OPGUARD_SYNC_MBPS=8
export OMP_NUM_THREADS=1

node() {  # node() NAME INDEX: one simulated node = its own node ID and its own node-local disk
  OPGUARD_NODE_ID=$1 OPGUARD_LOCAL_DUMP_BASE=$DEMO/$1/local-ssd \
    "$BIN/opguard-run" "$BIN/torchrun" --nnodes=2 --node-rank="$2" --nproc-per-node=2 \
      --master-addr=127.0.0.1 --master-port="$PORT" "$DEMO/app/train.py" 2>&1 | sed -u "s/^/[$1] /"
  return "${PIPESTATUS[0]}"
}

echo "== the plan of node-a (opguard-run --plan checks everything before a job starts)"
OPGUARD_NODE_ID=node-a OPGUARD_LOCAL_DUMP_BASE=$DEMO/node-a/local-ssd \
  "$BIN/opguard-run" --plan "$BIN/torchrun" --nnodes=2 --node-rank=0 --nproc-per-node=2 "$DEMO/app/train.py"

echo "== running 2 nodes x 2 ranks (periodic syncs every ${OPGUARD_LOCAL_DUMP_SYNC_INTERVAL} s, then a final drain)"
node node-a 0 & A=$!
node node-b 1 & B=$!
rc=0
wait $A || rc=$?
wait $B || rc=$((rc ? rc : $?))
if [ "$rc" -ne 0 ]; then
  echo "demo: the job failed (exit $rc)" >&2
  exit "$rc"
fi

echo "== verify (every stream sealed, every batch checked) and restore"
"$BIN/opguard" verify --require-sealed "$TARGET"
"$BIN/opguard" materialize --require-sealed "$TARGET" "$DEMO/restored"

echo "== summary"
"$BIN/python" - "$DEMO" <<'EOF'
import json
import sys
from pathlib import Path

demo = Path(sys.argv[1])
restored, bundles = demo / "restored", demo / "shared" / "demo-run" / ".opguard-bundles"
ok = True
for rank_dir in sorted((restored / "ranks").iterdir()):
    node = json.loads((rank_dir / "_node" / "node.json").read_text())["node_id"]
    local = demo / node / "local-ssd" / "ranks" / rank_dir.name
    files = sorted(p.relative_to(rank_dir).as_posix() for p in rank_dir.rglob("*") if p.is_file()
                   and "_node" not in p.parts)
    same = all((rank_dir / f).read_bytes() == (local / f).read_bytes() for f in files)
    ok &= same
    steps = len((rank_dir / "train" / "steps.jsonl").read_text().splitlines())
    batches = len(list((bundles / "streams" / rank_dir.name).glob("*.ogb")))
    print(f"  {rank_dir.name} (node {node}): {steps} step records, {len(files)} files, {batches} batches, "
          f"{'identical to' if same else 'DIFFERENT from'} the node-local original")
for node in ("node-a", "node-b"):
    rep = json.loads((demo / node / "local-ssd" / "state" / "launcher" / f"node-{node}.json").read_text())
    d = rep["drain"]
    print(f"  {node}: exit {rep['exit_code']}, {rep['syncs']} syncs, final drain {d['status']} "
          f"({d['published_batches']} batches, sealed {', '.join(d['sealed_streams'])})")
print(f"  restored tree: {restored}")
sys.exit(0 if ok else 1)
EOF

echo "== capture and compare: two captured runs of a seeded program, run b with one line changed"
CMP=$DEMO/compare
mkdir -p "$CMP/a" "$CMP/b"
cat > "$CMP/a/train.py" <<'EOF'
"""A seeded 2-rank training step (gloo, CPU), captured by `opguard-run --capture` without code changes."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

dist.init_process_group("gloo")
torch.manual_seed(0)
w1 = torch.randn(32, 64, requires_grad=True)
w2 = torch.randn(64, 1, requires_grad=True)
g = torch.Generator().manual_seed(100 + dist.get_rank())
for step in range(3):
    x = torch.randn(16, 32, generator=g)
    h = torch.matmul(x, w1)
    h = F.gelu(h)
    loss = torch.matmul(h, w2).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in (w1, w2):
            dist.all_reduce(p.grad)
            p -= 0.01 * p.grad
            p.grad = None
dist.destroy_process_group()
EOF
sed 's/    h = F.gelu(h)/    h = F.gelu(h, approximate="tanh")/' "$CMP/a/train.py" > "$CMP/b/train.py"
diff "$CMP/a/train.py" "$CMP/b/train.py" | sed 's/^/  /' || true
for run in a b; do
  PORT=$("$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  env -u OPGUARD_LOCAL_DUMP_ENABLED -u OPGUARD_LOCAL_DUMP_TARGET OPGUARD_TRACE_OUTPUT_BASE="$CMP/$run/traces" \
    "$BIN/opguard-run" --capture "$BIN/torchrun" --nnodes=1 --nproc-per-node=2 --master-addr=127.0.0.1 \
      --master-port="$PORT" "$CMP/$run/train.py" 2>&1 | sed -u "s/^/[run $run] /"
done
echo "== opguard compare a b (the summary leads, per rank, with the first introduced divergence)"
"$BIN/opguard" compare "$CMP/a/traces" "$CMP/b/traces" -o "$CMP/compare.pftrace" --json "$CMP/compare.json"
"$BIN/python" - "$CMP/compare.json" <<'EOF'
import json
import sys

doc = json.load(open(sys.argv[1]))
for r in doc["ranks"]:
    fd = r["first_divergence"]
    if not fd or fd["function"] != "torch.nn.functional.gelu" or not fd["where"].endswith("train.py:14"):
        sys.exit(f"demo: rank {r['rank']}: expected the first divergence at the changed gelu line, got {fd}")
print(f"  every rank's first divergence is the changed line: {fd['function']} at {fd['where']} ({fd['kind']})")
EOF
echo "demo: ok"
