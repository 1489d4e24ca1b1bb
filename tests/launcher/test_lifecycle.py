"""A run's life (issue 15): directories created, attempts explicit, capture refused early, local cleanup.

Real ``opguard-run`` wrappers, real syncs to a real target, real ``opguard verify/materialize/clean``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.helpers import OPGUARD, PY, run_wrapper, spawn, tree_snapshot, wait_for

PROG = str(Path(__file__).parent / "progs" / "sigchild.py")

WRITE = ("from opguard.staging.writers import open_jsonl, write_rank_file\n"
         "w = open_jsonl('trace.jsonl'); [w.write({'i': i}) for i in range(50)]; w.close()\n"
         "write_rank_file('t.bin', b'x' * 4096)\n")


def _env(staging_env: dict[str, str], **extra: str) -> dict[str, str]:
    return {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600", **extra}


def _run(env: dict[str, str], *args: str, code: str = WRITE) -> subprocess.CompletedProcess[str]:
    return run_wrapper(["--no-countdown", *args, PY, "-c", code], env)


def _opguard(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OPGUARD, *args], env=env, capture_output=True, text=True, timeout=120)


def test_fresh_target_and_local_base_are_created(staging_env: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "shared" / "experiment-002"
    local = tmp_path / "local-ssd" / "fresh-base"
    env = _env(staging_env, OPGUARD_LOCAL_DUMP_TARGET=str(target), OPGUARD_TRACE_OUTPUT_BASE=str(target),
               OPGUARD_LOCAL_DUMP_BASE=str(local))
    plan = run_wrapper(["--plan", PY, "-c", "pass"], env)
    assert plan.returncode == 0, plan.stderr
    assert not target.exists() and not local.exists(), "--plan must create nothing"
    r = _run(env)
    assert r.returncode == 0, r.stderr
    assert f"created OPGUARD_LOCAL_DUMP_TARGET={target}" in r.stderr
    assert f"created OPGUARD_LOCAL_DUMP_BASE={local}" in r.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 & ~umask
    assert stat.S_IMODE(local.stat().st_mode) == 0o700 & ~umask
    v = _opguard(env, "verify", "--require-sealed", str(target))
    assert v.returncode == 0, v.stderr
    dest = tmp_path / "restores" / "deep" / "run"  # materialize creates DEST's parents
    m = _opguard(env, "materialize", str(target), str(dest))
    assert m.returncode == 0, m.stderr
    assert (dest / "ranks" / "rank-000000" / "trace.jsonl").read_bytes().count(b"\n") == 50


def test_sync_creates_a_new_target_under_an_existing_parent(staging_env: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "shared" / "by-sync"
    env = _env(staging_env, OPGUARD_LOCAL_DUMP_TARGET=str(target), OPGUARD_TRACE_OUTPUT_BASE=str(target))
    (Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000").mkdir(parents=True)
    r = _opguard(env, "sync", "--rank", "0", "--final")
    assert r.returncode == 0, r.stderr
    assert (target / ".opguard-bundles" / "format.json").is_file()
    env["OPGUARD_LOCAL_DUMP_TARGET"] = env["OPGUARD_TRACE_OUTPUT_BASE"] = str(tmp_path / "gone" / "t")
    r = _opguard(env, "sync", "--rank", "0", "--final")
    assert r.returncode == 2 and f"neither does its parent {tmp_path / 'gone'}" in r.stderr
    assert not (tmp_path / "gone").exists()


def _attempts(local: Path) -> list[dict[str, object]]:
    doc = json.loads((local / "node" / "attempts.json").read_text())
    assert doc["version"] == 1 and doc["node_id"] == "node-a"
    return list(doc["attempts"])


def test_second_launch_into_a_sealed_run_is_refused(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = _env(staging_env, SLURM_JOB_ID="4711")
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    assert _run(env).returncode == 0
    before = tree_snapshot(target)
    marker = tmp_path / "child-ran"
    for args in (["--plan"], []):
        r = run_wrapper(["--no-countdown", *args, PY, "-c", f"open({str(marker)!r}, 'w')"], env)
        assert r.returncode == 2, r.stderr
        for needle in ("run 'experiment-001'", "is sealed", "by job 4711 (attempt 1)", "node-a",
                       "new directory", "--resume", "OPGUARD_RESUME=1"):
            assert needle in r.stderr, r.stderr
    assert not marker.exists(), "the child was started"
    assert tree_snapshot(target) == before, "the target was modified"
    # a Slurm requeue of ANOTHER job is not a continuation of this one
    r = _run({**env, "SLURM_JOB_ID": "4712", "SLURM_RESTART_COUNT": "1"})
    assert r.returncode == 2 and "not of the job that made the last attempt" in r.stderr
    assert tree_snapshot(target) == before
    assert len(_attempts(Path(env["OPGUARD_LOCAL_DUMP_BASE"]))) == 1


def test_resume_and_requeue_continue_and_list_the_attempts(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = _env(staging_env, SLURM_JOB_ID="4711")
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    assert _run(env).returncode == 0
    r = _run({**env, "SLURM_JOB_ID": "4800"}, "--resume",  # resumed from a checkpoint by a new job
             code=WRITE + "write_rank_file('only2.bin', b'2')\n")
    assert r.returncode == 0, r.stderr
    assert "attempt 2 of run experiment-001 (resume-flag)" in r.stderr
    r = _run({**env, "SLURM_JOB_ID": "4800", "SLURM_RESTART_COUNT": "1"}, code="import sys; sys.exit(3)")
    assert r.returncode == 3, r.stderr  # the requeued job continues without being asked; its status is kept
    r = _run({**env, "SLURM_JOB_ID": "4900", "OPGUARD_RESUME": "1"})
    assert r.returncode == 0, r.stderr
    assert _run({**env, "OPGUARD_RESUME": "maybe"}).returncode == 2
    attempts = _attempts(local)
    assert [(a["attempt"], a["job_id"], a["how"], a["exit_status"]) for a in attempts] == [
        (1, "4711", "first", 0), (2, "4800", "resume-flag", 0), (3, "4800", "slurm-requeue", 3),
        (4, "4900", "resume-env", 0)]
    assert all(isinstance(a["ended_at"], float) and a["ended_at"] >= a["started_at"] for a in attempts)
    firsts = [a["first_sequence"] for a in attempts]  # the batch each attempt's data starts at
    assert firsts[0] == {} and [f["rank-000000"] for f in firsts[1:]] == [2, 3, 3]
    v = _opguard(env, "verify", "--require-sealed", str(target))
    assert v.returncode == 0, v.stderr  # the end records were published and the node stream sealed again
    lines = [x for x in v.stdout.splitlines() if x.startswith("node node-a attempt")]
    assert len(lines) == 4 and "job 4711" in lines[0] and "exit 0 (first launch)" in lines[0]
    assert "resumed: --resume" in lines[1] and "exit 3 (Slurm requeue)" in lines[2]
    assert "resumed: OPGUARD_RESUME=1" in lines[3]
    js = json.loads(_opguard(env, "verify", "--json", str(target)).stdout)
    assert [a["attempt"] for a in js["attempts"]["node-a"]] == [1, 2, 3, 4]
    m = _opguard(env, "materialize", str(target), str(tmp_path / "restored"))
    assert m.returncode == 0, m.stderr
    assert sum("node node-a attempt" in x for x in m.stderr.splitlines()) == 4
    restored = tmp_path / "restored" / "ranks" / "rank-000000"
    assert (restored / "trace.jsonl").read_bytes().count(b"\n") == 150  # three writing attempts appended
    assert len(json.loads((restored / "_node" / "attempts.json").read_text())["attempts"]) == 4
    prov = json.loads((tmp_path / "restored" / ".opguard-attempts.json").read_text())
    assert [a["attempt"] for a in prov["attempts"]["node-a"]] == [1, 2, 3, 4]
    files = prov["files"]
    assert files["ranks/rank-000000/only2.bin"] == {"attempt": 2, "node_id": "node-a", "stream": "rank-000000",
                                                   "sequence": 2}
    assert files["ranks/rank-000000/trace.jsonl"]["attempt"] == 4
    assert files["nodes/node-a/attempts.json"]["attempt"] == 4  # the end record, published by attempt 4


def test_provenance_comes_from_the_restore_itself_and_appears_with_dest(
        staging_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``.opguard-attempts.json`` is written inside the partial tree before DEST is published, from
    what the replay applied: a second read of SOURCE (which another user could change in between)
    would fail here, and a restore that fails leaves neither DEST nor the file."""
    from opguard.errors import ConfigError
    from opguard.staging import attempts as attempts_mod
    from opguard.staging import restore as restore_mod

    env = _env(staging_env)
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    assert _run(env).returncode == 0

    def no_second_read(*_a: object, **_k: object) -> None:
        raise AssertionError("provenance re-read SOURCE after the restore")

    monkeypatch.setattr(attempts_mod, "published_attempts", no_second_read)
    seen: list[bool] = []
    real_rename = restore_mod.rename_noreplace

    def rename(partial: Path, dest: Path) -> None:
        seen.append((partial / attempts_mod.PROVENANCE_FILE).is_file())  # present before publication
        real_rename(partial, dest)

    monkeypatch.setattr(restore_mod, "rename_noreplace", rename)
    report = restore_mod.materialize(target, tmp_path / "restored")
    assert seen == [True] and report.provenance == str(tmp_path / "restored" / attempts_mod.PROVENANCE_FILE)
    prov = json.loads(Path(report.provenance).read_text())
    assert prov["files"]["ranks/rank-000000/t.bin"] == {"attempt": 1, "node_id": "node-a",
                                                       "stream": "rank-000000", "sequence": 1}
    assert set(prov["files"]) == {f"ranks/rank-000000/{n}" for n in ("trace.jsonl", "t.bin")} | {
        f"nodes/node-a/{n}" for n in os.listdir(tmp_path / "restored" / "nodes" / "node-a")}

    def fail(*_a: object, **_k: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(attempts_mod, "atomic_replace_bytes", fail)
    with pytest.raises(ConfigError, match="No space left on device"):
        restore_mod.materialize(target, tmp_path / "restored-2")
    assert not (tmp_path / "restored-2").exists()
    assert not [p for p in os.listdir(tmp_path) if ".opguard-partial-" in p]


def test_leftover_capture_directory_is_refused_before_the_child(staging_env: dict[str, str],
                                                                 tmp_path: Path) -> None:
    env = _env(staging_env)
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    cap = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000" / "capture"
    cap.mkdir(parents=True)
    (cap / "meta.json").write_text("{}")
    before = tree_snapshot(target)
    marker = tmp_path / "child-ran"
    r = run_wrapper(["--no-countdown", "--capture", PY, "-c", f"open({str(marker)!r}, 'w')"],
                    {**env, "OPGUARD_CAPTURE_DIGEST": "md5"})
    assert r.returncode == 2, r.stderr
    assert f"{cap} already holds a capture" in r.stderr and "OPGUARD_CAPTURE_DIGEST" in r.stderr, r.stderr
    assert "2 problem(s)" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists() and tree_snapshot(target) == before
    (cap / "meta.json").unlink()
    r = run_wrapper(["--no-countdown", "--capture", PY, "-c", f"open({str(marker)!r}, 'w')"], env)
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stderr.splitlines() if "capture on:" in x]
    assert line == [f"opguard-run: capture on: level function, digest full, steps all, every op; traces go to "
                    f"{env['OPGUARD_LOCAL_DUMP_BASE']}/ranks/rank-*/capture/, published to {target}"], r.stderr


def test_command_interpreter_without_torch_is_refused(staging_env: dict[str, str], tmp_path: Path) -> None:
    venv = tmp_path / "no-torch"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    marker = tmp_path / "child-ran"
    r = run_wrapper(["--no-countdown", "--capture", str(venv / "bin" / "python"), "-c",
                     f"open({str(marker)!r}, 'w')"], _env(staging_env))
    assert r.returncode == 2, r.stderr
    assert f"{venv / 'bin' / 'python'} cannot import torch" in r.stderr and not marker.exists()


@pytest.mark.parametrize("flags", [["-I"], ["-E"], ["-u", "-S"], ["-uE"]])
def test_a_python_flag_that_skips_the_bootstrap_is_refused(staging_env: dict[str, str], tmp_path: Path,
                                                           flags: list[str]) -> None:
    """``python -I``/``-E`` ignore PYTHONPATH and ``-S`` skips site: capture's bootstrap never loads,
    and ``opguard-run --capture`` said "capture on", exited 0 and wrote no trace (hand test). It is
    refused before the command starts, naming the flag and the fix."""
    from opguard.launcher.capturecheck import python_flags

    marker = tmp_path / "child-ran"
    r = run_wrapper(["--no-countdown", "--capture", PY, *flags, "-c", f"open({str(marker)!r}, 'w')"],
                    _env(staging_env))
    assert r.returncode == 2, r.stderr
    bad = [f for f in python_flags([PY, *flags, "-c", ""]) if f in "IES"]
    assert f"with {' '.join('-' + f for f in bad)}: capture starts through PYTHONPATH's sitecustomize" in r.stderr
    assert "fix: drop" in r.stderr and not marker.exists()
    assert python_flags(["python3", "-W", "ignore", "-X", "dev", "-u", "train.py", "-I"]) == ["u"]
    assert python_flags(["python", "-Wignore", "-c", "-I"]) == [] and python_flags(["torchrun", "-I"]) == []


def test_clean_removes_only_sealed_and_verified_copies(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = _env(staging_env)
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    assert _run(env).returncode == 0
    rank = local / "ranks" / "rank-000000"
    with open(rank / "trace.jsonl", "ab") as f:  # an unpublished tail: written after the final drain
        f.write(b'{"late": 1}\n')
    snap = tree_snapshot(local)
    d = _opguard(env, "clean", "--dry-run")
    assert d.returncode == 5, d.stderr
    assert "would remove node-node-a" in d.stderr and "kept rank-000000" in d.stderr
    assert "changed after it was published" in d.stderr and "bytes" in d.stderr
    assert tree_snapshot(local) == snap, "--dry-run removed something"
    c = _opguard(env, "clean")
    assert c.returncode == 5, c.stderr
    assert not (local / "node").exists() and not (local / "state" / "streams" / "node-node-a").exists()
    assert (rank / "trace.jsonl").read_bytes().endswith(b'{"late": 1}\n')
    freed = int(c.stderr.split("stream(s), ")[1].split(" bytes")[0])
    assert freed > 0
    # after a sync publishes the tail (the stream is sealed again), the copy goes
    assert _opguard(env, "sync", "--rank", "0", "--final").returncode == 0
    assert _opguard(env, "clean").returncode == 0
    assert not rank.exists() and not (local / "state" / "streams" / "rank-000000").exists()
    v = _opguard(env, "verify", "--require-sealed", str(target))
    assert v.returncode == 0, v.stderr


def test_clean_rechecks_the_target(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = _env(staging_env)
    target = Path(env["OPGUARD_LOCAL_DUMP_TARGET"])
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    assert _run(env).returncode == 0
    batch = next((target / ".opguard-bundles" / "streams" / "rank-000000").glob("*.ogb"))
    data = bytearray(batch.read_bytes())
    data[40] ^= 0xFF  # damaged on the shared copy: the local one is the only good copy left
    batch.chmod(0o644)
    batch.write_bytes(bytes(data))
    c = _opguard(env, "clean")
    assert c.returncode == 5 and "kept rank-000000" in c.stderr and "does not match the digest" in c.stderr
    assert (local / "ranks" / "rank-000000" / "trace.jsonl").exists()


@pytest.mark.parametrize("tail", [False, True])
def test_clean_local_after_the_drain(staging_env: dict[str, str], tail: bool) -> None:
    env = _env(staging_env)
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    # an incomplete last line is never published: with it the rank's copy must stay
    code = WRITE + ("open(__import__('opguard.staging.writers').staging.writers.rank_dir() / 'trace.jsonl', "
                    "'ab').write(b'{\"partial\": ')\n" if tail else "")
    r = _run(env, "--clean-local", code=code)
    assert r.returncode == 0, r.stderr
    assert "opguard-run: clean: removed node-node-a" in r.stderr
    assert (local / "ranks" / "rank-000000").exists() == tail
    if tail:
        assert "kept rank-000000" in r.stderr and "incomplete last line" in r.stderr
    else:
        assert "removed rank-000000" in r.stderr


def test_clean_is_refused_while_a_wrapper_runs_on_the_base(staging_env: dict[str, str], tmp_path: Path) -> None:
    env = _env(staging_env)
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"])
    assert _run(env).returncode == 0  # a sealed run: everything in it looks published
    out = tmp_path / "out"
    second = spawn(["--no-countdown", "--resume", PY, PROG, str(out), "wait", "0"], env)
    try:
        wait_for(lambda: (out / "ready").exists(), 60, "the second attempt's program")
        # the program keeps writing: compare the paths, not contents; the running uploader's own
        # hidden temporaries (.opguard-tmp-*, renamed into place by it) come and go by design
        def paths() -> set[str]:       # names only: a temporary may vanish between listing and reading
            return {os.path.relpath(os.path.join(d, n), local) for d, ds, fs in os.walk(local) for n in (*ds, *fs)
                    if not n.startswith(".opguard-tmp-")}
        before = paths()
        c = _opguard(env, "clean")
        assert c.returncode == 2 and "an opguard-run is running on this local base" in c.stderr, c.stderr
        assert before <= paths(), "clean removed something under a running job"
    finally:
        (out / "release").write_text("1")
        second.communicate(timeout=120)
    assert second.returncode == 0
    assert _opguard(env, "clean").returncode in (0, 5)  # after the job: allowed
