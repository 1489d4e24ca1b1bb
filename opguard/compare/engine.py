"""``opguard compare A B -o OUT``: resolve, pair, diff, export, summarise (``docs/compare.md``).

Two passes over each corresponding stream: the first reads only what pairing needs (call-site
keys and captured-input anchor keys, as integers), the second walks both streams in the merged
order, diffs the pairs and streams the slices into the export, so memory stays bounded by the
number of operations, not their size.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from opguard.compare.diff import MISMATCH, OK, UNALIGNED, diff_pair
from opguard.compare.opevents import OpEncoder
from opguard.compare.pairing import NO_ANCHOR, NO_CORRESPONDING_FILE, Pairing, pair_streams
from opguard.compare.perfetto_export import ROW_NS, ExportWriter
from opguard.compare.records import Record
from opguard.compare.sources import Run, Stream, open_run
from opguard.compare.summary import FirstMismatch, StreamSummary, Summary
from opguard.errors import ConfigError

EXPORT_KIND = "opguard-compare-v1"


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


def _intern(intern: dict[str, int], k: str) -> int:
    kid = intern.get(k)
    if kid is None:
        kid = intern[k] = len(intern) + 1
    return kid


def _index(stream: Stream, intern: dict[str, int]) -> _Index:
    keys = array("q")
    line_keys = array("q")
    anchors = array("Q")
    coll: list[int] = []
    all_digests = True
    for key, line_key, text, collective, has_digest in stream.index_fields():
        keys.append(_intern(intern, key))
        line_keys.append(_intern(intern, line_key))
        all_digests = all_digests and has_digest
        anchors.append(anchor_hash(text) if text and not collective else NO_ANCHOR)
        if collective:
            coll.append(len(keys) - 1)
    return _Index(keys, line_keys, anchors, coll, all_digests)


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


def record_id(run: str, rec: Record, stream: str) -> str:
    return f"{run}/rank{rec.rank}/{stream}/{rec.index}"


def _where(rec: Record) -> str:
    return f"{rec.file or '?'}:{rec.line if rec.line is not None else '?'}"


Row = tuple[Record | None, Record | None]


def _walk(pairing: Pairing, recs_a: Iterator[Record], recs_b: Iterator[Record]) -> Iterator[Row]:
    for i, j in pairing.rows():
        ra = next(recs_a) if i >= 0 else None
        rb = next(recs_b) if j >= 0 else None
        yield ra, rb


def _compare_stream(em: OpEncoder, sa: Stream, sb: Stream, tracks: tuple[int, int], summ: StreamSummary,
                    intern: dict[str, int]) -> None:
    ia, ib = _index(sa, intern), _index(sb, intern)
    if not (ia.all_digests and ib.all_digests):
        # identities must be comparable: without source-line digests on a side, both use line numbers
        ia.keys, ib.keys = ia.line_keys, ib.line_keys
        missing = " and ".join(s for s, i in (("A", ia), ("B", ib)) if not i.all_digests)
        summ.notes.append(f"call sites identified by file name and line number: run {missing} lacks source-line "
                          "digests (lines inserted elsewhere in a file change these identities)")
    _collective_anchors(ia, ib)
    pairing = pair_streams(ia.keys, ib.keys, ia.anchors, ib.anchors)
    summ.ops_a, summ.ops_b = len(ia.keys), len(ib.keys)
    summ.notes.extend([*(f"run A: {n}" for n in sa.notes), *(f"run B: {n}" for n in sb.notes)])
    del ia, ib
    unresolved = 0
    for row, (ra, rb) in enumerate(_walk(pairing, sa.records(), sb.records())):
        ts = row * ROW_NS
        if ra is not None and rb is not None:
            rid_a, rid_b = record_id("A", ra, sa.name), record_id("B", rb, sb.name)
            basis = pairing.basis_a[ra.index] or ""
            d = diff_pair(ra, rb)
            em.flow += 1
            em.op(tracks[0], ts, "A", sa.name, ra, rid_a, {"state": "paired", "other": rid_b, "basis": basis},
                  d.status, d, flow_out=em.flow)
            em.op(tracks[1], ts, "B", sb.name, rb, rid_b, {"state": "paired", "other": rid_a, "basis": basis},
                  d.status, d, flow_in=em.flow)
            summ.status[d.status] += 1
            summ.basis[basis] += 1
            if d.status == MISMATCH:
                fm = FirstMismatch(rid_a, rid_b, ra.function, _where(ra), d.fields, d.numeric, unresolved)
                if summ.first_mismatch is None:
                    summ.first_mismatch = fm
                if d.inputs_equal and summ.first_equal_input_mismatch is None:
                    summ.first_equal_input_mismatch = fm
            continue
        rec = ra if ra is not None else rb
        assert rec is not None
        side = "A" if ra is not None else "B"
        reason = (pairing.reason_a if side == "A" else pairing.reason_b)[rec.index] or ""
        stream = sa.name if side == "A" else sb.name
        em.op(tracks[0 if side == "A" else 1], ts, side, stream, rec, record_id(side, rec, stream),
              {"state": "undetermined", "reason": reason}, UNALIGNED, None)
        (summ.reasons_a if side == "A" else summ.reasons_b)[reason] += 1
        summ.status[UNALIGNED] += 1
        unresolved += 1


def _export_only(em: OpEncoder, side: str, st: Stream, track: int, summ: StreamSummary) -> None:
    n = 0
    for rec in st.records():
        em.op(track, rec.index * ROW_NS, side, st.name, rec, record_id(side, rec, st.name),
              {"state": "undetermined", "reason": NO_CORRESPONDING_FILE}, UNALIGNED, None)
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


def compare(a: str, b: str, out: Path) -> Summary:
    """Compare runs A and B, write the Perfetto view to OUT, return the summary.

    Raises ConfigError when there is nothing to compare (no trace files, no corresponding files) or
    when nothing at all was paired (the view is still written, for inspection).
    """
    with open_run(a, "A") as run_a, open_run(b, "B") as run_b:
        common = sorted(run_a.streams.keys() & run_b.streams.keys())
        if not common:
            raise ConfigError(
                f"no corresponding trace files: A has {_describe(run_a)}; B has {_describe(run_b)}",
                "compare runs of the same program: streams correspond by rank and stream name")
        attributes: dict[str, str | int] = {
            "opguard.export": EXPORT_KIND,
            "opguard.input_a.path": run_a.restored_from or str(run_a.root),
            "opguard.input_a.kind": run_a.kind,
            "opguard.input_a.sha256": run_a.digest(),
            "opguard.input_b.path": run_b.restored_from or str(run_b.root),
            "opguard.input_b.kind": run_b.kind,
            "opguard.input_b.sha256": run_b.digest(),
        }
        writer = ExportWriter(out, attributes)
        summary = Summary(export_path=str(out))
        try:
            em = OpEncoder(writer)
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
                    _compare_stream(em, run_a.streams[key], run_b.streams[key], (ta, tb), summ, intern)
                elif key in run_a.streams:
                    summary.only_a.append(key)
                    _export_only(em, "A", run_a.streams[key], ta, summ)
                else:
                    summary.only_b.append(key)
                    _export_only(em, "B", run_b.streams[key], tb, summ)
            summary.export_bytes = writer.commit()
        except BaseException:
            writer.abort()
            raise
    return summary


def check_paired(summary: Summary) -> None:
    if summary.pairs == 0:
        raise ConfigError(
            f"nothing was paired: every operation is undetermined (the view was written to {summary.export_path} "
            "for inspection)",
            "check that A and B are runs of the same program; see the reasons per rank above and docs/compare.md")


__all__ = ["MISMATCH", "OK", "UNALIGNED", "check_paired", "compare"]
