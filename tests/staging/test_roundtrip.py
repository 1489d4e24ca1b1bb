"""Round trip through the real CLI only: many ``opguard sync`` runs over a realistic 4-rank tree, then
``opguard verify`` and ``opguard materialize`` reproduce the producers' tree byte for byte.

Complements tests/staging/test_sync_restore.py (library restore, 2 ranks) with: the CLI restore and verify
(exit codes, DEST on stdout, unsealed streams named before the final drain), four ranks, the
producer API's own rotation (``JsonlWriter(rotate_bytes=...)``) beside rotation by rename and by
truncation, and the same model as the crash tests (no record lost or duplicated, explained).
"""

from __future__ import annotations

import random
from pathlib import Path

from opguard.staging.writers import JsonlWriter
from tests.staging.faultinject.checks import opguard, state_leftovers
from tests.staging.test_crash import World


def test_many_cli_syncs_then_cli_restore_is_byte_exact(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = {**staging_env, "OPGUARD_SYNC_BATCH_MB": "1"}
    w = World(env, seed=5)
    w.add_rank(2)
    w.add_rank(3)
    rng = random.Random(5)
    target = env["OPGUARD_LOCAL_DUMP_TARGET"]
    with JsonlWriter(w.ranks[3].root / "events.jsonl", rotate_bytes=20_000) as jw:
        for i in range(25):
            w.step(3)
            for _ in range(rng.randrange(0, 120)):
                w.ids[0] += 1
                jw.write({"id": w.ids[0], "pad": "e" * rng.randrange(0, 200)})
            if i % 8 == 7:
                w.bulk(rng.randrange(4), 1 << 20)  # more than one batch: the backlog spans syncs
            w.normal_sync()
            if i % 6 == 0:
                r = opguard(env, "verify", target)
                assert r.returncode == 0, r.stderr
                r = opguard(env, "verify", target, "--require-sealed")
                assert r.returncode == 5 and "rank-000003" in r.stderr, r.stderr
    assert len(list((w.ranks[3].root).glob("events.*.jsonl"))) > 3, "the writer never rotated"
    w.normal_sync("--final")
    assert state_leftovers(env) == []
    dest = tmp_path / "restored"
    r = opguard(env, "materialize", target, str(dest))
    assert r.returncode == 0 and r.stdout.strip() == str(dest), r.stderr
    (tmp_path / "again").mkdir()
    w.check_final(tmp_path / "again")  # verify --require-sealed, materialize, compare with the model
    assert sorted(p.name for p in dest.iterdir()) == ["nodes", "ranks"]
