"""Status of a pair (``docs/compare.md`` §4): ``ok``, ``mismatch`` (with numeric differences), or
``unaligned`` for an unresolved operation (no diff at all).

``ok`` means the compared recorded fields agree — slot names, dtype, shape and content digest of
every input and output — not bitwise tensor equality. For a differing output the numeric
differences are: with tensor dumps on both sides, the element-wise ``max_abs_err``,
``max_rel_err`` and ``cosine``; otherwise the differences of the recorded statistics
(``stats_max_abs_diff``, ``stats_max_rel_diff``), named as such.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opguard.compare.records import AUTOCAST_SLOT, Record, Slot, arg_changes
from opguard.staging.fsutil import open_regular

AUTOCAST_CHANGE = AUTOCAST_SLOT + ": "  # how arg_changes() starts a change of the autocast state
OK = "ok"
MISMATCH = "mismatch"
UNALIGNED = "unaligned"
STATUSES = (OK, MISMATCH, UNALIGNED)


@dataclass
class Diff:
    status: str
    fields: list[str] = field(default_factory=list)      # e.g. "outputs.out0.digest", "args.approximate"
    inputs_equal: bool = True
    numeric: dict[str, dict[str, float]] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)        # "approximate: 'none' -> 'tanh'" (schema v2)
    uninitialized: int = 0      # entries marked uninitialized whose recorded content differs (not compared)
    function: str | None = None  # "A's function -> B's" when they differ (basis function-differs)
    # the inputs differ only in order: the same tensors (dtype, shape, digest) in other slots (b - a
    # for a - b): the edit is here, not upstream
    reordered: bool = False
    # inputs equal but for these, whose content neither or only one run recorded (no digest:
    # uninitialised memory, a tensor subclass, ...): "input (uninitialised memory)"; the differing
    # outputs can come from them, so the pair does not introduce the difference
    unseen: list[str] = field(default_factory=list)
    # a differing dtype or shape field's values, "A's -> B's" ("inputs.self.dtype": "float16 -> bfloat16")
    values: dict[str, str] = field(default_factory=dict)

    @property
    def introduced(self) -> bool:
        """The pair introduced the difference: its arguments differ, its inputs are the same tensors
        in another order, or its inputs are equal and its function, arguments or outputs differ
        (docs/compare.md §4)."""
        return self.status == MISMATCH and (bool(self.args) or self.inputs_equal or self.reordered)


_OK = Diff(OK)


def _compare_slots(kind: str, a: list[Slot], b: list[Slot], out: list[str], diff: Diff | None = None
                   ) -> list[tuple[Slot, Slot]]:
    by_a = {s.name: s for s in a}
    by_b = {s.name: s for s in b}
    differing: list[tuple[Slot, Slot]] = []
    # A's slots in A's order, then B's own: the same order in every process (a set's order follows
    # the per-process string hash, and the numeric differences are listed in this order)
    for name in [*by_a, *(n for n in by_b if n not in by_a)]:
        sa, sb = by_a.get(name), by_b.get(name)
        if sa is None or sb is None:
            out.append(f"{kind}.{name}.present")
            continue
        bad = False
        uninit = sa.uninitialized or sb.uninitialized
        for attr in ("dtype", "shape", "digest"):
            if getattr(sa, attr) != getattr(sb, attr):
                if attr == "digest" and uninit:
                    if diff is not None:
                        diff.uninitialized += 1      # uninitialised memory: never compared, counted apart
                    continue
                out.append(f"{kind}.{name}.{attr}")
                if attr != "digest" and diff is not None:
                    diff.values[f"{kind}.{name}.{attr}"] = f"{_shown(getattr(sa, attr))} -> {_shown(getattr(sb, attr))}"
                bad = True
        if bad:
            differing.append((sa, sb))
    out.sort()
    return differing


def _shown(v: Any) -> str:
    return "[" + ", ".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)


def _stats_diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    abs_d = 0.0
    rel_d = 0.0
    seen = False
    for k in ("min", "max", "mean", "std", "absmax"):
        if k in a and k in b and math.isfinite(a[k]) and math.isfinite(b[k]):
            d = abs(a[k] - b[k])
            abs_d = max(abs_d, d)
            rel_d = max(rel_d, d / max(abs(a[k]), abs(b[k]), 1e-30) if d else 0.0)
            seen = True
    out: dict[str, float] = {}
    if seen:
        out = {"stats_max_abs_diff": abs_d, "stats_max_rel_diff": rel_d}
    for k in ("nan", "inf", "nan_count", "inf_count"):
        if k in a and k in b and a[k] != b[k]:
            out[f"{k}_diff"] = b[k] - a[k]
    return out


def load_dump(path: str) -> Any:
    """A tensor dump as a flat float64 numpy array (``.npy`` with numpy, ``.pt`` with torch, lazily);
    a complex tensor as its (real, imaginary) pairs, so a difference in either part counts."""
    import numpy as np

    p = Path(path)
    # a regular file, its last component no link, never a FIFO or device (a dump record names a
    # file in its own rank directory: docs/compare.md §1)
    with os.fdopen(open_regular(p), "rb") as f:
        if p.suffix == ".npy":
            arr = np.load(f, allow_pickle=False)
        else:
            import torch

            t = torch.load(f, map_location="cpu", weights_only=True).detach().resolve_conj().resolve_neg()
            if t.is_complex():
                t = torch.view_as_real(t)
            arr = t.to(torch.float64).numpy()
    if np.iscomplexobj(arr):
        arr = np.stack([arr.real, arr.imag], axis=-1)
    return np.asarray(arr, dtype=np.float64).ravel()


def dump_errors(pa: str, pb: str) -> dict[str, float]:
    import numpy as np

    a, b = load_dump(pa), load_dump(pb)
    if a.shape != b.shape:
        return {}
    # non-finite elements (inf - inf, 0 / 0, an all-NaN difference) give NaN, left out by nanmax; no
    # NumPy RuntimeWarning reaches the user's terminal
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        d = np.abs(a - b)
        rel = d / np.maximum(np.abs(a), np.abs(b))
        rel = np.where(d == 0, 0.0, rel)
        out = {"max_abs_err": float(np.nanmax(d)) if d.size else 0.0,
               "max_rel_err": float(np.nanmax(rel)) if rel.size else 0.0}
        na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
        if na > 0 and nb > 0 and math.isfinite(na) and math.isfinite(nb):
            out["cosine"] = float(np.dot(a, b) / (na * nb))
    return out


def diff_pair(a: Record, b: Record) -> Diff:
    changes = arg_changes(a.args, b.args)
    if changes:  # a slot given a tensor in one run and a value in the other (bias=None)
        changes = arg_changes(a.args, b.args, {s.name for s in a.inputs}, {s.name for s in b.inputs})
    other_fn = a.function != b.function
    # the autocast state alone (docs/compare.md §4): a call it does not cast computes the same under
    # both (the grad mode is not: an output made with grad off has no autograd graph, §4)
    context_only = bool(changes) and all(c.startswith(AUTOCAST_CHANGE) for c in changes)
    if not other_fn and (not changes or context_only) and \
            [s.signature() for s in a.inputs] == [s.signature() for s in b.inputs] and \
            [s.signature() for s in a.outputs] == [s.signature() for s in b.outputs]:
        return _OK
    d = Diff(MISMATCH, args=changes, function=f"{a.function} -> {b.function}" if other_fn else None)
    fields: list[str] = []
    _compare_slots("inputs", a.inputs, b.inputs, fields, d)
    if not fields:
        # a random draw into uninitialised memory (nn.init.kaiming_uniform_ of a new Linear's weight,
        # uniform_ of torch.empty) does not read it: that input is not where outputs can come from
        d.unseen = _unseen(a.inputs, b.inputs, drawn=a.seeded or b.seeded)
    inputs_equal = not fields and not d.unseen
    if other_fn:
        fields.insert(0, "function")
    fields.extend(f"args.{c.split(':', 1)[0]}" for c in changes)
    differing = _compare_slots("outputs", a.outputs, b.outputs, fields, d)
    if not fields:
        return Diff(OK, uninitialized=d.uninitialized)
    numeric: dict[str, dict[str, float]] = {}
    for sa, sb in differing:
        vals: dict[str, float] = {}
        if sa.dump and sb.dump:
            try:
                vals = dump_errors(sa.dump, sb.dump)
            except Exception:  # a damaged, forged or foreign file (unpickling errors too): statistics then
                vals = {}
        if not vals and sa.stats and sb.stats:
            vals = _stats_diff(sa.stats, sb.stats)
        if vals:
            numeric[sa.name] = vals
    d.fields, d.inputs_equal, d.numeric = fields, inputs_equal, numeric
    d.reordered = not inputs_equal and _reordered(a.inputs, b.inputs)
    return d


def _unseen(a: list[Slot], b: list[Slot], drawn: bool = False) -> list[str]:
    """The inputs (equal slots otherwise) whose content was not recorded in A or B, with why; for a
    call that draws random numbers (``drawn``), uninitialised memory on both sides is left out."""
    by_b = {s.name: s for s in b}
    out = []
    for sa in a:
        sb = by_b.get(sa.name)
        if drawn and sb is not None and sa.uninitialized and sb.uninitialized:
            continue
        if sb is not None and (sa.digest is None or sb.digest is None):
            why = ("uninitialised memory" if sa.uninitialized or sb.uninitialized else
                   sa.reason or sb.reason or "no digest")
            label = sa.label or sb.label
            out.append(f"{label} ({sa.name}, {why})" if label else f"{sa.name} ({why})")
    return out


def _reordered(a: list[Slot], b: list[Slot]) -> bool:
    """The same input tensors on both sides, by content, in other slots (every digest known)."""
    if len(a) != len(b) or any(s.digest is None for s in (*a, *b)):
        return False
    def key(s: Slot) -> tuple[str, str, str]:
        return (str(s.dtype), str(s.shape), str(s.digest))
    ka, kb = [key(s) for s in a], [key(s) for s in b]
    return ka != kb and sorted(ka) == sorted(kb)
