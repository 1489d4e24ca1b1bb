"""opguard-run's cost, as ratios against a baseline measured in the same run.

1. start-up: wall time of ``opguard-run CMD`` vs bare ``CMD`` (CMD = ``python -c pass``), staging
   disabled and enabled (enabled: preflight, node claim, node metadata, first sync, final drain);
   goal: <= 150 ms added (median of interleaved runs).
2. idle: the wrapper's own CPU time while it runs ``sleep DURATION`` with periodic syncs, as a
   percentage of one core; goal < 1 %. The syncs' CPU (separate, niced child processes) is shown
   beside it.
3. training: steps/s of a small CPU torch job that logs one record per step, bare vs under
   opguard-run with syncs every 2 s; goal >= 0.98x (median of interleaved runs).

usage: python bench/launcher_overhead.py [--duration 60] [--reps 10] [--train-seconds 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent
RUN = str(BIN / "opguard-run")
PY = sys.executable

TRAIN = r'''
import sys, time
import torch
from opguard.staging.writers import open_jsonl
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
deadline = None
steps = 0
with open_jsonl("bench/steps.jsonl") as log:
    while True:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        log.write({"step": steps, "loss": loss.item(), "pad": "x" * 200})
        steps += 1
        if steps == 20:
            t0 = time.perf_counter(); deadline = t0 + float(sys.argv[1]); counted = 0
        if deadline is not None:
            counted += 1
            if time.perf_counter() >= deadline:
                break
print(counted / (time.perf_counter() - t0))
'''


def staging_env(root: Path, interval: float) -> dict[str, str]:
    target = root / "shared" / "bench-run"
    local = root / "local"
    target.mkdir(parents=True, exist_ok=True)
    local.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPGUARD_", "SLURM_", "PMI_", "OMPI_"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # measure an installed package (bytecode cached), not recompiles
    env.update({"OPGUARD_LOCAL_DUMP_ENABLED": "1", "OPGUARD_TRACE_OUTPUT_BASE": str(target),
                "OPGUARD_LOCAL_DUMP_TARGET": str(target), "OPGUARD_LOCAL_DUMP_BASE": str(local),
                "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": str(interval), "OPGUARD_NODE_ID": "bench-node",
                "OMP_NUM_THREADS": "1"})
    return env


STAMP = "import time, sys; sys.stdout.write(repr(time.time()))"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(start-up s: launch until the program's first statement, wall s in all, CPU s of the process
    and every descendant it waited for). CPU time is what the wrapper itself costs; wall time also
    carries the scheduler's delays on a busy machine."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p0 = time.perf_counter()
    out = subprocess.run(argv, env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - p0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return float(out.stdout) - t0, wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def startup(reps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="opguard-bench-") as tmp:
        for label, enabled in (("disabled", False), ("enabled", True)):
            root = Path(tmp) / label
            env = staging_env(root, 3600)
            if not enabled:
                env["OPGUARD_LOCAL_DUMP_ENABLED"] = "0"
            bare, wrapped = [], []
            timed([PY, "-c", STAMP], env)  # warm caches (and write bytecode)
            timed([RUN, "--quiet", PY, "-c", STAMP], env)
            for _ in range(reps):  # interleaved, so load changes hit both alike
                bare.append(timed([PY, "-c", STAMP], env))
                wrapped.append(timed([RUN, "--quiet", PY, "-c", STAMP], env))
            for i, what in enumerate(("start", "wall", "cpu")):
                b = statistics.median(x[i] for x in bare)
                w = statistics.median(x[i] for x in wrapped)
                out[f"{label}_{what}_bare_ms"] = round(b * 1000, 1)
                out[f"{label}_{what}_wrapped_ms"] = round(w * 1000, 1)
                out[f"{label}_{what}_added_ms"] = round((w - b) * 1000, 1)
    return out


def idle(duration: float, interval: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="opguard-bench-") as tmp:
        env = staging_env(Path(tmp), interval)
        t0 = time.perf_counter()
        p = psutil.Popen([RUN, "--quiet", "sleep", str(duration)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        last = p.cpu_times()
        while p.poll() is None:
            try:
                last = p.cpu_times()  # the wrapper itself; children_* = reaped syncs (+ sleep)
            except psutil.Error:
                break
            time.sleep(0.5)
        wall = time.perf_counter() - t0
        own = last.user + last.system
        kids = last.children_user + last.children_system
    return {"duration_s": round(wall, 1), "interval_s": interval, "wrapper_cpu_s": round(own, 3),
            "wrapper_cpu_percent_of_core": round(100 * own / wall, 3),
            "syncs_cpu_s": round(kids, 3), "syncs_cpu_percent_of_core": round(100 * kids / wall, 3)}


def train(seconds: float, rounds: int) -> dict[str, float]:
    bare, wrapped = [], []
    with tempfile.TemporaryDirectory(prefix="opguard-bench-") as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(TRAIN)
        for i in range(rounds):
            for label, runs in (("bare", bare), ("wrapped", wrapped)):
                env = staging_env(Path(tmp) / f"{label}-{i}", 2)
                argv = [PY, str(script), str(seconds)]
                if label == "wrapped":
                    argv = [RUN, "--quiet", *argv]
                r = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
                runs.append(float(r.stdout.strip().splitlines()[-1]))
    b, w = statistics.median(bare), statistics.median(wrapped)
    return {"seconds_per_run": seconds, "rounds": rounds, "bare_steps_per_s": round(b, 1),
            "wrapped_steps_per_s": round(w, 1), "ratio": round(w / b, 3),
            "bare_all": [round(x, 1) for x in bare], "wrapped_all": [round(x, 1) for x in wrapped]}  # type: ignore[dict-item]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="idle run length, s")
    ap.add_argument("--interval", type=float, default=5.0, help="sync interval during the idle run, s")
    ap.add_argument("--reps", type=int, default=10, help="start-up repetitions")
    ap.add_argument("--train-seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved bare/wrapped training rounds")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    res = {"cpus": psutil.cpu_count(), "load_before": os.getloadavg()[0], "startup": startup(a.reps),
           "idle": idle(a.duration, a.interval), "train": train(a.train_seconds, a.rounds),
           "load_after": os.getloadavg()[0]}
    s, i, t = res["startup"], res["idle"], res["train"]
    print(f"load average {res['load_before']:.1f} -> {res['load_after']:.1f} on {res['cpus']} CPUs")
    for label in ("disabled", "enabled"):
        print(f"staging {label}: start-up +{s[label + '_start_added_ms']} ms "
              f"({s[label + '_start_wrapped_ms']} vs {s[label + '_start_bare_ms']} ms; goal <= 150), "
              f"whole run +{s[label + '_wall_added_ms']} ms wall, +{s[label + '_cpu_added_ms']} ms CPU "
              "(enabled: includes the syncs and the final drain)")
    print(f"idle {i['duration_s']} s, syncs every {i['interval_s']} s: wrapper {i['wrapper_cpu_percent_of_core']} % "
          f"of a core (goal < 1), syncs {i['syncs_cpu_percent_of_core']} %")
    print(f"training: {t['wrapped_steps_per_s']} vs {t['bare_steps_per_s']} steps/s = {t['ratio']}x (goal >= 0.98)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
