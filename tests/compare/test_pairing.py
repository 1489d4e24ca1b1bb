"""The correspondence algorithm exactly as the spec states it (pure, over integer keys/anchors)."""

from __future__ import annotations

import pytest

from opguard.compare.pairing import (
    ANCHOR_ORDER_CONFLICT,
    BETWEEN_ANCHORS,
    EQUAL_SEQUENCE,
    INPUT_ANCHOR,
    NO_ANCHOR,
    NO_COUNTERPART_IN_SEGMENT,
    SEGMENT_DIFFERS,
    _unique,
    pair_streams,
)


def test_equal_sequences_pair_in_order_even_without_anchors() -> None:
    p = pair_streams([1, 2, 1, 2], [1, 2, 1, 2], [NO_ANCHOR] * 4, [NO_ANCHOR] * 4)
    assert list(p.a_to_b) == [0, 1, 2, 3] and set(p.basis_a) == {EQUAL_SEQUENCE}


def test_unequal_without_anchors_stays_unresolved() -> None:
    # the same keys on both sides, in another order and number: order cannot pair them
    p = pair_streams([1, 2, 3], [3, 2, 1, 2], [NO_ANCHOR] * 3, [NO_ANCHOR] * 4)
    assert list(p.a_to_b) == [-1, -1, -1] and list(p.b_to_a) == [-1] * 4
    assert p.reason_a == [SEGMENT_DIFFERS] * 3 and p.reason_b == [SEGMENT_DIFFERS] * 4
    # ... except their common start and end (§2 rule 8): only what is between stays unresolved
    p = pair_streams([1, 2, 3], [1, 3, 2, 3], [NO_ANCHOR] * 3, [NO_ANCHOR] * 4)
    assert list(p.a_to_b) == [0, 2, 3] and list(p.b_to_a) == [0, -1, 1, 2]
    assert p.reason_b == [None, SEGMENT_DIFFERS, None, None] and set(p.basis_a) == {BETWEEN_ANCHORS}
    # one key only B has (§2 rule 6): set aside, the rest pairs
    from opguard.compare.pairing import NOT_IN_OTHER_SEGMENT
    p = pair_streams([1, 2, 3], [1, 9, 2, 3], [NO_ANCHOR] * 3, [NO_ANCHOR] * 4)
    assert list(p.b_to_a) == [0, -1, 1, 2] and p.reason_b[1] == NOT_IN_OTHER_SEGMENT


def test_anchors_then_equal_segments_between_them() -> None:
    # A: 1 2 [x] 3 4 ; B: 1 2 [x] 3 7 4  (ops 3 and 7 between the anchors: 3 is in both, in other orders)
    p = pair_streams([1, 2, 5, 7, 3, 4], [1, 2, 5, 3, 7, 4], [0, 0, 100, 0, 0, 200], [0, 0, 100, 0, 0, 200])
    assert list(p.a_to_b) == [0, 1, 2, -1, -1, 5] and p.reason_a[3] == SEGMENT_DIFFERS
    assert p.basis_a == [BETWEEN_ANCHORS, BETWEEN_ANCHORS, INPUT_ANCHOR, None, None, INPUT_ANCHOR]
    assert p.reason_b[3:5] == [SEGMENT_DIFFERS, SEGMENT_DIFFERS]


def test_empty_counterpart_segment() -> None:
    p = pair_streams([1, 3], [1, 7, 3], [10, 30], [10, 0, 30])
    assert list(p.a_to_b) == [0, 2] and p.reason_b[1] == NO_COUNTERPART_IN_SEGMENT


def test_duplicate_anchor_keys_are_not_anchors() -> None:
    # anchor 50 occurs twice in B: not unique, so it cannot anchor
    p = pair_streams([1, 2], [1, 3, 2], [50, 60], [50, 50, 60])
    assert p.anchors == 1 and p.a_to_b[1] == 2 and p.basis_a[0] != "input-anchor"


def test_an_anchor_pairs_only_the_same_occurrence_of_its_call_site() -> None:
    """A loop's call drew the same data index in A's iteration 9 and B's iteration 4 (an edit that
    shifted the random stream): equal inputs, a unique anchor key on each side, and that anchor paired
    whole iterations five apart, with false 'arguments differ: lr' mismatches (hand test). The k-th
    call at a call site pairs only with the k-th call at its counterpart."""
    # 3 iterations of (index draw 7, step 8); A's iteration 2 and B's iteration 0 drew equal input (99)
    keys = [7, 8, 7, 8, 7, 8]
    p = pair_streams(keys, [7, 8, 5, 7, 8, 7, 8], [1, 2, 3, 4, 99, 6], [99, 12, 13, 14, 15, 16, 17])
    assert p.anchors == 0
    assert p.a_to_b[4] != 0 and p.b_to_a[0] != 4
    # the same occurrence still anchors (an extra call at another site in between)
    q = pair_streams([7, 8, 7, 8], [7, 8, 5, 7, 8], [1, 2, 99, 4], [11, 12, 13, 99, 14])
    assert q.anchors == 1 and q.a_to_b[2] == 3 and q.basis_a[2] == "input-anchor"
    # with steps, occurrences count within a step, and an anchor stays in its step: B calls 7 twice
    # per step (a loop run twice), A once; A's step-1 call anchors with B's first of step 1
    r = pair_streams([7, 8, 7, 8], [7, 7, 8, 7, 7, 8], [1, 2, 99, 4], [11, 12, 13, 99, 15, 16],
                     steps_a=[0, 0, 1, 1], steps_b=[0, 0, 0, 1, 1, 1])
    assert r.anchors == 1 and r.a_to_b[2] == 3
    # the same input one step apart is not an anchor, whatever the occurrence
    t = pair_streams([7, 8, 7, 8], [7, 5, 8, 7, 8], [99, 2, 3, 4], [11, 12, 13, 99, 14],
                     steps_a=[0, 0, 1, 1], steps_b=[0, 0, 0, 1, 1])
    assert t.anchors == 0


def test_order_conflict_keeps_the_longest_monotone_set() -> None:
    # anchors 10,20,30 in A; B has 30 first: LIS keeps 10,20; 30 conflicts
    p = pair_streams([1, 2, 3], [3, 1, 2], [10, 20, 30], [30, 10, 20])
    assert list(p.a_to_b) == [1, 2, -1]
    assert p.reason_a[2] == ANCHOR_ORDER_CONFLICT and p.reason_b[0] == ANCHOR_ORDER_CONFLICT
    rows = p.rows()
    assert [r for r in rows if r[0] >= 0 and r[1] >= 0] == [(0, 1), (1, 2)]
    assert sorted(i for i, _ in rows if i >= 0) == [0, 1, 2] and sorted(j for _, j in rows if j >= 0) == [0, 1, 2]


def test_pairs_are_monotone_and_one_to_one_on_random_inputs() -> None:
    import random

    rng = random.Random(7)
    for _ in range(300):
        na, nb = rng.randint(0, 30), rng.randint(0, 30)
        ka = [rng.randint(1, 4) for _ in range(na)]
        kb = [rng.randint(1, 4) for _ in range(nb)]
        aa = [rng.choice([0, rng.randint(1, 20)]) for _ in range(na)]
        ab = [rng.choice([0, rng.randint(1, 20)]) for _ in range(nb)]
        p = pair_streams(ka, kb, aa, ab)
        pairs = [(i, j) for i, j in enumerate(p.a_to_b) if j >= 0]
        assert all(p.b_to_a[j] == i for i, j in pairs)
        assert [j for _, j in pairs] == sorted({j for _, j in pairs})           # monotone, one-to-one
        for i, j in pairs:                                                       # never a false call-site pair
            assert ka[i] == kb[j] or p.basis_a[i] == INPUT_ANCHOR
        for i in range(na):
            assert (p.a_to_b[i] >= 0) != (p.reason_a[i] is not None)
        for j in range(nb):
            assert (p.b_to_a[j] >= 0) != (p.reason_b[j] is not None)
        ra, rb = p.row_arrays()
        assert list(zip(ra, rb, strict=True)) == p.rows()


def test_a_function_that_differs_at_the_same_call_site_pairs_when_its_inputs_are_equal() -> None:
    """docs/compare.md §2 rule 5. Keys: function x call site; sites: the call site alone. Op 1 calls
    another function at site 20 with equal inputs (established); op 4, the same site again in a
    later segment (after the anchor at 3), differs in function with other inputs: paired too."""
    from opguard.compare.pairing import FUNCTION_DIFFERS

    keys_a, keys_b = [10, 21, 30, 40, 21], [10, 22, 30, 40, 22]
    sites = [10, 20, 30, 40, 20]
    anchors_a, anchors_b = [0, 0, 0, 7, 0], [0, 0, 0, 7, 0]
    inputs_a, inputs_b = [1, 5, 6, 7, 8], [1, 5, 9, 7, 99]
    p = pair_streams(keys_a, keys_b, anchors_a, anchors_b, sites, sites, inputs_a, inputs_b)
    assert list(p.a_to_b) == [0, 1, 2, 3, 4]
    assert p.basis_a == [BETWEEN_ANCHORS, FUNCTION_DIFFERS, BETWEEN_ANCHORS, INPUT_ANCHOR, FUNCTION_DIFFERS]
    # inputs not equal where the function first differs: nothing establishes it, the segment differs
    # (the calls only one side makes are then set aside, §2 rule 6: the rest pairs)
    from opguard.compare.pairing import NOT_IN_OTHER_SEGMENT
    p = pair_streams(keys_a, keys_b, anchors_a, anchors_b, sites, sites, [1, 5, 6, 7, 8], [1, 4, 6, 7, 98])
    assert list(p.a_to_b) == [0, -1, 2, 3, -1] and p.reason_a[1] == NOT_IN_OTHER_SEGMENT
    # another call site (not only the function) differs: never paired this way
    p = pair_streams(keys_a, keys_b, anchors_a, anchors_b, sites, [10, 25, 30, 40, 20], inputs_a, inputs_a)
    assert p.a_to_b[1] == -1 and p.reason_a[1] == NOT_IN_OTHER_SEGMENT
    # without sites/inputs (the caller gives none): the rule does not apply
    assert pair_streams(keys_a, keys_b, anchors_a, anchors_b).a_to_b[1] == -1


def test_a_function_that_differs_with_other_nested_calls_pairs_by_its_top_level_operations() -> None:
    """docs/compare.md §2 rule 5, nested calls set aside: A's function at site 20 makes a nested call
    (key 91, depth 1: ``F.relu`` -> ``torch.relu``), B's none (``F.gelu``): the segment's lengths
    differ, so rule 5 alone cannot pair it (it stayed segment-differs). The top-level operations
    pair; the nested call has no counterpart (nested-calls-differ); the next step's nested calls
    of an unchanged function (key 31 at site 30, nested 92) pair."""
    from opguard.compare.pairing import FUNCTION_DIFFERS, NESTED_CALLS_DIFFER

    keys_a, keys_b = [10, 21, 91, 30, 92, 10, 21, 91, 30, 92], [10, 22, 30, 92, 10, 22, 30, 92]
    sites_a, sites_b = [10, 20, 20, 30, 30, 10, 20, 20, 30, 30], [10, 20, 30, 30, 10, 20, 30, 30]
    nested_a, nested_b = [0, 0, 1, 0, 1, 0, 0, 1, 0, 1], [0, 0, 0, 1, 0, 0, 0, 1]
    anchors_a, anchors_b = [7, 0, 0, 0, 0, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0, 0, 0]
    inputs_a, inputs_b = [7, 5, 5, 6, 6, 8, 9, 9, 3, 3], [7, 5, 6, 6, 18, 19, 13, 13]
    p = pair_streams(keys_a, keys_b, anchors_a, anchors_b, sites_a, sites_b, inputs_a, inputs_b)
    assert list(p.a_to_b) == [0, -1, -1, 2, 3, 4, -1, -1, 6, 7]  # without depth: only rule 6 (swap unpaired)
    assert p.basis_a[1] is None
    p = pair_streams(keys_a, keys_b, anchors_a, anchors_b, sites_a, sites_b, inputs_a, inputs_b, nested_a, nested_b)
    assert list(p.a_to_b) == [0, 1, -1, 2, 3, 4, 5, -1, 6, 7]
    assert [p.basis_a[i] for i in (1, 6)] == [FUNCTION_DIFFERS, FUNCTION_DIFFERS]
    assert [p.basis_a[i] for i in (3, 4, 5, 8, 9)] == [BETWEEN_ANCHORS] * 5
    assert p.reason_a[2] == p.reason_a[7] == NESTED_CALLS_DIFFER
    # where the function first differs its inputs differ too: nothing established; the calls only one
    # side makes (keys 21, 91 / 22) are set aside (§2 rule 6) and the rest pairs
    from opguard.compare.pairing import NOT_IN_OTHER_SEGMENT
    p = pair_streams(keys_a, keys_b, anchors_a, anchors_b, sites_a, sites_b, inputs_a,
                     [7, 4, 6, 6, 18, 19, 13, 13], nested_a, nested_b)
    assert list(p.a_to_b) == [0, -1, -1, 2, 3, 4, -1, -1, 6, 7] and p.reason_a[1] == NOT_IN_OTHER_SEGMENT


def test_calls_only_one_run_makes_are_set_aside_and_the_rest_pairs() -> None:
    """docs/compare.md §2 rule 6: B makes one more call (key 50) on an edited line in every loop
    iteration; set aside, the rest pairs in order and the extra calls are not-in-other-segment.
    Keys both sides have in other numbers or orders are never paired this way."""
    from opguard.compare.pairing import NOT_IN_OTHER_SEGMENT

    keys_a, keys_b = [1, 2, 3, 2, 3, 9], [1, 2, 3, 50, 2, 3, 50, 9]
    anchors_a, anchors_b = [7, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0, 0, 0]
    p = pair_streams(keys_a, keys_b, anchors_a, anchors_b)
    assert list(p.a_to_b) == [0, 1, 2, 4, 5, 7]
    assert [p.reason_b[j] for j in (3, 6)] == [NOT_IN_OTHER_SEGMENT] * 2
    assert p.basis_a[1:] == [BETWEEN_ANCHORS] * 5
    # one call fewer in B: A's extra call set aside
    p = pair_streams(keys_b, keys_a, anchors_b, anchors_a)
    assert list(p.b_to_a) == [0, 1, 2, 4, 5, 7] and p.reason_a[3] == p.reason_a[6] == NOT_IN_OTHER_SEGMENT
    # B repeats an iteration (keys both have, another count): rule 6 does not pair it; the common
    # start and end do (§2 rule 8), B's extra iteration stays unresolved
    p = pair_streams(keys_a, [1, 2, 3, 2, 3, 2, 3, 9], anchors_a, [7, 0, 0, 0, 0, 0, 0, 0])
    assert list(p.a_to_b) == [0, 1, 2, 3, 4, 7] and p.reason_b[5:7] == [SEGMENT_DIFFERS] * 2
    # one-sided calls set aside, but the rest is in another order: only the common end pairs
    p = pair_streams(keys_a, [1, 3, 2, 50, 2, 3, 9], anchors_a, [7, 0, 0, 0, 0, 0, 0])
    assert list(p.a_to_b) == [0, -1, -1, 4, 5, 6] and p.reason_a[1] == SEGMENT_DIFFERS


@pytest.mark.parametrize(("anchors", "expected"), [
    ([5, NO_ANCHOR, 7, 5, NO_ANCHOR, 9], {7: 2, 9: 5}),      # a repeated key is no anchor
    ([3, NO_ANCHOR, 4, NO_ANCHOR], {3: 0, 4: 2}),            # every key distinct: the fast path
    ([NO_ANCHOR, NO_ANCHOR], {}), ([], {}), ([8, 8], {}), ([2, 1], {2: 0, 1: 1})])
def test_unique_anchors_are_the_keys_that_occur_once_in_order_of_position(anchors: list[int],
                                                                          expected: dict[int, int]) -> None:
    got = _unique(anchors)
    assert got == expected and list(got.values()) == sorted(got.values())


def test_an_added_pass_under_no_grad_is_set_aside_and_the_training_calls_pair() -> None:
    """B adds an evaluation pass (``model.eval(); with torch.no_grad(): model(x)``) before the
    training forward: the same call sites in the same order, so by call-site keys alone the common
    start would pair A's training forward with B's evaluation pass (``training: True -> False`` as
    the first divergence). The grad mode (``grad_off_*``: 1 for a record made with grad mode off)
    tells them apart: B's calls under no_grad that A's segment never makes are set aside."""
    keys_a = [1, 2, 3]                # linear, dropout, linear (training forward)
    keys_b = [1, 2, 3, 9, 1, 2, 3]    # eval forward, its .sum() (a new line), training forward
    off_b = bytearray([1, 1, 1, 1, 0, 0, 0])
    p = pair_streams(keys_a, keys_b, [NO_ANCHOR] * 3, [NO_ANCHOR] * 7, grad_off_a=bytearray(3), grad_off_b=off_b)
    from opguard.compare.pairing import NOT_IN_OTHER_SEGMENT
    assert list(p.a_to_b) == [4, 5, 6]
    assert p.reason_b[:4] == [NOT_IN_OTHER_SEGMENT] * 4
    # the same calls with grad mode off in both runs are not told apart (no split where A has it too)
    p = pair_streams(keys_a, keys_b, [NO_ANCHOR] * 3, [NO_ANCHOR] * 7, grad_off_a=bytearray([1, 1, 1]),
                     grad_off_b=bytearray(7))
    assert list(p.a_to_b) == [0, 1, 2]          # rule 8, as without the grad mode
    # equal key sequences pair whatever the grad mode (a block wrapped in no_grad in B: its calls pair,
    # and the grad mode is compared as evidence)
    p = pair_streams(keys_a, keys_a, [NO_ANCHOR] * 3, [NO_ANCHOR] * 3, grad_off_a=bytearray(3),
                     grad_off_b=bytearray([0, 1, 0]))
    assert list(p.a_to_b) == [0, 1, 2]


def test_a_segment_that_spans_steps_pairs_step_by_step() -> None:
    """A changed seed makes a data-dependent loop (NMS, greedy matching) run another number of times
    in each step: over the whole segment rule 8 paired only its two ends and left every step between
    unresolved. Split at the steps, each step pairs its own common ends."""
    keys_a = [1, 5, 5, 3, 1, 5, 3]          # step 0: the loop body 5 twice; step 1: once
    keys_b = [1, 5, 3, 1, 5, 5, 3]          # step 0: once; step 1: twice
    steps_a, steps_b = [0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]
    p = pair_streams(keys_a, keys_b, [NO_ANCHOR] * 7, [NO_ANCHOR] * 7, steps_a=steps_a, steps_b=steps_b)
    assert list(p.a_to_b) == [0, 1, -1, 2, 3, 4, 6]
    assert p.reason_a[2] == SEGMENT_DIFFERS and p.reason_b[5] == SEGMENT_DIFFERS
    # a step only one run has stays unresolved, the steps around it pair
    p = pair_streams([1, 2, 1, 2, 1, 2], [1, 2, 1, 2], [NO_ANCHOR] * 6, [NO_ANCHOR] * 4,
                     steps_a=[0, 0, 1, 1, 2, 2], steps_b=[0, 0, 2, 2])
    assert list(p.a_to_b) == [0, 1, -1, -1, 2, 3] and p.reason_a[2:4] == [NO_COUNTERPART_IN_SEGMENT] * 2
    # steps that come back (set by hand, out of order): not split, as before
    p = pair_streams(keys_a, keys_b, [NO_ANCHOR] * 7, [NO_ANCHOR] * 7, steps_a=[0, 0, 1, 1, 0, 0, 0],
                     steps_b=steps_b)
    assert list(p.a_to_b) == [0, 1, -1, -1, -1, 5, 6]


def test_a_call_inserted_among_nested_calls_is_set_aside_and_the_rest_pair() -> None:
    """A custom ``autograd.Function.backward`` edited from ``g - s`` to ``g - 0.5 * s``: its calls are
    nested in ``Tensor.backward``; the top-level operations pair (rule 5 with nothing differing) and
    the nested run gained one call. It stayed unresolved whole (nested-calls-differ, 404 of 740
    operations in a hand test); now rule 6 sets the new call aside and the rest of the run pairs."""
    from opguard.compare.pairing import NOT_IN_OTHER_SEGMENT

    # top: 10 (forward), 20 (Tensor.backward) with nested 31, 32 (sub), 33; B adds 40 (mul) before 32
    keys_a, keys_b = [10, 11, 20, 31, 32, 33], [10, 11, 20, 31, 40, 32, 33]
    sites_a, sites_b = [10, 11, 20, 31, 32, 33], [10, 11, 20, 31, 32, 32, 33]
    nested_a, nested_b = [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]
    inputs_a, inputs_b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 5, 6]
    p = pair_streams(keys_a, keys_b, [NO_ANCHOR] * 6, [NO_ANCHOR] * 7, sites_a, sites_b, inputs_a, inputs_b,
                     nested_a, nested_b)
    assert list(p.a_to_b) == [0, 1, 2, 3, 5, 6]
    assert p.reason_b[4] == NOT_IN_OTHER_SEGMENT
