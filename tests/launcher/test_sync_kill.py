"""A sync the wrapper stops (``sidecar.kill_sync``) takes its stream workers with it, and the
wrapper, a child subreaper that inherits them, is left with no zombie of theirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from opguard.staging.writers import write_file_atomic
from tests.helpers.sync import rank_dir

SCRIPT = r"""
import ctypes, json, os, subprocess, sys, time
import psutil
from opguard.launcher.sidecar import kill_sync
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, as opguard-run is
decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the "command": untouched
proc = subprocess.Popen([sys.argv[1], "sync", "--all", "-q"], start_new_session=True)
deadline = time.monotonic() + 60
workers = []
while len(workers) < 2:  # its stream workers are running (polled: nothing to await)
    assert proc.poll() is None and time.monotonic() < deadline, "no stream workers appeared"
    workers = psutil.Process(proc.pid).children()
    time.sleep(0.01)
kill_sync(proc)
left = [(c.pid, c.status()) for c in psutil.Process().children() if c.pid != decoy.pid]
print(json.dumps({"sync_rc": proc.returncode, "workers": [w.pid for w in workers], "left": left,
                  "decoy_alive": decoy.poll() is None}))
decoy.kill()
decoy.wait()
"""


def test_killing_a_sync_kills_and_reaps_its_stream_workers(staging_env: dict[str, str]) -> None:
    for r in range(4):  # 4 streams, uploads of seconds each at 0.25 MiB/s: the sync is mid-way when killed
        write_file_atomic(rank_dir(staging_env, r) / "blob.bin", bytes(range(256)) * 4096 * 2)
    env = {**staging_env, "OPGUARD_SYNC_MBPS": "0.25"}
    opguard = str(Path(sys.executable).parent / "opguard")
    r = subprocess.run([sys.executable, "-c", SCRIPT, opguard], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["sync_rc"] == -9 and len(out["workers"]) == 2
    assert out["left"] == [], f"stream workers left behind in the wrapper: {out['left']}"
    assert out["decoy_alive"]  # the command's process was not touched
