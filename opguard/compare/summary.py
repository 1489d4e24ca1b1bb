"""The terminal summary of a comparison (stderr; ``docs/compare.md`` §6)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

CAVEAT = ("caveat: unresolved operations precede it in this stream; an observed first diff after unresolved "
          "events may not be the earliest actual divergence — investigate caller/callee, upstream writes and "
          "downstream consumers, or retain the ambiguity")


@dataclass
class FirstMismatch:
    record_a: str
    record_b: str
    function: str
    where: str                 # file:line (evidence)
    fields: list[str]
    numeric: dict[str, dict[str, float]]
    unresolved_before: int     # unresolved operations earlier in the stream (either side)


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
    first_equal_input_mismatch: FirstMismatch | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def pairs(self) -> int:
        return self.status["ok"] + self.status["mismatch"]


@dataclass
class Summary:
    streams: dict[tuple[int, str], StreamSummary] = field(default_factory=dict)
    only_a: list[tuple[int, str]] = field(default_factory=list)
    only_b: list[tuple[int, str]] = field(default_factory=list)
    export_path: str = ""
    export_bytes: int = 0

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
            lines.extend(f"  note: {n}" for n in s.notes)
            for side, reasons in (("A", s.reasons_a), ("B", s.reasons_b)):
                if reasons:
                    detail = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
                    lines.append(f"  undetermined in {side}: {detail}")
            for label, fm in (("first mismatch", s.first_mismatch),
                              ("first mismatch with equal captured inputs", s.first_equal_input_mismatch)):
                if fm is None:
                    continue
                nums = "; ".join(f"{slot}: " + ", ".join(f"{k}={v:.6g}" for k, v in vals.items())
                                 for slot, vals in fm.numeric.items())
                lines.append(f"  {label}: {fm.function} at {fm.where} ({fm.record_a} <-> {fm.record_b}); "
                             f"differs: {', '.join(fm.fields)}" + (f"; {nums}" if nums else ""))
                if fm.unresolved_before:
                    lines.append(f"    {CAVEAT} ({fm.unresolved_before} unresolved before it)")
            if s.first_mismatch is not None and s.first_equal_input_mismatch is None:
                lines.append("  no mismatch with equal captured inputs: every mismatch here inherited different inputs "
                             "(or its inputs were not captured)")
        for side, keys in (("A", self.only_a), ("B", self.only_b)):
            for rank, name in keys:
                lines.append(f"rank {rank} [{name}]: only in run {side} — its operations are undetermined "
                             f"(no-corresponding-file)")
        return "\n".join(lines)
