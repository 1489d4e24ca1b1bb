"""``opguard compare A B -o OUT``: resolve, pair, diff, export, summarise (``docs/compare.md``).

Two passes over each corresponding stream: the first reads only what pairing needs (call-site
keys and captured-input anchor keys, as integers), the second walks both streams in the merged
order, diffs the pairs and streams the slices into the export, so memory stays bounded by the
number of operations, not their size.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import secrets
from array import array
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import IO, Any

from orjson import loads as orjson_loads

from opguard.compare.diff import MISMATCH, OK, UNALIGNED, Diff, diff_pair
from opguard.compare.linemap import MOVED, assign_identities, is_new_line
from opguard.compare.opevents import OpEncoder
from opguard.compare.pairing import (
    EDITED_LINE_CALLS,
    FUNCTION_DIFFERS,
    NO_ANCHOR,
    NO_CORRESPONDING_FILE,
    NO_COUNTERPART_IN_SEGMENT,
    NOT_IN_OTHER_SEGMENT,
    Pairing,
    pair_streams,
)
from opguard.compare.perfetto_export import ROW_NS, ExportWriter
from opguard.compare.records import Record, RecordSite, Slot
from opguard.compare.sources import KIND_CAPTURE, Run, Stream, open_run
from opguard.compare.summary import (
    ARGS_DIFFER,
    COLLECTIVE_DIFFERS,
    FUNCTION_DIFFERS_KIND,
    INHERITED,
    MODULE_DIFFERS,
    OUTPUT_FORM_DIFFERS,
    OUTPUTS_DIFFER,
    REORDERED,
    UNSEEN_INPUTS,
    FirstMismatch,
    StreamSummary,
    Summary,
    other_inputs,
    random_differs,
)
from opguard.errors import ConfigError, OpguardError
from opguard.staging import forkpool

EXPORT_KIND = "opguard-compare-v2"
# the reasons of an unresolved operation the other run does not make there (docs/compare.md §6)
_NOT_MADE = (NOT_IN_OTHER_SEGMENT, EDITED_LINE_CALLS, NO_COUNTERPART_IN_SEGMENT)


def anchor_hash(text: str) -> int:
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return h or 1


@dataclass
class _Index:
    keys: array[int]
    line_keys: array[int]
    anchors: array[int]
    collectives: list[int]                 # positions of collective operations
    all_digests: bool                      # every record has a source-line digest
    files: array[int]                      # where each operation starts (capture streams)
    offsets: array[int]
    dumps: dict[int, dict[str, str]]
    notes: list[str]
    site_ids: array[int] = field(default_factory=lambda: array("q"))   # capture: each operation's call site
    sites: list[RecordSite] = field(default_factory=list)
    inputs: array[int] = field(default_factory=lambda: array("Q"))   # captured-input key without the function
    nested: bytearray | None = None        # capture: 1 for an operation made inside another recorded one (depth > 0)
    steps: array[int] = field(default_factory=lambda: array("q"))   # capture: each operation's step (none: 0)
    grad_off: bytearray | None = None      # capture: 1 for an operation recorded with grad mode off ("grad": false)


_MASK = (1 << 64) - 1
_INT_FIELDS = ("seq", "step", "line", "depth", "parent", "site")


def inputs_key(text: str) -> int:
    """The key of an operation's captured inputs without its function (docs/compare.md §2 rule 5):
    a 64-bit hash, consistent within this process and the workers it forks (never stored)."""
    return (hash(text) & _MASK) or 1


def _intern(intern: dict[str, int], k: str) -> int:
    kid = intern.get(k)
    if kid is None:
        kid = intern[k] = len(intern) + 1
    return kid


def _index_local(stream: Stream) -> tuple[list[str], _Index]:
    """Pass 1 over one stream, with a local key table (so it can run in a worker process)."""
    intern: dict[str, int] = {}
    keys = array("q")
    line_keys = array("q")
    anchors = array("Q")
    files = array("q")
    offsets = array("q")
    coll: list[int] = []
    if stream.kind == KIND_CAPTURE:
        site_ids = array("q")
        sites: list[RecordSite] = []
        inputs = array("Q")
        nested = bytearray()
        steps = array("q")
        grad_off = bytearray()
        all_digests = _index_capture(stream, intern, keys, line_keys, anchors, coll, files, offsets, site_ids, sites,
                                     inputs, nested, steps, grad_off)
        return _table(intern), _Index(keys, line_keys, anchors, coll, all_digests, files, offsets, stream.dumps,
                                      stream.notes, site_ids, sites, inputs, nested, steps, grad_off)
    all_digests = True
    ref_ids = array("q")
    ref_sites: list[RecordSite] = []
    ref_inputs = array("Q")
    seen: dict[tuple[Any, ...], int] = {}
    for rec in stream.reference_records():
        raw = (rec.function, rec.file, rec.line, rec.context, rec.collective, rec.line_digest)
        sid = seen.get(raw)
        if sid is None:
            sid = seen[raw] = len(ref_sites)
            ref_sites.append(RecordSite(rec.function, rec.file, rec.line, rec.scope, rec.line_digest, rec.site,
                                        rec.context, rec.collective, rec.key(), rec.line_key()))
        keys.append(_intern(intern, ref_sites[sid].key))
        line_keys.append(keys[-1])
        all_digests = all_digests and rec.line_digest is not None
        text = rec.anchor_text()
        anchors.append(anchor_hash(text) if text and not rec.collective else NO_ANCHOR)
        ref_inputs.append(inputs_key(text.split("\x00", 1)[1]) if text else NO_ANCHOR)
        if rec.collective:
            coll.append(len(keys) - 1)
        files.append(0)
        offsets.append(0)
        ref_ids.append(sid)
    return _table(intern), _Index(keys, line_keys, anchors, coll, all_digests, files, offsets, stream.dumps,
                                  stream.notes, ref_ids, ref_sites, ref_inputs)


def _table(intern: dict[str, int]) -> list[str]:
    table = [""] * (len(intern) + 1)
    for k, v in intern.items():
        table[v] = k
    return table


_NO_SLOT = object()


def _index_capture(stream: Stream, intern: dict[str, int], keys: array[int], line_keys: array[int],
                   anchors: array[int], coll: list[int], files: array[int], offsets: array[int],
                   site_ids: array[int], site_list: list[RecordSite], inputs: array[int], nested: bytearray,
                   steps: array[int], grad_off: bytearray) -> bool:
    """Pass 1 over a capture stream (Stream.index_fields, inlined for speed: the same keys and
    anchors, and each operation's call site for pass 2); returns whether every record has a
    source-line digest."""
    sites: dict[tuple[Any, ...], tuple[int, int, bool, bool, str, int]] = {}
    all_digests = True
    # the function-level records nested in a call of a function either run collapsed (docs/capture.md
    # §3.10) are left out: both streams then read as if collapsed from the first call. Records come in
    # call order, a call's nested records right after it: below = the depth of the call whose nested
    # records are being left out (-1: none)
    aside, below = stream.aside, -1
    for fi, n, off, obj in stream.capture_ops():
        if aside:
            depth = obj.get("depth")
            if depth.__class__ is not int:  # absent or malformed (checked below): top level here
                depth = 0
            if below >= 0:
                if depth > below:
                    if obj.get("api") == "function":
                        continue
                else:
                    below = -1
            if below < 0 and obj.get("fn") in aside:
                below = depth
        try:
            for field_name in _INT_FIELDS:  # integers or absent (docs/capture.md §3.1): "seq": "x" is refused
                value = obj.get(field_name)
                if value is not None and value.__class__ is not int:
                    raise TypeError(f"field {field_name} is {value!r:.40}, not an integer")
            raw = (obj["fn"], obj.get("file"), obj.get("line"), obj.get("src"), obj.get("func"), obj.get("module"),
                   obj.get("context"), obj.get("phase"), obj.get("api"))
            ent = sites.get(raw)
            if ent is None:
                site = stream.sites.get(obj)
                ent = sites[raw] = (_intern(intern, site.key), _intern(intern, site.line_key), site.collective,
                                    site.line_digest is not None, site.function, len(site_list))
                site_list.append(site)
            kid, lkid, collective, has_digest, function, sid = ent
            anchor = inp = NO_ANCHOR
            ins = obj.get("inputs")
            if ins:
                parts = []
                for k, s in enumerate(ins):
                    d = s.get("digest")
                    if d:
                        name = s.get("slot", _NO_SLOT)
                        parts.append(f"{f'in{k}' if name is _NO_SLOT else name}={d}")
                if parts:       # the same keys as inputs_key / anchor_hash of the texts, inlined
                    tail = "\x00".join(parts)
                    inp = (hash(tail) & _MASK) or 1
                    if not collective:
                        anchor = int.from_bytes(blake2b(f"{function}\x00{tail}".encode("utf-8", "surrogatepass"),
                                                        digest_size=8).digest(), "little") or 1
        except _MALFORMED as e:
            raise ConfigError(f"{stream.where(fi, n, off)}: not an opguard capture op record "
                              f"({type(e).__name__}: {e})",
                              "pass a trace directory written by opguard capture (docs/capture.md)") from None
        keys.append(kid)
        line_keys.append(lkid)
        anchors.append(anchor)
        inputs.append(inp)
        if collective:
            coll.append(len(keys) - 1)
        if not has_digest:
            all_digests = False
        files.append(fi)
        offsets.append(off)
        site_ids.append(sid)
        nested.append(1 if obj.get("depth") else 0)
        steps.append(obj.get("step") or 0)
        grad_off.append(1 if obj.get("grad") is False else 0)
    return all_digests


def _globalise(table: list[str], idx: _Index, intern: dict[str, int]) -> _Index:
    remap = [0] + [_intern(intern, k) for k in table[1:]]
    idx.keys = array("q", [remap[k] for k in idx.keys])
    idx.line_keys = array("q", [remap[k] for k in idx.line_keys])
    return idx


def _collective_anchors(a: _Index, b: _Index) -> None:
    """Collectives are natural anchors: the k-th collective of a call site pairs with the k-th,
    when both runs issued that call site's collective equally often (unique by construction)."""
    count_a = Counter(a.keys[p] for p in a.collectives)
    count_b = Counter(b.keys[p] for p in b.collectives)
    for idx in (a, b):
        seen: Counter[int] = Counter()
        for pos in idx.collectives:
            kid = idx.keys[pos]
            if count_a[kid] == count_b[kid]:
                idx.anchors[pos] = anchor_hash(f"collective\x00{kid}\x00{seen[kid]}")
            seen[kid] += 1


def _where(rec: Record) -> str:
    return f"{rec.file or '?'}:{rec.line if rec.line is not None else '?'}"


# ---- pass 2: a range of rows of one stream pair (in this process or a worker) -------------------

@dataclass
class Select:
    """``--rank/--step/--function``: which streams are compared (ranks) and which operations the
    summary's counts, first divergence and the ``--pairs`` listing cover (steps, functions)."""

    ranks: frozenset[int] | None = None
    steps: frozenset[int] | None = None
    functions: tuple[str, ...] | None = None     # fnmatch patterns of function names

    @property
    def per_op(self) -> bool:
        return self.steps is not None or self.functions is not None

    def op(self, function: str, step: Any) -> bool:
        if self.steps is not None and step not in self.steps:
            return False
        return self.functions is None or any(fnmatch.fnmatchcase(function, f) for f in self.functions)

    def as_json(self) -> dict[str, Any]:
        return {k: sorted(v) if isinstance(v, frozenset) else list(v)
                for k, v in (("rank", self.ranks), ("step", self.steps), ("function", self.functions))
                if v is not None}


@dataclass
class Options:
    """What a comparison reports besides the export and the summary."""

    select: Select = field(default_factory=Select)
    pairs: IO[str] | None = None        # --pairs: one JSON line per pair and per unresolved operation
    show: frozenset[str] = frozenset()  # --show: record_ids whose full evidence is collected

    @property
    def serial(self) -> bool:
        return self.pairs is not None or bool(self.show) or self.select.per_op


@dataclass
class _Job:
    sa: Stream
    sb: Stream
    ia: _Index
    ib: _Index
    pairing: Pairing
    rows_a: array[int]
    rows_b: array[int]
    tracks: tuple[int, int]
    flow_base: int
    opts: Options = field(default_factory=Options)


@dataclass
class _Chunk:
    status: Counter[str] = field(default_factory=Counter)
    basis: Counter[str] = field(default_factory=Counter)
    reasons_a: Counter[str] = field(default_factory=Counter)
    reasons_b: Counter[str] = field(default_factory=Counter)
    unresolved: int = 0
    first_mismatch: FirstMismatch | None = None
    first_divergence: FirstMismatch | None = None
    introduced: int = 0
    inherited: int = 0
    uninitialized: int = 0
    last_unresolved: str | None = None
    first_random_unresolved: str | None = None  # the first unpaired operation that drew random numbers
    # before the first mismatch: the last ok pair whose outputs capture recorded without content (a
    # torch.func wrapper, a tensor subclass, ...), and the last such random draw (docs/compare.md §4)
    last_unseen: str | None = None
    last_unseen_draw: str | None = None
    # the A seqs of the first divergence's call and the calls nested in it, while the rows are in
    # it: set when that call's outputs differ with inputs and arguments equal (torch.autograd.grad
    # running an edited backward); a nested call that introduced a difference itself replaces it
    fd_tree: set[Any] | None = None
    first_unresolved: str | None = None
    first_new_b: str | None = None
    first_gone_a: str | None = None
    shown: list[dict[str, Any]] = field(default_factory=list)
    slices: int = 0
    flows: int = 0


def _start(rows: array[int], r0: int, r1: int, idx: _Index) -> tuple[int, tuple[int, int]]:
    for r in range(r0, r1):
        i = rows[r]
        if i >= 0:
            return i, (idx.files[i], idx.offsets[i]) if len(idx.files) else (0, 0)
    return -1, (0, 0)


_Item = tuple[int, int, int, dict[str, Any]] | Record
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError)


class _Side:
    """One stream's operations in pass 2, from the first operation of a range of rows. Capture
    records stay parsed JSON (encoded straight from it, with the call sites pass 1 found); a
    :class:`Record` is built only for a pair whose recorded slots differ (the diff) or a record the
    fast encoder refuses."""

    def __init__(self, em: OpEncoder, st: Stream, run: str, track: int, rows: array[int], r0: int, r1: int,
                 idx: _Index) -> None:
        self.em, self.st, self.run, self.track = em, st, run, track
        first, self.pos = _start(rows, r0, r1, idx)
        self.capture = st.kind == KIND_CAPTURE
        it: Iterator[_Item] = iter(())
        raw: Iterator[tuple[int, int, int, bytes]] = iter(())
        if first >= 0:
            if self.capture:
                raw = st.capture_op_lines(self.pos, idx.files, idx.offsets, first)
                it = self._parsed(raw)
            else:
                it = st.records(first, self.pos)
        self.next = it.__next__         # the next operation, parsed
        self.next_raw = raw.__next__    # capture: the next operation's line, unparsed (the same sequence)
        self.head = em.head(run, st.name, st.rank)
        self.site_ids = idx.site_ids
        self.sites: list[tuple[bytes, bytes] | None] = [None] * len(idx.sites)
        self.site_objs = idx.sites

    def _parsed(self, raw: Iterator[tuple[int, int, int, bytes]]) -> Iterator[_Item]:
        parse, pos = self.st.parse_op, self.pos
        for fi, n, off, line in raw:
            yield fi, n, off, parse(fi, n, off, line, pos)

    def rid(self, index: int) -> bytes:
        return self.head[0] + b"%d" % index

    def record(self, item: _Item, index: int) -> Record:
        if isinstance(item, Record):
            rec = item
        else:
            fi, n, off, obj = item
            rec = self.st.capture_record(obj, index, self.st.where(fi, n, off, self.pos))
        site = self.site_objs[self.site_ids[index]]       # the identity this stream pair assigned
        rec.site, rec.line_map = site.site, site.line_map
        return rec

    def emit(self, ts: int, item: _Item, index: int, rid: bytes, corr: tuple[str, str, str], other: bytes | None,
             d: Diff | None, flow_out: int | None = None, flow_in: int | None = None,
             slots: bytes | None = None, same: bool = False) -> bytes:
        em, st = self.em, self.st
        if d is None and item.__class__ is tuple:      # a capture item (not a Record)
            sid = self.site_ids[index]
            site = self.sites[sid]
            if site is None:
                site = self.sites[sid] = em.site_entry(self.site_objs[sid])
            try:
                return em.capture_op(self.track, ts, self.head, site, index, rid, item[3], st.dumps, corr, other,
                                     flow_out, flow_in, slots, same)
            except _MALFORMED:
                pass        # the Record path reports what is wrong with it (or encodes what it accepts)
        return em.op(self.track, ts, self.run, st.name, self.record(item, index), corr, other, d, flow_out, flow_in,
                     None if not isinstance(item, Record) else slots, same)


_SEQ = b'"seq":'


def _same_but_seq(la: bytes, lb: bytes) -> tuple[int, int] | None:
    """(A's seq, B's seq) when two op lines are byte-equal except the digits of their top-level
    ``seq`` (then B's record is A's with B's seq: pass 2 need not parse it); else None."""
    p = la.find(_SEQ)
    if p < 0 or la.find(b"[", 0, p) >= 0 or la.find(b"{", 1, p) >= 0 or not lb.startswith(la[:p + 6]):
        return None         # (no container opened before it: the key is the top-level one)
    qa, qb = la.find(b",", p + 6), lb.find(b",", p + 6)
    if qa < 0 or qb < 0 or la[qa:] != lb[qb:] or la.find(_SEQ, qa) >= 0:
        return None
    da, db = la[p + 6:qa], lb[p + 6:qb]
    if not (da.isdigit() and db.isdigit()):
        return None
    return int(da), int(db)


def _in_tree(out: _Chunk, x: _Item) -> bool:
    """Whether the pair's A record is nested (at any depth) in the first divergence's call
    (``_Chunk.fd_tree``); the first row outside it ends the tree."""
    tree = out.fd_tree
    rec = x[3] if x.__class__ is tuple else None
    if tree is not None and isinstance(rec, dict):
        parent = rec.get("parent")
        if parent is not None and parent.__class__ is int and parent in tree:
            tree.add(rec.get("seq"))
            return True
    out.fd_tree = None
    return False


_NOT_UNSEEN = (None, "digest mode none", "uninitialized memory")  # no content by choice, or none to have


def _note_unseen(out: _Chunk, side: Any, x: _Item, i: int, rid: bytes) -> None:
    """Remember an ok pair whose outputs capture recorded without content (``reason``: a torch.func
    wrapper, a tensor subclass, ...): it agreed only where recorded (``other_inputs``)."""
    if isinstance(x, Record):
        why = next((s.reason for s in x.outputs if s.digest is None and s.reason not in _NOT_UNSEEN), None)
        seeded = x.seeded
    else:
        outs = x[3].get("outputs")
        why = next((e.get("reason") for e in outs if e.__class__ is dict and e.get("digest") is None
                    and e.get("reason") not in _NOT_UNSEEN), None) if outs.__class__ is list else None
        seeded = x[3].get("seeded") is True
    if why is None:
        return
    site = side.site_objs[side.site_ids[i]]
    loc = f"{site.file or '?'}:{site.line if site.line is not None else '?'}"
    desc = (f"{site.function} at {loc} ({rid.decode('utf-8', 'surrogatepass')}) "
            f"{'drew random numbers into' if seeded else 'made'} outputs capture recorded without content ({why})")
    out.last_unseen = desc
    if seeded:
        out.last_unseen_draw = desc


def _slots_equal(x: _Item, y: _Item, dumps: bool) -> bool:
    """Every recorded field of the slots equal (then the diff is ok and the encoding can be shared)."""
    if x.__class__ is tuple and y.__class__ is tuple:     # both capture items (the usual case)
        a, b = x[3], y[3]
        return not dumps and a.get("inputs") == b.get("inputs") and a.get("outputs") == b.get("outputs") and \
            a.get("error") == b.get("error") and a.get("args") == b.get("args") and \
            a.get("autocast") == b.get("autocast") and a.get("grad") == b.get("grad")
    return isinstance(x, Record) and isinstance(y, Record) and x.inputs == y.inputs and x.outputs == y.outputs


def _module(context: str) -> str | None:
    m = context.split("|", 1)[0]
    return None if m in ("", "-") else m


def _raised(ra: Record, rb: Record) -> str | None:
    """Which run's call raised what, when only one did or their exceptions differ (its text, 160
    characters at most): 'outputs.error.present' alone named no exception."""
    if ra.error == rb.error:
        return None
    parts = [f"{run} raised {err[:160]}" for run, err in (("A", ra.error), ("B", rb.error)) if err]
    return "; ".join(parts) + ("" if ra.error and rb.error else f"; {'B' if ra.error else 'A'} did not")


def _step(item: _Item) -> Any:
    return item.step if isinstance(item, Record) else item[3].get("step")


def _op_json(side: _Side, item: _Item, index: int) -> dict[str, Any]:
    site = side.site_objs[side.site_ids[index]]
    d: dict[str, Any] = {"record": side.rid(index).decode("utf-8", "surrogatepass"), "function": site.function,
                         "file": site.file, "line": site.line, "identity": site.site,
                         "module": _module(site.context), "step": _step(item)}
    if site.line_map is not None:
        d["line_map"] = site.line_map
    return d


def _evidence(side: _Side, rec: Record) -> dict[str, Any]:
    def slot(s: Slot) -> dict[str, Any]:
        fields: list[tuple[str, Any]] = [("digest", s.digest), ("dtype", s.dtype), ("device", s.device),
                                         ("shape", list(s.shape) if s.shape is not None else None),
                                         ("stats", s.stats), ("dump", s.dump), ("reason", s.reason)]
        out: dict[str, Any] = {k: v for k, v in fields if v is not None}
        if s.uninitialized:
            out["uninitialized"] = True
        return out
    return {"record": side.rid(rec.index).decode("utf-8", "surrogatepass"), "function": rec.function,
            "callsite": {"file": rec.file, "line": rec.line, "scope": rec.scope, "line_sha256": rec.line_digest,
                         "identity": rec.site, "line_map": rec.line_map},
            "module": _module(rec.context), "context": rec.context, "step": rec.step, "seq": rec.seq,
            "args": {a.slot: {"type": a.type, "value": a.show()} for a in rec.args or ()},
            "inputs": {s.name: slot(s) for s in rec.inputs}, "outputs": {s.name: slot(s) for s in rec.outputs}}


def _run_rows(job: _Job, r0: int, r1: int, writer: ExportWriter) -> _Chunk:
    em = OpEncoder(writer)
    out = _Chunk()
    sa, sb, pairing = job.sa, job.sb, job.pairing
    rows_a, rows_b = job.rows_a, job.rows_b
    side_a = _Side(em, sa, "A", job.tracks[0], rows_a, r0, r1, job.ia)
    side_b = _Side(em, sb, "B", job.tracks[1], rows_b, r0, r1, job.ib)
    next_a, next_b = side_a.next, side_b.next
    dumps = bool(sa.dumps or sb.dumps)
    basis_a, reason_a, reason_b = pairing.basis_a, pairing.reason_a, pairing.reason_b
    ok_corr: dict[str, tuple[str, str, str]] = {}
    status, basis_count = out.status, out.basis
    opts = job.opts
    sel = opts.select if opts.select.per_op else None
    pairs_out, show = opts.pairs, opts.show
    head = {"rank": sa.rank, "stream": sa.name}
    # pairs whose lines differ only in seq skip B's parse (the usual case: ok pairs of a rerun)
    fast = side_a.capture and side_b.capture and sel is None and not show and pairs_out is None and not dumps
    raw_a, raw_b, parse_a, parse_b = side_a.next_raw, side_b.next_raw, sa.parse_op, sb.parse_op
    xa: _Item
    xb: _Item
    for row in range(r0, r1):
        i, j = rows_a[row], rows_b[row]
        ts = row * ROW_NS
        if i >= 0 and j >= 0:
            if fast:
                la, lb = raw_a(), raw_b()
                seqs = _same_but_seq(la[3], lb[3])
                oa: Any = None
                if seqs is not None:
                    try:
                        oa = orjson_loads(la[3])
                    except ValueError:
                        oa = None
                if oa.__class__ is dict and seqs is not None and oa.get("seq") == seqs[0] and \
                        oa["seq"].__class__ is int:
                    xa = (la[0], la[1], la[2], oa)
                    xb = (lb[0], lb[1], lb[2], {**oa, "seq": seqs[1]})    # what parsing B's line gives
                    synth = True        # the slots are A's objects: equal (no dumps in fast mode)
                else:
                    synth = False
                    xa = (la[0], la[1], la[2], parse_a(*la, side_a.pos))
                    xb = (lb[0], lb[1], lb[2], parse_b(*lb, side_b.pos))
            else:
                xa, xb = next_a(), next_b()
                synth = False
            rid_a, rid_b = side_a.rid(i), side_b.rid(j)
            basis = basis_a[i] or ""
            flow = job.flow_base + row + 1
            selected = sel is None or sel.op(side_a.site_objs[side_a.site_ids[i]].function, _step(xa)) or \
                sel.op(side_b.site_objs[side_b.site_ids[j]].function, _step(xb))
            if basis != FUNCTION_DIFFERS and (synth or _slots_equal(xa, xb, dumps)) and \
                    (not show or (rid_a.decode() not in show and rid_b.decode() not in show)):
                corr = ok_corr.get(basis)
                if corr is None:
                    corr = ok_corr[basis] = ("paired", basis, OK)
                slots = side_a.emit(ts, xa, i, rid_a, corr, rid_b, None, flow_out=flow)
                side_b.emit(ts, xb, j, rid_b, corr, rid_a, None, flow_in=flow, slots=slots, same=True)
                if selected:
                    status[OK] += 1
                    basis_count[basis] += 1
                    if pairs_out is not None:
                        pairs_out.write(json.dumps({**head, "row": row, "status": OK, "basis": basis,
                                                    "a": _op_json(side_a, xa, i), "b": _op_json(side_b, xb, j)})
                                        + "\n")
                if out.first_mismatch is None:
                    _note_unseen(out, side_a, xa, i, rid_a)
                if out.fd_tree is not None:
                    _in_tree(out, xa)
                continue
            ra, rb = side_a.record(xa, i), side_b.record(xb, j)
            d = diff_pair(ra, rb)
            corr = ("paired", basis, d.status)
            side_a.emit(ts, ra, i, rid_a, corr, rid_b, d, flow_out=flow)
            side_b.emit(ts, rb, j, rid_b, corr, rid_a, d, flow_in=flow)
            if show and (rid_a.decode() in show or rid_b.decode() in show):
                out.shown.append({**head, "state": "paired", "basis": basis, "status": d.status,
                                  "a": _evidence(side_a, ra), "b": _evidence(side_b, rb),
                                  "diff": None if d.status != MISMATCH else
                                  {"fields": d.fields, "args": d.args, "inputs_equal": d.inputs_equal,
                                   "introduced": d.introduced, "numeric": d.numeric, "function": d.function},
                                  "uninitialized_not_compared": d.uninitialized})
            if d.status == OK and out.first_mismatch is None:
                _note_unseen(out, side_a, ra, i, rid_a)
            inside = out.fd_tree is not None and _in_tree(out, xa)
            if not selected:
                continue
            status[d.status] += 1
            basis_count[basis] += 1
            out.uninitialized += d.uninitialized
            if pairs_out is not None:
                line: dict[str, Any] = {**head, "row": row, "status": d.status, "basis": basis,
                                        "a": _op_json(side_a, xa, i), "b": _op_json(side_b, xb, j)}
                if d.status == MISMATCH:
                    line.update(differs=d.fields, args=d.args, introduced=d.introduced, numeric=d.numeric)
                    if d.function:
                        line["function"] = d.function
                if d.uninitialized:
                    line["uninitialized_not_compared"] = d.uninitialized
                pairs_out.write(json.dumps(line) + "\n")
            if d.status == MISMATCH:
                kind = (FUNCTION_DIFFERS_KIND if d.function and d.inputs_equal else ARGS_DIFFER if d.args else
                        (OUTPUT_FORM_DIFFERS if any(k.startswith("outputs.") for k in d.values) else
                         COLLECTIVE_DIFFERS if ra.collective or rb.collective else
                         random_differs(out.first_random_unresolved, out.last_unseen_draw)
                         if ra.seeded or rb.seeded else
                         MODULE_DIFFERS if ra.whole_module or rb.whole_module else
                         OUTPUTS_DIFFER) if d.inputs_equal else
                        REORDERED if d.reordered else UNSEEN_INPUTS + ", ".join(d.unseen) if d.unseen else INHERITED)
                fm = FirstMismatch(rid_a.decode("utf-8", "surrogatepass"), rid_b.decode("utf-8", "surrogatepass"),
                                   ra.function, _where(ra), d.fields, d.numeric, out.unresolved,
                                   _module(ra.context), ra.step, d.args, kind, _where(rb), out.last_unresolved,
                                   rb.line_map, rb.function if d.function else None, _raised(ra, rb),
                                   d.values)
                if out.first_mismatch is None:
                    out.first_mismatch = fm
                if d.introduced:
                    out.introduced += 1
                    if out.first_divergence is None:
                        out.first_divergence = fm
                        if kind == OUTPUTS_DIFFER and xa.__class__ is tuple:
                            out.fd_tree = {xa[3].get("seq")}
                    elif inside and kind != OUTPUTS_DIFFER and out.first_divergence is not None:
                        # a call nested in it introduced a difference of its own (its arguments or
                        # function differ): that is where B first computed differently
                        outer = out.first_divergence
                        fm.inside = f"{outer.function} at {outer.where} ({outer.record_a} <-> {outer.record_b})"
                        out.first_divergence = fm
                        out.fd_tree = None
                else:
                    out.inherited += 1
            continue
        side, x, k = (side_a, next_a(), i) if i >= 0 else (side_b, next_b(), j)
        reason = (reason_a[i] if i >= 0 else reason_b[j]) or ""
        side.emit(ts, x, k, side.rid(k), ("undetermined", reason, UNALIGNED), None, None)
        if show and side.rid(k).decode() in show:
            out.shown.append({**head, "state": "undetermined", "reason": reason, "status": UNALIGNED,
                              side.run.lower(): _evidence(side, side.record(x, k))})
        site = side.site_objs[side.site_ids[k]]
        if sel is not None and not sel.op(site.function, _step(x)):
            continue
        (out.reasons_a if i >= 0 else out.reasons_b)[reason] += 1
        status[UNALIGNED] += 1
        out.unresolved += 1
        loc = f"{site.file or '?'}:{site.line if site.line is not None else '?'}"
        out.last_unresolved = f"run {side.run} {site.function} at {loc} ({side.rid(k).decode()}, {reason})"
        try:  # the first draw only one run made: the likely why of a later draw's difference
            if out.first_random_unresolved is None and side.record(x, k).seeded:
                out.first_random_unresolved = f"run {side.run}'s {site.function} at {loc} ({side.rid(k).decode()})"
        except Exception:  # pragma: no cover - a record pass 1 accepted reads in pass 2 too
            pass
        if out.first_unresolved is None:
            out.first_unresolved = out.last_unresolved
        # (no-counterpart-in-segment: the other run makes nothing at all between those anchors)
        if out.first_new_b is None and i < 0 and (is_new_line(site.line_map) or reason in _NOT_MADE):
            out.first_new_b = out.last_unresolved  # B's first operation A does not make (a new line, a new call)
            if (site.line_map or "").startswith(MOVED):   # not a line A lacks: say where it was in A
                out.first_new_b += f" [B's line: {site.line_map}]"
        if out.first_gone_a is None and i >= 0 and reason in _NOT_MADE:
            out.first_gone_a = out.last_unresolved  # A's first operation B does not make (a removed call)
        if pairs_out is not None:
            pairs_out.write(json.dumps({**head, "row": row, "status": UNALIGNED, "reason": reason,
                                        side.run.lower(): _op_json(side, x, k)}) + "\n")
    out.slices, out.flows = writer.slices, writer.flows
    return out


# Worker processes are forked with the job in this module global (nothing large is pickled).
_FORK_JOB: _Job | None = None
_FORK_STREAMS: dict[str, Stream] = {}


def _pass1_worker(side: str) -> tuple[list[str], _Index]:
    return _index_local(_FORK_STREAMS[side])


def _rows_job(job: tuple[int, int, str, int]) -> _Chunk:
    return _rows_worker(*job)


def _rows_worker(r0: int, r1: int, part: str, seq_id: int) -> _Chunk:
    assert _FORK_JOB is not None
    writer = ExportWriter(Path(part), None, seq_id=seq_id, part=True)
    try:
        chunk = _run_rows(_FORK_JOB, r0, r1, writer)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return chunk


PARALLEL_MIN_OPS = 20_000


MAX_WORKERS = 8


def workers() -> int:
    """Processes for pass 2: the CPUs this process may use, at most MAX_WORKERS (pass 1 uses 2)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, n))


def _lost(job: object, why: str) -> Any:
    """A compare worker that died (killed, out of memory) loses the whole comparison: exit 1."""
    raise OpguardError(f"a compare worker process {why} (job {job!r}); nothing was written to the output",
                       "run the compare again; if the kernel log shows the OOM killer, compare fewer ranks at "
                       "once (--rank) or leave the machine more memory")


def _pass1(sa: Stream, sb: Stream, intern: dict[str, int], parallel: bool) -> tuple[_Index, _Index]:
    global _FORK_STREAMS
    if not parallel:
        res = [_index_local(sa), _index_local(sb)]
    else:
        _FORK_STREAMS = {"A": sa, "B": sb}
        try:
            res = forkpool.run(["A", "B"], 2, _pass1_worker, _lost, where="a compare worker process")
        finally:
            _FORK_STREAMS = {}
    ia, ib = (_globalise(t, i, intern) for t, i in res)
    for st, idx in ((sa, ia), (sb, ib)):
        st.dumps, st.notes = idx.dumps, idx.notes
    return ia, ib


def _compare_stream(writer: ExportWriter, sa: Stream, sb: Stream, tracks: tuple[int, int], summ: StreamSummary,
                    intern: dict[str, int], flow_base: int, opts: Options, shown: list[dict[str, Any]]) -> int:
    """Pair and export one stream pair; returns the number of rows (flow ids used)."""
    global _FORK_JOB
    n_workers = workers()
    big = n_workers > 1 and not opts.serial and forkpool.available() and sa.kind == sb.kind == KIND_CAPTURE and \
        sum(p.stat().st_size for p in (*sa.files, *sb.files)) > PARALLEL_MIN_OPS * 500
    if sa.kind == sb.kind == KIND_CAPTURE and sa.forms[1] != sb.forms[1]:  # docs/capture.md §2.1 arg_forms
        summ.notes.append(
            f"the runs record arguments in other forms (run A: opguard {sa.forms[0] or 'unknown'}, argument forms "
            f"{sa.forms[1]}; run B: opguard {sb.forms[0] or 'unknown'}, argument forms {sb.forms[1]}): one value can "
            "read as two (an index tuple x[:, 0], a NumPy array), so an argument difference can be the form alone; "
            "capture both runs with one opguard to compare their arguments")
    if sa.kind == sb.kind == KIND_CAPTURE:  # wrappers either run collapsed: nested records left out (§3.10)
        sa.aside = sb.aside = sa.collapsed | sb.collapsed
        if sa.collapsed != sb.collapsed:
            only_a, only_b = sorted(sa.collapsed - sb.collapsed)[:8], sorted(sb.collapsed - sa.collapsed)[:8]
            summ.notes.append(
                "the runs collapsed different wrapper functions (docs/capture.md §3.10; only A: "
                f"{', '.join(only_a) or 'none'}; only B: {', '.join(only_b) or 'none'}): the calls nested "
                "in the functions either run collapsed were left out of the pairing on both sides")
    ia, ib = _pass1(sa, sb, intern, big)
    # call-site identities from the line correspondence of each file's two versions (docs/compare.md §2)
    ia.sites, ib.sites, notes = assign_identities(ia.sites, ib.sites, sa.sources.lines, sb.sources.lines)
    summ.notes.extend(notes)
    for idx in (ia, ib):
        site_keys = [_intern(intern, s.key) for s in idx.sites]
        idx.keys = array("q", [site_keys[s] for s in idx.site_ids])
    _collective_anchors(ia, ib)
    if ia.keys == ib.keys:
        pairing = pair_streams(ia.keys, ib.keys, ia.anchors, ib.anchors)
    else:       # call sites without the function, for a function that differs at the same call site
        rel: dict[str, int] = {}
        site_a, site_b = ([_intern(rel, f"{s.site}\x00{s.context}") for s in idx.sites] for idx in (ia, ib))
        line_a = [_intern(rel, f"{s.site}\x01") for s in ia.sites]  # the identity alone: an edited line
        # operations on lines the source diff says were edited (B: edited in place or new; A: edited)
        edited_b = [is_new_line(s.line_map) or (s.line_map or "").startswith("edited") for s in ib.sites]
        edited_ids = {s.site for s, e in zip(ib.sites, edited_b, strict=True) if e}
        edited_a = [s.site in edited_ids for s in ia.sites]
        pairing = pair_streams(ia.keys, ib.keys, ia.anchors, ib.anchors,
                               array("q", map(site_a.__getitem__, ia.site_ids)),
                               array("q", map(site_b.__getitem__, ib.site_ids)), ia.inputs, ib.inputs,
                               ia.nested, ib.nested, array("q", map(line_a.__getitem__, ia.site_ids)),
                               bytearray(map(edited_a.__getitem__, ia.site_ids)),
                               bytearray(map(edited_b.__getitem__, ib.site_ids)),
                               ia.steps or None, ib.steps or None, ia.grad_off, ib.grad_off)
    summ.ops_a, summ.ops_b = len(ia.keys), len(ib.keys)
    summ.notes.extend([*(f"run A: {n}" for n in sa.notes), *(f"run B: {n}" for n in sb.notes)])
    rows_a, rows_b = pairing.row_arrays()
    job = _Job(sa, sb, ia, ib, pairing, rows_a, rows_b, tracks, flow_base, opts)
    n = len(rows_a)
    if big:
        bounds = [n * k // n_workers for k in range(n_workers + 1)]
        parts = [writer.path.parent / f".{writer.path.name}.opguard-part-{secrets.token_hex(4)}-{k}"
                 for k in range(n_workers)]
        _FORK_JOB = job
        try:
            jobs = [(bounds[k], bounds[k + 1], str(parts[k]), 2 + k) for k in range(n_workers)]
            chunks = forkpool.run(jobs, n_workers, _rows_job, _lost, where="a compare worker process")
            for part, chunk in zip(parts, chunks, strict=True):
                writer.append_part(part, chunk.slices, chunk.flows)
        finally:
            _FORK_JOB = None
            for part in parts:
                part.unlink(missing_ok=True)
    else:
        chunks = [_run_rows(job, 0, n, writer)]
    unresolved = 0
    last_unresolved: str | None = None
    if sa.selection or sb.selection:  # capture left calls out: a mismatch's inputs can come from them
        summ.notes.append(
            "capture recorded a selection only (" + "; ".join(
                f"run {run}: {sel}" for run, sel in (("A", sa.selection), ("B", sb.selection)) if sel)
            + "): the calls it left out were not compared, and an operation whose inputs differ can have them "
            "from there (compare with --step/--function instead, on runs captured whole)")
    else:
        _first_reads_other_inputs(chunks, opts)
    for c in chunks:
        summ.status.update(c.status)
        summ.basis.update(c.basis)
        summ.reasons_a.update(c.reasons_a)
        summ.reasons_b.update(c.reasons_b)
        for attr in ("first_mismatch", "first_divergence"):
            fm: FirstMismatch | None = getattr(c, attr)
            if fm is not None and getattr(summ, attr) is None:
                fm.unresolved_before += unresolved
                if fm.nearest_unresolved is None:
                    fm.nearest_unresolved = last_unresolved
                setattr(summ, attr, fm)
        summ.introduced += c.introduced
        summ.inherited += c.inherited
        summ.uninitialized += c.uninitialized
        shown.extend(c.shown)
        unresolved += c.unresolved
        last_unresolved = c.last_unresolved or last_unresolved
        summ.first_unresolved = summ.first_unresolved or c.first_unresolved
        summ.first_new_b = summ.first_new_b or c.first_new_b
        summ.first_gone_a = summ.first_gone_a or c.first_gone_a
    return n


def _first_reads_other_inputs(chunks: list[_Chunk], opts: Options) -> None:
    """docs/compare.md §4: the first mismatch of the stream, its inputs differing, with every earlier
    operation paired and ok (no filter hid any): no recorded operation passed a difference on, so
    it is not "inherited" but the first divergence, reading other tensors (an edited variable, or
    memory written where capture records nothing). Counted as introduced from then on."""
    if opts.select.per_op:
        return
    unseen = draw = None
    for c in chunks:
        unseen, draw = c.last_unseen or unseen, c.last_unseen_draw or draw
        fm = c.first_mismatch
        if fm is None:
            if c.unresolved:
                return
            continue
        if fm.kind == INHERITED and fm.unresolved_before == 0:
            fm.kind = other_inputs(draw or unseen)
            c.first_divergence = fm
            c.introduced += 1
            c.inherited -= 1
        return


def _export_only(writer: ExportWriter, side: str, st: Stream, track: int, summ: StreamSummary) -> None:
    em = OpEncoder(writer)
    n = 0
    corr = ("undetermined", NO_CORRESPONDING_FILE, UNALIGNED)
    for rec in st.records():
        em.op(track, rec.index * ROW_NS, side, st.name, rec, corr, None, None)
        n += 1
    summ.notes.extend(f"run {side}: {note}" for note in st.notes)
    if side == "A":
        summ.ops_a = n
        summ.reasons_a[NO_CORRESPONDING_FILE] += n
    else:
        summ.ops_b = n
        summ.reasons_b[NO_CORRESPONDING_FILE] += n
    summ.status[UNALIGNED] += n


def _describe(run: Run) -> str:
    keys = sorted(run.streams)
    shown = ", ".join(f"rank {r} [{n}]" for r, n in keys[:6]) + (" ..." if len(keys) > 6 else "")
    return f"{run.given} ({run.kind}): {shown}"


def compare(a: str, b: str, out: Path, opts: Options | None = None) -> Summary:
    """Compare runs A and B, write the Perfetto view to OUT, return the summary.

    Raises ConfigError when there is nothing to compare (no trace files, no corresponding files) or
    when nothing at all was paired (the view is still written, for inspection).
    """
    opts = opts or Options()
    with open_run(a, "A") as run_a, open_run(b, "B") as run_b:
        ranks = opts.select.ranks
        if ranks is not None:
            have = sorted({r for r, _ in run_a.streams} | {r for r, _ in run_b.streams})
            if not ranks & set(have):
                raise ConfigError(f"--rank {','.join(map(str, sorted(ranks)))}: no such rank in A or B "
                                  f"(they have ranks {', '.join(map(str, have))})", "pass a rank that ran")
            for run in (run_a, run_b):
                run.streams = {k: v for k, v in run.streams.items() if k[0] in ranks}
        common = sorted(run_a.streams.keys() & run_b.streams.keys())
        if not common:
            raise ConfigError(
                f"no corresponding trace files: A has {_describe(run_a)}; B has {_describe(run_b)}",
                "compare runs of the same program: streams correspond by rank and stream name")
        # the two runs' SHA-256 at once: hashing and reading release the GIL (the threads end here,
        # before any forked pass: forkpool.available() wants a single thread)
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="opguard-digest") as pool:
            digest_a, digest_b = pool.map(Run.digest, (run_a, run_b))
        attributes: dict[str, str | int] = {
            "opguard.export": EXPORT_KIND,
            "opguard.input_a.path": run_a.restored_from or str(run_a.root),
            "opguard.input_a.kind": run_a.kind,
            "opguard.input_a.sha256": digest_a,
            "opguard.input_b.path": run_b.restored_from or str(run_b.root),
            "opguard.input_b.kind": run_b.kind,
            "opguard.input_b.sha256": digest_b,
        }
        writer = ExportWriter(out, attributes)
        summary = Summary(export_path=str(out), inputs={"A": a, "B": b}, filters=opts.select.as_json())
        try:
            flow_base = 0
            top_a = writer.track(f"run A: {a}", order=0, description=attributes["opguard.input_a.path"])  # type: ignore[arg-type]
            top_b = writer.track(f"run B: {b}", order=1, description=attributes["opguard.input_b.path"])  # type: ignore[arg-type]
            intern: dict[str, int] = {}
            for order, key in enumerate(sorted(run_a.streams.keys() | run_b.streams.keys())):
                rank, name = key
                label = f"rank {rank} [{name}]"
                ta = writer.track(label, parent=top_a, order=order) if key in run_a.streams else 0
                tb = writer.track(label, parent=top_b, order=order) if key in run_b.streams else 0
                summ = summary.stream(rank, name)
                if key in run_a.streams and key in run_b.streams:
                    flow_base += _compare_stream(writer, run_a.streams[key], run_b.streams[key], (ta, tb), summ,
                                                 intern, flow_base, opts, summary.shown)
                elif key in run_a.streams:
                    summary.only_a.append(key)
                    _export_only(writer, "A", run_a.streams[key], ta, summ)
                else:
                    summary.only_b.append(key)
                    _export_only(writer, "B", run_b.streams[key], tb, summ)
            summary.export_bytes = writer.commit()
        except BaseException:
            writer.abort()
            raise
    return summary


def check_paired(summary: Summary) -> None:
    """Nothing paired at all is an error (exit 2) saying why: no operations recorded, or the
    reasons the operations stayed undetermined."""
    if summary.pairs > 0:
        return
    ops_a = sum(s.ops_a for s in summary.streams.values())
    ops_b = sum(s.ops_b for s in summary.streams.values())
    where = f"the view was written to {summary.export_path} for inspection"
    if summary.filters and (ops_a or ops_b) and summary.total("unaligned") == 0:
        raise ConfigError(f"nothing was paired within the selection {summary.filters} ({where})",
                          "widen --step/--function, or drop them to see every operation")
    if ops_a == 0 or ops_b == 0:
        sides = [side for side, n in (("A", ops_a), ("B", ops_b)) if n == 0]
        empty = " and ".join(sides)
        # a capture that never ended (a signal, os._exit: capture's exit handler did not run) lost the
        # records it still held (up to its buffer): "capture was not on" would send the user the wrong way
        unended = [side for side in sides if any(n.startswith(f"run {side}: no end record")
                                                 for st in summary.streams.values() for n in st.notes)]
        if unended:
            which = " and ".join(unended)
            raise ConfigError(
                f"nothing was paired: run {empty} recorded no operations, and the capture of run {which} did not "
                f"end: the process ended without capture's exit handler (a signal, os._exit) and lost the records "
                f"it still held ({where})",
                "let the program end normally (return or sys.exit), or lower OPGUARD_CAPTURE_BUFFER so records are "
                "written sooner (docs/capture.md §10)")
        raise ConfigError(f"nothing was paired: run {empty} recorded no operations ({where})",
                          f"check that capture was on for run {empty} (opguard-run --capture) and that the "
                          "program reached the traced code; a program that does its work in processes it starts "
                          "itself (torch.multiprocessing.spawn) starts capture in them (docs/capture.md §1)")
    reasons: Counter[str] = Counter()
    for s in summary.streams.values():
        reasons.update(s.reasons_a)
        reasons.update(s.reasons_b)
    detail = ", ".join(f"{k} {v}" for k, v in reasons.most_common())
    raise ConfigError(
        f"nothing was paired: all {ops_a} operations of A and {ops_b} of B stayed undetermined ({detail}; {where})",
        "order pairs only equal call-site sequences, and anchors need inputs captured equally on both sides; "
        "docs/compare.md §2-3 explains each reason")


__all__ = ["MISMATCH", "OK", "UNALIGNED", "Options", "Select", "check_paired", "compare"]
