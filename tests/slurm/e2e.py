"""Helpers of the end-to-end tests: the staging environment a template gets, what each node's
/local-ssd holds, restoring the shared target and comparing, reading published manifests."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opguard.staging.bundle import read_manifest

from .conftest import APPS, BIN, SLURM_DIR, Cluster

TEMPLATES = {name: SLURM_DIR / f"{name}.sbatch" for name in ("torchrun", "srun-per-rank", "mpi-pmi2", "mpirun")}


@dataclass
class Run:
    """One job's directories: the shared target (on the shared fs) and the node-local base."""

    cluster: Cluster
    workdir: Path
    name: str

    @property
    def target(self) -> Path:
        return self.workdir / "target"

    @property
    def local_base(self) -> str:
        """As the nodes see it (each node has its own /local-ssd)."""
        return f"/local-ssd/{self.name}"

    def local_on(self, node: str) -> Path:
        """Host path of ``node``'s local base."""
        return self.cluster.local_ssd(node) / self.name

    def env(self, app_args: str, interval: float = 3, mbps: float = 50, extra: dict[str, str] | None = None,
            **more: str) -> dict[str, str]:
        env = {
            "OPGUARD_VENV": str(BIN.parent),
            "OPGUARD_EXIT_HOOK": str(SLURM_DIR / "exit-hook.sh"),
            "RUN_TARGET": str(self.target),
            "LOCAL_BASE": self.local_base,
            "APP": str(APPS / "trace_app.py"),
            "APP_ARGS": app_args,
            "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": f"{interval:g}",
            "OPGUARD_SYNC_MBPS": f"{mbps:g}",
            "OPGUARD_SYNC_LOCK_TIMEOUT": "20",
            "PYTHONUNBUFFERED": "1",
        }
        env.update(extra or {})
        env.update(more)
        return env

    def submit(self, template: str, *sbatch_args: str, env: dict[str, str]) -> int:
        return self.cluster.sbatch(TEMPLATES[template], "-o", str(self.workdir / "job-%j.out"), *sbatch_args,
                                   env=env)

    def output(self, job_id: int) -> str:
        p = self.workdir / f"job-{job_id}.out"
        return p.read_text(errors="replace") if p.exists() else "(no job output)"

    def local_rank_dirs(self) -> dict[int, tuple[str, Path]]:
        """rank -> (node, host path of its local rank dir), from every node's /local-ssd."""
        out: dict[int, tuple[str, Path]] = {}
        for k in range(1, self.cluster.nodes + 1):
            node = f"node{k}"
            ranks = self.local_on(node) / "ranks"
            for d in sorted(ranks.glob("rank-*")) if ranks.is_dir() else []:
                r = int(d.name.split("-")[1])
                assert r not in out, f"rank {r} staged on {out[r][0]} and on {node}"
                out[r] = (node, d)
        return out

    def restore(self, dest_name: str = "restored") -> Path:
        dest = self.workdir / dest_name
        p = self.cluster.run([str(BIN / "opguard"), "materialize", str(self.target), str(dest)], check=False)
        assert p.returncode == 0, f"materialize failed rc {p.returncode}:\n{p.stderr}"
        return dest

    def verify(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.cluster.run([str(BIN / "opguard"), "verify", *args, str(self.target)], check=False)


def tree_files(root: Path, skip_dirs: tuple[str, ...] = ()) -> dict[str, Path]:
    """Relative path -> path of every regular file under ``root`` (writers' temporaries excluded)."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        for f in filenames:
            if f.startswith(".opguard-tmp-"):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, f))
            out[rel] = Path(dirpath) / f
    return out


def assert_same_tree(local: Path, restored: Path) -> int:
    """Byte-for-byte: every file of ``local`` is in ``restored`` (which has nothing else but
    ``_node/``). Returns the number of files compared."""
    a = tree_files(local)
    b = tree_files(restored, skip_dirs=("_node",))
    assert sorted(a) == sorted(b), f"{local} vs {restored}: only local {sorted(set(a) - set(b))[:5]}, " \
                                   f"only restored {sorted(set(b) - set(a))[:5]}"
    for rel, p in a.items():
        assert filecmp.cmp(p, b[rel], shallow=False), f"{rel} differs between {local} and {restored}"
    return len(a)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def manifests(target: Path) -> list[dict[str, Any]]:
    """Every published batch's manifest, with ``_mtime`` (the published file's mtime) added."""
    out = []
    for p in sorted((target / ".opguard-bundles" / "streams").glob("*/*.ogb")):
        m = dict(read_manifest(p).manifest)
        m["_mtime"] = p.stat().st_mtime
        out.append(m)
    return out


def seals(target: Path) -> dict[str, dict[str, Any]]:
    """stream -> its current (highest) seal record."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted((target / ".opguard-bundles" / "streams").glob("*/*.seal")):
        out[p.parent.name] = json.loads(p.read_text())
    return out


def last_batches(target: Path) -> dict[str, tuple[int, str]]:
    """stream -> (sequence, digest) of its last published batch."""
    out: dict[str, tuple[int, str]] = {}
    for p in sorted((target / ".opguard-bundles" / "streams").glob("*/*.ogb")):
        seq, digest = int(p.name[:12]), p.name[13:77]
        if seq > out.get(p.parent.name, (0, ""))[0]:
            out[p.parent.name] = (seq, digest)
    return out


def assert_all_sealed(target: Path, streams: set[str]) -> None:
    s, last = seals(target), last_batches(target)
    for stream in streams:
        assert stream in s, f"stream {stream} has no seal: its final drain did not finish"
        want = last.get(stream, (0, None))
        got = (s[stream]["last_sequence"], s[stream]["last_digest"])
        assert got == want, f"stream {stream} is unsealed: seal names {got}, last batch is {want}"
