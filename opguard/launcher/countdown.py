"""The scheduler's end time of the job, re-read every time (never cached): Slurm's ``squeue``.

A job's end time moves (``scontrol update TimeLimit``, preemption), so every check asks the
scheduler again. The final drain starts when the time left falls to what a drain of the
current backlog needs at the cap (``schedule.warning_seconds``: margin and floor included).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from datetime import datetime

from opguard.launcher import schedule


def job_id(env: Mapping[str, str]) -> str | None:
    jid = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "")).strip()
    return jid or None


def parse_end_time(text: str, now: float | None = None) -> float | None:
    """``squeue -o %e`` / scontrol ``EndTime=`` (local time, ISO); None for N/A, Unknown, empty."""
    raw = text.strip().splitlines()[0].strip() if text.strip() else ""
    if raw.startswith("EndTime="):
        raw = raw.split("=", 1)[1].split()[0]
    if not raw or raw.upper() in ("N/A", "UNKNOWN", "NONE", "INVALID"):
        return None
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        return None


def end_time(env: Mapping[str, str], timeout: float = 10.0) -> float | None:
    """The job's end time (epoch seconds) from ``squeue``, else ``scontrol show job``; None if unknown."""
    jid = job_id(env)
    if jid is None:
        return None
    for argv in (["squeue", "-h", "-j", jid, "-o", "%e"], ["scontrol", "show", "job", jid]):
        if shutil.which(argv[0], path=env.get("PATH")) is None:
            continue
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                                 env=dict(env))
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode != 0:
            continue
        text = out.stdout
        if argv[0] == "scontrol":
            for tok in text.split():
                if tok.startswith("EndTime="):
                    text = tok
                    break
        t = parse_end_time(text)
        if t is not None:
            return t
    return None


def lead_seconds(pending_bytes: float, cap_mib_s: float) -> float:
    """How long before the end the final drain must start."""
    return float(schedule.warning_seconds(pending_bytes, cap_mib_s))
