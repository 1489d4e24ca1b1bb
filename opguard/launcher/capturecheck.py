"""``opguard-run --capture``: what capture would refuse at ``import torch``, checked before the command
starts (``docs/capture.md`` §1), and the one line per node that says capture is on.

No torch import: the options come from :mod:`opguard.capture.options`; whether the child's
interpreter has torch is asked of that interpreter (``importlib.util.find_spec``, which does not
import it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from opguard.errors import ConfigError
from opguard.launcher.identity import Identity
from opguard.staging.config import StagingConfig
from opguard.staging.layout import CAPTURE_DIRNAME, CAPTURE_META_FILE, RANK_STREAM_PREFIX, RANKS_DIRNAME, Layout

_PYTHON_RE = re.compile(r"^python[0-9.]*$")
FIND_TORCH = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"
PROBE_TIMEOUT_S = 30.0


def _options_problem(env: Mapping[str, str]) -> ConfigError | None:
    from opguard.capture.bootstrap import child_env

    try:
        child_env(env)
    except ConfigError as e:
        return e
    return None


def capture_root(config: StagingConfig | None) -> Path | None:
    """Where the rank directories (and so the capture directories) of this node live."""
    if config is None:
        return None
    if config.enabled:
        return config.local_base
    return config.output_base


def _rank_dirs(config: StagingConfig, identity: Identity) -> list[Path]:
    layout = Layout(config)
    ranks = identity.owned_ranks()
    if ranks is not None:
        return [layout.rank_dir(r) for r in ranks]
    root = capture_root(config)
    assert root is not None
    try:
        return sorted(p for p in (root / RANKS_DIRNAME).iterdir() if p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _leftovers(config: StagingConfig | None, identity: Identity) -> list[ConfigError]:
    if config is None:
        return []  # the configuration's own problems are reported
    if capture_root(config) is None:
        return [ConfigError("--capture needs somewhere to write: OPGUARD_TRACE_OUTPUT_BASE is not set and local "
                            "staging is off", "export OPGUARD_TRACE_OUTPUT_BASE=/absolute/path (or enable staging)")]
    held = [d / CAPTURE_DIRNAME for d in _rank_dirs(config, identity)
            if (d / CAPTURE_DIRNAME / CAPTURE_META_FILE).exists()]
    if not held:
        return []
    more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
    return [ConfigError(f"{held[0]}{more} already holds a capture ({CAPTURE_META_FILE}) from an earlier run: "
                        "capture would refuse it in every process at `import torch`, after the job started",
                        "use a new OPGUARD_TRACE_OUTPUT_BASE / OPGUARD_LOCAL_DUMP_TARGET and a fresh "
                        "OPGUARD_LOCAL_DUMP_BASE for every captured run (or remove the old capture directories)")]


def child_interpreter(cmd: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The Python interpreter the command runs, where that can be told: the command itself when it
    is ``python*``, else the interpreter of its ``#!`` line when that is ``python*``; else None."""
    if not cmd:
        return None
    exe = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0], path=env.get("PATH", os.defpath))
    if exe is None:
        return None
    if _PYTHON_RE.match(os.path.basename(exe)):
        return exe
    try:
        with open(exe, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    if not parts:
        return None
    interp = parts[0]
    if os.path.basename(interp) == "env" and len(parts) > 1:
        found = shutil.which(parts[1], path=env.get("PATH", os.defpath))
        interp = found if found is not None else parts[1]
    return interp if _PYTHON_RE.match(os.path.basename(interp)) and os.path.isfile(interp) else None


def _torch_problem(cmd: Sequence[str], env: Mapping[str, str]) -> ConfigError | None:
    interp = child_interpreter(cmd, env)
    if interp is None:
        return None
    try:
        proc = subprocess.run([interp, "-c", FIND_TORCH], env=dict(env), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None  # cannot tell: the child says it itself
    if proc.returncode != 3:
        return None
    return ConfigError(f"--capture: the command's interpreter {interp} cannot import torch: there is nothing to "
                       "capture", "run the command with the Python of the training environment (the virtualenv "
                       "that has torch), or drop --capture")


# interpreter flags that skip what capture loads through: PYTHONPATH (-E, -I) or site, which runs
# the bootstrap's sitecustomize (-S, -I)
_SKIPS_BOOTSTRAP = {"I": "ignores PYTHONPATH and site-packages' user site", "E": "ignores PYTHONPATH",
                    "S": "does not import site (nor its sitecustomize)"}


def python_flags(cmd: Sequence[str]) -> list[str]:
    """The single-letter options a ``python*`` command gives its interpreter before the script,
    ``-c`` or ``-m`` (``-IE`` gives ``I`` and ``E``); [] for any other command."""
    if not cmd or not _PYTHON_RE.match(os.path.basename(cmd[0])):
        return []
    out: list[str] = []
    args = list(cmd[1:])
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or a == "-" or not a.startswith("-") or a.startswith("--"):
            break  # the script, stdin, or a long option (--version, --help: nothing runs)
        letters = a[1:]
        for k, ch in enumerate(letters):
            if ch in "cm":
                return out
            if ch in "WX":  # takes a value: the rest of this argument, or the next one
                if k == len(letters) - 1:
                    i += 1
                break
            out.append(ch)
        i += 1
    return out


def _flags_problem(cmd: Sequence[str]) -> ConfigError | None:
    bad = [f for f in dict.fromkeys(python_flags(cmd)) if f in _SKIPS_BOOTSTRAP]
    if not bad:
        return None
    why = "; ".join(f"-{f} {_SKIPS_BOOTSTRAP[f]}" for f in bad)
    flags = " ".join("-" + f for f in bad)
    return ConfigError(f"--capture: the command runs {os.path.basename(cmd[0])} with {flags}: capture starts "
                       f"through PYTHONPATH's sitecustomize, which that skips ({why}): the program would run "
                       "uncaptured", f"drop {flags} from the command, or start capture in the program itself "
                       "(opguard.capture.capture(), docs/capture.md §1) under opguard-run without --capture")


def capture_problems(cmd: Sequence[str], env: Mapping[str, str], config: StagingConfig | None,
                     identity: Identity) -> list[ConfigError]:
    """Bad capture options, a leftover capture directory, an interpreter flag that skips the
    bootstrap (``python -I``/``-E``/``-S``), no torch in the child's interpreter."""
    problems = [p for p in (_options_problem(env), _flags_problem(cmd)) if p is not None]
    problems += _leftovers(config, identity)
    torch = _torch_problem(cmd, env)
    if torch is not None:
        problems.append(torch)
    return problems


def start_line(env: Mapping[str, str], config: StagingConfig | None) -> str:
    """``opguard-run: capture on: ...`` (level, digest mode, selection, where traces go)."""
    from opguard.capture.options import CaptureOptions

    o = CaptureOptions.from_env(env)
    sel = [f"{k}={','.join(v)}" for k, v in (("functions", o.functions), ("modules", o.modules),
                                              ("contexts", o.contexts)) if v]
    selection = f"steps {o.steps}, " + (" ".join(sel) if sel else "every op")
    root = capture_root(config)
    where = (f"{root}/{RANKS_DIRNAME}/{RANK_STREAM_PREFIX}*/{CAPTURE_DIRNAME}/" if root is not None
             else "(nowhere: not configured)")
    if config is not None and config.enabled:
        where += f", published to {config.target}"
    dumps = f", tensor dumps at steps {o.dump_steps}" if str(o.dump_steps) != "none" else ""
    line = f"opguard-run: capture on: level {o.level}, digest {o.digest}, {selection}{dumps}; traces go to {where}"
    if o.level == "dispatch":  # the one level that changes results: say it before the program runs
        line += ("\nopguard-run: note: under level dispatch PyTorch computes some operations differently (prod's "
                 "backward, linalg.eigvalsh, svdvals, matrix norms, lstsq: the last bits can differ from an "
                 "uncaptured run; docs/capture.md §4); the default level function does not")
    return line
