"""Call-site identity by aligning the two versions of each source file (``docs/compare.md`` §2).

A file of run A corresponds to a file of run B when their paths are equal, or else when their
base names are equal and each side has exactly one call-site file of that name. When both runs
have the source of a corresponding pair, a line diff gives the line correspondence: equal lines
correspond, the k-th line of a changed hunk of equal length on both sides corresponds to the
k-th line of the other (an edited line), every other line has no counterpart (evidence says
"moved" when its text is that of exactly one A line without a counterpart). A call site's
identity in B is then the A line its line corresponds to, so shifts and edits keep identities.
Without a source on a side, identities are file name and line number, and a note says so.
"""

from __future__ import annotations

import difflib
import os
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from opguard.compare.records import RecordSite

SAME = "same"
NO_COUNTERPART = "no counterpart"
MOVED = "moved from A:"           # + A's line: no counterpart, but the same text left A's line there


def line_correspondence(a: Sequence[str], b: Sequence[str]) -> tuple[array[int], list[str]]:
    """For every line of ``b`` (index 0 = line 1): the corresponding line of ``a`` (1-based; 0 =
    none) and how it corresponds (``same``, ``shifted A:<n>``, ``edited A:<n>``, ``no counterpart``)."""
    to_a = array("q", [0]) * len(b)
    how = [NO_COUNTERPART] * len(b)
    sa = [x.strip() for x in a]
    sb = [x.strip() for x in b]
    if sa == sb:
        for j in range(len(b)):
            to_a[j] = j + 1
            how[j] = SAME
        return to_a, how
    sm = difflib.SequenceMatcher(None, sa, sb, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            for k in range(j2 - j1):
                i, j = i1 + k, j1 + k
                to_a[j] = i + 1
                if tag == "replace":
                    how[j] = f"edited A:{i + 1}"
                else:
                    how[j] = SAME if i == j else f"shifted A:{i + 1}"
    _mark_moved(sa, sb, to_a, how)
    return to_a, how


def _mark_moved(sa: Sequence[str], sb: Sequence[str], to_a: array[int], how: list[str]) -> None:
    """Evidence only: a B line without a counterpart whose text is that of exactly one A line
    without a counterpart (and of no other such B line) says ``moved from A:<n>``. It keeps no
    counterpart, so its identity and the pairing are unchanged; the summary then says where the
    line came from instead of calling it a line A does not have."""
    matched_a = set(to_a)
    free_a: dict[str, list[int]] = {}
    for i, text in enumerate(sa):
        if i + 1 not in matched_a and _code(text):
            free_a.setdefault(text, []).append(i)
    free_b: dict[str, list[int]] = {}
    for j, text in enumerate(sb):
        if how[j] == NO_COUNTERPART and _code(text):
            free_b.setdefault(text, []).append(j)
    for text, js in free_b.items():
        ia = free_a.get(text, ())
        if len(js) == 1 and len(ia) == 1:
            how[js[0]] = f"{MOVED}{ia[0] + 1}"


def _code(text: str) -> bool:
    return bool(text) and not text.startswith("#")


def is_new_line(line_map: str | None) -> bool:
    """B's line has no counterpart in A (inserted, or moved from elsewhere)."""
    return line_map is not None and (line_map == NO_COUNTERPART or line_map.startswith(MOVED))


@dataclass(frozen=True)
class _FileMap:
    a_name: str
    to_a: array[int] | None        # None: no line correspondence (a side lacks the source)
    how: list[str]


def _line_site(file: str | None, line: int | None) -> str:
    name = os.path.basename(file) if file else "?"
    return f"{name}:line={line if line is not None else '?'}"


def _with_identity(site: RecordSite, ident: str, line_map: str | None) -> RecordSite:
    return replace(site, site=ident, line_map=line_map, key=f"{site.function}\x00{ident}\x00{site.context}")


LinesOf = Callable[[str], list[str] | None]


def assign_identities(sites_a: Sequence[RecordSite], sites_b: Sequence[RecordSite], lines_a: LinesOf, lines_b: LinesOf
                      ) -> tuple[list[RecordSite], list[RecordSite], list[str]]:
    """The call sites of both runs with their identities (and keys) for this stream pair, and the
    notes for the summary (files identified by line number, and why)."""
    files_a = {s.file for s in sites_a if s.file}
    files_b = {s.file for s in sites_b if s.file}
    names_a: dict[str, list[str]] = {}
    names_b: dict[str, list[str]] = {}
    for f in files_a:
        names_a.setdefault(os.path.basename(f), []).append(f)
    for f in files_b:
        names_b.setdefault(os.path.basename(f), []).append(f)
    counterpart: dict[str, str] = {}          # B file -> A file
    for f in files_b:
        if f in files_a:
            counterpart[f] = f
        else:
            name = os.path.basename(f)
            if len(names_a.get(name, ())) == 1 and len(names_b[name]) == 1:
                counterpart[f] = names_a[name][0]
    maps: dict[str, _FileMap] = {}
    no_source: dict[str, list[str]] = {"A": [], "B": []}
    mapped_a: set[str] = set()
    for fb, fa in sorted(counterpart.items()):
        la, lb = lines_a(fa), lines_b(fb)
        if la is None or lb is None:
            for side, lines, f in (("A", la, fa), ("B", lb, fb)):
                if lines is None:
                    no_source[side].append(os.path.basename(f))
            maps[fb] = _FileMap(os.path.basename(fa), None, [])
            continue
        to_a, how = line_correspondence(la, lb)
        maps[fb] = _FileMap(os.path.basename(fa), to_a, how)
        mapped_a.add(fa)
    out_a = [_with_identity(s, f"{os.path.basename(s.file)}:{s.line}" if s.file in mapped_a
                            and s.line is not None else _line_site(s.file, s.line), None) for s in sites_a]
    out_b: list[RecordSite] = []
    for s in sites_b:
        fm = maps.get(s.file) if s.file else None
        if fm is None or fm.to_a is None or s.line is None:
            out_b.append(_with_identity(s, _line_site(s.file, s.line), None))
            continue
        j = s.line - 1
        if 0 <= j < len(fm.to_a) and fm.to_a[j]:
            out_b.append(_with_identity(s, f"{fm.a_name}:{fm.to_a[j]}", fm.how[j]))
        else:
            line_map = fm.how[j] if 0 <= j < len(fm.how) else NO_COUNTERPART      # no counterpart, or moved
            out_b.append(_with_identity(s, f"{os.path.basename(s.file or '?')}:+{s.line}", line_map))
    notes = []
    by_sides: dict[str, list[str]] = {}          # "A", "B" or "A and B" -> file names without a source there
    for name in sorted(set(no_source["A"]) | set(no_source["B"])):
        sides = " and ".join(s for s in ("A", "B") if name in no_source[s])
        by_sides.setdefault(sides, []).append(name)
    for sides, names in by_sides.items():
        verb = "have" if " and " in sides else "has"
        notes.append(f"call sites identified by file name and line number in {', '.join(names[:8])}: run {sides} "
                     f"{verb} no source of it (a line inserted above a call site changes its identity)")
    unmatched = sorted({os.path.basename(f) for f in files_b if f not in counterpart} |
                       {os.path.basename(f) for f in files_a if f not in counterpart.values()})
    if unmatched:
        notes.append("call-site files without a corresponding file in the other run (identified by line "
                     f"number): {', '.join(unmatched[:8])}")
    return out_a, out_b, notes


# ---- reference implementation: original lines from its rewritten source copies --------------------

_WRAPPER = re.compile(r"opguard_wrapped_\w*?\((\d+)\)\(")
_UNWRAP_ARGS = re.compile(r"opguard_wrapped_\w*?\(\d+\)\(([\w.]+), ")
_UNWRAP_NOARGS = re.compile(r"opguard_wrapped_\w*?\(\d+\)\(([\w.]+)\)")
# lines the rewriter inserts: its imports, wrapper definitions and buffer flushes
_INSERTED = re.compile(r"^\s*(from opguard[.\w]* import |import opguard\b|opguard_wrapped_\w* = make_wrapper\(|"
                       r"flush_trace_buffer\()")


def unwrap(text: str) -> str:
    """A rewritten line with its wrapper calls undone: ``opguard_wrapped_x(13)(torch.relu, h)`` ->
    ``torch.relu(h)`` where the callee is a name or attribute path; any other wrapper loses its prefix."""
    text = _UNWRAP_NOARGS.sub(r"\1()", _UNWRAP_ARGS.sub(r"\1(", text))
    return _WRAPPER.sub("(", text)


def recover_original(copy: list[str]) -> list[str]:
    """The original file's lines from a reference rewritten copy (``docs/compare.md`` §2.1)."""
    if not any(_WRAPPER.search(x) for x in copy):
        return list(copy)
    kept = [x for x in copy if not _INSERTED.match(x)]
    anchors: list[tuple[int, int]] = []          # (index in kept, original line)
    for k, text in enumerate(kept):
        m = _WRAPPER.search(text)
        if m:
            anchors.append((k, int(m.group(1))))
    n = max(orig for _, orig in anchors)
    n = max(n, anchors[-1][1] + (len(kept) - 1 - anchors[-1][0]))
    out = [""] * n
    prev_k, prev_orig = -1, 0
    for k, orig in [*anchors, (len(kept), n + 1)]:
        if orig <= prev_orig:
            continue                                  # a second wrapper line of the same number
        between = kept[prev_k + 1:k]                  # copy lines between two recovered lines
        slots = orig - prev_orig - 1                  # original line numbers between them
        if len(between) > slots:
            between = between[len(between) - slots:] if slots > 0 else []
        for d, text in enumerate(between):
            out[prev_orig + d] = text
        if k < len(kept):
            out[orig - 1] = unwrap(kept[k])
        prev_k, prev_orig = k, orig
    return out
