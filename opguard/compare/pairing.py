"""Call correspondence between two corresponding trace streams (``docs/compare.md`` §2).

The rules, and nothing else (no similarity scores, no repair passes):

1. Equal call-site key sequences (function, call site, rank, context) pair in execution order,
   basis ``equal-sequence``.
2. Otherwise, **anchors**: an anchor key that occurs exactly once on each side matches those two
   operations, unless they are at different call sites neither of which is on a line the source
   diff says was edited or is new, or they are not in the same step and the same occurrence of
   their call-site keys in it (the k-th call at its site on one side, another count on the other);
   of those matches only a longest set whose order agrees on both sides is kept (longest
   increasing subsequence; ties keep the earliest), basis ``input-anchor``.
3. Between consecutive anchors (and before the first / after the last), equal call-site key
   sequences pair in order, basis ``between-anchors``; a segment that differs only in the function
   called at the same call sites pairs in order too when the first such call at each of those
   sites had equal captured inputs, the calls whose function differs with basis
   ``function-differs`` (tried on the top-level operations alone when the functions made
   different nested calls); a segment that pairs once the calls whose key the other side's
   segment lacks are set aside pairs the rest in order (tried again with keys told apart by the
   grad mode: an added evaluation pass under ``no_grad``); in a segment nothing else pairs, its common
   start and end (equal keys) pair in order. Every other operation stays unresolved with a reason
   from :data:`REASONS`.

Keys and anchor keys are plain integers chosen by the caller (:mod:`opguard.compare.records`):
this module never sees an output value or shape.
"""

from __future__ import annotations

import itertools
import operator
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# bases of a pair
EQUAL_SEQUENCE = "equal-sequence"
INPUT_ANCHOR = "input-anchor"
BETWEEN_ANCHORS = "between-anchors"
FUNCTION_DIFFERS = "function-differs"
ALIGN_MAP = "alignment-map"
BASES = (EQUAL_SEQUENCE, INPUT_ANCHOR, BETWEEN_ANCHORS, FUNCTION_DIFFERS, ALIGN_MAP)

# reasons of an unresolved operation (the documented list, docs/compare.md §3)
NO_CORRESPONDING_FILE = "no-corresponding-file"
SEGMENT_DIFFERS = "segment-differs"
NO_COUNTERPART_IN_SEGMENT = "no-counterpart-in-segment"
ANCHOR_ORDER_CONFLICT = "anchor-order-conflict"
REJECTED_BY_MAP = "rejected-by-alignment-map"
NESTED_CALLS_DIFFER = "nested-calls-differ"
NOT_IN_OTHER_SEGMENT = "not-in-other-segment"
EDITED_LINE_CALLS = "edited-line-calls"
REASONS = (NO_CORRESPONDING_FILE, SEGMENT_DIFFERS, NO_COUNTERPART_IN_SEGMENT, ANCHOR_ORDER_CONFLICT,
           REJECTED_BY_MAP, NESTED_CALLS_DIFFER, NOT_IN_OTHER_SEGMENT, EDITED_LINE_CALLS)

NO_ANCHOR = 0


@dataclass
class Pairing:
    """Result for one stream pair. ``a_to_b[i]`` is the B index paired with A's i-th op, or -1."""

    a_to_b: array[int]
    b_to_a: array[int]
    basis_a: list[str | None]      # basis of A's i-th op when paired
    reason_a: list[str | None]     # reason of A's i-th op when unresolved
    reason_b: list[str | None]
    anchors: int = 0

    def row_arrays(self) -> tuple[array[int], array[int]]:
        """:meth:`rows` as two arrays (A's index per row, B's index per row; -1: none)."""
        ra, rb = array("q"), array("q")
        j = 0
        nb = len(self.b_to_a)
        for i, b in enumerate(self.a_to_b):
            if b < 0:
                ra.append(i)
                rb.append(-1)
                continue
            if j < b:
                ra.extend(array("q", [-1]) * (b - j))
                rb.extend(range(j, b))
            ra.append(i)
            rb.append(b)
            j = b + 1
        if j < nb:
            ra.extend(array("q", [-1]) * (nb - j))
            rb.extend(range(j, nb))
        return ra, rb

    def rows(self) -> list[tuple[int, int]]:
        """Both sequences merged in execution order: (a, b), (a, -1) or (-1, b) per row.

        Every pair is monotone, so each pair is one row and the unresolved operations of each
        side sit between the pairs around them (A's before B's).
        """
        out: list[tuple[int, int]] = []
        j = 0
        nb = len(self.b_to_a)
        for i, b in enumerate(self.a_to_b):
            if b < 0:
                out.append((i, -1))
                continue
            while j < b:
                out.append((-1, j))
                j += 1
            out.append((i, b))
            j = b + 1
        while j < nb:
            out.append((-1, j))
            j += 1
        return out


def _lis(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Longest subsequence of ``pairs`` (sorted by a) with strictly increasing b; earliest on ties."""
    tails: list[int] = []          # smallest b ending an increasing run of length k+1
    tail_idx: list[int] = []
    prev = [-1] * len(pairs)
    for k, (_, b) in enumerate(pairs):
        pos = bisect_left(tails, b)
        if pos == len(tails):
            tails.append(b)
            tail_idx.append(k)
        else:
            tails[pos] = b
            tail_idx[pos] = k
        prev[k] = tail_idx[pos - 1] if pos else -1
    out: list[tuple[int, int]] = []
    k = tail_idx[-1] if tail_idx else -1
    while k >= 0:
        out.append(pairs[k])
        k = prev[k]
    out.reverse()
    return out


def _occurrences(keys: Sequence[int], steps: Sequence[int] | None = None) -> array[int]:
    """For each position, how many earlier positions of the same step hold the same key (0 for a
    key's first call in its step); without steps (or a length that does not fit), in the stream."""
    seen: dict[Any, int] = {}
    get = seen.get
    out = array("q", bytes(8 * len(keys)))
    per_step = steps is not None and len(steps) == len(keys)
    for i, k in enumerate(keys):
        key: Any = (steps[i], k) if per_step and steps is not None else k
        n = get(key, 0)
        out[i] = n
        seen[key] = n + 1
    return out


def _unique(anchors: Sequence[int]) -> dict[int, int]:
    """Anchor key -> position, for the keys that occur exactly once, in order of position (``last``
    keeps the order of first occurrence, which for a key that occurs once is its position)."""
    last = dict(zip(anchors, range(len(anchors)), strict=True))     # a unique key's only position
    none = anchors.count(NO_ANCHOR)
    if len(last) == len(anchors) - none + (1 if none else 0):  # every key but NO_ANCHOR occurs once (the usual case)
        last.pop(NO_ANCHOR, None)
        return last
    counts = Counter(anchors)
    return {key: i for key, i in last.items() if counts[key] == 1 and key != NO_ANCHOR}


def _other_function(seg_a: Sequence[int], seg_b: Sequence[int], keys_a: Sequence[int], keys_b: Sequence[int],
                    sites_a: Sequence[int], sites_b: Sequence[int], inputs_a: Sequence[int],
                    inputs_b: Sequence[int], edited: set[int], lines_a: Sequence[int] | None = None
                    ) -> list[int] | None:
    """docs/compare.md §2 rule 5: a segment whose call-site keys differ only in the function, at
    call sites (keys without the function) equal position by position, pairs in order when every
    position whose function differs is on a line established as calling another function — by the
    captured inputs of one such position on that line being equal (then it is established, also
    for later segments: ``edited``) or by an earlier segment. A line is established for every
    module and context that runs it (``lines_a``: each operation's call-site identity without the
    context; block 0's call with equal inputs establishes the line for block 1, whose inputs
    already differ). Returns the positions (in the segment) whose function differs, or None when
    the segment does not pair this way."""
    if len(seg_a) != len(seg_b) or not seg_a:
        return None
    line_of = sites_a if lines_a is None else lines_a
    differ: list[int] = []
    new: set[int] = set()
    for k, (i, j) in enumerate(zip(seg_a, seg_b, strict=True)):
        if keys_a[i] == keys_b[j]:
            continue
        if sites_a[i] != sites_b[j]:
            return None
        differ.append(k)
        if inputs_a[i] != NO_ANCHOR and inputs_a[i] == inputs_b[j]:
            new.add(line_of[i])
    if any(line_of[seg_a[k]] not in edited and line_of[seg_a[k]] not in new for k in differ):
        return None
    edited.update(new)
    return differ


def _in_order(result: Pairing, seq_a: Sequence[int], seq_b: Sequence[int]) -> None:
    """Pair ``seq_a[k]`` with ``seq_b[k]`` for every k (equal lengths), basis ``between-anchors``."""
    a_to_b, b_to_a, basis_a = result.a_to_b, result.b_to_a, result.basis_a
    for i, j in zip(seq_a, seq_b, strict=True):
        a_to_b[i] = j
        b_to_a[j] = i
        basis_a[i] = BETWEEN_ANCHORS


def _top_level(seg_a: range, seg_b: range, keys_a: Sequence[int], keys_b: Sequence[int],
               sites_a: Sequence[int], sites_b: Sequence[int], inputs_a: Sequence[int], inputs_b: Sequence[int],
               nested_a: Sequence[int], nested_b: Sequence[int], edited: set[int], result: Pairing,
               lines_a: Sequence[int] | None = None) -> bool:
    """docs/compare.md §2 rule 5, nested calls set aside: a function that differs at a call site can
    make other nested calls (``F.relu`` records a nested ``torch.relu``, ``F.gelu`` none), so the
    segment's lengths differ. When the segment's *top-level* operations (depth 0) pair by rule 5,
    they are paired; the nested operations after each paired operation (and before the first) pair
    in order where their call-site keys are equal, or by rule 6 (the calls whose key the other run
    lacks set aside: ``g - s`` edited to ``g - 0.5 * s`` in a custom ``backward``), else stay
    unresolved (``nested-calls-differ``).
    False (nothing paired) when there is nothing nested to set aside or rule 5 does not apply."""
    top_a = [i for i in seg_a if not nested_a[i]]
    top_b = [j for j in seg_b if not nested_b[j]]
    if not top_a or (len(top_a) == len(seg_a) and len(top_b) == len(seg_b)):
        return False
    differ = _other_function(top_a, top_b, keys_a, keys_b, sites_a, sites_b, inputs_a, inputs_b, edited, lines_a)
    if differ is None:
        return False
    _in_order(result, top_a, top_b)
    for k in differ:
        result.basis_a[top_a[k]] = FUNCTION_DIFFERS
    # the nested runs: before the first top-level operation, then after each one
    starts_a, starts_b = [seg_a.start - 1, *top_a], [seg_b.start - 1, *top_b]
    ends_a, ends_b = [*top_a, seg_a.stop], [*top_b, seg_b.stop]
    for a0, a1, b0, b1 in zip(starts_a, ends_a, starts_b, ends_b, strict=True):
        run_a, run_b = range(a0 + 1, a1), range(b0 + 1, b1)
        if len(run_a) == len(run_b) and all(keys_a[i] == keys_b[j] for i, j in zip(run_a, run_b, strict=True)):
            _in_order(result, run_a, run_b)
        elif run_a and run_b and _one_sided(run_a, run_b, keys_a, keys_b, result):
            pass  # rule 6 in the run: a call only one side makes (a line edited in a custom backward)
        else:
            for i in run_a:
                result.reason_a[i] = NESTED_CALLS_DIFFER
            for j in run_b:
                result.reason_b[j] = NESTED_CALLS_DIFFER
    return True


def _one_sided(seg_a: range, seg_b: range, keys_a: Sequence[int], keys_b: Sequence[int], result: Pairing) -> bool:
    """docs/compare.md §2 rule 6, calls only one run makes: set aside the operations whose call-site
    key does not occur in the other run's segment at all (``x = h.sin()`` edited to ``x = h.sin() *
    0.5``: B's ``Tensor.mul`` at that line); when the rest are equal key sequences they pair in
    order (basis ``between-anchors``), and the set-aside ones stay unresolved
    (``not-in-other-segment``). False (nothing paired) when nothing is one-sided or the rest differ."""
    in_a = {keys_a[i] for i in seg_a}
    in_b = {keys_b[j] for j in seg_b}
    rest_a = [i for i in seg_a if keys_a[i] in in_b]
    rest_b = [j for j in seg_b if keys_b[j] in in_a]
    if (len(rest_a) == len(seg_a) and len(rest_b) == len(seg_b)) or not rest_a or len(rest_a) != len(rest_b):
        return False
    if any(keys_a[i] != keys_b[j] for i, j in zip(rest_a, rest_b, strict=True)):
        return False
    _in_order(result, rest_a, rest_b)
    for i in seg_a:
        if result.a_to_b[i] < 0:
            result.reason_a[i] = NOT_IN_OTHER_SEGMENT
    for j in seg_b:
        if result.b_to_a[j] < 0:
            result.reason_b[j] = NOT_IN_OTHER_SEGMENT
    return True


def _runs(seg: range, steps: Sequence[int]) -> list[tuple[int, range]] | None:
    """The steps of a segment as (step, positions) runs, in order; None when a step comes back
    after another (steps set by hand, out of order: no split)."""
    runs: list[tuple[int, range]] = []
    start = seg.start
    for i in range(seg.start + 1, seg.stop + 1):
        if i == seg.stop or steps[i] != steps[start]:
            runs.append((steps[start], range(start, i)))
            start = i
    values = [s for s, _ in runs]
    return runs if all(map(operator.lt, values, values[1:])) else None


def _by_step(seg_a: range, seg_b: range, steps_a: Sequence[int] | None, steps_b: Sequence[int] | None
             ) -> list[tuple[range, range]]:
    """docs/compare.md §2: a segment that spans steps is paired step by step — the k-th step's calls
    of A only with the k-th step's calls of B (a changed seed or batch changes how often a
    data-dependent loop runs in each step: rule 8's common ends then paired step 1's tail with step
    5's, leaving every step between unresolved); a step only one side's segment has is a segment
    of its own with no counterpart. Unsplit when either side's steps are not in increasing runs."""
    if steps_a is None or steps_b is None or not seg_a or not seg_b:
        return [(seg_a, seg_b)]
    runs_a, runs_b = _runs(seg_a, steps_a), _runs(seg_b, steps_b)
    if runs_a is None or runs_b is None or (len(runs_a) == 1 and len(runs_b) == 1):
        return [(seg_a, seg_b)]
    by_a, by_b = dict(runs_a), dict(runs_b)
    out = []
    for step in sorted(by_a.keys() | by_b.keys()):
        out.append((by_a.get(step, range(seg_a.stop, seg_a.stop)), by_b.get(step, range(seg_b.stop, seg_b.stop))))
    return out


def _grad_split(keys: Sequence[int], grad_off: Sequence[int]) -> list[int]:
    """docs/compare.md §2 rule 6 with the grad mode: each call-site key told apart by whether grad
    mode was off (an evaluation pass under ``torch.no_grad()`` runs the training forward's call
    sites in the same order)."""
    return [k * 2 + (1 if off else 0) for k, off in zip(keys, grad_off, strict=True)]


def _edited_lines(seg_a: range, seg_b: range, keys_a: Sequence[int], keys_b: Sequence[int],
                  changed_a: Sequence[int], changed_b: Sequence[int], result: Pairing) -> bool:
    """docs/compare.md §2 rule 7, calls on an edited line: walk both sides in order; equal keys pair,
    and where they differ B's operation is set aside when it is on an edited line (``changed_b``),
    else A's (``changed_a``); what is left at the end must be on edited lines too. The set-aside
    operations stay unresolved (``edited-line-calls``). False (nothing paired) when the walk meets
    two different keys neither of which is on an edited line, or nothing was set aside."""
    i, j, ia, jb = seg_a.start, seg_b.start, seg_a.stop, seg_b.stop
    pairs: list[tuple[int, int]] = []
    aside_a: list[int] = []
    aside_b: list[int] = []
    while i < ia and j < jb:
        if keys_a[i] == keys_b[j]:
            pairs.append((i, j))
            i += 1
            j += 1
        elif changed_b[j]:
            aside_b.append(j)
            j += 1
        elif changed_a[i]:
            aside_a.append(i)
            i += 1
        else:
            return False
    if not all(changed_a[k] for k in range(i, ia)) or not all(changed_b[k] for k in range(j, jb)):
        return False
    aside_a.extend(range(i, ia))
    aside_b.extend(range(j, jb))
    if not pairs or not (aside_a or aside_b):
        return False
    _in_order(result, [p for p, _ in pairs], [q for _, q in pairs])
    for k in aside_a:
        result.reason_a[k] = EDITED_LINE_CALLS
    for k in aside_b:
        result.reason_b[k] = EDITED_LINE_CALLS
    return True


def _common_ends(seg_a: range, seg_b: range, keys_a: Sequence[int], keys_b: Sequence[int], result: Pairing
                 ) -> tuple[range, range]:
    """docs/compare.md §2 rule 8, common ends: in a segment no other rule pairs, the longest run of
    equal keys at its start, and then at its end, pair in order (basis ``between-anchors``), as
    rule 4 pairs a whole segment (``nn.GRU`` edited to ``nn.LSTM``: the calls before the first one
    the edit changed, and after the last, still pair). Returns what is left between them."""
    a0, a1, b0, b1 = seg_a.start, seg_a.stop, seg_b.start, seg_b.stop
    while a0 < a1 and b0 < b1 and keys_a[a0] == keys_b[b0]:
        a0 += 1
        b0 += 1
    while a1 > a0 and b1 > b0 and keys_a[a1 - 1] == keys_b[b1 - 1]:
        a1 -= 1
        b1 -= 1
    _in_order(result, range(seg_a.start, a0), range(seg_b.start, b0))
    _in_order(result, range(a1, seg_a.stop), range(b1, seg_b.stop))
    return range(a0, a1), range(b0, b1)


def pair_streams(keys_a: Sequence[int], keys_b: Sequence[int],
                 anchors_a: Sequence[int], anchors_b: Sequence[int],
                 sites_a: Sequence[int] | None = None, sites_b: Sequence[int] | None = None,
                 inputs_a: Sequence[int] | None = None, inputs_b: Sequence[int] | None = None,
                 nested_a: Sequence[int] | None = None, nested_b: Sequence[int] | None = None,
                 lines_a: Sequence[int] | None = None, changed_a: Sequence[int] | None = None,
                 changed_b: Sequence[int] | None = None, steps_a: Sequence[int] | None = None,
                 steps_b: Sequence[int] | None = None, grad_off_a: Sequence[int] | None = None,
                 grad_off_b: Sequence[int] | None = None) -> Pairing:
    """Pair two streams given their call-site keys and anchor keys (``NO_ANCHOR`` = none).

    ``sites_*`` (call-site keys without the function) and ``inputs_*`` (captured-input keys without
    the function, ``NO_ANCHOR`` = none), when given, let a segment whose function differs at the
    same call site pair (basis ``function-differs``, :func:`_other_function`); ``nested_*`` (1 for an
    operation made inside another recorded one) let it pair by its top-level operations when the
    functions that differ make different nested calls (:func:`_top_level`); ``lines_a`` (A's call-site
    identities without the context) let one call on an edited line establish it for every module
    that runs the line; ``changed_*`` (1 for an operation on a line the source diff says was edited)
    let a segment pair around the calls an edited line makes in other numbers (:func:`_edited_lines`);
    ``steps_*`` (each operation's step, none: all 0) keep anchors within a step (:func:`_occurrences`);
    ``grad_off_*`` (1 for an operation recorded with grad mode off) let rule 6 set aside the calls
    of a pass under ``no_grad`` that the other run's segment does not make (:func:`_grad_split`)."""
    na, nb = len(keys_a), len(keys_b)
    a_to_b = array("q", [-1]) * na
    b_to_a = array("q", [-1]) * nb
    basis_a: list[str | None] = [None] * na
    reason_a: list[str | None] = [None] * na
    reason_b: list[str | None] = [None] * nb
    result = Pairing(a_to_b, b_to_a, basis_a, reason_a, reason_b)
    if na == nb and list(keys_a) == list(keys_b):
        for i in range(na):
            a_to_b[i] = i
            b_to_a[i] = i
            basis_a[i] = EQUAL_SEQUENCE
        return result

    ua, ub = _unique(anchors_a), _unique(anchors_b)
    matches = [(i, ub[key]) for key, i in ua.items() if key in ub]  # in order of A's position (_unique)
    if sites_a is not None and sites_b is not None and changed_a is not None and changed_b is not None:
        # not across call sites the source diff says correspond elsewhere: at different call sites,
        # one of the two lines is edited or new (code that moved); equal inputs at two lines the
        # diff keeps are two different calls (a loop's extra iteration read what the next line reads)
        matches = [(i, j) for i, j in matches if sites_a[i] == sites_b[j] or changed_a[i] or changed_b[j]]
    if matches:  # not across iterations: the same step, and the k-th call at a call site in it only
        # with the k-th at its counterpart (an edit that shifted the random stream made a data-indexing
        # call draw the same batch at A's step 9 and B's step 4: that anchor paired whole steps off by
        # five; a sampling loop's iteration 2 in A drew what iteration 0 did in B)
        occ_a, occ_b = _occurrences(keys_a, steps_a), _occurrences(keys_b, steps_b)
        if steps_a is not None and steps_b is not None and len(steps_a) == na and len(steps_b) == nb:
            matches = [(i, j) for i, j in matches if occ_a[i] == occ_b[j] and steps_a[i] == steps_b[j]]
        else:
            matches = [(i, j) for i, j in matches if occ_a[i] == occ_b[j]]
    bs = [j for _, j in matches]
    # when B's positions already increase (the usual case) the longest monotone set is all of them
    kept = matches if all(map(operator.lt, bs, itertools.islice(bs, 1, None))) else _lis(matches)
    conflict_a: set[int] = set()
    conflict_b: set[int] = set()
    if len(kept) != len(matches):
        conflict_a = {i for i, _ in matches}.difference(i for i, _ in kept)
        conflict_b = set(bs).difference(j for _, j in kept)
    for i, j in kept:
        a_to_b[i] = j
        b_to_a[j] = i
        basis_a[i] = INPUT_ANCHOR
    result.anchors = len(kept)

    edited: set[int] = set()       # call sites established as calling another function in B
    split: list[tuple[list[int], list[int]]] = []   # keys with the grad mode, made when first needed

    def segment(seg_a: range, seg_b: range) -> None:
        """Rules 4-8 on one segment (between two anchors, within one step)."""
        if len(seg_a) == len(seg_b) and all(keys_a[i] == keys_b[j] for i, j in zip(seg_a, seg_b, strict=True)):
            _in_order(result, seg_a, seg_b)
            return
        if sites_a is not None and sites_b is not None and inputs_a is not None and inputs_b is not None:
            differ = _other_function(seg_a, seg_b, keys_a, keys_b, sites_a, sites_b, inputs_a, inputs_b, edited,
                                     lines_a)
            if differ is not None:
                _in_order(result, seg_a, seg_b)
                for k in differ:
                    basis_a[seg_a[k]] = FUNCTION_DIFFERS
                return
            if nested_a is not None and nested_b is not None and _top_level(
                    seg_a, seg_b, keys_a, keys_b, sites_a, sites_b, inputs_a, inputs_b, nested_a, nested_b, edited,
                    result, lines_a):
                return
        if seg_a and seg_b and grad_off_a is not None and grad_off_b is not None and not split and (
                any(grad_off_a[i] for i in seg_a) or any(grad_off_b[j] for j in seg_b)):
            split.append((_grad_split(keys_a, grad_off_a), _grad_split(keys_b, grad_off_b)))
        if seg_a and seg_b and (_one_sided(seg_a, seg_b, keys_a, keys_b, result) or (
                split and _one_sided(seg_a, seg_b, split[0][0], split[0][1], result))):
            # an operation whose unique input match was dropped by the order filter is not a call the
            # other run lacks: it has a counterpart elsewhere (two independent calls swapped)
            for i in conflict_a.intersection(seg_a):
                if a_to_b[i] < 0:
                    reason_a[i] = ANCHOR_ORDER_CONFLICT
            for j in conflict_b.intersection(seg_b):
                if b_to_a[j] < 0:
                    reason_b[j] = ANCHOR_ORDER_CONFLICT
            return
        if seg_a and seg_b and changed_a is not None and changed_b is not None and _edited_lines(
                seg_a, seg_b, keys_a, keys_b, changed_a, changed_b, result):
            return
        why = NO_COUNTERPART_IN_SEGMENT if (not seg_a or not seg_b) else SEGMENT_DIFFERS
        if seg_a and seg_b:
            seg_a, seg_b = _common_ends(seg_a, seg_b, keys_a, keys_b, result)
        for i in seg_a:
            reason_a[i] = ANCHOR_ORDER_CONFLICT if i in conflict_a else why
        for j in seg_b:
            reason_b[j] = ANCHOR_ORDER_CONFLICT if j in conflict_b else why

    bounds = [(-1, -1), *kept, (na, nb)]
    for (a0, b0), (a1, b1) in itertools.pairwise(bounds):
        if a1 == a0 + 1 and b1 == b0 + 1:
            continue                # adjacent anchors: nothing between them
        seg_a = range(a0 + 1, a1)
        seg_b = range(b0 + 1, b1)
        if len(seg_a) == len(seg_b) and all(keys_a[i] == keys_b[j] for i, j in zip(seg_a, seg_b, strict=True)):
            _in_order(result, seg_a, seg_b)
            continue
        for piece_a, piece_b in _by_step(seg_a, seg_b, steps_a, steps_b):
            segment(piece_a, piece_b)
    return result
