"""Encoding of one operation's slice (its typed annotations), tuned for millions of operations.

Low-cardinality values (run, stream, status, dtype, shape, device, call sites) are encoded once
and reused; digests and statistics are encoded directly. The structure is exactly what
``docs/compare.md`` §5 lists; :func:`opguard.compare.perfetto_export.read_export` reads it back.
"""

from __future__ import annotations

import struct
from typing import Any

from opguard.compare.diff import MISMATCH, Diff
from opguard.compare.perfetto_export import ExportWriter
from opguard.compare.protoenc import F, uv
from opguard.compare.records import Record, Slot


class OpEncoder:
    def __init__(self, writer: ExportWriter) -> None:
        self.w = writer
        self.ann = writer.ann
        self.flow = 0
        self._cache: dict[tuple[str, object], bytes] = {}
        self._names: dict[str, bytes] = {}
        self._packers: dict[tuple[str, ...], tuple[struct.Struct, list[bytes]]] = {}

    # ---- primitives (name bytes from the writer's interning) ----
    def _n(self, name: str) -> bytes:
        b = self._names.get(name)
        if b is None:
            b = self._names[name] = self.ann.name(name)
        return b

    def _s(self, name: str, value: str) -> bytes:
        v = value.encode("utf-8", "surrogatepass")
        return self._n(name) + F.D_STRING + uv(len(v)) + v

    def _cs(self, name: str, value: object) -> bytes:
        """A cached annotation for a low-cardinality value."""
        key = (name, value)
        b = self._cache.get(key)
        if b is None:
            b = self._cache[key] = self.ann.value(name, value)
        return b

    def _i(self, name: str, value: int) -> bytes:
        return self.ann.i(name, value)

    def _dict(self, name: str, entries: list[bytes]) -> bytes:
        out = [self._n(name)]
        for e in entries:
            out.append(F.D_DICT + uv(len(e)) + e)
        return b"".join(out)

    def _meta(self, s: Slot) -> bytes:
        """dtype, shape and device entries of a slot (framed), cached per distinct combination."""
        key = ("meta", (s.dtype, s.shape, s.device))
        b = self._cache.get(key)
        if b is None:
            parts = []
            if s.dtype is not None:
                parts.append(self._cs("dtype", s.dtype))
            if s.shape is not None:
                parts.append(self._cs("shape", str(list(s.shape))))
            if s.device is not None:
                parts.append(self._cs("device", s.device))
            b = self._cache[key] = b"".join(F.D_DICT + uv(len(e)) + e for e in parts)
        return b

    def _stats(self, stats: dict[str, float]) -> bytes:
        """The stats entry (framed): one struct.pack per distinct key order."""
        keys = tuple(stats)
        packer = self._packers.get(keys)
        if packer is None:
            consts = [F.D_DICT + uv(len(self._n(k)) + 1 + 8) + self._n(k) + F.D_DOUBLE for k in keys]
            fmt = "<" + "".join(f"{len(c)}sd" for c in consts)
            packer = self._packers[keys] = (struct.Struct(fmt), consts)
        st, consts = packer
        args: list[object] = []
        for c, v in zip(consts, stats.values(), strict=True):
            args.append(c)
            args.append(v)
        body = self._n("stats") + st.pack(*args)
        return F.D_DICT + uv(len(body)) + body

    def _slot(self, s: Slot) -> bytes:
        out = [self._n(s.name)]
        if s.digest is not None:
            e = self._s("digest", s.digest)
            out.append(F.D_DICT + uv(len(e)) + e)
        out.append(self._meta(s))
        if s.dump is not None:
            e = self._s("dump", s.dump)
            out.append(F.D_DICT + uv(len(e)) + e)
        if s.stats:
            out.append(self._stats(s.stats))
        return b"".join(out)

    def _callsite(self, rec: Record) -> bytes:
        key = ("callsite", (rec.file, rec.line, rec.scope, rec.line_digest, rec.site))
        b = self._cache.get(key)
        if b is None:
            cs: dict[str, Any] = {"file": rec.file, "line": rec.line, "scope": rec.scope,
                                  "line_sha256": rec.line_digest, "identity": rec.site}
            b = self._cache[key] = self.ann.value("callsite", cs)
        return b

    def op(self, track: int, ts: int, run: str, stream: str, rec: Record, rid: str,
           correspondence: dict[str, Any], status: str, diff: Diff | None,
           flow_out: int | None = None, flow_in: int | None = None,
           slots: tuple[bytes, bytes] | None = None) -> tuple[bytes, bytes]:
        """Emit the slice; returns the encoded (inputs, outputs) annotations, which the caller may
        pass back as ``slots`` for another record whose slots are equal in every field."""
        anns = [self._s("record_id", rid), self._cs("run", run), self._i("rank", rec.rank),
                self._cs("stream", stream), self._i("index", rec.index)]
        if rec.seq is not None:
            anns.append(self._i("seq", int(rec.seq)))
        if rec.step is not None:
            anns.append(self._i("step", int(rec.step)))
        anns.append(self._callsite(rec))
        if rec.context:
            anns.append(self._cs("context", rec.context))
        if rec.collective:
            anns.append(self._cs("collective", True))
        corr = [self._cs("state", correspondence["state"])]
        for k in ("other", "basis", "reason"):
            v = correspondence.get(k)
            if v is not None:
                corr.append(self._s(k, str(v)) if k == "other" else self._cs(k, v))
        anns.append(self._dict("correspondence", corr))
        if correspondence["state"] == "paired":
            anns.append(self._cs("validation", "unreviewed"))
        anns.append(self._cs("status", status))
        if diff is not None and diff.status == MISMATCH:
            dd: dict[str, object] = {"fields": ", ".join(diff.fields), "inputs_equal": diff.inputs_equal}
            dd.update(diff.numeric)
            anns.append(self.ann.value("diff", dd))
        if slots is None:
            slots = (self._dict("inputs", [self._slot(s) for s in rec.inputs]) if rec.inputs else b"",
                     self._dict("outputs", [self._slot(s) for s in rec.outputs]) if rec.outputs else b"")
        anns.extend(x for x in slots if x)
        tag = F.E_ANNOTATION
        framed = b"".join([tag + uv(len(a)) + a for a in anns])
        self.w.slice_framed(track, ts, rec.function, framed, flows_out=() if flow_out is None else (flow_out,),
                            flows_in=() if flow_in is None else (flow_in,))
        return slots
