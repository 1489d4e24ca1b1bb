"""Capture options: one frozen, validated object from keywords and ``OPGUARD_CAPTURE_*`` variables.

No torch import here: the launcher builds the child environment from these options.
Every bad value names the variable (or keyword), the value and the fix (``docs/capture.md`` §1.1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from opguard.errors import ConfigError
from opguard.staging.config import FALSE_WORDS, TRUE_WORDS

LEVELS = ("function", "dispatch")
DIGEST_MODES = ("full", "sample", "xor", "none")
HOST_KERNELS = ("auto", "native", "torch")
OPTIMIZER_MODES = ("step", "ops")


@dataclass(frozen=True)
class StepSet:
    """``all`` or a union of inclusive ranges; ``None`` in ``ranges`` means every step."""

    ranges: tuple[tuple[int, int], ...] | None

    @classmethod
    def parse(cls, raw: str, what: str) -> StepSet:
        text = raw.strip().lower()
        if text in ("all", "*"):
            return cls(None)
        if text in ("", "none"):
            return cls(())
        out: list[tuple[int, int]] = []
        for part in text.split(","):
            part = part.strip()
            try:
                if "-" in part:
                    a, b = (int(x) for x in part.split("-", 1))
                else:
                    a = b = int(part)
            except ValueError:
                raise ConfigError(f"{what}={raw!r}: {part!r} is not a step N or a range A-B",
                                  f"set {what} to e.g. '0-3,10' or 'all'") from None
            if a < 0 or b < a:
                raise ConfigError(f"{what}={raw!r}: range {part!r} is empty or negative",
                                  f"write ranges as A-B with 0 <= A <= B (e.g. {what}=0-3)")
            out.append((a, b))
        return cls(tuple(out))

    def __contains__(self, step: object) -> bool:
        if self.ranges is None:
            return True
        return isinstance(step, int) and any(a <= step <= b for a, b in self.ranges)

    def __str__(self) -> str:
        if self.ranges is None:
            return "all"
        if not self.ranges:
            return "none"
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in self.ranges)


def _patterns(raw: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def _sites(raw: str, what: str) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    for item in _patterns(raw):
        path, sep, line = item.rpartition(":")
        if not sep or not path or not line.isdigit() or int(line) < 1:
            raise ConfigError(f"{what}={raw!r}: {item!r} is not FILE:LINE",
                              f"name call sites as FILE:LINE, comma-separated (e.g. {what}=train.py:42)")
        out.append((path, int(line)))
    return tuple(out)


@dataclass(frozen=True)
class CaptureOptions:
    """Resolved capture settings (``docs/capture.md`` §1.1)."""

    level: str = "function"
    digest: str = "full"
    steps: StepSet = StepSet(None)
    functions: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    contexts: tuple[str, ...] = ()
    dump_steps: StepSet = StepSet(())
    dump_filter: tuple[str, ...] = ()
    dump_sites: tuple[tuple[str, int], ...] = ()
    max_mb: float = 1024.0
    buffer: int = 256
    nested: bool = True
    collapse_wrappers: bool = True
    fast_call: bool = True
    host_kernel: str = "auto"
    record_noise: bool = False
    step_auto: bool = True
    optimizer: str = "step"

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(f"capture level {self.level!r} is not one of {', '.join(LEVELS)}",
                              "set OPGUARD_CAPTURE_LEVEL (or level=) to 'function' or 'dispatch'")
        if self.digest not in DIGEST_MODES:
            raise ConfigError(f"digest mode {self.digest!r} is not one of {', '.join(DIGEST_MODES)}",
                              "set OPGUARD_CAPTURE_DIGEST (or digest=) to full, sample, xor or none "
                              "(docs/capture.md §5 says what each gives up)")
        if self.host_kernel not in HOST_KERNELS:
            raise ConfigError(f"host kernel {self.host_kernel!r} is not one of {', '.join(HOST_KERNELS)}",
                              "set OPGUARD_CAPTURE_HOST_KERNEL (or host_kernel=) to auto (the native kernel when "
                              "built), native (required) or torch (PyTorch ops; docs/capture.md §5.2)")
        if self.optimizer not in OPTIMIZER_MODES:
            raise ConfigError(f"optimizer recording {self.optimizer!r} is not one of {', '.join(OPTIMIZER_MODES)}",
                              "set OPGUARD_CAPTURE_OPTIMIZER (or optimizer=) to step (each Optimizer.step() one "
                              "record) or ops (every op inside it; docs/capture.md §3.8)")
        if not (self.max_mb > 0):
            raise ConfigError(f"capture size cap {self.max_mb!r} MiB must be > 0",
                              "set OPGUARD_CAPTURE_MAX_MB (or max_mb=) to a positive number of MiB")
        if self.buffer < 1:
            raise ConfigError(f"capture buffer {self.buffer!r} must be >= 1 record",
                              "set OPGUARD_CAPTURE_BUFFER (or buffer=) to a positive integer like 256")

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * (1 << 20))

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CaptureOptions:
        """Options from ``OPGUARD_CAPTURE_*`` variables; keyword ``overrides`` win (strings are parsed)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = env_name(f.name)
            if f.name in overrides and overrides[f.name] is not None:
                raw: Any = overrides[f.name]
                what = f.name
            elif var in env:
                raw = env[var]
                what = var
            else:
                continue
            values[f.name] = _convert(f.name, raw, what)
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown capture option(s): {', '.join(sorted(unknown))}",
                              f"use only {', '.join(f.name for f in fields(cls))}")
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The ``OPGUARD_CAPTURE_*`` variables that reproduce these options in a child."""
        return {env_name(k): _render(v) for k, v in asdict(self).items()} | {
            env_name("steps"): str(self.steps), env_name("dump_steps"): str(self.dump_steps)}

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = str(self.steps)
        d["dump_steps"] = str(self.dump_steps)
        d["dump_sites"] = [f"{p}:{n}" for p, n in self.dump_sites]
        for k in ("functions", "modules", "contexts", "dump_filter"):
            d[k] = list(d[k])
        return d


def env_name(field_name: str) -> str:
    return "OPGUARD_CAPTURE_" + field_name.upper()


def _render(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, tuple):
        return ",".join(f"{x[0]}:{x[1]}" if isinstance(x, tuple) else str(x) for x in v)
    if isinstance(v, dict):  # StepSet after asdict
        return str(StepSet(tuple(tuple(r) for r in v["ranges"]) if v["ranges"] is not None else None))
    return str(v)


def _convert(name: str, raw: Any, what: str) -> Any:
    if name in ("steps", "dump_steps"):
        if isinstance(raw, StepSet):
            return raw
        if isinstance(raw, int):
            return StepSet(((raw, raw),))
        if isinstance(raw, (list, tuple, range)):
            return StepSet.parse(",".join(str(int(x)) for x in raw), what)
        return StepSet.parse(str(raw), what)
    if name in ("functions", "modules", "contexts", "dump_filter"):
        return tuple(raw) if isinstance(raw, (list, tuple)) else _patterns(str(raw))
    if name == "dump_sites":
        if isinstance(raw, (list, tuple)):
            raw = ",".join(f"{x[0]}:{x[1]}" if isinstance(x, tuple) else str(x) for x in raw)
        return _sites(str(raw), what)
    if name == "max_mb":
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{what}={raw!r} is not a number of MiB", f"set {what} to e.g. 1024") from None
    if name == "buffer":
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{what}={raw!r} is not an integer", f"set {what} to e.g. 256") from None
    if name in ("nested", "collapse_wrappers", "fast_call", "record_noise", "step_auto"):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
        raise ConfigError(f"{what}={raw!r} is not a boolean", f"set {what} to 1 or 0")
    return str(raw).strip().lower()
