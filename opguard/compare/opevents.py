"""Encoding of one operation's slice (its typed annotations), tuned for millions of operations.

Every annotation is built as framed bytes (``TrackEvent.debug_annotations`` fields) from cached
pieces: the run/rank/stream block per stream, the call-site block per distinct call site, the
correspondence/status blocks per basis, reason and status, and per tensor slot a cached head
(name, dtype, shape, device) around which only the digest, dump and statistics are encoded.
Capture records are encoded straight from their parsed JSON (:meth:`OpEncoder.capture_op`, no
:class:`~opguard.compare.records.Record` is built); other records through :meth:`OpEncoder.op`.
Both produce the same bytes for the same observations. The structure is exactly what
``docs/compare.md`` §5 lists; :func:`opguard.compare.perfetto_export.read_export` reads it back.
"""

from __future__ import annotations

import struct
from typing import Any

from orjson import dumps as _dumps

from opguard.compare.diff import MISMATCH, Diff
from opguard.compare.perfetto_export import ExportWriter, callsite_text
from opguard.compare.protoenc import N_SMALL as _NU
from opguard.compare.protoenc import SMALL_VARINTS as _U
from opguard.compare.protoenc import F, uv, varint
from opguard.compare.records import Arg, Record, RecordSite, Slot, capture_args, capture_stats
from opguard.staging.layout import capture_dump_slot

SLOTS, SAME_AS_OTHER = "slots", "same as other"   # docs/compare.md §5: B's slots equal A's in every field

_E = F.E_ANNOTATION
_DD = F.D_DICT
_DS = F.D_STRING
_DI = F.D_INT


def _frame(a: bytes) -> bytes:
    """An annotation framed as a TrackEvent.debug_annotations field."""
    return _E + uv(len(a)) + a


def _entry(e: bytes) -> bytes:
    """A dict entry framed as a DebugAnnotation.dict_entries field."""
    return _DD + uv(len(e)) + e


class OpEncoder:
    def __init__(self, writer: ExportWriter) -> None:
        self.w = writer
        self.ann = writer.ann
        self._cache: dict[tuple[str, object], bytes] = {}
        self._names: dict[str, bytes] = {}
        self._packers: dict[tuple[str, ...], tuple[struct.Struct, bytes, list[object]]] = {}
        self._blocks: dict[object, bytes] = {}
        self._heads: dict[tuple[str, str, int], tuple[bytes, bytes, bytes]] = {}
        self._corrs: dict[tuple[str, str, str], tuple[bytes, bytes, bytes]] = {}
        self._fnames: dict[str, bytes] = {}
        self._slot_heads: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        self._raw_heads: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}   # by the slot's raw JSON fields
        self._str_pre: dict[tuple[str, int], bytes] = {}
        self._dpre: dict[int, bytes] = {}
        self._same = _frame(self._cs(SLOTS, SAME_AS_OTHER))
        self._nseq = self._n("seq") + _DI
        self._nstep = self._n("step") + _DI

    # ---- primitives (name bytes from the writer's interning) ----
    def _n(self, name: str) -> bytes:
        b = self._names.get(name)
        if b is None:
            b = self._names[name] = self.ann.name(name)
        return b

    def _s(self, name: str, value: str) -> bytes:
        v = value.encode("utf-8", "surrogatepass")
        return self._n(name) + _DS + uv(len(v)) + v

    def _sb(self, name: str, v: bytes) -> bytes:
        """A string annotation whose value is already UTF-8, framed as a dict entry (the bytes
        before the value cached per name and length)."""
        pre = self._str_pre.get((name, len(v)))
        if pre is None:
            n = self._n(name)
            pre = self._str_pre[(name, len(v))] = _DD + uv(len(n) + len(_DS) + len(uv(len(v))) + len(v)) + \
                n + _DS + uv(len(v))
        return pre + v

    def _cs(self, name: str, value: object) -> bytes:
        """A cached annotation for a low-cardinality value."""
        key = (name, value)
        b = self._cache.get(key)
        if b is None:
            b = self._cache[key] = self.ann.value(name, value)
        return b

    def _int(self, name: str, value: int) -> bytes:
        """A framed int annotation."""
        a = self._n(name) + _DI + varint(value)
        return _E + uv(len(a)) + a

    def _dict(self, name: str, entries: list[bytes]) -> bytes:
        out = [self._n(name)]
        for e in entries:
            out.append(_DD + uv(len(e)) + e)
        return b"".join(out)

    # ---- cached blocks ----
    def head(self, run: str, stream: str, rank: int) -> tuple[bytes, bytes, bytes]:
        """(record_id prefix, record_id annotation name, b"") of a stream: run, rank, stream and index are
        not annotations of their own (the record_id and the track imply them; read_export restores them)."""
        key = (run, stream, rank)
        h = self._heads.get(key)
        if h is None:
            h = self._heads[key] = (f"{run}/rank{rank}/{stream}/".encode("utf-8", "surrogatepass"),
                                    self._n("record_id") + _DS, b"")
        return h

    def _site_block(self, file: str | None, line: int | None, scope: str | None, line_digest: str | None,
                    ident: str, context: str, collective: bool, line_map: str | None = None) -> bytes:
        """Framed callsite, context and collective annotations, cached per distinct call site."""
        key = ("site", file, line, scope, line_digest, ident, context, collective, line_map)
        b = self._blocks.get(key)
        if b is None:
            cs: dict[str, Any] = {"file": file, "line": line, "scope": scope, "line_sha256": line_digest,
                                  "identity": ident}
            if line_map is not None:
                cs["line_map"] = line_map
            # one interned string (its JSON text), not a dict of 5-6 entries: ~6 bytes per slice, not ~38
            b = _frame(self._cs("callsite", callsite_text(cs)))
            if context:
                b += _frame(self._cs("context", context))
            if collective:
                b += _frame(self._cs("collective", True))
            self._blocks[key] = b
        return b

    def _corr(self, state: str, basis_or_reason: str, status: str) -> tuple[bytes, bytes, bytes]:
        """(correspondence prefix, suffix, framed validation/status) for one state, basis or reason and
        status; a pair's ``other`` entry goes between prefix and suffix."""
        key = (state, basis_or_reason, status)
        b = self._corrs.get(key)
        if b is None:
            pre = self._n("correspondence") + _entry(self._cs("state", state))
            if state == "paired":
                post = _entry(self._cs("basis", basis_or_reason))
                tail = _frame(self._cs("validation", "unreviewed")) + _frame(self._cs("status", status))
            else:
                post = _entry(self._cs("reason", basis_or_reason))
                tail = _frame(self._cs("status", status))
            b = self._corrs[key] = (pre, post, tail)
        return b

    def _meta(self, dtype: str | None, shape: tuple[int | str, ...] | None, device: str | None) -> bytes:
        """dtype, shape and device entries of a slot (framed)."""
        parts = []
        if dtype is not None:
            parts.append(self._cs("dtype", dtype))
        if shape is not None:
            parts.append(self._cs("shape", str(list(shape))))
        if device is not None:
            parts.append(self._cs("device", device))
        return b"".join(_DD + uv(len(e)) + e for e in parts)

    def _slot_head(self, name: str, dtype: str | None, shape: tuple[int | str, ...] | None,
                   device: str | None) -> tuple[bytes, bytes]:
        key = (name, dtype, shape, device)
        h = self._slot_heads.get(key)
        if h is None:
            h = self._slot_heads[key] = (self._n(name), self._meta(dtype, shape, device))
        return h

    def _stats(self, stats: dict[str, Any]) -> bytes:
        """The stats entry (framed): one struct.pack per record (values must be numbers)."""
        keys = tuple(stats)
        packer = self._packers.get(keys)
        if packer is None:
            consts = [_DD + uv(len(self._n(k)) + 1 + 8) + self._n(k) + F.D_DOUBLE for k in keys]
            st = struct.Struct("<" + "".join(f"{len(c)}sd" for c in consts))
            body_len = len(self._n("stats")) + st.size
            args: list[object] = [x for c in consts for x in (c, 0.0)]
            packer = self._packers[keys] = (st, _DD + uv(body_len) + self._n("stats"), args)
        st, pre, args = packer
        args[1::2] = stats.values()
        return pre + st.pack(*args)

    def _args(self, args: tuple[Arg, ...] | None) -> bytes:
        """The framed ``args`` annotation (schema v2): argument slot -> its value as shown."""
        return _frame(self.ann.value("args", {a.slot: a.show() for a in args or ()}))

    # ---- slots ----
    def _slot(self, s: Slot) -> bytes:
        name, meta = self._slot_head(s.name, s.dtype, s.shape, s.device)
        out = [name]
        if s.digest is not None:
            out.append(self._sb("digest", s.digest.encode("utf-8", "surrogatepass")))
        out.append(meta)
        if s.dump is not None:
            out.append(self._sb("dump", s.dump.encode("utf-8", "surrogatepass")))
        if s.stats:
            out.append(self._stats(s.stats))
        if s.uninitialized:
            out.append(self._uninit())
        return b"".join(out)

    def _uninit(self) -> bytes:
        e = self._cs("uninitialized", True)
        return _DD + uv(len(e)) + e

    def _raw_slots(self, kind: str, raw: Any, prefix: str, dumps: dict[str, str] | None,
                   error: Any = None) -> bytes:
        """The framed ``inputs``/``outputs`` annotation of capture slot dicts (docs/capture.md §3);
        the same bytes as :meth:`_slot` over :func:`~opguard.compare.records.capture_slot`.
        Strict UTF-8 (a lone surrogate raises ValueError: the Record path takes the record)."""
        if not raw and not error:
            return b""
        out = [self._n(kind)]
        heads = self._slot_heads
        raw_heads = self._raw_heads
        dpre = self._dpre
        packers = self._packers
        for i, s in enumerate(raw or ()):
            name = s.get("slot")
            if name.__class__ is not str:
                name = str(s.get("slot", f"{prefix}{i}"))
            dt = s.get("dtype")
            if dt.__class__ is not str:
                dt = None
            dv = s.get("device")
            if dv.__class__ is not str:
                dv = None
            sh = s.get("shape")
            try:        # the shape's JSON text tells a list of ints from any other value exactly
                rkey: tuple[Any, ...] | None = (name, dt, dv, _dumps(sh))
            except TypeError:
                rkey = None
            h = raw_heads.get(rkey) if rkey is not None else None
            if h is None:
                key = (name, dt, tuple(sh) if sh.__class__ is list and all(x.__class__ is int for x in sh)
                       else None, dv)
                h = heads.get(key)
                if h is None:
                    h = self._slot_head(*key)
                if rkey is not None:
                    raw_heads[rkey] = h
            d = s.get("digest")
            if d.__class__ is str:
                v = d.encode()
                pre = dpre.get(len(v))
                if pre is None:
                    pre = dpre[len(v)] = self._sb("digest", v)[:-len(v) or None]
                b = h[0] + pre + v + h[1]
            else:
                b = h[0] + h[1]
            if dumps is not None:  # an output named like an input it wrote: out.<slot> (capture §7)
                dump = dumps.get(capture_dump_slot(name, kind == "outputs"))
                if dump is not None:
                    b += self._sb("dump", dump.encode())
            st = s.get("stats")
            if st:
                try:
                    packer = packers.get(tuple(st))
                    if packer is None:
                        b += self._stats(st)
                    else:
                        args = packer[2]
                        args[1::2] = st.values()
                        b += packer[1] + packer[0].pack(*args)
                except (struct.error, TypeError, AttributeError):
                    norm = capture_stats(st)
                    if norm:
                        b += self._stats(norm)
            if s.get("uninitialized") is True:
                b += self._uninit()
            n = len(b)
            out.append(_DD + (_U[n] if n < _NU else uv(n)) + b)
        if error:
            b = self._n("error") + self._sb("digest", str(error).encode())
            if dumps is not None and dumps.get("error") is not None:
                b += self._sb("dump", dumps["error"].encode())
            out.append(_DD + uv(len(b)) + b)
        if len(out) == 1:
            return b""
        a = b"".join(out)
        n = len(a)
        return _E + (_U[n] if n < _NU else uv(n)) + a

    # ---- one operation ----
    def _common(self, run: str, stream: str, rank: int, index: int, seq: Any, step: Any, site_block: bytes,
                corr: tuple[str, str, str], other: bytes | None, diff: Diff | None) -> tuple[bytes, list[bytes]]:
        """(record_id bytes, framed annotations up to the slots)."""
        prefix, rid, _ = self.head(run, stream, rank)
        ridb = prefix + b"%d" % index
        a = rid + uv(len(ridb)) + ridb
        parts = [_E + uv(len(a)) + a]
        if seq is not None:
            parts.append(self._int("seq", int(seq)))
        if step is not None:
            parts.append(self._int("step", int(step)))
        parts.append(site_block)
        pre, post, tail = self._corr(*corr)
        c = pre + self._sb("other", other) + post if other is not None else pre + post
        parts.append(_E + uv(len(c)) + c)
        parts.append(tail)
        if diff is not None and diff.status == MISMATCH:
            dd: dict[str, object] = {"fields": ", ".join(diff.fields), "inputs_equal": diff.inputs_equal,
                                     "introduced": diff.introduced}
            if diff.function:
                dd["function"] = diff.function
            if diff.args:
                dd["args"] = "; ".join(diff.args)
            dd.update(diff.numeric)
            parts.append(_frame(self.ann.value("diff", dd)))
        return ridb, parts

    def site_entry(self, site: RecordSite) -> tuple[bytes, bytes]:
        """(framed callsite/context/collective annotations, TrackEvent name field) of a call site."""
        return (self._site_block(site.file, site.line, site.scope, site.line_digest, site.site, site.context,
                                 site.collective, site.line_map), self.ann.event_name(site.function))

    def capture_op(self, track: int, ts: int, head: tuple[bytes, bytes, bytes], site: tuple[bytes, bytes],
                   index: int, ridb: bytes, obj: dict[str, Any], dumps: dict[int, dict[str, str]],
                   corr: tuple[str, str, str], other: bytes | None, flow_out: int | None = None,
                   flow_in: int | None = None, slots: bytes | None = None, same: bool = False) -> bytes:
        """Emit the slice of a capture ``op`` record (no diff: ``ok`` or unresolved) straight from its
        JSON object. ``head``: :meth:`head` of its stream; ``site``: :meth:`site_entry` of its call
        site (as pass 1 found it for this record); ``ridb``: its :meth:`record_id`. Returns the
        encoded slot annotations, which the caller may pass back as ``slots`` for a record whose
        slots are equal in every field; ``same``: write ``slots: same as other`` instead of them (B's
        slice of an ``ok`` pair whose recorded slots equal A's in every field). Raises KeyError/
        TypeError/ValueError/AttributeError on a record it does not take (the caller then takes the
        :class:`Record` path, which reports what is wrong with it)."""
        if obj["rank"].__class__ is not int:
            raise TypeError("rank")
        a = head[1] + uv(len(ridb)) + ridb
        parts = [_E + uv(len(a)) + a]
        seq: Any = obj.get("seq")
        if seq is not None:
            v = varint(int(seq))
            parts.append(_E + _U[len(self._nseq) + len(v)] + self._nseq + v)
        step = obj.get("step")
        if step is not None:
            v = varint(int(step))
            parts.append(_E + _U[len(self._nstep) + len(v)] + self._nstep + v)
        parts.append(site[0])
        cb = self._corrs.get(corr)
        pre, post, tail = cb if cb is not None else self._corr(*corr)
        if other is not None:
            op = self._str_pre.get(("other", len(other)))
            c = pre + (op + other if op is not None else self._sb("other", other)) + post
        else:
            c = pre + post
        n = len(c)
        parts.append(_E + (_U[n] if n < _NU else uv(n)) + c)
        parts.append(tail)
        if slots is None:
            d = dumps.get(seq) if dumps else None
            slots = self._raw_slots("inputs", obj.get("inputs"), "in", d) + \
                self._raw_slots("outputs", obj.get("outputs"), "out", d, obj.get("error"))
        raw_args = obj.get("args")
        if raw_args:
            parts.append(self._args(capture_args(raw_args)))
        parts.append(self._same if same else slots)
        self.w.slice_named(track, ts, site[1], b"".join(parts), flow_out, flow_in)
        return slots

    def op(self, track: int, ts: int, run: str, stream: str, rec: Record, corr: tuple[str, str, str],
           other: bytes | None, diff: Diff | None, flow_out: int | None = None, flow_in: int | None = None,
           slots: bytes | None = None, same: bool = False) -> bytes:
        """Emit the slice of a :class:`Record`; returns (and takes) slots as :meth:`capture_op` does."""
        block = self._site_block(rec.file, rec.line, rec.scope, rec.line_digest, rec.site, rec.context,
                                 rec.collective, rec.line_map)
        _ridb, parts = self._common(run, stream, rec.rank, rec.index, rec.seq, rec.step, block, corr, other, diff)
        if slots is None:
            ins = [self._slot(s) for s in rec.inputs]
            outs = [self._slot(s) for s in rec.outputs]
            slots = (_frame(self._dict("inputs", ins)) if ins else b"") + \
                (_frame(self._dict("outputs", outs)) if outs else b"")
        if rec.args:
            parts.append(self._args(rec.args))
        parts.append(self._same if same else slots)
        name = self._fnames.get(rec.function)
        if name is None:
            name = self._fnames[rec.function] = self.ann.event_name(rec.function)
        self.w.slice_named(track, ts, name, b"".join(parts), flow_out, flow_in)
        return slots

    def record_id(self, run: str, stream: str, rank: int, index: int) -> bytes:
        """The record_id of an operation, UTF-8 (``<run>/rank<R>/<stream>/<index>``)."""
        return self.head(run, stream, rank)[0] + b"%d" % index
