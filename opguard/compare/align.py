"""``python -m opguard.tools align EXPORT MAP -o NEW`` (``docs/compare.md`` §7).

Writes a new Perfetto view from an existing export and an alignment map bound to that export's
SHA-256. The map can

* ``pairs``: link explicitly chosen tensor slots of any two operations (across files, functions
  and ranks) and compare those slots' recorded fields, and
* ``reject``: turn an automatic pair back into two ``undetermined`` operations
  (reason ``rejected-by-alignment-map``).

Every original observation stays in the new view (a changed correspondence keeps the original
under ``original``); EXPORT itself is never modified. Offline: no GPU run, no tensor transform,
no claim of semantic correspondence — a link is a candidate like any other (validation
``unreviewed``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opguard.compare.diff import MISMATCH, OK, UNALIGNED, dump_errors
from opguard.compare.pairing import ALIGN_MAP, REJECTED_BY_MAP
from opguard.compare.perfetto_export import (
    IMPLIED,
    Export,
    ExportedOp,
    ExportWriter,
    callsite_text,
    read_export,
)
from opguard.errors import ConfigError, IdentityError
from opguard.staging.bundle import file_sha256

MAP_VERSION = 1
_FIX_MAP = ('write the map as {"version": 1, "export_sha256": "<sha256 of EXPORT>", "pairs": [{"a": {"record": ID, '
            '"slot": "outputs.out"}, "b": {"record": ID, "slot": "inputs.arg0"}}], "reject": [{"a": ID, "b": ID}]}')


@dataclass
class AlignReport:
    links: int
    rejected: int
    ops: int
    path: str
    bytes: int


def _load_map(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the alignment map {path}: {e}", "pass an existing JSON file") from None
    except ValueError as e:
        raise ConfigError(f"the alignment map {path} is not JSON ({e})", _FIX_MAP) from None
    if not isinstance(data, dict) or data.get("version") != MAP_VERSION:
        raise ConfigError(f"the alignment map {path} has no \"version\": {MAP_VERSION}", _FIX_MAP)
    for key in ("pairs", "reject"):
        if not isinstance(data.get(key, []), list):
            raise ConfigError(f"the alignment map {path}: \"{key}\" must be a list", _FIX_MAP)
    return data


def _op(ids: dict[str, ExportedOp], rid: Any, where: str) -> ExportedOp:
    if not isinstance(rid, str) or rid not in ids:
        raise ConfigError(f"{where}: record {rid!r} is not in the export",
                          "use record_id values of the export's slices (e.g. A/rank0/capture/17)")
    return ids[rid]


def _slot(op: ExportedOp, spec: Any, where: str) -> dict[str, Any]:
    if not isinstance(spec, str) or "." not in spec:
        raise ConfigError(f"{where}: slot {spec!r} must be inputs.<slot> or outputs.<slot>", _FIX_MAP)
    kind, name = spec.split(".", 1)
    slots = op.args.get(kind) if kind in ("inputs", "outputs") else None
    if not isinstance(slots, dict) or name not in slots:
        have = [f"{k}.{n}" for k in ("inputs", "outputs") for n in (op.args.get(k) or {})]
        raise ConfigError(f"{where}: {op.record_id} has no slot {spec!r}", f"choose one of: {', '.join(have)}")
    return dict(slots[name])


def compare_slots(sa: dict[str, Any], sb: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Status and differences of two recorded tensor slots (the same fields compare() uses)."""
    fields = [f for f in ("dtype", "shape", "digest") if sa.get(f) != sb.get(f)]
    if not fields:
        return OK, {}
    diff: dict[str, Any] = {"fields": ", ".join(fields)}
    if sa.get("dump") and sb.get("dump"):
        try:
            diff.update(dump_errors(str(sa["dump"]), str(sb["dump"])))
        except (OSError, ValueError, RuntimeError, ImportError) as e:
            diff["dump_error"] = str(e)
    st_a, st_b = sa.get("stats"), sb.get("stats")
    if isinstance(st_a, dict) and isinstance(st_b, dict):
        d = [abs(float(st_a[k]) - float(st_b[k])) for k in ("min", "max", "mean", "std", "absmax")
             if isinstance(st_a.get(k), int | float) and isinstance(st_b.get(k), int | float)
             and math.isfinite(float(st_a[k])) and math.isfinite(float(st_b[k]))]
        if d:
            diff["stats_max_abs_diff"] = max(d)
    return MISMATCH, diff


def align(export_path: Path, map_path: Path, new: Path) -> AlignReport:
    if new.resolve() == export_path.resolve():
        raise ConfigError(f"NEW {new} is the export itself", "write the aligned view to another file; the "
                          "original export is never modified")
    digest = file_sha256(export_path) if export_path.is_file() else ""
    amap = _load_map(map_path)
    bound = amap.get("export_sha256")
    export: Export = read_export(export_path)
    if bound != digest:
        raise IdentityError(f"the alignment map {map_path} is bound to export {bound!r}, but {export_path} has "
                            f"SHA-256 {digest}", "write the map against this export (its export_sha256 must be "
                            "the SHA-256 of EXPORT), or pass the export it was written for")
    ids = export.by_id()
    extra: dict[str, dict[str, Any]] = {}
    flows_out: dict[str, list[int]] = {}
    flows_in: dict[str, list[int]] = {}
    next_flow = 1 + max((f for op in export.ops for f in (*op.flows_out, *op.flows_in)), default=0)

    rejected: set[str] = set()
    for k, entry in enumerate(amap.get("reject", [])):
        where = f"{map_path}: reject[{k}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be an object", _FIX_MAP)
        oa, ob = _op(ids, entry.get("a"), where), _op(ids, entry.get("b"), where)
        corr = oa.args.get("correspondence") or {}
        if corr.get("state") != "paired" or corr.get("other") != ob.record_id:
            raise ConfigError(f"{where}: {oa.record_id} and {ob.record_id} are not a pair in the export",
                              "reject only relations the export states (correspondence.other)")
        for op, other in ((oa, ob), (ob, oa)):
            rejected.add(op.record_id)
            extra.setdefault(op.record_id, {})["reject"] = {"other": other.record_id,
                                                            "note": str(entry.get("note", ""))}

    links = 0
    for k, entry in enumerate(amap.get("pairs", [])):
        where = f"{map_path}: pairs[{k}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("a"), dict) or not isinstance(entry.get("b"), dict):
            raise ConfigError(f"{where} must be {{\"a\": {{\"record\", \"slot\"}}, \"b\": {{...}}}}", _FIX_MAP)
        oa = _op(ids, entry["a"].get("record"), where)
        ob = _op(ids, entry["b"].get("record"), where)
        sa = _slot(oa, entry["a"].get("slot"), where)
        sb = _slot(ob, entry["b"].get("slot"), where)
        status, diff = compare_slots(sa, sb)
        for op, mine, other, theirs in ((oa, entry["a"]["slot"], ob, entry["b"]["slot"]),
                                        (ob, entry["b"]["slot"], oa, entry["a"]["slot"])):
            link = {"entry": k, "basis": ALIGN_MAP, "validation": "unreviewed", "slot": mine,
                    "other": other.record_id, "other_slot": theirs, "status": status,
                    "note": str(entry.get("note", ""))}
            if diff:
                link["diff"] = diff
            extra.setdefault(op.record_id, {}).setdefault("links", []).append(link)
        flows_out.setdefault(oa.record_id, []).append(next_flow)
        flows_in.setdefault(ob.record_id, []).append(next_flow)
        next_flow += 1
        links += 1

    attributes: dict[str, str | int] = {k: v for k, v in export.attributes.items() if isinstance(v, str | int)}
    attributes["opguard.align.export_sha256"] = digest
    attributes["opguard.align.map_sha256"] = file_sha256(map_path)
    writer = ExportWriter(new, attributes)
    try:
        uuid_map: dict[int, int] = {}
        for uuid in sorted(export.tracks):
            t = export.tracks[uuid]
            uuid_map[uuid] = writer.track(t["name"], parent=uuid_map.get(t["parent"]) if t["parent"] else None,
                                          order=t.get("order"), description=t.get("description") or None)
        ann = writer.ann
        for op in export.ops:
            args = {k: v for k, v in op.args.items() if k not in IMPLIED}
            if isinstance(args.get("callsite"), dict):
                args["callsite"] = callsite_text(args["callsite"])
            out_f, in_f = list(op.flows_out), list(op.flows_in)
            x = extra.get(op.record_id, {})
            if op.record_id in rejected:
                args["original"] = {k: args[k] for k in ("correspondence", "validation", "status", "diff") if k in args}
                args.pop("validation", None)
                args.pop("diff", None)
                args["correspondence"] = {"state": "undetermined", "reason": REJECTED_BY_MAP,
                                          "rejected_other": x["reject"]["other"], "note": x["reject"]["note"]}
                args["status"] = UNALIGNED
                out_f, in_f = [], []
            if "links" in x:
                args["alignment"] = {f"link{i}": link for i, link in enumerate(x["links"])}
            out_f += flows_out.get(op.record_id, [])
            in_f += flows_in.get(op.record_id, [])
            writer.slice(uuid_map[op.track], op.ts, op.name, [ann.value(k, v) for k, v in args.items()],
                         flows_out=out_f, flows_in=in_f)
        size = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return AlignReport(links, len(rejected) // 2, len(export.ops), str(new), size)
