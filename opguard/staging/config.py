"""The staging configuration: one frozen, validated object built from the environment.

Every problem names the variable, the bad value and the fix (see ``docs/format.md`` §1).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from opguard.errors import ConfigError

MIB = 1 << 20

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off", ""}
_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_LOOPBACK = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", "::1", "0.0.0.0"}

DEFAULT_SYNC_INTERVAL = 60.0
DEFAULT_BATCH_MB = 256
DEFAULT_MBPS = 32.0
DEFAULT_LOCK_TIMEOUT = 60.0
SYNC_WORKER_KINDS = ("auto", "processes", "threads")  # OPGUARD_SYNC_WORKERS (docs/protocol.md)


def env_bool(env: Mapping[str, str], name: str, default: bool, fix: str | None = None) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off/empty (any case); ConfigError otherwise."""
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean", fix or f"set {name} to 1 or 0")


def _path(env: Mapping[str, str], name: str, required: bool, why: str = "") -> Path | None:
    raw = env.get(name, "").strip()
    if not raw:
        if required:
            raise ConfigError(f"{name} is not set{why}", f"export {name}=/absolute/path")
        return None
    if not os.path.isabs(raw):
        raise ConfigError(
            f"{name}={raw!r} is not an absolute path (processes on different nodes and in "
            "different working directories would resolve it differently)",
            f"set {name} to an absolute path",
        )
    return Path(os.path.normpath(raw))


def _number(env: Mapping[str, str], name: str, default: float | None, *, integer: bool = False,
            minimum: float = 0.0, strict: bool = True) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={raw!r} is not {kind}", f"set {name} to {kind} like {default}") from None
    if not math.isfinite(value) or (value <= minimum if strict else value < minimum):
        cmp = ">" if strict else ">="
        raise ConfigError(f"{name}={raw!r} must be {cmp} {minimum:g}", f"set {name} to a value {cmp} {minimum:g}")
    return float(value)


def validate_identifier(name: str, value: str, what: str) -> str:
    """Check a node or run ID against ``docs/format.md`` §2; returns it unchanged."""
    if not value:
        raise ConfigError(f"{name} is empty: a {what} cannot be empty", f"set {name} to a stable, unique name")
    if not _ID_RE.match(value):
        raise ConfigError(
            f"{name}={value!r} is not a valid {what}: use 1-128 characters from [A-Za-z0-9._-], "
            "not starting with '.'",
            f"set {name} to e.g. {re.sub(r'[^A-Za-z0-9._-]', '-', value).lstrip('.')[:128] or 'node-1'!r}",
        )
    return value


def is_loopback_id(value: str) -> bool:
    """True for node IDs that name the local machine rather than one node of a cluster."""
    low = value.lower()
    return low in _LOOPBACK or low.startswith("127.") or low.startswith("localhost.")


def validate_node_id(name: str, value: str) -> str:
    validate_identifier(name, value, "node ID")
    if is_loopback_id(value):
        raise ConfigError(
            f"{name}={value!r} looks like a loopback name: every node would claim the same identity",
            "set OPGUARD_NODE_ID to the node's real, unique name (e.g. $SLURMD_NODENAME)",
        )
    return value


@dataclass(frozen=True)
class StagingConfig:
    """Validated staging settings (``docs/format.md`` §1)."""

    output_base: Path | None
    enabled: bool
    target: Path | None
    local_base: Path | None
    sync_interval: float
    batch_bytes: int
    mbps: float
    aggregate_mbps: float | None
    lock_timeout: float
    node_id: str | None
    run_id: str | None
    sync_workers: str = "auto"

    @property
    def rate_bytes_per_s(self) -> float:
        return self.mbps * MIB

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StagingConfig:
        env = os.environ if env is None else env
        enabled = env_bool(env, "OPGUARD_LOCAL_DUMP_ENABLED", False)
        why = " but OPGUARD_LOCAL_DUMP_ENABLED=1 needs it"
        output_base = _path(env, "OPGUARD_TRACE_OUTPUT_BASE", False)
        target = _path(env, "OPGUARD_LOCAL_DUMP_TARGET", enabled, why)
        local_base = _path(env, "OPGUARD_LOCAL_DUMP_BASE", enabled, why)
        if enabled:
            assert target is not None and local_base is not None
            if output_base is None:
                output_base = target
            if _contains(local_base, target) or _contains(target, local_base):
                raise ConfigError(
                    f"OPGUARD_LOCAL_DUMP_BASE={local_base} and OPGUARD_LOCAL_DUMP_TARGET={target} "
                    "contain each other: staging would upload into itself or write shared storage directly",
                    "point OPGUARD_LOCAL_DUMP_BASE at node-local disk (e.g. /local-ssd/opguard), "
                    "outside the shared target",
                )
        interval = _number(env, "OPGUARD_LOCAL_DUMP_SYNC_INTERVAL", DEFAULT_SYNC_INTERVAL)
        batch_mb = _number(env, "OPGUARD_SYNC_BATCH_MB", DEFAULT_BATCH_MB, integer=True)
        mbps = _number(env, "OPGUARD_SYNC_MBPS", DEFAULT_MBPS)
        aggregate = _number(env, "OPGUARD_SYNC_AGGREGATE_MBPS", None)
        lock_timeout = _number(env, "OPGUARD_SYNC_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT, strict=False)
        workers = env.get("OPGUARD_SYNC_WORKERS", "auto").strip().lower() or "auto"
        if workers not in SYNC_WORKER_KINDS:
            raise ConfigError(f"OPGUARD_SYNC_WORKERS={env['OPGUARD_SYNC_WORKERS']!r} is not a worker kind",
                              f"use one of {', '.join(SYNC_WORKER_KINDS)} (auto: forked processes where that "
                              "is safe, else threads)")
        node_id = env.get("OPGUARD_NODE_ID")
        if node_id is not None:
            node_id = validate_node_id("OPGUARD_NODE_ID", node_id.strip())
        run_id = env.get("OPGUARD_RUN_ID")
        if run_id is not None:
            run_id = validate_identifier("OPGUARD_RUN_ID", run_id.strip(), "run ID")
        else:
            root = target if enabled else output_base
            if root is not None:
                run_id = validate_identifier(
                    "OPGUARD_RUN_ID (defaulted from the basename of "
                    + ("OPGUARD_LOCAL_DUMP_TARGET" if enabled else "OPGUARD_TRACE_OUTPUT_BASE") + ")",
                    root.name, "run ID")
        assert interval is not None and batch_mb is not None and mbps is not None and lock_timeout is not None
        return cls(
            output_base=output_base, enabled=enabled, target=target, local_base=local_base,
            sync_interval=interval, batch_bytes=int(batch_mb) * MIB, mbps=mbps,
            aggregate_mbps=aggregate, lock_timeout=lock_timeout, node_id=node_id, run_id=run_id,
            sync_workers=workers,
        )

    def require_staging(self) -> tuple[Path, Path, str]:
        """(local_base, target, run_id) or a ConfigError saying staging is off."""
        if not self.enabled or self.local_base is None or self.target is None or self.run_id is None:
            raise ConfigError(
                "local staging is not enabled (OPGUARD_LOCAL_DUMP_ENABLED is not 1)",
                "export OPGUARD_LOCAL_DUMP_ENABLED=1 with OPGUARD_LOCAL_DUMP_TARGET and OPGUARD_LOCAL_DUMP_BASE",
            )
        return self.local_base, self.target, self.run_id


def _contains(outer: Path, inner: Path) -> bool:
    a = os.path.realpath(outer)
    b = os.path.realpath(inner)
    return b == a or b.startswith(a.rstrip(os.sep) + os.sep)
