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

import hashlib
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opguard.compare.protoenc import Annotations, F, decode_annotation, ld, uv, vfield
from opguard.errors import ConfigError

ROW_NS = 1000
SLICE_NS = 800
SEQ_ID = 1


class ExportWriter:
    """Streams packets to ``path`` (via a temporary file); :meth:`commit` publishes it."""

    def __init__(self, path: Path, attributes: dict[str, str | int]) -> None:
        self.path = path
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"the directory of the export {path}, {parent}, does not exist",
                              f"create it first: mkdir -p {parent}")
        if path.is_dir():
            raise ConfigError(f"the export path {path} is a directory", "pass a file name, e.g. compare.pftrace")
        self.tmp = parent / f".{path.name}.opguard-tmp-{secrets.token_hex(4)}"
        self._f = open(self.tmp, "wb", buffering=1 << 20)  # noqa: SIM115 (closed in commit/abort)
        self.ann = Annotations()
        self._uuid = 0
        self.slices = 0
        self.flows = 0
        self._write(vfield(F.P_SEQ_ID, SEQ_ID) + vfield(F.P_SEQ_FLAGS, F.SEQ_INCREMENTAL_STATE_CLEARED))
        attrs = []
        for k, v in attributes.items():
            val = vfield(F.A_LONG, v) if isinstance(v, int) else ld(F.A_STRING, str(v).encode())
            attrs.append(ld(F.A_ATTRIBUTE, ld(F.A_KEY, k.encode()) + val))
        self._write(ld(F.P_TRACE_ATTRIBUTES, b"".join(attrs)) + vfield(F.P_SEQ_ID, SEQ_ID))

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
        self._write(ld(F.P_TRACK_DESCRIPTOR, body) + vfield(F.P_SEQ_ID, SEQ_ID))
        return self._uuid

    def slice(self, track: int, ts: int, name: str, annotations: list[bytes], *,
              flows_out: Sequence[int] = (), flows_in: Sequence[int] = ()) -> None:
        ev = [vfield(F.E_TYPE, F.SLICE_BEGIN), vfield(F.E_TRACK, track), ld(F.E_NAME, name.encode())]
        ev.extend(ld(F.E_ANNOTATION, a) for a in annotations)
        for f in flows_out:
            ev.append(F.E_FLOW + struct.pack("<Q", f))
            self.flows += 1
        for f in flows_in:
            ev.append(F.E_TERMINATING_FLOW + struct.pack("<Q", f))
        pkt = vfield(F.P_TIMESTAMP, ts) + ld(F.P_TRACK_EVENT, b"".join(ev)) + vfield(F.P_SEQ_ID, SEQ_ID)
        new = self.ann.take_new_names()
        if new:
            pkt += ld(F.P_INTERNED, new)
        self._write(pkt + vfield(F.P_SEQ_FLAGS, F.SEQ_NEEDS_INCREMENTAL_STATE))
        end = vfield(F.E_TYPE, F.SLICE_END) + vfield(F.E_TRACK, track)
        self._write(vfield(F.P_TIMESTAMP, ts + SLICE_NS) + ld(F.P_TRACK_EVENT, end) + vfield(F.P_SEQ_ID, SEQ_ID))
        self.slices += 1

    def commit(self) -> int:
        """Publish the file; returns its size in bytes."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return self.path.stat().st_size

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


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
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb  # type: ignore[import-untyped]

    try:
        trace = pb.Trace.FromString(path.read_bytes())
    except OSError as e:
        raise ConfigError(f"cannot read the export {path}: {e}", "pass an existing export file") from None
    except Exception as e:  # protobuf's DecodeError
        raise ConfigError(f"{path} is not a Perfetto protobuf trace ({e})",
                          "pass a file written by `opguard compare -o`") from None
    names: dict[int, str] = {}
    attributes: dict[str, Any] = {}
    tracks: dict[int, dict[str, Any]] = {}
    ops: list[ExportedOp] = []
    for p in trace.packet:
        if p.HasField("interned_data"):
            for n in p.interned_data.debug_annotation_names:
                names[n.iid] = n.name
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
            args = dict(decode_annotation(a, names) for a in ev.debug_annotations)
            ops.append(ExportedOp(ev.track_uuid, p.timestamp, ev.name, args, list(ev.flow_ids),
                                  list(ev.terminating_flow_ids)))
    if "opguard.export" not in attributes:
        raise ConfigError(f"{path} is a Perfetto trace but not an opguard compare export",
                          "pass a file written by `opguard compare -o`")
    return Export(attributes, tracks, ops)
