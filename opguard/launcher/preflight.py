"""Every check before the child starts, collected (not stopped at the first problem).

Nothing here writes to shared storage; the node claim is only *read* (``claim.py`` creates it
after every check has passed). Problems are :class:`~opguard.errors.ConfigError` s (exit 2).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from opguard.errors import ConfigError, OpguardError
from opguard.launcher.claim import claim_problem, node_duty_problem
from opguard.launcher.identity import Identity, resolve
from opguard.launcher.mounts import MOUNTINFO, filesystem_of, is_network_fstype
from opguard.staging.config import StagingConfig
from opguard.staging.dirs import creatable_problem
from opguard.staging.layout import Layout, node_stream, rank_stream

_VAR_RE = re.compile(r"^(OPGUARD_[A-Z_]+)")
# Required variables: a problem with one of these cannot be worked around to look further.
_REQUIRED = {"OPGUARD_LOCAL_DUMP_TARGET", "OPGUARD_LOCAL_DUMP_BASE", "OPGUARD_TRACE_OUTPUT_BASE",
             "OPGUARD_LOCAL_DUMP_ENABLED"}


@dataclass
class Preflight:
    """The outcome: config (None when it could not be built), identity, and every problem."""

    config: StagingConfig | None
    identity: Identity
    problems: list[ConfigError] = field(default_factory=list)
    local_fstype: str | None = None
    free_bytes: int | None = None
    expected_mib_s: float | None = None  # OPGUARD_EXPECTED_MBPS: new data per node, for the plan's sizing
    attempt_how: str | None = None  # why this attempt may start (opguard.staging.attempts); staging only

    @property
    def ok(self) -> bool:
        return not self.problems


def load_config(env: Mapping[str, str]) -> tuple[StagingConfig | None, list[ConfigError]]:
    """Build the config, collecting one problem per bad optional variable (each is then defaulted)."""
    work = dict(env)
    problems: list[ConfigError] = []
    for _ in range(16):
        try:
            return StagingConfig.from_env(work), problems
        except ConfigError as e:
            problems.append(e)
            m = _VAR_RE.match(e.message)
            var = m.group(1) if m else None
            if var is None or var in _REQUIRED or var not in work:
                return None, problems
            del work[var]  # look past it: the default stands in while we check the rest
    return None, problems


EXPECTED_RATE_VAR = "OPGUARD_EXPECTED_MBPS"


def expected_rate(env: Mapping[str, str]) -> tuple[float | None, ConfigError | None]:
    """``OPGUARD_EXPECTED_MBPS``: MiB/s of new trace data one node writes (all its ranks together).
    Optional; the plan derives the warning time from it. Unset or empty: None."""
    raw = env.get(EXPECTED_RATE_VAR, "").strip()
    if not raw:
        return None, None
    fix = (f"set {EXPECTED_RATE_VAR} to the MiB/s of trace data one node writes, all its ranks together "
           f"(a number > 0, e.g. 20), or unset it")
    try:
        value = float(raw)
    except ValueError:
        return None, ConfigError(f"{EXPECTED_RATE_VAR}={raw!r} is not a number", fix)
    if not math.isfinite(value) or value <= 0:
        return None, ConfigError(f"{EXPECTED_RATE_VAR}={raw!r} must be a finite number > 0", fix)
    return value, None


def _probe_writable(base: Path) -> str | None:
    try:
        fd, name = tempfile.mkstemp(prefix=".opguard-tmp-preflight-", dir=base)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(name)
    return None


def check_local_base(config: StagingConfig, mountinfo: Path = MOUNTINFO) -> tuple[list[ConfigError], str | None,
                                                                                   int | None]:
    """Missing parent, unwritable, network filesystem, out of space (free < one batch). A missing base
    whose parent exists is fine (the wrapper creates it); its parent is checked instead."""
    base = config.local_base
    assert base is not None
    problems: list[ConfigError] = []
    missing = creatable_problem(base, "OPGUARD_LOCAL_DUMP_BASE")
    if missing is not None:
        problems.append(missing)
        return problems, None, None
    if not base.is_dir():  # created after every check passed (docs/format.md §1.1): look at its parent now
        base = base.parent
    err = _probe_writable(base)
    if err is not None:
        problems.append(ConfigError(f"OPGUARD_LOCAL_DUMP_BASE={base} is not writable: {err}",
                                    "fix its permissions or point OPGUARD_LOCAL_DUMP_BASE at a writable "
                                    "node-local directory"))
    mount = filesystem_of(base, mountinfo)
    fstype = mount.fstype if mount else None
    if mount is not None and is_network_fstype(mount.fstype):
        problems.append(ConfigError(
            f"OPGUARD_LOCAL_DUMP_BASE={base} is on a {mount.fstype} filesystem ({mount.source} mounted at "
            f"{mount.mount_point}): staging must be node-local, or every node shares one staging area and "
            "small files hit shared storage after all",
            "point OPGUARD_LOCAL_DUMP_BASE at node-local disk (local SSD, /tmp, /dev/shm)"))
    st = os.statvfs(base)
    free = st.f_bavail * st.f_frsize
    if free < config.batch_bytes:
        problems.append(ConfigError(
            f"OPGUARD_LOCAL_DUMP_BASE={base} has {free / 2**20:.1f} MiB free, less than one batch "
            f"(OPGUARD_SYNC_BATCH_MB={config.batch_bytes // 2**20})",
            "free space on the node-local disk, choose another OPGUARD_LOCAL_DUMP_BASE, or lower "
            "OPGUARD_SYNC_BATCH_MB"))
    return problems, fstype, free


def owned_streams(identity: Identity) -> list[str]:
    """The streams this wrapper uploads that are known before the child starts."""
    ranks = identity.owned_ranks() or []
    streams = [rank_stream(r) for r in ranks]
    if identity.node_duty:
        streams.append(node_stream(identity.node_id))
    return streams


def check_target(config: StagingConfig, layout: Layout, streams: Sequence[str], local_ok: bool = True,
                 node_id: str | None = None) -> list[ConfigError]:
    """Run-identity problems of the target and the local state (read-only), via the uploader's own check."""
    from opguard.staging.target import check_target as uploader_check  # staging runs only (import cost)

    if not local_ok:
        streams = []  # the local base is unusable: only the target's identity can be checked
    try:
        uploader_check(config, layout, list(streams), node_id)
    except OpguardError as e:
        return [ConfigError(e.message, e.fix)]
    return []


def check_command(cmd: Sequence[str], env: Mapping[str, str]) -> list[ConfigError]:
    if not cmd:
        return [ConfigError("no command to run", "opguard-run [OPTIONS] COMMAND [ARGS...]")]
    exe = cmd[0]
    found = exe if os.sep in exe else shutil.which(exe, path=env.get("PATH", os.defpath))
    if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
        return [ConfigError(f"command {exe!r} not found or not executable (PATH={env.get('PATH', '')})",
                            "check the command name, PATH, or the virtualenv of the job")]
    return []


def run_preflight(cmd: Sequence[str], env: Mapping[str, str] | None = None, *, mountinfo: Path = MOUNTINFO,
                  hostname: str | None = None, resume: bool = False, capture: bool = False) -> Preflight:
    """All checks of ``opguard-run`` / ``--plan``; nothing is written to shared storage.

    ``resume``: ``--resume`` was given (a sealed run may be continued); ``capture``: ``--capture``
    was given (capture's own refusals are checked here, before the command starts)."""
    env = os.environ if env is None else env
    identity, id_problems = resolve(env, cmd, hostname)
    config, problems = load_config(env)
    pf = Preflight(config, identity, [*problems, *id_problems])
    pf.expected_mib_s, rate_problem = expected_rate(env)
    if rate_problem is not None:
        pf.problems.append(rate_problem)
    pf.problems.extend(check_command(cmd, env))
    if config is not None and config.enabled:
        _staging_checks(pf, config, mountinfo, env, resume)
    if capture:
        from opguard.launcher.capturecheck import capture_problems

        pf.problems.extend(capture_problems(cmd, env, config, identity))
    unique: dict[str, ConfigError] = {}
    for p in pf.problems:  # one variable can fail two checks with one message
        unique.setdefault(p.message, p)
    pf.problems = list(unique.values())
    return pf


def _staging_checks(pf: Preflight, config: StagingConfig, mountinfo: Path, env: Mapping[str, str],
                    resume: bool) -> None:
    identity = pf.identity
    layout = Layout(config)
    local, pf.local_fstype, pf.free_bytes = check_local_base(config, mountinfo)
    pf.problems.extend(local)
    pf.problems.extend(check_target(config, layout, owned_streams(identity), local_ok=not local,
                                    node_id=identity.node_id))
    claim = claim_problem(config, identity.node_id)
    if claim is not None:
        pf.problems.append(claim)
    if identity.node_duty and not local:
        duty = node_duty_problem(layout)
        if duty is not None:
            pf.problems.append(duty)
    if not local:  # a sealed run is continued only when asked (docs/format.md §4.1)
        from opguard.staging.attempts import decide

        pf.attempt_how, sealed = decide(config, layout, identity.node_id, env, resume)
        if sealed is not None:
            pf.problems.append(sealed)
