"""The Perfetto view of a comparison, in the protobuf trace format (``docs/compare.md`` §5).

Layout: one parent track per run ("run A", "run B"), a child track per rank and stream, a slice
per operation whose typed debug annotations carry its record, call site, correspondence, status
and observations, one flow per pair (from A's slice to B's), and the trace attributes
``opguard.input_a.sha256`` / ``opguard.input_b.sha256`` (plus paths and kinds). Slices of one
stream pair share one timeline: row *r* of the merged execution order starts at *r* µs, so a pair
sits at the same time on both runs' tracks.

The file is written to a temporary name beside OUT and renamed into place when complete.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from opguard.compare.protoenc import Annotations, F, decode_annotation, ld, uv, varint, vfield
from opguard.errors import ConfigError

ROW_NS = 1000
SLICE_NS = 800
SEQ_ID = 1

_PACKET, _TS, _EVENT = F.TRACE_PACKET, F.P_TIMESTAMP, F.P_TRACK_EVENT
_FLOW_OUT, _FLOW_IN = F.E_FLOW, F.E_TERMINATING_FLOW
_NEEDS_STATE = vfield(F.P_SEQ_FLAGS, F.SEQ_NEEDS_INCREMENTAL_STATE)
_pack_q = struct.Struct("<Q").pack


class ExportWriter:
    """Streams packets to ``path`` (via a temporary file); :meth:`commit` publishes it."""

    def __init__(self, path: Path, attributes: dict[str, str | int] | None, *, seq_id: int = SEQ_ID,
                 part: bool = False) -> None:
        """``part=True``: a fragment written straight to ``path`` (its own packet sequence
        ``seq_id``, no attributes), later appended to the export with :meth:`append_part`."""
        self.path = path
        self.seq_id = seq_id
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"the directory of the export {path}, {parent}, does not exist",
                              f"create it first: mkdir -p {parent}")
        if path.is_dir():
            raise ConfigError(f"the export path {path} is a directory", "pass a file name, e.g. compare.pftrace")
        self.part = part
        self.tmp = path if part else parent / f".{path.name}.opguard-tmp-{secrets.token_hex(4)}"
        self._f = open(self.tmp, "wb", buffering=1 << 20)  # noqa: SIM115 (closed in commit/abort)
        self.ann = Annotations()
        self._uuid = 0
        self._track_parts: dict[int, tuple[bytes, bytes, bytes]] = {}
        self.slices = 0
        self.flows = 0
        self._write(vfield(F.P_SEQ_ID, seq_id) + vfield(F.P_SEQ_FLAGS, F.SEQ_INCREMENTAL_STATE_CLEARED))
        if attributes is None:
            return
        attrs = []
        for k, v in attributes.items():
            val = vfield(F.A_LONG, v) if isinstance(v, int) else ld(F.A_STRING, str(v).encode())
            attrs.append(ld(F.A_ATTRIBUTE, ld(F.A_KEY, k.encode()) + val))
        self._write(ld(F.P_TRACE_ATTRIBUTES, b"".join(attrs)) + vfield(F.P_SEQ_ID, seq_id))

    def _write(self, packet: bytes) -> None:
        self._f.write(F.TRACE_PACKET + uv(len(packet)) + packet)

    def track(self, name: str, *, parent: int | None = None, order: int | None = None,
              description: str | None = None) -> int:
        self._uuid += 1
        body = vfield(F.T_UUID, self._uuid) + ld(F.T_NAME, name.encode())
        if parent is not None:
            body += vfield(F.T_PARENT, parent)
        else:
            body += vfield(F.T_CHILD_ORDERING, F.EXPLICIT_ORDERING)
        if order is not None:
            body += vfield(F.T_ORDER, order)
        if description:
            body += ld(F.T_DESCRIPTION, description.encode())
        self._write(ld(F.P_TRACK_DESCRIPTOR, body) + vfield(F.P_SEQ_ID, self.seq_id))
        return self._uuid

    def slice(self, track: int, ts: int, name: str, annotations: list[bytes], *,
              flows_out: Sequence[int] = (), flows_in: Sequence[int] = ()) -> None:
        framed = b"".join(F.E_ANNOTATION + uv(len(a)) + a for a in annotations)
        self.slice_framed(track, ts, name, framed, flows_out=flows_out, flows_in=flows_in)

    def slice_framed(self, track: int, ts: int, name: str, framed: bytes, *,
                     flows_out: Sequence[int] = (), flows_in: Sequence[int] = ()) -> None:
        """A slice whose annotations are already framed as TrackEvent.debug_annotations fields."""
        ev = [vfield(F.E_TYPE, F.SLICE_BEGIN), vfield(F.E_TRACK, track), self.ann.event_name(name), framed]
        for f in flows_out:
            ev.append(F.E_FLOW + struct.pack("<Q", f))
            self.flows += 1
        for f in flows_in:
            ev.append(F.E_TERMINATING_FLOW + struct.pack("<Q", f))
        seq = vfield(F.P_SEQ_ID, self.seq_id)
        pkt = vfield(F.P_TIMESTAMP, ts) + ld(F.P_TRACK_EVENT, b"".join(ev)) + seq
        new = self.ann.take_new_names()
        if new:
            pkt += ld(F.P_INTERNED, new)
        self._write(pkt + vfield(F.P_SEQ_FLAGS, F.SEQ_NEEDS_INCREMENTAL_STATE))
        end = vfield(F.E_TYPE, F.SLICE_END) + vfield(F.E_TRACK, track)
        self._write(vfield(F.P_TIMESTAMP, ts + SLICE_NS) + ld(F.P_TRACK_EVENT, end) + seq)
        self.slices += 1

    def slice_named(self, track: int, ts: int, name_field: bytes, framed: bytes, flow_out: int | None,
                    flow_in: int | None) -> None:
        """:meth:`slice_framed` for one operation: the TrackEvent name field already encoded, at most
        one flow out and one in. The same bytes, with per-track parts cached."""
        parts = self._track_parts.get(track)
        if parts is None:
            seq = vfield(F.P_SEQ_ID, self.seq_id)
            end = vfield(F.E_TYPE, F.SLICE_END) + vfield(F.E_TRACK, track)
            parts = self._track_parts[track] = (vfield(F.E_TYPE, F.SLICE_BEGIN) + vfield(F.E_TRACK, track), seq,
                                                ld(F.P_TRACK_EVENT, end) + seq)
        begin, seq, end_tail = parts
        n = len(begin) + len(name_field) + len(framed)     # the TrackEvent's length
        fo = fi = b""
        if flow_out is not None:
            fo = _FLOW_OUT + _pack_q(flow_out)
            n += len(fo)
            self.flows += 1
        if flow_in is not None:
            fi = _FLOW_IN + _pack_q(flow_in)
            n += len(fi)
        tsv = varint(ts)
        evl = uv(n)
        interned = ld(F.P_INTERNED, self.ann.take_new_names()) if self.ann.pending else b""
        end = _TS + varint(ts + SLICE_NS) + end_tail
        self._f.write(b"".join((_PACKET, uv(len(_TS) + len(tsv) + len(_EVENT) + len(evl) + n + len(seq) + len(interned)
                                             + len(_NEEDS_STATE)),
                                _TS, tsv, _EVENT, evl, begin, name_field, framed, fo, fi, seq, interned, _NEEDS_STATE,
                                _PACKET, uv(len(end)), end)))
        self.slices += 1

    def append_part(self, part: Path, slices: int, flows: int) -> None:
        """Append a fragment written by a part writer (then removed)."""
        self._f.flush()
        with open(part, "rb") as f:
            _copy(f, self._f)
        part.unlink()
        self.slices += slices
        self.flows += flows

    def commit(self) -> int:
        """Publish the file (a part: just close it); returns its size in bytes."""
        self._f.flush()
        if self.part:
            self._f.close()
            return self.path.stat().st_size
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return self.path.stat().st_size

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    """Append all of ``src`` to ``dst`` (flushed): in the kernel (copy_file_range) where it can."""
    size = os.fstat(src.fileno()).st_size
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src.fileno(), dst.fileno(), size - done)
            if n == 0:
                break
            done += n
    except OSError as e:
        if done or e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
            raise
    src.seek(done)
    dst.seek(0, os.SEEK_END)
    shutil.copyfileobj(src, dst, 1 << 22)      # the rest (none unless the kernel could not copy)


# ---- reading an export back (align, tests) ------------------------------------------------------

@dataclass
class ExportedOp:
    track: int
    ts: int
    name: str
    args: dict[str, Any]
    flows_out: list[int] = field(default_factory=list)
    flows_in: list[int] = field(default_factory=list)

    @property
    def record_id(self) -> str:
        return str(self.args.get("record_id"))


@dataclass
class Export:
    attributes: dict[str, Any]
    tracks: dict[int, dict[str, Any]]
    ops: list[ExportedOp]

    def by_id(self) -> dict[str, ExportedOp]:
        return {op.record_id: op for op in self.ops}


def read_export(path: Path) -> Export:
    """Parse an export with the perfetto package's protos (no trace processor needed)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    try:
        trace = pb.Trace.FromString(path.read_bytes())
    except OSError as e:
        raise ConfigError(f"cannot read the export {path}: {e}", "pass an existing export file") from None
    except Exception as e:  # protobuf's DecodeError
        raise ConfigError(f"{path} is not a Perfetto protobuf trace ({e})",
                          "pass a file written by `opguard compare -o`") from None
    names_by_seq: dict[int, dict[int, str]] = {}     # interned names are per packet sequence
    strings_by_seq: dict[int, dict[int, str]] = {}
    events_by_seq: dict[int, dict[int, str]] = {}
    attributes: dict[str, Any] = {}
    tracks: dict[int, dict[str, Any]] = {}
    ops: list[ExportedOp] = []
    for p in trace.packet:
        names = names_by_seq.setdefault(p.trusted_packet_sequence_id, {})
        strings = strings_by_seq.setdefault(p.trusted_packet_sequence_id, {})
        events = events_by_seq.setdefault(p.trusted_packet_sequence_id, {})
        if p.sequence_flags & F.SEQ_INCREMENTAL_STATE_CLEARED:
            names.clear()
            strings.clear()
            events.clear()
        if p.HasField("interned_data"):
            for n in p.interned_data.debug_annotation_names:
                names[n.iid] = n.name
            for s in p.interned_data.debug_annotation_string_values:
                strings[s.iid] = s.str.decode("utf-8", "surrogatepass")
            for en in p.interned_data.event_names:
                events[en.iid] = en.name
        if p.HasField("trace_attributes"):
            for a in p.trace_attributes.attribute:
                attributes[a.key] = a.string_value if a.HasField("string_value") else a.long_value
        if p.HasField("track_descriptor"):
            t = p.track_descriptor
            tracks[t.uuid] = {"name": t.name, "parent": t.parent_uuid if t.HasField("parent_uuid") else None,
                              "description": t.description,
                              "order": t.sibling_order_rank if t.HasField("sibling_order_rank") else None}
        if p.HasField("track_event") and p.track_event.type == F.SLICE_BEGIN:
            ev = p.track_event
            args = dict(decode_annotation(a, names, strings) for a in ev.debug_annotations)
            name = ev.name if ev.HasField("name") else events.get(ev.name_iid, f"#{ev.name_iid}")
            ops.append(ExportedOp(ev.track_uuid, p.timestamp, name, args, list(ev.flow_ids),
                                  list(ev.terminating_flow_ids)))
    if "opguard.export" not in attributes:
        raise ConfigError(f"{path} is a Perfetto trace but not an opguard compare export",
                          "pass a file written by `opguard compare -o`")
    restore_implied(ops)
    return Export(attributes, tracks, ops)


def callsite_text(cs: dict[str, Any]) -> str:
    """The ``callsite`` annotation's value: the JSON text of its dict (entries that are None left out)."""
    return json.dumps({k: v for k, v in cs.items() if v is not None}, separators=(",", ":"))


IMPLIED = ("run", "rank", "stream", "index")      # derived from record_id, not written (docs/compare.md §5)
_RECORD_ID = re.compile(r"([^/]+)/rank(-?\d+)/(.+)/(\d+)")


def restore_implied(ops: list[ExportedOp]) -> None:
    """What the export leaves implied, made explicit in each op's args (docs/compare.md §5): the
    ``callsite`` dict from its JSON text, ``run``,
    ``rank``, ``stream`` and ``index`` from the record_id, and the ``inputs``/``outputs`` of a slice
    marked ``slots: same as other`` copied from the slice its ``correspondence.other`` names."""
    by_id: dict[str, ExportedOp] = {}
    for op in ops:
        cs = op.args.get("callsite")
        if isinstance(cs, str) and cs.startswith("{"):
            op.args["callsite"] = json.loads(cs)
        rid = op.args.get("record_id")
        if isinstance(rid, str):
            by_id[rid] = op
            m = _RECORD_ID.fullmatch(rid)
            if m and "run" not in op.args:
                rest = {k: v for k, v in op.args.items() if k != "record_id"}
                op.args.clear()
                op.args.update(record_id=rid, run=m[1], rank=int(m[2]), stream=m[3], index=int(m[4]), **rest)
    for op in ops:
        if op.args.get("slots") != "same as other":
            continue
        corr = op.args.get("correspondence")
        other = by_id.get(corr.get("other", "")) if isinstance(corr, dict) else None
        if other is None:
            raise ConfigError(f"slice {op.record_id} says its slots are those of the other run's slice, but "
                              "that slice is not in the export", "pass an export written whole by opguard compare")
        del op.args["slots"]
        for k in ("inputs", "outputs"):
            if k in other.args:
                op.args[k] = other.args[k]
