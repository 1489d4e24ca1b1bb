"""Round trip through the restore: a realistic tree over many syncs restores byte-exact."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from opguard.staging.restore import materialize, verify
from opguard.staging.writers import JsonlWriter, write_file_atomic
from tests.helpers.sync import opguard, rank_dir, sync, tree_of


def _complete(data: bytes) -> bytes:
    """What a restore can hold of a JSON-lines file: its complete records."""
    return data[: data.rfind(b"\n") + 1]


class Model:
    """The producer side of one rank, plus what the restore must produce for it."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root, self.rng = root, rng
        self.expected: dict[str, bytes] = {}
        self.n = 0

    def record(self) -> bytes:
        self.n += 1
        return json.dumps({"n": self.n, "pad": "x" * self.rng.randrange(0, 300)}).encode() + b"\n"

    def step(self) -> None:
        r = self.rng.random()
        log = self.root / "trace.jsonl"
        if r < 0.35:  # appends, maybe ending in a partial record
            with open(log, "ab") as f:
                for _ in range(self.rng.randrange(1, 40)):
                    f.write(self.record())
                if self.rng.random() < 0.5:
                    rec = self.record()
                    cut = self.rng.randrange(1, len(rec))
                    f.write(rec[:cut])
                    f.flush()
                    self.pending_tail = rec[cut:]
        elif r < 0.45 and log.exists():  # finish a partial record
            with open(log, "ab") as f:
                f.write(getattr(self, "pending_tail", b""))
                self.pending_tail = b""
        elif r < 0.55 and log.exists():  # rotation by rename
            os.rename(log, self.root / f"trace.{self.n}.jsonl")
            self.pending_tail = b""
        elif r < 0.62 and log.exists():  # rotation by truncation
            log.write_bytes(self.record())
            self.pending_tail = b""
        elif r < 0.80:  # atomic tensor files, new or replaced
            write_file_atomic(self.root / "tensors" / f"t{self.rng.randrange(4)}.pt",
                              self.rng.randbytes(self.rng.randrange(0, 5000)))
        elif r < 0.90:  # in-place rewrite of a whole file (between syncs)
            (self.root / "meta.txt").write_bytes(self.rng.randbytes(self.rng.randrange(1, 100)))
        else:  # deletion (history keeps the last published content)
            victims = sorted(self.root.rglob("*.pt"))
            if victims:
                v = self.rng.choice(victims)
                self.expected[v.relative_to(self.root).as_posix()] = v.read_bytes()
                v.unlink()

    def snapshot(self) -> None:
        for p in self.root.rglob("*"):
            if p.is_file():
                rel = p.relative_to(self.root).as_posix()
                data = p.read_bytes()
                self.expected[rel] = _complete(data) if rel.endswith(".jsonl") else data


@pytest.mark.parametrize("seed", [2])
def test_many_syncs_restore_byte_exact(staging_env: dict[str, str], tmp_path: Path, seed: int) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    rng = random.Random(seed)
    models = [Model(rank_dir(env, r), rng) for r in (0, 3)]
    node = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "node"
    write_file_atomic(node / "topology.json", b'{"gpus":8}')
    for _ in range(10):
        for m in models:
            for _ in range(3):
                m.step()
            m.snapshot()
        sync(env, "--all")
    write_file_atomic(node / "topology.json", b'{"gpus":4}')
    for m in models:
        m.snapshot()
    sync(env, "--all", "--final")
    dest = tmp_path / "restored"
    materialize(Path(env["OPGUARD_LOCAL_DUMP_TARGET"]), dest, require_sealed=True)
    for m, r in zip(models, (0, 3), strict=True):
        got = tree_of(dest / "ranks" / f"rank-{r:06d}")
        node_copy = {k: v for k, v in got.items() if k.startswith("_node/")}
        assert node_copy == {"_node/topology.json": b'{"gpus":4}'}
        assert {k: v for k, v in got.items() if not k.startswith("_node/")} == m.expected
    assert tree_of(dest / "nodes" / "node-a") == {"topology.json": b'{"gpus":4}'}


def test_unsealed_then_sealed(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = staging_env
    with JsonlWriter(rank_dir(env) / "a.jsonl") as w:
        w.write({"a": 1})
    sync(env)
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    verify(target)  # intact (unsealed is only a warning without --require-sealed)
    r = opguard(env, "verify", str(target), "--require-sealed")
    assert r.returncode != 0 and "rank-000000" in r.stderr
    sync(env, "--final")
    r = opguard(env, "verify", str(target), "--require-sealed")
    assert r.returncode == 0, r.stderr
    # more data after the seal: unsealed again until the next final drain
    with JsonlWriter(rank_dir(env) / "a.jsonl") as w:
        w.write({"a": 2})
    sync(env)
    assert opguard(env, "verify", str(target), "--require-sealed").returncode != 0
    sync(env, "--final")
    assert opguard(env, "verify", str(target), "--require-sealed").returncode == 0
    materialize(target, tmp_path / "out", require_sealed=True)
    assert (tmp_path / "out/ranks/rank-000000/a.jsonl").read_bytes() == b'{"a":1}\n{"a":2}\n'


def test_final_seals_an_empty_stream(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = staging_env
    rank_dir(env, 4)
    sync(env, "--rank", "4", "--final")
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    seal = target / ".opguard-bundles/streams/rank-000004/000000000000.seal"
    doc = json.loads(seal.read_text())
    assert (doc["last_sequence"], doc["last_digest"], doc["stream"]) == (0, None, "rank-000004")
    assert opguard(env, "verify", str(target), "--require-sealed").returncode == 0


def test_file_replaced_by_a_directory_and_back_latest_wins(staging_env: dict[str, str], tmp_path: Path) -> None:
    """docs/format.md §8: a path that was a file and later a directory (or the reverse) restores as the
    later one; the older one is left out and named on stderr; verify reports the same."""
    env = staging_env
    root = rank_dir(env)
    write_file_atomic(root / "a", b"old file a")
    write_file_atomic(root / "d" / "x.pt", b"x")
    write_file_atomic(root / "d" / "y.pt", b"y")
    sync(env)
    (root / "a").unlink()
    write_file_atomic(root / "a" / "b.pt", b"new a/b")  # the file a became a directory a/
    for p in ("x.pt", "y.pt"):
        (root / "d" / p).unlink()
    (root / "d").rmdir()
    write_file_atomic(root / "d", b"d is a file now")  # the directory d/ became a file d
    sync(env, "--final")
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    r = opguard(env, "materialize", "--require-sealed", str(target), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    got = tree_of(tmp_path / "out" / "ranks" / "rank-000000")
    assert got == {"a/b.pt": b"new a/b", "d": b"d is a file now"}
    assert "leaves out the older file 'ranks/rank-000000/a'" in r.stderr, r.stderr
    assert ("leaves out the older directory with its 2 file(s) ('ranks/rank-000000/d/x.pt', "
            "'ranks/rank-000000/d/y.pt')") in r.stderr, r.stderr
    r = opguard(env, "verify", "--require-sealed", str(target))
    assert r.returncode == 0 and r.stderr.count("the latest wins") == 2, r.stderr
