"""How much margin does KillWait leave? Published bytes and seconds-to-drain of a cancelled job.

Brings up the test cluster (slurm/cluster/up.sh, root), then for each load runs the
slurm/srun-per-rank.sbatch template with one rank per node: every rank writes ``load x cap x
KillWait`` of incompressible trace files, no periodic sync runs before the cancel (long interval),
and the job is cancelled with ``scancel`` once everything is written. Slurm then sends SIGTERM and
SIGKILLs KillWait seconds later; opguard-run drains at the per-node cap in between.

Per node it reports the bytes published after the cancel, the seconds from scancel to the node's
last seal (the drain time), drain time / KillWait (the margin used; > 1 cannot seal) and whether
every stream of the node was sealed. The dimensionless load = pending / (cap x KillWait) is what
transfers to other settings: with the defaults (32 MiB/s, KillWait 30 s) load 1.0 is 960 MiB.

Usage (root, Debian slurm-wlm + munge):
    .venv/bin/python bench/slurm_drain.py [--killwait 10] [--mbps 2] [--loads 0.25,0.5,0.8,1.2] [--nodes 3]
Writes bench/out/slurm_drain.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
APP = REPO / "tests" / "slurm" / "apps" / "trace_app.py"
BASE = Path(os.environ.get("OPGUARD_TEST_CLUSTER", "/tmp/opguard-test-cluster"))
MIB = 1 << 20


def sh(args: list[str], env: dict[str, str], timeout: float = 120) -> str:
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
    return p.stdout


def job_state(job: int, env: dict[str, str]) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], env=env, capture_output=True, text=True).stdout
    return next((t.split("=", 1)[1] for t in out.split() if t.startswith("JobState=")), "?")


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def one_load(load: float, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    name = f"bench-drain-{load:g}"
    work = BASE / "shared" / name
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    pending_mib = load * args.mbps * args.killwait
    steps = max(1, round(pending_mib))  # one 1 MiB incompressible file per step
    job_env = dict(env, OPGUARD_VENV=str(BIN.parent), OPGUARD_EXIT_HOOK=str(REPO / "slurm" / "exit-hook.sh"),
                   RUN_TARGET=str(work / "target"), LOCAL_BASE=f"/local-ssd/{name}", APP=str(APP),
                   APP_ARGS=f"--steps {steps} --sleep 0 --pad 10 --file-every 1 --file-bytes {MIB} --hold 600",
                   OPGUARD_LOCAL_DUMP_SYNC_INTERVAL="3600", OPGUARD_SYNC_MBPS=f"{args.mbps:g}")
    job = int(sh(["sbatch", "--parsable", "-N", str(args.nodes), "--ntasks-per-node=1", "-t", "10",
                  "-o", str(work / "job-%j.out"), str(REPO / "slurm" / "srun-per-rank.sbatch")], job_env).strip())
    nodes = [f"node{k}" for k in range(1, args.nodes + 1)]

    def written() -> bool:
        for n in nodes:
            d = BASE / "nodes" / n / "local-ssd" / name / "ranks"
            files = list(d.glob("rank-*/tensors/*.bin")) if d.is_dir() else []
            if len(files) < steps:
                return False
        return True
    wait_until(written, 300, f"{steps} MiB written on every node")
    time.sleep(0.5)  # the last rename done: let the app reach its --hold sleep
    streams = work / "target" / ".opguard-bundles" / "streams"
    before = {p: p.stat().st_size for p in streams.glob("*/*.ogb")} if streams.exists() else {}
    t_cancel = time.time()
    sh(["scancel", str(job)], env)
    wait_until(lambda: job_state(job, env) in ("CANCELLED", "COMPLETED", "FAILED"), 120, "the job to end")
    wait_until(lambda: not subprocess.run(["squeue", "-h", "-j", str(job)], env=env, capture_output=True,
                                          text=True).stdout.strip(), 120, "the job to leave squeue")
    rows = []
    for k, n in enumerate(nodes):
        rank_stream, node_stream = streams / f"rank-{k:06d}", streams / f"node-{n}"
        published = sum(p.stat().st_size for s in (rank_stream, node_stream) for p in s.glob("*.ogb")
                        if p not in before)
        seal_times, sealed = [], True
        for s in (rank_stream, node_stream):
            seals = sorted(s.glob("*.seal"))
            batches = sorted(s.glob("*.ogb"))
            if not seals:
                sealed = False
                continue
            seal = json.loads(seals[-1].read_text())
            last = (int(batches[-1].name[:12]), batches[-1].name[13:77]) if batches else (0, None)
            sealed &= (seal["last_sequence"], seal["last_digest"]) == last
            seal_times.append(seal["sealed_at"])
        drain = max(seal_times) - t_cancel if seal_times and sealed else None
        rows.append({"load": load, "node": n, "pending_mib": pending_mib,
                     "published_after_cancel_mib": round(published / MIB, 3),
                     "drain_s": None if drain is None else round(drain, 2),
                     "drain_over_killwait": None if drain is None else round(drain / args.killwait, 3),
                     "expected_drain_s": round(pending_mib / args.mbps, 2), "sealed": sealed})
    return {"load": load, "job": job, "state": job_state(job, env), "nodes": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--killwait", type=int, default=10)
    ap.add_argument("--mbps", type=float, default=2.0, help="OPGUARD_SYNC_MBPS, per-node cap")
    ap.add_argument("--loads", default="0.25,0.5,0.8,1.2", help="pending / (cap x KillWait), comma-separated")
    ap.add_argument("--nodes", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/slurm_drain.py needs root (it starts the test cluster in namespaces)")
    env = dict(os.environ, OPGUARD_TEST_CLUSTER=str(BASE), KILLWAIT=str(args.killwait),
               SLURM_CONF=str(BASE / "etc" / "slurm.conf"), PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    t0 = time.monotonic()
    sh([str(REPO / "slurm" / "cluster" / "up.sh"), str(args.nodes)], env)
    startup = time.monotonic() - t0
    results = []
    try:
        for load in (float(x) for x in args.loads.split(",")):
            results.append(one_load(load, args, env))
    finally:
        subprocess.run([str(REPO / "slurm" / "cluster" / "down.sh")], env=env, check=False)
    out = {"killwait_s": args.killwait, "cap_mib_s": args.mbps, "nodes": args.nodes,
           "cluster_start_s": round(startup, 2), "runs": results}
    (REPO / "bench" / "out").mkdir(parents=True, exist_ok=True)
    (REPO / "bench" / "out" / "slurm_drain.json").write_text(json.dumps(out, indent=1))
    print(f"KillWait {args.killwait} s, cap {args.mbps:g} MiB/s per node, {args.nodes} nodes "
          f"(cluster up in {startup:.2f} s)")
    print(f"{'load':>5} {'node':>6} {'pending MiB':>11} {'published MiB':>13} {'drain s':>8} {'expected s':>10} "
          f"{'drain/KillWait':>14} {'sealed':>6}")
    for r in results:
        for n in r["nodes"]:
            print(f"{n['load']:>5g} {n['node']:>6} {n['pending_mib']:>11.1f} {n['published_after_cancel_mib']:>13.2f} "
                  f"{n['drain_s'] if n['drain_s'] is not None else '-':>8} {n['expected_drain_s']:>10} "
                  f"{n['drain_over_killwait'] if n['drain_over_killwait'] is not None else '-':>14} "
                  f"{'yes' if n['sealed'] else 'NO':>6}")


if __name__ == "__main__":
    main()
