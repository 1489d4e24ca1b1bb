"""Creating the run's directories: the target's and the local base's last component (``docs/format.md`` §1.1).

A fresh experiment directory is new by nature, so opguard creates it; a missing *parent* is a
typo or an unmounted filesystem, so it is refused, naming the parent. Creation is race-safe:
every node of a launch may try at once, and ``mkdir`` succeeds for exactly one of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from opguard.errors import ConfigError

TARGET_MODE = 0o755  # shared target: readable by whoever restores the run (the umask still applies)
LOCAL_BASE_MODE = 0o700  # node-local staging: private to the job's user


def creatable_problem(path: Path, var: str) -> ConfigError | None:
    """None when ``path`` is a directory or can be created by :func:`ensure_dir` (its parent is a
    directory); otherwise the refusal, naming what is missing. Reads only."""
    if path.is_dir():
        return None
    if os.path.lexists(path):
        return ConfigError(f"{var}={path} exists but is not a directory",
                           f"remove what is in its place or point {var} at a directory")
    parent = path.parent
    if not parent.is_dir():
        return ConfigError(
            f"{var}={path} does not exist and neither does its parent {parent} (opguard creates only the "
            "last component: a missing parent is a typo or an unmounted filesystem)",
            f"fix {var}, mount the filesystem, or create the parent (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        return ConfigError(f"{var}={path} does not exist and its parent {parent} is not writable by this user",
                           f"create {path} yourself, fix the parent's permissions, or choose another {var}")
    return None


def ensure_dir(path: Path, var: str, mode: int) -> bool:
    """Make ``path`` a directory: create its last component with ``mode`` when the parent exists.

    True when this call created it. Another process creating it at the same moment is not an error
    (``FileExistsError`` is followed by a check that it is a directory). Raises ConfigError."""
    problem = creatable_problem(path, var)
    if problem is not None:
        raise problem
    if path.is_dir():
        return False
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if path.is_dir():
            return False
        raise ConfigError(f"{var}={path} appeared as something other than a directory",
                          f"remove it or point {var} at a directory") from None
    except OSError as e:
        raise ConfigError(f"cannot create {var}={path}: {e.strerror or e}",
                          f"create it yourself (mkdir {path}) or choose another {var}") from None
    return True


def make_dest_parents(source: Path, dest: Path) -> list[Path]:
    """``materialize``: create the restore destination's missing parents (``mkdir -p``), unless
    DEST lies inside SOURCE (refused here, before anything is created in a run's output).
    Returns the directories created."""
    dest = Path(os.path.abspath(dest))
    real_src = Path(os.path.abspath(source)).resolve()
    missing: list[Path] = []
    p = dest.parent
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    if not missing:
        return []
    if p.resolve() == real_src or real_src in p.resolve().parents:
        raise ConfigError(f"restore destination {dest} is inside the source {source}",
                          "choose a destination outside the source directory")
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"cannot create {d}, a parent of the restore destination {dest}: {e.strerror or e}",
                              "choose a destination under a writable directory") from None
    return list(reversed(missing))
