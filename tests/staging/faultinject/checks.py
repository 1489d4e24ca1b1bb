"""Checks of the shared target and the local state after a crash or a fault, and the CLI calls they need."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from opguard.staging.bundle import parse_batch_name, verify_batch
from opguard.staging.crashpoints import ENV
from opguard.staging.restore import NothingPublished, verify
from tests.conftest import BIN

KILLED = -signal.SIGKILL


def opguard(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "opguard"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def sync_crashing_at(env: dict[str, str], point: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``opguard sync ARGS`` that SIGKILLs itself at crash point ``point`` (``NAME``, ``NAME#N``, ``*#N``)."""
    return opguard({**env, ENV: point}, "sync", *args)


def bundles(env: dict[str, str]) -> Path:
    return Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles"


class TargetChecker:
    """Checks that everything visible on the target is whole; verifies each batch once (incremental)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.verified: set[Path] = set()

    def check_visible(self) -> int:
        """No non-hidden file under streams/ that fails verification; returns how many batches exist."""
        root = bundles(self.env) / "streams"
        n = 0
        if not root.is_dir():
            return 0
        for sdir in sorted(root.iterdir()):
            seqs: dict[int, str] = {}
            for p in sorted(sdir.iterdir()):
                if p.name.startswith("."):
                    continue  # .tmp-*: in-progress or abandoned uploads, ignored by readers
                parsed = parse_batch_name(p.name)
                if parsed is not None:
                    seq, digest = parsed
                    assert seq not in seqs, f"{sdir.name}: two batches with sequence {seq}: {p.name}, {seqs[seq]}"
                    seqs[seq] = digest
                    if p not in self.verified:
                        info = verify_batch(p, digest)  # raises on a partial or damaged batch
                        assert info.manifest["sequence"] == seq and info.manifest["stream"] == sdir.name
                        self.verified.add(p)
                    n += 1
                elif p.name.endswith(".seal"):
                    doc = json.loads(p.read_bytes())  # a partial seal would not parse
                    assert doc["stream"] == sdir.name and int(p.name[:12]) == doc["last_sequence"]
                else:
                    raise AssertionError(f"unexpected visible file on the target: {p}")
            assert sorted(seqs) == list(range(1, len(seqs) + 1)), f"{sdir.name}: sequence gap {sorted(seqs)}"
        return n

    def check_restorable(self) -> None:
        """The real restore's checks (hash chain, seals, every entry) pass on what is there now.

        A crash before ``format.json`` exists published nothing: then there must be no stream either."""
        if not (bundles(self.env) / "format.json").exists():
            assert not (bundles(self.env) / "streams").exists(), "streams/ exists without format.json"
            if not bundles(self.env).exists():
                return  # killed before the target was touched
        try:
            verify(Path(self.env["OPGUARD_LOCAL_DUMP_TARGET"]))
        except NothingPublished:  # a crash before the first batch or seal: there must be none
            assert not list(bundles(self.env).glob("streams/*/[0-9]*")), "a batch or seal that verify did not see"


def state_leftovers(env: dict[str, str]) -> list[str]:
    """After a successful sync: anything a crash left in the local state or on the target that should be gone."""
    out: list[str] = []
    state = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state"
    if state.is_dir():
        out += [f"state {n}" for n in os.listdir(state) if n.startswith(".")]
    streams = state / "streams"
    if streams.is_dir():
        for s in sorted(streams.iterdir()):
            out += [f"state {s.name}/{n}" for n in os.listdir(s) if n.startswith(".opguard-tmp-")]
            if (s / "pending.json").exists():
                out.append(f"state {s.name}/pending.json")
            if (s / "pending").is_dir():
                out += [f"state {s.name}/pending/{n}" for n in os.listdir(s / "pending")]
    tdir = bundles(env) / "streams"
    if tdir.is_dir():
        for s in sorted(tdir.iterdir()):
            out += [f"target {s.name}/{n}" for n in os.listdir(s) if n.startswith(".")]
    if bundles(env).is_dir():  # a crash while creating format.json leaves its temporary (see top_orphans)
        out += [f"target {n}" for n in os.listdir(bundles(env)) if n.startswith(".")
                and not n.startswith(ORPHAN_OK)]
    return out


# Temporaries of create-if-absent files on the target that no sync may remove (another node's
# creation could be in flight): readers ignore them.
ORPHAN_OK = ".tmp-format.json."
