"""The summary of a comparison: stderr text and ``--json`` (``docs/compare.md`` §6)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

CAVEAT = ("caveat: unresolved operations precede it in this stream; an observed first diff after unresolved "
          "events may not be the earliest actual divergence — investigate caller/callee, upstream writes and "
          "downstream consumers, or retain the ambiguity")

ARGS_DIFFER = "arguments differ"
OUTPUTS_DIFFER = "outputs differ, inputs and arguments equal"
# the same when an output's dtype or shape differs: what the call made was asked for differently
OUTPUT_FORM_DIFFERS = ("outputs differ in dtype or shape, inputs and arguments equal (another default dtype, "
                       "torch.set_default_dtype; or a size or dtype the call took from somewhere capture does not "
                       "record)")
# the same for a call that draws random numbers (capture's "seeded"): the likely why
RANDOM_DIFFERS = ("outputs differ, inputs and arguments equal, in a random draw (the generator's state differs: "
                  "another seed, or another number of draws before it)")


def random_differs(unpaired_draw: str | None, unseen_draw: str | None = None) -> str:
    """:data:`RANDOM_DIFFERS`, naming the unpaired call that drew random numbers before it, if any,
    else an earlier paired draw whose outputs capture recorded without content (``unseen_draw``:
    inside a torch.func transform, ...), whose own difference could not be seen."""
    if unpaired_draw is not None:
        return ("outputs differ, inputs and arguments equal, in a random draw (the generator's state differs: "
                f"{unpaired_draw}, a call the other run does not make, drew random numbers before it)")
    if unseen_draw is not None:
        return RANDOM_DIFFERS[:-1] + f"; before it, {unseen_draw}: it may have drawn differently)"
    return RANDOM_DIFFERS


# the same for a collective or point-to-point transfer: what this rank received differs, another
# rank's data is the likely why
COLLECTIVE_DIFFERS = ("outputs differ, inputs and arguments equal, in a collective (what this rank received differs: "
                      "another rank sent or contributed other data; see the other ranks' first divergences)")
# the same for a module recorded as one call (capture's api "module"): what it ran inside is not recorded
MODULE_DIFFERS = ("outputs differ, inputs and arguments equal, in a module recorded as one call (the calls inside "
                  "it, its submodules' hooks included, were not recorded: the difference was computed there)")
INHERITED = "inputs differ (inherited)"
# inputs differ, but no earlier operation of the stream differs or went unpaired: nothing recorded
# passed the difference on (docs/compare.md §4)
OTHER_INPUTS = ("inputs differ, although every earlier operation of this stream agrees: B's call reads other "
                "tensors than A's (an edited line reading another variable), or tensors written where capture "
                "records nothing (loaded from a file or made from NumPy, another Python thread, a DataLoader "
                "worker, another process or rank, DDP's gradient all-reduce, a saved-tensors pack hook)")


def other_inputs(unseen: str | None) -> str:
    """:data:`OTHER_INPUTS`, first naming the last earlier operation (a random draw preferred) whose
    outputs capture recorded without content (``unseen``: a tensor inside a torch.func transform, a
    tensor subclass, ...): it agreed only where recorded, and the difference can come from there."""
    if unseen is None:
        return OTHER_INPUTS
    return (f"inputs differ, although every earlier operation of this stream agrees where recorded: before it, "
            f"{unseen}: the difference can come from there; or" + OTHER_INPUTS.split(":", 1)[1])
# inputs equal where recorded, but one or more had no recorded content: the outputs can differ from there
UNSEEN_INPUTS = "outputs differ, inputs equal where recorded; not recorded, so the difference can come from there: "
REORDERED = "the same inputs in another order"
FUNCTION_DIFFERS_KIND = "function differs"
JSON_VERSION = 1


@dataclass
class FirstMismatch:
    record_a: str
    record_b: str
    function: str
    where: str                 # file:line (evidence; A's)
    fields: list[str]
    numeric: dict[str, dict[str, float]]
    unresolved_before: int     # unresolved operations earlier in the stream (either side)
    module: str | None = None
    step: int | None = None
    args: list[str] = field(default_factory=list)
    kind: str = INHERITED
    where_b: str = ""
    nearest_unresolved: str | None = None    # the last unresolved operation before it, described
    line_map_b: str | None = None             # how B's line corresponds to A's (docs/compare.md §2)
    function_b: str | None = None             # B's function, when it differs (basis function-differs)
    raised: str | None = None                 # which run's call raised what, when only one did or they differ
    values: dict[str, str] = field(default_factory=dict)  # a differing dtype/shape field: "A's -> B's"
    # the call it is nested in, whose outputs differed with inputs and arguments equal (docs/compare.md §4)
    inside: str | None = None

    def describe(self) -> str:
        """One line; at most SHOWN arguments, fields and numeric slots (an optimizer step's record
        can differ in every parameter: the rest are counted, all are in ``--json`` and the view)."""
        fields = [f"{f} ({self.values[f]})" if f in self.values else f for f in self.fields]
        what = _capped(self.args, "; ") if self.args else _capped(fields, ", ")
        if self.function_b:  # the "function" field is said by the arrow; no other field: outputs equal
            rest = self.args or [f for f in fields if f != "function"]
            what = f"{self.function} -> {self.function_b}; " + (
                _capped(rest, "; " if self.args else ", ") if rest else "inputs and outputs equal")
        if self.raised:
            what += f" ({self.raised})"
        nums = _capped([f"{slot}: " + ", ".join(f"{k}={v:.6g}" for k, v in vals.items())
                        for slot, vals in self.numeric.items()], "; ")
        at = self.where if not self.where_b or self.where_b == self.where else f"{self.where} (B: {self.where_b})"
        if self.line_map_b and not self.line_map_b.startswith(("same", "shifted")):
            at += f" [B's line: {self.line_map_b}]"
        ctx = []
        if self.module:
            ctx.append(f"module {self.module}")
        ctx.append(f"step {self.step if self.step is not None else '?'}")
        return (f"{self.function} at {at}, {', '.join(ctx)} ({self.record_a} <-> {self.record_b}): {self.kind}: "
                f"{what}" + (f"; {nums}" if nums else "")
                + (f" [a call inside {self.inside}, whose outputs differ with inputs and arguments equal]"
                   if self.inside else ""))

    def as_json(self) -> dict[str, Any]:
        return {"record_a": self.record_a, "record_b": self.record_b, "function": self.function,
                "where": self.where, "where_b": self.where_b or self.where, "module": self.module, "step": self.step,
                "kind": self.kind, "args": self.args, "fields": self.fields, "numeric": self.numeric,
                "unresolved_before": self.unresolved_before, "nearest_unresolved": self.nearest_unresolved,
                "line_map_b": self.line_map_b, "function_b": self.function_b,
                "raised": self.raised, "values": dict(self.values), "inside": self.inside}


SHOWN = 6  # items of a list shown in one summary line


def _capped(items: list[str], sep: str) -> str:
    if len(items) <= SHOWN:
        return sep.join(items)
    return sep.join(items[:SHOWN]) + f"{sep}... ({len(items) - SHOWN} more)"


@dataclass
class StreamSummary:
    rank: int
    stream: str
    ops_a: int = 0
    ops_b: int = 0
    status: Counter[str] = field(default_factory=Counter)       # ok / mismatch (pairs), unaligned (per op)
    basis: Counter[str] = field(default_factory=Counter)
    reasons_a: Counter[str] = field(default_factory=Counter)
    reasons_b: Counter[str] = field(default_factory=Counter)
    first_mismatch: FirstMismatch | None = None
    first_divergence: FirstMismatch | None = None               # the first introduced divergence
    introduced: int = 0
    inherited: int = 0
    uninitialized: int = 0      # entries marked uninitialized whose content differs (never compared)
    first_unresolved: str | None = None  # the first operation (in row order) that could not be paired
    first_new_b: str | None = None  # B's first unpaired operation on a line A lacks, or a call A's segment lacks
    first_gone_a: str | None = None  # A's first unpaired operation that B's segment lacks (a removed call)
    notes: list[str] = field(default_factory=list)

    @property
    def pairs(self) -> int:
        return self.status["ok"] + self.status["mismatch"]

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "stream": self.stream, "ops_a": self.ops_a, "ops_b": self.ops_b,
                "pairs": self.pairs, "ok": self.status["ok"], "mismatch": self.status["mismatch"],
                "unaligned": self.status["unaligned"], "basis": dict(sorted(self.basis.items())),
                "undetermined_a": dict(sorted(self.reasons_a.items())),
                "undetermined_b": dict(sorted(self.reasons_b.items())),
                "introduced": self.introduced, "inherited": self.inherited,
                "uninitialized_not_compared": self.uninitialized,
                "first_divergence": self.first_divergence.as_json() if self.first_divergence else None,
                "first_mismatch": self.first_mismatch.as_json() if self.first_mismatch else None,
                "first_unresolved": self.first_unresolved, "first_new_in_b": self.first_new_b,
                "first_missing_in_b": self.first_gone_a,
                "notes": list(self.notes)}


@dataclass
class Summary:
    streams: dict[tuple[int, str], StreamSummary] = field(default_factory=dict)
    only_a: list[tuple[int, str]] = field(default_factory=list)
    only_b: list[tuple[int, str]] = field(default_factory=list)
    export_path: str = ""
    export_bytes: int = 0
    inputs: dict[str, str] = field(default_factory=dict)
    filters: dict[str, Any] = field(default_factory=dict)
    shown: list[dict[str, Any]] = field(default_factory=list)     # --show: full evidence of chosen records

    def stream(self, rank: int, name: str) -> StreamSummary:
        key = (rank, name)
        if key not in self.streams:
            self.streams[key] = StreamSummary(rank, name)
        return self.streams[key]

    @property
    def pairs(self) -> int:
        return sum(s.pairs for s in self.streams.values())

    def total(self, status: str) -> int:
        return sum(s.status[status] for s in self.streams.values())

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` document (docs/compare.md §6)."""
        return {"version": JSON_VERSION, "a": self.inputs.get("A"), "b": self.inputs.get("B"),
                "export": self.export_path, "export_bytes": self.export_bytes,
                "pairs": self.pairs, "ok": self.total("ok"), "mismatch": self.total("mismatch"),
                "unaligned": self.total("unaligned"), "filters": self.filters,
                "ranks": [self.streams[k].as_json() for k in sorted(self.streams)],
                "only_in_a": [{"rank": r, "stream": n} for r, n in self.only_a],
                "only_in_b": [{"rank": r, "stream": n} for r, n in self.only_b]}

    def render(self) -> str:
        lines = [f"opguard compare: {self.pairs} pairs (ok {self.total('ok')}, mismatch {self.total('mismatch')}), "
                 f"{self.total('unaligned')} unaligned operations; view: {self.export_path} "
                 f"({self.export_bytes} bytes; open in ui.perfetto.dev)",
                 "pairs are candidates (validation: unreviewed); ok = the compared recorded fields agree, "
                 "not bitwise tensor equality"]
        for key in sorted(self.streams):
            s = self.streams[key]
            basis = ", ".join(f"{k} {v}" for k, v in sorted(s.basis.items())) or "none"
            lines.append(f"rank {s.rank} [{s.stream}]: A {s.ops_a} ops, B {s.ops_b} ops; paired {s.pairs} "
                         f"(ok {s.status['ok']}, mismatch {s.status['mismatch']}; basis: {basis}); "
                         f"unaligned {s.status['unaligned']}")
            fd = s.first_divergence
            if fd is not None:
                lines.append(f"  first divergence: {fd.describe()}")
                if fd.unresolved_before:
                    lines.append(f"    {CAVEAT} ({fd.unresolved_before} unresolved before it)")
                    lines.append(f"    the first unresolved operation: {s.first_unresolved}")
            elif s.first_mismatch is not None:
                fm = s.first_mismatch
                lines.append("  no introduced divergence among the pairs: every mismatch inherited different inputs "
                             f"(or its inputs were not captured); the first: {fm.describe()}")
                if fm.nearest_unresolved:
                    lines.append(f"    the last unresolved operation before it: {fm.nearest_unresolved}")
                if fm.unresolved_before:
                    lines.append(f"    {CAVEAT} ({fm.unresolved_before} unresolved before it)")
                    if s.first_unresolved != fm.nearest_unresolved:  # where the runs may first differ
                        lines.append(f"    the first unresolved operation: {s.first_unresolved}")
            elif s.pairs and s.status["unaligned"]:
                # never "no divergence" while operations went unpaired: the runs may differ exactly there
                lines.append(f"  no divergence among the {s.pairs} pairs, but {s.status['unaligned']} operations "
                             f"could not be paired, so the runs may differ there; the first: {s.first_unresolved}")
            elif s.pairs:
                lines.append("  no divergence: every pair's compared fields agree")
            if s.first_new_b is not None:  # a line only B has: what it computes is not in A at all
                lines.append("  B's first operation A does not make (on a line A does not have or has elsewhere, "
                             f"or a call A's run does not make there): {s.first_new_b}")
            if s.first_gone_a is not None:  # a call removed in B
                lines.append("  A's first operation B does not make (a call B's run does not make there): "
                             f"{s.first_gone_a}")
            if s.status["mismatch"]:
                lines.append(f"  mismatches: {s.introduced} introduced, {s.inherited} inherited (inputs differ)")
            if s.first_mismatch is not None and fd is not None and s.first_mismatch.record_a != fd.record_a:
                lines.append(f"  first mismatch (in execution order): {s.first_mismatch.describe()}")
            if s.uninitialized:
                lines.append(f"  {s.uninitialized} entries marked uninitialized differ in content: never compared")
            lines.extend(f"  note: {n}" for n in s.notes)
            for side, reasons in (("A", s.reasons_a), ("B", s.reasons_b)):
                if reasons:
                    detail = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
                    lines.append(f"  undetermined in {side}: {detail}")
        for side, keys in (("A", self.only_a), ("B", self.only_b)):
            for rank, name in keys:
                lines.append(f"rank {rank} [{name}]: only in run {side} — its operations are undetermined "
                             f"(no-corresponding-file)")
        return "\n".join(lines)
