#!/usr/bin/env python3
"""Staging benchmarks (issue 2, "Must show" 4): each figure is a ratio against a baseline measured in the same run.

    .venv/bin/python bench/staging_bench.py --all            # a–f, a few minutes, ~6 GiB of scratch disk
    .venv/bin/python bench/staging_bench.py sync restore     # some of: sync files rate unchanged rss restore

Items (goal in brackets):
  sync     (a) uncapped ``opguard sync --all --final`` of ~1 GiB of mixed trace data
               vs ``tar -cf - DIR | zstd -3 > FILE``                                  [<= 1.25x]
  files    (b) 8 ranks x 5,000 files of 16 KiB: files created on the target vs a direct copy
               [one file per batch] and wall time vs ``cp -r``                        [<= 1x]
  rate     (c) achieved upload rate at OPGUARD_SYNC_MBPS=32 over >= 256 MiB of incompressible data
                                                                                     [within +-5 %]
  unchanged (d) CPU of a sync of 10,000 unchanged files                              [<= 0.2 s]
  rss      (e) peak RSS of a sync that builds a 256 MiB batch                         [<= 128 MiB]
  restore  (f) ``opguard materialize`` of (a)'s data vs ``zstd -dc FILE | tar -x``     [<= 1.3x]

(a) and (f) also report the baseline followed by an fsync of what it wrote (``sync FILE...``):
opguard's sync and restore are durable (every file fsynced), the plain baselines are not.

Everything runs the real ``opguard`` CLI of this virtualenv in subprocesses, on the local disk
(source and target on one filesystem: no Lustre here). Timings are the best of ``--repeat`` runs
(default 2) with a warm page cache for both sides. Scratch data goes under ``--workdir`` (default:
a new directory in /tmp), which is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
OPGUARD = str(BIN / "opguard")
MiB = 1 << 20


@dataclass
class Run:
    wall: float
    cpu: float  # user + sys of the child(ren)
    maxrss_kib: int
    rc: int
    stderr: str


def run(cmd: Sequence[str] | str, env: dict[str, str] | None = None, *, shell: bool = False) -> Run:
    """Run a command to completion; wall time, CPU and peak RSS of the child (os.wait4)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stderr is not None
    err = p.stderr.read().decode(errors="replace")
    _pid, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return Run(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss, p.returncode, err)


# Linux carries a process's peak RSS across fork+exec (the forking parent's high-water mark): a child
# of this (large) benchmark process would report at least our own peak. Measure from a small helper.
_RSS_HELPER = ("import os,subprocess,sys; p=subprocess.Popen(sys.argv[1:],stdout=subprocess.DEVNULL); "
               "_,st,ru=os.wait4(p.pid,0); sys.stderr.write(f'\\nMAXRSS_KIB {ru.ru_maxrss} "
               "{os.waitstatus_to_exitcode(st)}\\n')")


def run_rss(cmd: Sequence[str], env: dict[str, str]) -> Run:
    """Like :func:`run`, with the peak RSS measured by a small intermediate process."""
    r = run([sys.executable, "-c", _RSS_HELPER, *cmd], env)
    line = r.stderr.rstrip().rsplit("\n", 1)[-1].split()
    assert line[0] == "MAXRSS_KIB", r.stderr
    return Run(r.wall, r.cpu, int(line[1]), int(line[2]), r.stderr)


def run_shell_tree(cmd: str) -> Run:
    """A shell pipeline: CPU of all its processes (RUSAGE_CHILDREN delta), wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(wall, cpu, after.ru_maxrss, r.returncode, r.stderr)


def check(r: Run, what: str) -> Run:
    if r.rc != 0:
        raise SystemExit(f"{what} failed (exit {r.rc}):\n{r.stderr}")
    return r


def sync(env: dict[str, str], *args: str) -> Run:
    return check(run([OPGUARD, "sync", *args], env), f"opguard sync {' '.join(args)}")


def drop_dir(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


def du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def count_files(p: Path) -> int:
    return sum(1 for f in p.rglob("*") if f.is_file())


class Workspace:
    """A staging environment: local base (ranks' files), shared target, scratch."""

    def __init__(self, root: Path, name: str, **settings: str) -> None:
        self.root = root / name
        drop_dir(self.root)
        self.local = self.root / "local"
        self.target = self.root / "shared" / "run"
        self.local.mkdir(parents=True)
        self.target.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPGUARD_", "SLURM_", "RANK"))}
        env.update({"OPGUARD_TRACE_OUTPUT_BASE": str(self.target), "OPGUARD_LOCAL_DUMP_ENABLED": "1",
                    "OPGUARD_LOCAL_DUMP_TARGET": str(self.target), "OPGUARD_LOCAL_DUMP_BASE": str(self.local),
                    "OPGUARD_NODE_ID": "bench-node", "OPGUARD_SYNC_MBPS": "1000000",
                    "OPGUARD_SYNC_BATCH_MB": "256"})
        env.update(settings)
        self.env = env

    def rank(self, r: int) -> Path:
        d = self.local / "ranks" / f"rank-{r:06d}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def reset_target(self) -> None:
        """Forget everything published (target and uploader state), keep the producers' files."""
        drop_dir(self.target)
        self.target.mkdir(parents=True)
        drop_dir(self.local / "state")


# ---- data -----------------------------------------------------------------------------------------

OPS = ["aten::mm", "aten::addmm", "aten::softmax", "aten::layer_norm", "nccl:all_reduce", "aten::gelu",
       "aten::_scaled_dot_product_flash_attention", "aten::embedding", "aten::add_", "aten::copy_"]


def write_jsonl(path: Path, nbytes: int, rng: random.Random) -> int:
    """Realistic trace records (unique sequence numbers and timestamps, varying shapes and values)."""
    pool = []
    for _ in range(4000):
        op = rng.choice(OPS)
        dims = [rng.choice((1, 8, 64, 128, 512, 1024, 4096, rng.randrange(1, 65536)))
                for _ in range(rng.randrange(1, 5))]
        pool.append(f'"op":"{op}","shape":{dims},"dtype":"{rng.choice(("bf16", "f32", "f16"))}",'
                    f'"stream":{rng.randrange(8)},"callsite":"model/layers.py:{rng.randrange(40, 900)}"')
    out, size, seq, ts = [], 0, 0, 1_764_000_000.0
    while size < nbytes:
        seq += 1
        ts += rng.expovariate(2000.0)
        line = (f'{{"seq":{seq},"ts":{ts:.6f},{rng.choice(pool)},"dur_us":{rng.expovariate(0.01):.3f},'
                f'"absmax":{rng.gauss(0, 3):.6g},"nan":{int(rng.random() < 0.001)}}}\n')
        out.append(line)
        size += len(line)
    data = "".join(out).encode()
    path.write_bytes(data)
    return len(data)


def write_tensor(path: Path, nbytes: int, seed: int) -> int:
    """float32 values of a normal distribution (compress only a little, like real activations)."""
    import numpy as np

    arr = np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(arr.tobytes())
    return int(arr.nbytes)


def mixed_tree(ws: Workspace, total: int, ranks: int = 8) -> int:
    """~total bytes over ranks: 56 % JSON lines (rotated segments), 44 % tensors, some small files."""
    rng = random.Random(7)
    per = total // ranks
    written = 0
    for r in range(ranks):
        d = ws.rank(r)
        jl = int(per * 0.56)
        for seg in range(3):
            name = "trace.jsonl" if seg == 2 else f"trace.{seg + 1:06d}.jsonl"
            written += write_jsonl(d / name, jl // 3, rng)
        tn = per - jl
        for t in range(7):
            written += write_tensor(d / "tensors" / f"step{t:03d}.pt", tn // 8, seed=r * 100 + t)
        for c in range(50):
            p = d / "callsites" / f"cs{c:03d}.json"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps({"frames": [f"model/layers.py:{rng.randrange(900)}" for _ in range(30)]}))
            written += p.stat().st_size
    node = ws.local / "node"
    node.mkdir(parents=True, exist_ok=True)
    (node / "topology.json").write_text(json.dumps({"gpus": 8, "nics": 4}))
    return written


# ---- the items ------------------------------------------------------------------------------------

Result = dict[str, object]


def best(fn: Callable[[], Run], repeat: int, before: Callable[[], None] | None = None) -> Run:
    runs = []
    for _ in range(repeat):
        if before:
            before()
        runs.append(fn())
    return min(runs, key=lambda r: r.wall)


def item_sync(work: Path, repeat: int, state: dict[str, object]) -> Result:
    ws = Workspace(work, "a-sync")
    size = mixed_tree(ws, 1 << 30)
    src = ws.local / "ranks"
    tarzst = work / "a-baseline.tar.zst"
    base = best(lambda: check(run_shell_tree(f"tar -cf - -C {ws.local} ranks node | zstd -q -3 > {tarzst}"),
                              "tar | zstd"), repeat)
    durable = best(lambda: check(run_shell_tree(f"tar -cf - -C {ws.local} ranks node | zstd -q -3 > {tarzst} && "
                                                f"sync {tarzst}"), "tar | zstd && sync"), repeat)
    ours = best(lambda: sync(ws.env, "--all", "--final", "-q"), repeat, before=ws.reset_target)
    state["a"] = (ws, tarzst, size)
    published = du(ws.target)
    return {"item": "a", "what": "uncapped sync of mixed trace data vs tar | zstd -3",
            "data_MiB": round(size / MiB, 1), "files": count_files(src),
            "sync_s": round(ours.wall, 3), "sync_cpu_s": round(ours.cpu, 3),
            "tar_zstd_s": round(base.wall, 3), "tar_zstd_cpu_s": round(base.cpu, 3),
            "published_MiB": round(published / MiB, 1), "tar_zst_MiB": round(tarzst.stat().st_size / MiB, 1),
            "ratio": round(ours.wall / base.wall, 3), "cpu_ratio": round(ours.cpu / base.cpu, 3), "goal": "<= 1.25",
            "tar_zstd_fsync_s": round(durable.wall, 3), "ratio_vs_fsynced": round(ours.wall / durable.wall, 3)}


def item_restore(work: Path, repeat: int, state: dict[str, object]) -> Result:
    if "a" not in state:
        item_sync(work, 1, state)
    saved = state["a"]
    assert isinstance(saved, tuple)
    ws, tarzst, size = saved
    assert isinstance(ws, Workspace) and isinstance(tarzst, Path) and isinstance(size, int)
    dest, base_dest = work / "f-restored", work / "f-extracted"

    def clean() -> None:
        drop_dir(dest)
        drop_dir(base_dest)
        base_dest.mkdir()

    base = best(lambda: check(run_shell_tree(f"zstd -q -dc {tarzst} | tar -xf - -C {base_dest}"), "zstd -dc | tar -x"),
                repeat, before=clean)
    durable = best(lambda: check(run_shell_tree(f"zstd -q -dc {tarzst} | tar -xf - -C {base_dest} && "
                                                f"find {base_dest} -type f -print0 | xargs -0 sync"),
                                 "zstd -dc | tar -x && sync"), repeat, before=clean)
    ours = best(lambda: check(run([OPGUARD, "materialize", str(ws.target), str(dest)], ws.env), "materialize"),
                repeat, before=clean)
    restored = du(dest)
    clean()
    return {"item": "f", "what": "opguard materialize vs zstd -dc | tar -x (data of a)",
            "data_MiB": round(size / MiB, 1), "restored_MiB": round(restored / MiB, 1),
            "materialize_s": round(ours.wall, 3), "materialize_cpu_s": round(ours.cpu, 3),
            "zstd_tar_s": round(base.wall, 3), "zstd_tar_cpu_s": round(base.cpu, 3),
            "ratio": round(ours.wall / base.wall, 3), "cpu_ratio": round(ours.cpu / base.cpu, 3), "goal": "<= 1.3",
            "zstd_tar_fsync_s": round(durable.wall, 3), "ratio_vs_fsynced": round(ours.wall / durable.wall, 3)}


def small_files_tree(ws: Workspace, ranks: int = 8, files: int = 5000) -> Path:
    """(b)'s tree: ``ranks`` x ``files`` files of 16 KiB cut from trace records; returns the ranks' directory."""
    rng = random.Random(11)
    pool = ws.root / "pool.jsonl"  # trace records to cut the small files from (compressible like real traces)
    write_jsonl(pool, 8 * MiB, rng)
    records = pool.read_bytes()
    pool.unlink()
    for r in range(ranks):
        d = ws.rank(r)
        for i in range(files):
            at = rng.randrange(0, len(records) - (16 << 10))
            (d / f"f{i:05d}.json").write_bytes(records[at: at + (16 << 10)])
    return ws.local / "ranks"


def item_files(work: Path, repeat: int, state: dict[str, object]) -> Result:
    ws = Workspace(work, "b-files")
    src = small_files_tree(ws)
    direct = work / "b-copy"
    # Interleaved rounds, each side after a global sync(): one side's best against the other's best
    # would compare two states of the machine. The median of the rounds' ratios is the figure.
    # Copies are moved aside, not deleted, until the end: on this VM's ext4 (mounted with discard),
    # creating files soon after deleting ~40,000 others was 10x slower (cp -r 2.2 s in a fresh
    # state, 21-26 s in the next rounds), which would flatter the sync.
    trash = work / "b-trash"
    trash.mkdir(exist_ok=True)
    rounds = []
    for i in range(max(repeat, 3)):
        os.sync()
        cp = check(run(["cp", "-r", str(src), str(direct)]), "cp -r")
        t0 = time.perf_counter()
        os.sync()  # cp -r made durable (ours fsyncs every batch, checkpoint and directory it writes)
        cp_sync = cp.wall + time.perf_counter() - t0
        direct_files = count_files(direct)
        direct.rename(trash / f"copy-{i}")
        ws.reset_target()
        os.sync()
        ours = sync(ws.env, "--all", "-q")
        rounds.append({"sync_s": round(ours.wall, 3), "sync_cpu_s": round(ours.cpu, 3), "cp_s": round(cp.wall, 3),
                       "cp_cpu_s": round(cp.cpu, 3), "cp_then_sync_s": round(cp_sync, 3),
                       "ratio": round(ours.wall / cp.wall, 3), "ratio_vs_synced": round(ours.wall / cp_sync, 3)})
    drop_dir(trash)
    streams = ws.target / ".opguard-bundles" / "streams"
    batches = sum(1 for p in streams.rglob("*.ogb"))
    target_files = count_files(ws.target)
    ratios = sorted(r["ratio"] for r in rounds)
    return {"item": "b", "what": "8 ranks x 5,000 files of 16 KiB: files on the target and wall time vs cp -r",
            "source_files": count_files(src), "direct_copy_files": direct_files, "batches": batches,
            "target_files_total": target_files, "files_ratio": round(target_files / direct_files, 5),
            "files_per_batch_ratio": round(direct_files / batches, 1),
            "ratio": statistics.median(ratios), "ratio_min_max": [ratios[0], ratios[-1]],
            "ratio_vs_synced": statistics.median(r["ratio_vs_synced"] for r in rounds),
            "cpu_ratio": statistics.median(r["sync_cpu_s"] / max(r["cp_cpu_s"], 1e-9) for r in rounds),
            "rounds": rounds, "goal": "one file per batch; time <= 1"}


def item_rate(work: Path, repeat: int, state: dict[str, object]) -> Result:
    cap = 32
    ws = Workspace(work, "c-rate", OPGUARD_SYNC_MBPS=str(cap), OPGUARD_SYNC_BATCH_MB="512")
    d = ws.rank(0)
    with open(d / "blob.bin", "wb") as f:
        for _ in range(288):  # 288 MiB incompressible
            f.write(os.urandom(MiB))
    sdir = ws.target / ".opguard-bundles" / "streams" / "rank-000000"
    p = subprocess.Popen([OPGUARD, "sync", "-q"], env=ws.env, stderr=subprocess.PIPE)
    t_start: float | None = None
    t_end: float | None = None
    size = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # poll the target: when the upload appears, when it is renamed
        names = os.listdir(sdir) if sdir.is_dir() else []
        now = time.perf_counter()
        if t_start is None and any(n.startswith(".tmp-") for n in names):
            t_start = now
        done = [n for n in names if n.endswith(".ogb")]
        if done:
            t_end, size = now, (sdir / done[0]).stat().st_size
            break
        if p.poll() is not None and not done:
            names = os.listdir(sdir) if sdir.is_dir() else []
            if not any(n.endswith(".ogb") for n in names):
                err = p.stderr.read().decode() if p.stderr else ""
                raise SystemExit(f"sync ended without publishing: {err}")
        time.sleep(0.002)
    p.wait()
    assert t_start is not None and t_end is not None, "upload not observed"
    rate = size / (t_end - t_start) / MiB
    return {"item": "c", "what": f"achieved upload rate at OPGUARD_SYNC_MBPS={cap}, incompressible data",
            "batch_MiB": round(size / MiB, 1), "upload_s": round(t_end - t_start, 3),
            "rate_MiB_s": round(rate, 2), "cap_MiB_s": cap, "ratio": round(rate / cap, 4),
            "goal": "0.95 .. 1.05 (poll resolution ~2 ms)"}


def item_unchanged(work: Path, repeat: int, state: dict[str, object]) -> Result:
    ws = Workspace(work, "d-unchanged")
    d = ws.rank(0)
    for i in range(10_000):
        sub = d / f"dir{i // 500:02d}"
        if i % 500 == 0:
            sub.mkdir()
        (sub / f"f{i:05d}.json").write_bytes(b'{"x":%d}\n' % i)
    sync(ws.env, "-q")  # publishes everything (one batch)
    unchanged = best(lambda: sync(ws.env, "-q"), repeat + 1)
    # baseline: the same CLI on a stream with one unchanged file (interpreter + imports + identity checks)
    empty = Workspace(work, "d-empty")
    (empty.rank(0) / "one.json").write_bytes(b"{}\n")
    sync(empty.env, "-q")
    startup = best(lambda: sync(empty.env, "-q"), repeat + 1)
    # in-process: only sync_streams (what the wrapper's loop would pay if it called the library)
    code = ("import time,sys; from opguard.staging.config import StagingConfig; from opguard.staging.layout import "
            "Layout; from opguard.staging.sync import sync_streams; c=StagingConfig.from_env(); l=Layout(c); "
            "t=time.process_time(); r=sync_streams(c,l,['rank-000000'],node_id='bench-node'); "
            "print(time.process_time()-t, r.batches, r.exit_code)")
    out = subprocess.run([sys.executable, "-c", code], env=ws.env, capture_output=True, text=True, check=True).stdout
    inproc, batches, rc = out.split()
    assert batches == "0" and rc == "0", out
    net = unchanged.cpu - startup.cpu
    return {"item": "d", "what": "CPU of a sync of 10,000 unchanged files",
            "cli_cpu_s": round(unchanged.cpu, 3), "cli_one_file_cpu_s": round(startup.cpu, 3),
            "net_cpu_s": round(net, 3), "in_process_cpu_s": round(float(inproc), 3),
            "ratio": round(float(inproc) / 0.2, 3), "goal": "<= 0.2 s (ratio: in-process CPU / 0.2 s)"}


def item_rss(work: Path, repeat: int, state: dict[str, object]) -> Result:
    ws = Workspace(work, "e-rss")
    d = ws.rank(0)
    with open(d / "big.bin", "wb") as f:  # one large whole file and many records: a 256 MiB payload
        for _ in range(128):
            f.write(os.urandom(MiB))
    write_jsonl(d / "trace.jsonl", 128 * MiB, random.Random(3))
    big = check(run_rss([OPGUARD, "sync", "-q"], ws.env), "sync")
    manifest = max((ws.target / ".opguard-bundles" / "streams" / "rank-000000").glob("*.ogb"))
    small = Workspace(work, "e-small")
    (small.rank(0) / "one.json").write_bytes(b"{}\n")
    tiny = check(run_rss([OPGUARD, "sync", "-q"], small.env), "sync")
    many = Workspace(work, "e-streams")  # the same payload in 4 streams: a sync --all and its stream workers
    for r in range(4):
        with open(many.rank(r) / "big.bin", "wb") as f:
            for _ in range(64):
                f.write(os.urandom(MiB // 2) + bytes(MiB // 2))
    tree = tree_memory([OPGUARD, "sync", "--all", "-q"], many.env)
    return {"item": "e", "what": "peak RSS of a sync building and uploading a 256 MiB batch",
            "batch_MiB": round(manifest.stat().st_size / MiB, 1), "payload_MiB": 256,
            "peak_rss_MiB": round(big.maxrss_kib / 1024, 1), "tiny_batch_rss_MiB": round(tiny.maxrss_kib / 1024, 1),
            "ratio": round(big.maxrss_kib / 1024 / 128, 3), "goal": "<= 128 MiB (ratio: peak / 128 MiB)",
            "vs_tiny_batch": round(big.maxrss_kib / tiny.maxrss_kib, 2),
            "four_streams_of_64_MiB": tree}


def tree_memory(cmd: Sequence[str], env: dict[str, str]) -> dict[str, float]:
    """Peak of the summed RSS and PSS of a command and its child processes (sampled every 20 ms)."""
    import psutil

    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    top = psutil.Process(p.pid)
    rss = pss = 0
    procs = 0
    while p.poll() is None:
        try:
            tree = [top, *top.children(recursive=True)]
            infos = [t.memory_full_info() for t in tree]
        except psutil.Error:
            continue
        rss, pss = max(rss, sum(i.rss for i in infos)), max(pss, sum(i.pss for i in infos))
        procs = max(procs, len(tree))
        time.sleep(0.02)  # a sampling period, not a synchronisation
    _, err = p.communicate()
    assert p.returncode == 0, err
    return {"processes": procs, "peak_sum_rss_MiB": round(rss / MiB, 1), "peak_sum_pss_MiB": round(pss / MiB, 1)}


ITEMS: dict[str, Callable[[Path, int, dict[str, object]], Result]] = {
    "sync": item_sync, "restore": item_restore, "files": item_files, "rate": item_rate,
    "unchanged": item_unchanged, "rss": item_rss}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="*", help=f"items to run, of: {' '.join(ITEMS)}")
    ap.add_argument("--all", action="store_true", help="run every item")
    ap.add_argument("--repeat", type=int, default=2, help="runs per timing; the best is kept")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: new one in /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    a = ap.parse_args(argv)
    unknown = [n for n in a.items if n not in ITEMS]
    if unknown:
        ap.error(f"unknown item(s) {unknown}; choose from {list(ITEMS)}")
    names = list(ITEMS) if a.all or not a.items else list(dict.fromkeys(a.items))
    work = Path(tempfile.mkdtemp(prefix="opguard-bench-", dir=a.workdir))
    results: list[Result] = []
    state: dict[str, object] = {}
    try:
        for name in names:
            t0 = time.perf_counter()
            res = ITEMS[name](work, a.repeat, state)
            res["bench_s"] = round(time.perf_counter() - t0, 1)
            res["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine skews the figures
            results.append(res)
            print(json.dumps(res), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
