"""Helpers for the uploader tests: run the real CLI, read published batches back."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from opguard.staging.bundle import iter_entries, parse_batch_name, read_manifest, verify_batch
from tests.conftest import BIN


def opguard(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "opguard"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def sync(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    r = opguard(env, "sync", *args)
    assert r.returncode == 0, f"sync {args} failed ({r.returncode}): {r.stderr}"
    assert r.stdout == "", "sync must print nothing on stdout"
    return r


def rank_dir(env: dict[str, str], rank: int = 0) -> Path:
    d = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / f"rank-{rank:06d}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def stream_dir(env: dict[str, str], stream: str = "rank-000000") -> Path:
    return Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams" / stream


def batches(env: dict[str, str], stream: str = "rank-000000") -> list[Path]:
    d = stream_dir(env, stream)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if parse_batch_name(p.name) is not None)


def manifests(env: dict[str, str], stream: str = "rank-000000") -> list[dict[str, Any]]:
    return [read_manifest(p).manifest for p in batches(env, stream)]


def replay(env: dict[str, str], stream: str = "rank-000000") -> dict[str, bytes]:
    """Apply every batch of a stream in order (checking the chain): the latest content per path."""
    files: dict[str, bytes] = {}
    versions: dict[str, int] = {}
    prev: str | None = None
    for i, p in enumerate(batches(env, stream), start=1):
        seq, digest = parse_batch_name(p.name) or (0, "")
        assert seq == i, f"sequence gap at {p.name}"
        info = verify_batch(p, digest)
        assert info.manifest["prev_digest"] == prev
        assert info.manifest["sequence"] == seq
        prev = digest
        for entry, chunks in iter_entries(info):
            data = b"".join(chunks)
            path, version = entry["path"], entry["version"]
            if entry["op"] == "file" or version != versions.get(path):
                assert entry["offset"] == 0
                assert version > versions.get(path, 0)
                files[path] = b""
                versions[path] = version
            assert entry["offset"] == len(files[path]), f"non-contiguous append to {path}"
            files[path] += data
    return files


def checkpoint(env: dict[str, str], stream: str = "rank-000000") -> dict[str, Any]:
    p = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "streams" / stream / "checkpoint.json"
    return dict(json.loads(p.read_text()))


def tree_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def forked_workers(p: subprocess.Popen[Any], n: int, ready: Callable[[], bool] = lambda: True,
                   timeout: float = 60) -> list[psutil.Process]:
    """The ``n`` child processes of ``p`` once they exist and ``ready()`` holds (polled: a process
    appearing is not an event a test can await)."""
    deadline = time.monotonic() + timeout
    workers: list[psutil.Process] = []
    while len(workers) < n or not ready():
        assert p.poll() is None and time.monotonic() < deadline, f"{n} worker processes never appeared"
        workers = psutil.Process(p.pid).children()
        time.sleep(0.01)
    assert len(workers) == n, workers
    return workers


def kill_and_check_workers_die(p: subprocess.Popen[Any], workers: list[psutil.Process]) -> None:
    """SIGKILL ``p`` alone: its forked workers must die with it (``PR_SET_PDEATHSIG``)."""
    p.kill()
    p.wait(timeout=30)
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == [], f"workers outlived their killed parent: {alive}"
