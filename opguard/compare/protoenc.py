"""A small, fast protobuf encoder for the Perfetto trace messages the export writes.

Field numbers come from the ``perfetto`` package's own descriptors (``perfetto_trace_pb2``), so
the bytes are exactly what those protos define; the tests parse every export back with them.
Building a message object per event costs ~70 µs in Python; this costs a few µs.
"""

from __future__ import annotations

import struct
from typing import Any

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

VARINT, I64, LEN = 0, 1, 2


def _num(msg: Any, name: str) -> int:
    return int(msg.DESCRIPTOR.fields_by_name[name].number)


def varint(n: int) -> bytes:
    """A varint (a negative int as its 64-bit two's complement, as protobuf's int64)."""
    if 0 <= n < _N_SMALL:
        return _SMALL[n]
    if 0 < n < _N_SMALL2:                       # timestamps and indices: two table lookups
        return _CONT[n & 0x3FFF] + (_SMALL[n >> 14] if n < _N_SMALL3 else _CONT[(n >> 14) & 0x3FFF] + _SMALL[n >> 28])
    if n < 0:
        n += 1 << 64
    return _varint_slow(n)


def _varint_slow(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_N_SMALL = 1 << 14
_N_SMALL3 = 1 << 28
_N_SMALL2 = 1 << 42
_SMALL = [_varint_slow(i) for i in range(_N_SMALL)]
SMALL_VARINTS, N_SMALL = _SMALL, _N_SMALL      # varint(n) is SMALL_VARINTS[n] for 0 <= n < N_SMALL
_CONT = [bytes((b[0] | 0x80, (b[1] if len(b) > 1 else 0) | 0x80)) for b in _SMALL]   # 14 bits, more follow


def uv(n: int) -> bytes:
    """An unsigned varint (a length, a small count)."""
    return _SMALL[n] if 0 <= n < _N_SMALL else varint(n)


def tag(field: int, wire: int) -> bytes:
    return varint((field << 3) | wire)


def ld(field_tag: bytes, payload: bytes) -> bytes:
    return field_tag + uv(len(payload)) + payload


def vfield(field_tag: bytes, n: int) -> bytes:
    return field_tag + uv(n)


class F:
    """Pre-encoded field tags."""

    TRACE_PACKET = tag(_num(pb.Trace, "packet"), LEN)
    # TracePacket
    P_TIMESTAMP = tag(_num(pb.TracePacket, "timestamp"), VARINT)
    P_TRACK_EVENT = tag(_num(pb.TracePacket, "track_event"), LEN)
    P_TRACK_DESCRIPTOR = tag(_num(pb.TracePacket, "track_descriptor"), LEN)
    P_TRACE_ATTRIBUTES = tag(_num(pb.TracePacket, "trace_attributes"), LEN)
    P_SEQ_ID = tag(_num(pb.TracePacket, "trusted_packet_sequence_id"), VARINT)
    P_INTERNED = tag(_num(pb.TracePacket, "interned_data"), LEN)
    P_SEQ_FLAGS = tag(_num(pb.TracePacket, "sequence_flags"), VARINT)
    # TrackEvent
    E_TYPE = tag(_num(pb.TrackEvent, "type"), VARINT)
    E_TRACK = tag(_num(pb.TrackEvent, "track_uuid"), VARINT)
    E_NAME = tag(_num(pb.TrackEvent, "name"), LEN)
    E_ANNOTATION = tag(_num(pb.TrackEvent, "debug_annotations"), LEN)
    E_FLOW = tag(_num(pb.TrackEvent, "flow_ids"), I64)
    E_TERMINATING_FLOW = tag(_num(pb.TrackEvent, "terminating_flow_ids"), I64)
    SLICE_BEGIN = int(pb.TrackEvent.TYPE_SLICE_BEGIN)
    SLICE_END = int(pb.TrackEvent.TYPE_SLICE_END)
    # TrackDescriptor
    T_UUID = tag(_num(pb.TrackDescriptor, "uuid"), VARINT)
    T_PARENT = tag(_num(pb.TrackDescriptor, "parent_uuid"), VARINT)
    T_NAME = tag(_num(pb.TrackDescriptor, "name"), LEN)
    T_DESCRIPTION = tag(_num(pb.TrackDescriptor, "description"), LEN)
    T_ORDER = tag(_num(pb.TrackDescriptor, "sibling_order_rank"), VARINT)
    T_CHILD_ORDERING = tag(_num(pb.TrackDescriptor, "child_ordering"), VARINT)
    EXPLICIT_ORDERING = int(pb.TrackDescriptor.ChildTracksOrdering.EXPLICIT)
    # TraceAttributes
    A_ATTRIBUTE = tag(_num(pb.TraceAttributes, "attribute"), LEN)
    A_KEY = tag(_num(pb.TraceAttributes.Attribute, "key"), LEN)
    A_STRING = tag(_num(pb.TraceAttributes.Attribute, "string_value"), LEN)
    A_LONG = tag(_num(pb.TraceAttributes.Attribute, "long_value"), VARINT)
    # InternedData / DebugAnnotationName
    I_ANNOTATION_NAMES = tag(_num(pb.InternedData, "debug_annotation_names"), LEN)
    N_IID = tag(_num(pb.DebugAnnotationName, "iid"), VARINT)
    N_NAME = tag(_num(pb.DebugAnnotationName, "name"), LEN)
    I_STRING_VALUES = tag(_num(pb.InternedData, "debug_annotation_string_values"), LEN)
    S_IID = tag(_num(pb.InternedString, "iid"), VARINT)
    S_STR = tag(_num(pb.InternedString, "str"), LEN)
    I_EVENT_NAMES = tag(_num(pb.InternedData, "event_names"), LEN)
    EN_IID = tag(_num(pb.EventName, "iid"), VARINT)
    EN_NAME = tag(_num(pb.EventName, "name"), LEN)
    E_NAME_IID = tag(_num(pb.TrackEvent, "name_iid"), VARINT)
    # DebugAnnotation
    D_NAME_IID = tag(_num(pb.DebugAnnotation, "name_iid"), VARINT)
    D_BOOL = tag(_num(pb.DebugAnnotation, "bool_value"), VARINT)
    D_INT = tag(_num(pb.DebugAnnotation, "int_value"), VARINT)
    D_DOUBLE = tag(_num(pb.DebugAnnotation, "double_value"), I64)
    D_STRING = tag(_num(pb.DebugAnnotation, "string_value"), LEN)
    D_STRING_IID = tag(_num(pb.DebugAnnotation, "string_value_iid"), VARINT)
    D_DICT = tag(_num(pb.DebugAnnotation, "dict_entries"), LEN)
    SEQ_INCREMENTAL_STATE_CLEARED = int(pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED)
    SEQ_NEEDS_INCREMENTAL_STATE = int(pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE)


class Annotations:
    """Debug annotations with interned names and string values, and interned event names (Perfetto's
    InternedData, per packet sequence); ``take_new_names()`` yields the InternedData bytes of what
    was interned since the last call (written in the packet that first uses it)."""

    def __init__(self) -> None:
        self._iid: dict[str, bytes] = {}
        self._sv: dict[str, bytes] = {}
        self._events: dict[str, bytes] = {}
        self.pending: list[bytes] = []

    def sv(self, value: str) -> bytes:
        """The encoded (interned) string value field of an annotation."""
        b = self._sv.get(value)
        if b is None:
            iid = len(self._sv) + 1
            b = self._sv[value] = F.D_STRING_IID + uv(iid)
            self.pending.append(ld(F.I_STRING_VALUES, F.S_IID + uv(iid) +
                                   ld(F.S_STR, value.encode("utf-8", "surrogatepass"))))
        return b

    def event_name(self, name: str) -> bytes:
        """The encoded (interned) TrackEvent name field."""
        b = self._events.get(name)
        if b is None:
            iid = len(self._events) + 1
            b = self._events[name] = F.E_NAME_IID + uv(iid)
            self.pending.append(ld(F.I_EVENT_NAMES, F.EN_IID + uv(iid) +
                                   ld(F.EN_NAME, name.encode("utf-8", "surrogatepass"))))
        return b

    def name(self, name: str) -> bytes:
        """The encoded (interned) name field of an annotation."""
        return self._name(name)

    def _name(self, name: str) -> bytes:
        b = self._iid.get(name)
        if b is None:
            iid = len(self._iid) + 1
            b = F.D_NAME_IID + uv(iid)
            self._iid[name] = b
            self.pending.append(ld(F.I_ANNOTATION_NAMES, F.N_IID + uv(iid) + ld(F.N_NAME, name.encode())))
        return b

    def take_new_names(self) -> bytes:
        if not self.pending:
            return b""
        out = b"".join(self.pending)
        self.pending = []
        return out

    def s(self, name: str, value: str) -> bytes:
        """A string annotation, its value interned (use :meth:`inline` for values seen once)."""
        return self._name(name) + self.sv(value)

    def inline(self, name: str, value: str) -> bytes:
        return self._name(name) + ld(F.D_STRING, value.encode("utf-8", "surrogatepass"))

    def i(self, name: str, value: int) -> bytes:
        return self._name(name) + F.D_INT + varint(value)

    def d(self, name: str, value: float) -> bytes:
        return self._name(name) + F.D_DOUBLE + struct.pack("<d", value)

    def b(self, name: str, value: bool) -> bytes:
        return self._name(name) + F.D_BOOL + (b"\x01" if value else b"\x00")

    def dict(self, name: str, entries: list[bytes]) -> bytes:
        return self._name(name) + b"".join(ld(F.D_DICT, e) for e in entries)

    def value(self, name: str, v: Any) -> bytes:
        """A typed annotation for a plain Python value (dicts nest)."""
        if isinstance(v, bool):
            return self.b(name, v)
        if isinstance(v, int):
            return self.i(name, v)
        if isinstance(v, float):
            return self.d(name, v)
        if isinstance(v, dict):
            return self.dict(name, [self.value(str(k), x) for k, x in v.items() if x is not None])
        return self.s(name, str(v))


def decode_annotation(a: Any, names: dict[int, str], strings: dict[int, str] | None = None) -> tuple[str, Any]:
    """(name, value) of a parsed DebugAnnotation; dict entries become Python dicts; interned string
    values are looked up in ``strings``."""
    name = a.name if a.HasField("name") else names.get(a.name_iid, f"#{a.name_iid}")
    which = a.WhichOneof("value")
    if which is None and len(a.dict_entries):
        return name, dict(decode_annotation(e, names, strings) for e in a.dict_entries)
    if which is None:
        return name, {}
    if which == "string_value_iid":
        iid = a.string_value_iid
        return name, (strings or {}).get(iid, f"#{iid}")
    return name, getattr(a, which)
