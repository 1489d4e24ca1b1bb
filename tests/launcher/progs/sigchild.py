"""A training-like child for the signal tests: appends records to its rank's trace, records the
signals it receives, and reacts to SIGTERM as told.

usage: sigchild.py OUT_DIR MODE [EXIT_CODE]
  MODE term-exit: on SIGTERM write a last record and exit 3
       ignore:    ignore SIGTERM (and spawn a grandchild in its own session that ignores it too)
       orphan:    spawn a grandchild in its own session, then exit EXIT_CODE at once
       wait:      run until OUT_DIR/release exists, then exit EXIT_CODE
                  (while OUT_DIR/pause exists it writes nothing and says so in OUT_DIR/paused)
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from opguard.staging.writers import open_jsonl

out = Path(sys.argv[1])
mode = sys.argv[2]
code = int(sys.argv[3]) if len(sys.argv) > 3 else 0
out.mkdir(parents=True, exist_ok=True)
trace = open_jsonl("trace.jsonl")
state = {"n": 0}


def note(name: str) -> None:
    with open(out / "signals.txt", "a") as f:
        f.write(name + "\n")


def on_signal(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    note(name)
    if signum == signal.SIGTERM and mode == "term-exit":
        trace.write({"i": state["n"], "event": "SIGTERM"})
        trace.close()
        os._exit(3)


for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2, signal.SIGTERM):
    signal.signal(s, on_signal)
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

grandchild = None
if mode in ("ignore", "orphan"):
    grandchild = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
        start_new_session=True)
    (out / "grandchild.pid").write_text(str(grandchild.pid))
(out / "child.pid").write_text(str(os.getpid()))
if mode == "orphan":
    os._exit(code)

while True:
    if (out / "pause").exists():
        (out / "paused").write_text(str(state["n"]))
    else:
        trace.write({"i": state["n"], "pad": "x" * 200})
        state["n"] += 1
    if state["n"] == 1:
        (out / "ready").write_text("1")
    if (out / "release").exists():
        break
    time.sleep(0.02)
trace.write({"i": state["n"], "event": "released"})
trace.close()
sys.exit(code)
