"""Crash consistency: a real ``opguard sync`` SIGKILLed at every protocol step and at random moments.

Each crash is followed by the checks a reader relies on (every visible batch verifies, sequences
are contiguous, the real restore's verification passes) and by a normal sync, after which nothing
of the crash is left (no temporaries, no pending batch). Finally ``opguard verify --require-sealed``
passes and ``opguard materialize`` reproduces the producers' tree: no record lost, none duplicated.
The kill points are ``opguard.staging.crashpoints`` (``OPGUARD_TEST_CRASH_AT``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from opguard.staging.crashpoints import ENV, POINTS
from tests.conftest import BIN
from tests.helpers.restore import files_of
from tests.staging.faultinject.checks import KILLED, TargetChecker, opguard, state_leftovers, sync_crashing_at
from tests.staging.faultinject.model import Producer

SEAL_POINTS = {"sealing", "sealed"}
# which occurrence the final drain is killed at: a later batch of rank 0's multi-batch drain where possible
FINAL_OCCURRENCE = {"locked": 2, "initial-checkpoint": 1, "cleaned": 2, "building": 5, "durable-tmp-written": 3,
                    "exclusive-tmp-written": 1, "sealing": 2, "sealed": 2}


class World:
    """Producers of ranks 0, 1 (2 added later) and the node, under one staging environment."""

    def __init__(self, env: dict[str, str], seed: int) -> None:
        self.env = env
        self.rng = random.Random(seed)
        self.local = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
        self.ids = [0]
        self.ranks: dict[int, Producer] = {}
        self.node = Producer(self.local / "node", self.rng, node=True, ids=self.ids)
        self.checker = TargetChecker(env)
        for r in (0, 1):
            self.add_rank(r)

    def add_rank(self, r: int) -> None:
        self.ranks[r] = p = Producer(self.local / "ranks" / f"rank-{r:06d}", self.rng, ids=self.ids)
        p.append()  # a rank that never wrote anything has nothing to restore

    def step(self, n: int = 2) -> None:
        for p in [*self.ranks.values(), self.node]:
            for _ in range(self.rng.randrange(1, n + 1)):
                p.step()

    def bulk(self, rank: int, nbytes: int) -> None:
        """Append about ``nbytes`` of poorly compressible whole records (a multi-batch drain)."""
        p = self.ranks[rank]
        p.finish_partial()
        with open(p.root / "trace.jsonl", "ab") as f:
            while nbytes > 0:
                p.ids[0] += 1
                rec = b'{"id":%d,"pad":"%s"}\n' % (p.ids[0], self.rng.randbytes(1500).hex().encode())
                f.write(rec)
                nbytes -= len(rec)

    def after_crash(self) -> None:
        self.checker.check_visible()
        self.checker.check_restorable()

    def normal_sync(self, *args: str) -> None:
        r = opguard({**self.env, "OPGUARD_SYNC_MBPS": "1000"}, "sync", "--all", *args)
        assert r.returncode == 0, f"the sync after a crash failed ({r.returncode}): {r.stderr}"
        assert state_leftovers(self.env) == [], "a crash left something a normal sync did not clean up"
        self.checker.check_visible()

    def check_final(self, tmp: Path) -> None:
        target = self.env["OPGUARD_LOCAL_DUMP_TARGET"]
        r = opguard(self.env, "verify", target, "--require-sealed")
        assert r.returncode == 0, r.stderr
        dest = tmp / "restored"
        r = opguard(self.env, "materialize", target, str(dest), "--require-sealed")
        assert r.returncode == 0, r.stderr
        node_tree = self.node.current()
        assert files_of(dest / "nodes" / "node-a") == node_tree
        for rank, p in self.ranks.items():
            got = files_of(dest / "ranks" / f"rank-{rank:06d}")
            assert {k[len("_node/"):]: v for k, v in got.items() if k.startswith("_node/")} == node_tree, \
                f"rank {rank}: node metadata not copied into _node/"
            p.check_restored({k: v for k, v in got.items() if not k.startswith("_node/")})
        assert sorted(os.listdir(dest / "ranks")) == [f"rank-{r:06d}" for r in sorted(self.ranks)]


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_each_protocol_step(staging_env: dict[str, str], tmp_path: Path, point: str) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    w = World(env, seed=POINTS.index(point))
    w.step()
    # a periodic sync (the first one: identity, initial checkpoints) killed at the point
    r = sync_crashing_at(env, point, "--all")
    assert r.returncode == (0 if point in SEAL_POINTS else KILLED), f"{point}: {r.returncode} {r.stderr}"
    w.after_crash()
    w.step()
    w.normal_sync()
    # a final drain of several batches (rank 0 holds ~2.5 MiB, the limit is 1 MiB) killed at a later occurrence
    w.add_rank(2)
    w.step()
    w.bulk(0, 5 << 19)
    spec = f"{point}#{FINAL_OCCURRENCE.get(point, 2)}"
    r = sync_crashing_at(env, spec, "--all", "--final")
    assert r.returncode == KILLED, f"{spec} was never reached in a final drain: {r.returncode} {r.stderr}"
    w.after_crash()
    w.normal_sync("--final")
    w.check_final(tmp_path)


def test_unknown_crash_point_is_refused(staging_env: dict[str, str]) -> None:
    Producer(Path(staging_env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks/rank-000000", random.Random(0)).append()
    r = sync_crashing_at(staging_env, "uploded")
    assert r.returncode == 2 and "OPGUARD_TEST_CRASH_AT='uploded'" in r.stderr and "upload-renamed" in r.stderr


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@pytest.mark.crash
def test_sigkill_at_random_moments(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Hundreds of kills (bounded: OPGUARD_CRASH_ITERATIONS, OPGUARD_CRASH_BUDGET_S; seed OPGUARD_CRASH_SEED):
    half at a random crash point (``*#k``), half after a random delay on a rate-limited (16 MiB/s) upload.
    About 0.5 s per iteration on 2 cores: the default budget gives ~300 iterations."""
    seed = _env_int("OPGUARD_CRASH_SEED", 20261129)
    iterations, budget = _env_int("OPGUARD_CRASH_ITERATIONS", 300), _env_int("OPGUARD_CRASH_BUDGET_S", 150)
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1", "OPGUARD_SYNC_MBPS": "16"}
    w = World(env, seed)
    rng = random.Random(seed)
    killed = done = 0
    deadline = time.monotonic() + budget
    while done < iterations and time.monotonic() < deadline:
        done += 1
        w.step(3)
        if len(w.ranks) < 4 and rng.random() < 0.02:
            w.add_rank(len(w.ranks))
        if rng.random() < 0.05:
            w.bulk(rng.choice(list(w.ranks)), rng.randrange(1, 3 << 20))
        args = ["sync", "--all", *(["--final"] if rng.random() < 0.15 else [])]
        if rng.random() < 0.5:
            rc = opguard({**env, ENV: f"*#{rng.randrange(1, 60)}"}, *args).returncode
        else:
            p = subprocess.Popen([str(BIN / "opguard"), *args], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            try:
                rc = p.wait(timeout=rng.uniform(0.05, 0.4))  # the kill moment, not a synchronisation
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                rc = p.wait()
        assert rc in (0, KILLED), f"iteration {done} (seed {seed}): sync exited {rc}"
        killed += rc == KILLED
        w.checker.check_visible()
        if done % 50 == 0:
            w.checker.check_restorable()
        w.normal_sync()
    print(f"random crash loop: seed {seed}, {done} iterations, {killed} killed, "
          f"{w.checker.check_visible()} batches")
    assert done >= min(iterations, 20), f"only {done} iterations in {budget} s"
    assert killed >= done // 4, f"only {killed} of {done} syncs were killed: the loop tests too little"
    w.normal_sync("--final")
    w.check_final(tmp_path)


def test_crash_while_creating_run_json_leaves_nothing_behind(staging_env: dict[str, str], tmp_path: Path) -> None:
    w = World(staging_env, seed=99)
    r = sync_crashing_at(staging_env, "exclusive-tmp-written#2")  # #1 is format.json, #2 the local run.json
    assert r.returncode == KILLED, r.stderr
    w.after_crash()
    w.normal_sync()  # asserts that nothing of the crash is left


def test_run_json_temporary_left_after_the_link_is_removed(staging_env: dict[str, str], tmp_path: Path) -> None:
    """A crash after linking run.json but before unlinking its temporary: run.json exists, the temporary too."""
    w = World(staging_env, seed=98)
    w.normal_sync()
    orphan = w.local / "state" / ".tmp-run.json.0123456789ab"
    orphan.write_bytes((w.local / "state" / "run.json").read_bytes())
    w.step()
    w.normal_sync()  # asserts that nothing of the crash is left
    assert not orphan.exists() and (w.local / "state" / "run.json").is_file()


def test_restore_of_a_target_holding_only_a_temporary_says_nothing_was_published(
        staging_env: dict[str, str], tmp_path: Path) -> None:
    World(staging_env, seed=97)
    r = sync_crashing_at(staging_env, "exclusive-tmp-written#1")  # killed while creating format.json
    assert r.returncode == KILLED, r.stderr
    target = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"])
    assert [n.startswith(".tmp-format.json.") for n in os.listdir(target / ".opguard-bundles")] == [True]
    for args in (("materialize", str(target), str(tmp_path / "out")), ("verify", str(target))):
        r = opguard(staging_env, *args)
        assert r.returncode == 5, r.stderr  # a restore of nothing never looks like success
        assert f"nothing has been published to {target} yet" in r.stderr, r.stderr
        assert "only 1 temporary file(s)" in r.stderr and "opguard sync --all --final" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and [p for p in tmp_path.iterdir() if "partial" in p.name] == []
