"""Signals and exit codes with real processes: the wrapper, its child, grandchildren, real syncs."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.launcher.helpers import OPGUARD, OPGUARD_RUN, PY, default_signals, pid_alive, spawn, wait_for

PROG = str(Path(__file__).parent / "progs" / "sigchild.py")


def start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return spawn(args, env)


def restore(env: dict[str, str], dest: Path) -> Path:
    r = subprocess.run([OPGUARD, "materialize", env["OPGUARD_LOCAL_DUMP_TARGET"], str(dest)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dest


def report(env: dict[str, str], stream: str = "rank-000000") -> dict[str, object]:
    path = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "state" / "launcher" / f"{stream}.json"
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize("code", [0, 1, 7])
def test_exit_codes_preserved(staging_env: dict[str, str], code: int) -> None:
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    r = subprocess.run([OPGUARD_RUN, PY, "-c", f"import sys; print('out'); sys.exit({code})"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code
    assert r.stdout == "out\n"  # the child's stdout passes through untouched


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGABRT, signal.SIGSEGV])
def test_signal_death_is_128_plus_signal(staging_env: dict[str, str], sig: signal.Signals) -> None:
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    r = subprocess.run([OPGUARD_RUN, PY, "-c", f"import os; os.kill(os.getpid(), {int(sig)})"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 128 + sig


def test_exit_code_preserved_with_staging_and_failing_sync(staging_env: dict[str, str], tmp_path: Path) -> None:
    """A sync that fails (target removed under it) is reported, never changes the exit code."""
    out = tmp_path / "out"
    p = start(staging_env, PY, PROG, str(out), "wait", "7")
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    target = Path(staging_env["OPGUARD_LOCAL_DUMP_TARGET"])
    wait_for(lambda: (target / ".opguard-bundles" / "format.json").exists(), 60, "the first sync")
    os.rename(target, tmp_path / "moved-away")
    target.write_text("not a directory any more")  # every later sync fails, none can recreate it
    (out / "release").write_text("1")
    _stdout, err = p.communicate(timeout=120)
    assert p.returncode == 7, err
    assert "FAILED" in err and "drain failed" in err
    doc = report(staging_env)
    assert doc["exit_code"] == 7 and doc["drain"]["status"] == "failed"  # type: ignore[index]


def test_sigterm_forwarded_everything_published_exit_code_is_childs(staging_env: dict[str, str],
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}  # only the drain publishes
    p = start(env, PY, PROG, str(out), "term-exit")
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start writing")
    p.send_signal(signal.SIGTERM)
    _stdout, err = p.communicate(timeout=120)
    assert p.returncode == 3, err  # the child's own exit code, not 143 and not 0
    assert (out / "signals.txt").read_text().split() == ["SIGTERM"]
    assert "final drain requested (SIGTERM)" in err and "drain complete" in err
    assert "opguard-run: drain: rank-000000: published batch 1" in err  # drain progress lines
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000" / "trace.jsonl"
    restored = restore(env, tmp_path / "restored") / "ranks" / "rank-000000" / "trace.jsonl"
    assert restored.read_bytes() == local.read_bytes()
    assert json.loads(restored.read_bytes().splitlines()[-1])["event"] == "SIGTERM"
    doc = report(env)
    assert doc["drain"]["status"] == "complete" and "rank-000000" in doc["drain"]["sealed_streams"]  # type: ignore[index]
    assert doc["signals"][0]["signal"] == "SIGTERM" and doc["signals"][0]["forwarded"]  # type: ignore[index]


def test_forwarded_signals_reach_the_child(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    p = start(env, PY, PROG, str(out), "wait", "0")
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    sent = [signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2]
    def received(n: int) -> bool:
        return (out / "signals.txt").exists() and len((out / "signals.txt").read_text().split()) == n

    for i, s in enumerate(sent):
        p.send_signal(s)
        wait_for(functools.partial(received, i + 1), 30, f"{s.name} at the child")
    (out / "release").write_text("1")
    p.communicate(timeout=60)
    assert p.returncode == 0
    assert (out / "signals.txt").read_text().split() == [s.name for s in sent]


def test_warning_signal_starts_drain_early_and_is_consumed(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
    p = start(env, PY, PROG, str(out), "wait", "0")
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    seal_dir = Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams" / "rank-000000"
    assert not seal_dir.exists()
    p.send_signal(signal.SIGUSR1)
    # the drain publishes and seals while the child is still running
    wait_for(lambda: any(seal_dir.glob("*.seal")) if seal_dir.exists() else False, 60, "an early seal")
    child_pid = int((out / "child.pid").read_text())
    assert pid_alive(child_pid)
    (out / "release").write_text("1")
    _stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err  # USR1 was not forwarded: python would have died of it (138)
    assert not (out / "signals.txt").exists()
    assert "warning signal SIGUSR1" in err
    seals = sorted(seal_dir.glob("*.seal"))
    # the early drains' seals (the child kept writing, so drains ran back to back) and the final one
    assert len(seals) >= 2
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000" / "trace.jsonl"
    restored = restore(env, tmp_path / "restored") / "ranks" / "rank-000000" / "trace.jsonl"
    assert restored.read_bytes() == local.read_bytes()


def test_after_the_warning_drains_run_back_to_back_and_seal_only_new_data(staging_env: dict[str, str],
                                                                            tmp_path: Path) -> None:
    """After USR1 the wrapper keeps draining until the command exits (the periodic interval is an
    hour here, so only continuous drains can publish); drains that find nothing new write no seal."""
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
    p = start(env, "--verbose", PY, PROG, str(out), "wait", "0")
    lines: list[str] = []
    stderr = p.stderr
    assert stderr is not None

    def read() -> None:
        lines.extend(iter(stderr.readline, ""))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    seal_dir = Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams" / "rank-000000"

    def seals() -> list[Path]:
        return sorted(seal_dir.glob("*.seal")) if seal_dir.exists() else []

    def drain_starts() -> int:
        return sum(1 for x in list(lines) if x.startswith("opguard-run: starting sync") and "--final" in x)

    p.send_signal(signal.SIGUSR1)
    # the child writes all the time: every drain publishes something new and seals it
    wait_for(lambda: len(seals()) >= 3, 90, "three seals from back-to-back drains while the command runs")
    assert pid_alive(int((out / "child.pid").read_text()))
    (out / "pause").write_text("1")
    wait_for(lambda: (out / "paused").exists(), 30, "the child to stop writing")
    after_pause = drain_starts()
    # the drain running at the pause may still publish; the one after it sees everything
    wait_for(lambda: drain_starts() >= after_pause + 2, 60, "two more drains after the pause")
    settled = len(seals())
    wait_for(lambda: drain_starts() >= after_pause + 4, 60, "two drains that find nothing new")
    assert len(seals()) == settled  # nothing new published: no extra seal
    assert pid_alive(int((out / "child.pid").read_text()))
    (out / "pause").unlink()
    (out / "release").write_text("1")
    assert p.wait(timeout=120) == 0
    reader.join(30)
    err = "".join(lines)
    assert "drain complete" in err, err
    assert len(seals()) == settled + 1  # the last final drain after the child's "released" record
    after_warning = err.split("final drain requested (warning signal SIGUSR1)", 1)[1]
    assert "sync #" not in after_warning  # no periodic sync after the warning: drains only
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000" / "trace.jsonl"
    restored = restore(env, tmp_path / "restored") / "ranks" / "rank-000000" / "trace.jsonl"
    assert restored.read_bytes() == local.read_bytes()


def test_warning_forwarded_only_when_asked(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    p = start(env, "--forward-warning", PY, PROG, str(out), "wait", "0")
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    p.send_signal(signal.SIGUSR1)
    p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGUSR1  # the child had no handler for it: its death is reported


def test_child_ignoring_sigterm_is_killed_with_its_whole_tree(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = start(staging_env, "--kill-grace", "1", PY, PROG, str(out), "ignore")
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    child = int((out / "child.pid").read_text())
    grandchild = int((out / "grandchild.pid").read_text())
    p.send_signal(signal.SIGTERM)
    _stdout, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGKILL, err
    assert "SIGKILL" in err
    assert not pid_alive(child) and not pid_alive(grandchild)
    assert report(staging_env)["killed"] is True


def test_orphaned_grandchild_does_not_outlive_the_wrapper(staging_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    r = subprocess.run([OPGUARD_RUN, "--kill-grace", "1", PY, PROG, str(out), "orphan", "5"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 5, r.stderr
    grandchild = int((out / "grandchild.pid").read_text())
    assert not pid_alive(grandchild)
    assert "left in its tree" in r.stderr


def test_a_process_that_exits_with_the_command_is_not_a_leftover(staging_env: dict[str, str]) -> None:
    """multiprocessing's resource tracker (started by any spawn-context lock or queue: every
    ``torch.multiprocessing.spawn`` program) exits when it reads EOF from the command, a few
    milliseconds after the command. It was announced as 'terminating 1 process(es) left in its tree'
    on every such run; now what exits on its own within LEFTOVER_SETTLE_S is no leftover."""
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    code = ("import multiprocessing as mp, os, sys\n"
            "mp.get_context('spawn').Lock()\n"
            "from multiprocessing import resource_tracker as rt\n"
            "print(rt._resource_tracker._pid, flush=True)\n"
            "sys.exit(3)\n")
    r = subprocess.run([OPGUARD_RUN, PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    tracker = int(r.stdout.split()[0])
    assert not pid_alive(tracker)
    assert "left in its tree" not in r.stderr, r.stderr


def test_bad_signal_option(staging_env: dict[str, str]) -> None:
    r = subprocess.run([OPGUARD_RUN, "--forward-signals", "TERM,KILL", PY, "-c", "pass"], env=staging_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "SIGKILL cannot be caught" in r.stderr


def test_sigterm_not_forwarded_still_drains(staging_env: dict[str, str], tmp_path: Path) -> None:
    """--forward-signals without TERM: the wrapper still drains at once; the child is not signalled."""
    out = tmp_path / "out"
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600"}
    p = start(env, "--forward-signals", "INT", PY, PROG, str(out), "wait", "4")
    wait_for(lambda: (out / "ready").exists(), 60, "the child to start")
    seal_dir = Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles" / "streams" / "rank-000000"
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: any(seal_dir.glob("*.seal")) if seal_dir.exists() else False, 60, "the drain's seal")
    (out / "release").write_text("1")
    _o, err = p.communicate(timeout=120)
    assert p.returncode == 4, err
    assert not (out / "signals.txt").exists()
    assert "received SIGTERM: not forwarded (--forward-signals)" in err


def test_warning_during_preflight_is_kept_not_fatal(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Slurm's --signal can arrive while the preflight still reads shared storage. Its default action
    would kill the wrapper; instead it is recorded and starts the drain as soon as the command runs.
    The preflight is held deterministically: the target's format.json is a FIFO until we answer it."""
    env = staging_env
    bundles = Path(env["OPGUARD_LOCAL_DUMP_TARGET"]) / ".opguard-bundles"
    bundles.mkdir()
    fifo = bundles / "format.json"
    os.mkfifo(fifo)
    doc = json.dumps({"format": "opguard-bundles", "version": 2, "run_id": "experiment-001",
                      "created_at": 0.0, "created_by": "test"}).encode()
    p = start(env, PY, "-c", "import time; time.sleep(3)")

    fds: list[int] = []

    def reader_waiting() -> bool:
        """Opening the write end without blocking succeeds only while a reader (the preflight) waits."""
        try:
            fds.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            return p.poll() is not None
        return True

    wait_for(reader_waiting, 30, "the preflight to open format.json")
    assert p.poll() is None and fds
    os.kill(p.pid, signal.SIGUSR1)
    regular = bundles / "format.json.regular"
    regular.write_bytes(doc)
    os.set_blocking(fds[0], True)
    os.write(fds[0], doc)
    os.replace(regular, fifo)  # later readers (the syncs) see a regular file
    os.close(fds[0])
    _out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "received SIGUSR1" in err
    drain = report(env)["drain"]
    assert isinstance(drain, dict) and "USR1" in str(drain.get("reason")), drain


WRITE_AND_EXIT = """
import base64, os
from opguard.staging.writers import open_jsonl
t = open_jsonl("trace.jsonl")
for i in range(48):  # ~3 MiB that zstd cannot shrink much: the drain takes seconds at 1 MiB/s
    t.write({"i": i, "blob": base64.b64encode(os.urandom(48 * 1024)).decode()})
t.close()
"""


def test_a_step_wide_warning_signal_does_not_kill_the_drain(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Slurm delivers a step's signals to every process of the step, the wrapper's syncs included
    (the batch script forwards --signal=B:USR1@N to the step): the final drain must survive the
    warning it was started for. The CI failure this pins: 'final drain FAILED (exit 138)'."""
    psutil = pytest.importorskip("psutil")
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL": "3600", "OPGUARD_SYNC_MBPS": "1"}
    p = start(env, PY, "-c", WRITE_AND_EXIT)

    def final_sync() -> list[object]:
        try:
            kids = psutil.Process(p.pid).children()
        except psutil.NoSuchProcess:
            return []
        found = []
        for k in kids:
            try:
                if "--final" in k.cmdline():
                    found.append(k)
            except psutil.Error:  # a child that exited between the listing and the read (a periodic sync)
                continue
        return found

    wait_for(lambda: bool(final_sync()) or p.poll() is not None, 60, "the final drain to start")
    syncs = final_sync()
    assert syncs, "the wrapper exited before its final drain could be signalled"
    sync = syncs[0]
    # set before exec, so from its first instruction: nice 19, idle I/O, the step's signals ignored
    assert sync.nice() == 19
    io = sync.ionice()
    assert io.ioclass == psutil.IOPRIO_CLASS_IDLE or (io.ioclass == psutil.IOPRIO_CLASS_BE and io.value == 7), io
    ignored = int(next(x for x in Path(f"/proc/{sync.pid}/status").read_text().splitlines()
                       if x.startswith("SigIgn:")).split()[1], 16)
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):
        assert ignored >> (int(s) - 1) & 1, f"{s.name} is not ignored by the sync"
    for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):  # as slurmstepd would
        sync.send_signal(s)
    p.send_signal(signal.SIGUSR1)
    _stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "drain complete" in err and "FAILED" not in err, err
    local = Path(env["OPGUARD_LOCAL_DUMP_BASE"]) / "ranks" / "rank-000000" / "trace.jsonl"
    restored = restore(env, tmp_path / "restored") / "ranks" / "rank-000000" / "trace.jsonl"
    assert restored.read_bytes() == local.read_bytes()


_DISPOSITIONS = ("import json, signal; print(json.dumps({n: str(signal.getsignal(getattr(signal, n))) "
                 "for n in ('SIGINT', 'SIGHUP', 'SIGTERM', 'SIGQUIT')}))")


def _ignoring(*sigs: signal.Signals) -> None:  # preexec: what `nohup` or `trap '' INT` leave the command
    for s in sigs:
        signal.signal(s, signal.SIG_IGN)


def test_signals_ignored_by_whoever_started_the_wrapper_stay_ignored(staging_env: dict[str, str]) -> None:
    """``nohup opguard-run ... &`` (or a shell with ``trap '' INT``): the wrapper replaced the
    inherited SIG_IGN with its forwarding handlers, so the command got the default dispositions back
    (SIG_IGN survives exec, a handler does not): a SIGHUP killed it where ``nohup python ...`` keeps
    running, and an ignored SIGINT became a KeyboardInterrupt (hand test). An ignored signal now
    stays ignored, for the wrapper and the command."""
    env = {**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}
    pre = functools.partial(_ignoring, signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT)
    plain = subprocess.run([PY, "-c", _DISPOSITIONS], env=env, capture_output=True, text=True, timeout=60,
                           preexec_fn=pre)
    wrapped = subprocess.run([OPGUARD_RUN, PY, "-c", _DISPOSITIONS], env=env, capture_output=True, text=True,
                             timeout=60, preexec_fn=pre)
    assert wrapped.returncode == 0, wrapped.stderr
    assert json.loads(wrapped.stdout) == json.loads(plain.stdout) == dict.fromkeys(
        ("SIGINT", "SIGHUP", "SIGTERM", "SIGQUIT"), str(signal.SIG_IGN))
    # and a default disposition is still the wrapper's to forward: the command gets Python's own
    unset = subprocess.run([OPGUARD_RUN, PY, "-c", _DISPOSITIONS], env=env, capture_output=True, text=True,
                           timeout=60, preexec_fn=default_signals)
    assert json.loads(unset.stdout)["SIGINT"] == "<built-in function default_int_handler>", unset.stdout
