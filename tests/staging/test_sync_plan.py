"""The pure batch selection and the token bucket (driven by a virtual clock, as the simulator does)."""

from __future__ import annotations

import pytest

from opguard.staging.batchplan import Item, select_batch
from opguard.staging.ratelimit import TokenBucket

MB = 1 << 20


def test_items_are_taken_in_order_until_one_does_not_fit() -> None:
    items = [Item("a", "file", 400), Item("b", "file", 500), Item("c", "file", 300), Item("d", "file", 10)]
    plan = select_batch(items, 1000)
    assert [t.item.path for t in plan.takes] == ["a", "b"]  # c does not fit: d waits behind it (no starvation)
    assert plan.payload_bytes == 900 and plan.backlog_bytes == 310


def test_one_whole_file_may_exceed_the_limit_alone() -> None:
    plan = select_batch([Item("big", "file", 5000), Item("small", "file", 1)], 1000)
    assert [(t.item.path, t.nbytes) for t in plan.takes] == [("big", 5000)]
    plan = select_batch([Item("small", "file", 1), Item("big", "file", 5000)], 1000)
    assert [t.item.path for t in plan.takes] == ["small"]


def test_json_lines_are_split_at_the_room_left() -> None:
    plan = select_batch([Item("a", "file", 300), Item("log.jsonl", "append", 5000, first_record=100)], 1000)
    assert [(t.item.path, t.nbytes) for t in plan.takes] == [("a", 300), ("log.jsonl", 700)]
    assert plan.backlog_bytes == 5300 - 1000
    # a first record that does not fit in the room left ends the batch
    plan = select_batch([Item("a", "file", 950), Item("log.jsonl", "append", 500, first_record=100)], 1000)
    assert [t.item.path for t in plan.takes] == ["a"]


def test_a_record_larger_than_the_limit_is_reported_and_held_back_alone() -> None:
    items = [Item("huge.jsonl", "append", 3000, first_record=2000), Item("ok", "file", 10)]
    plan = select_batch(items, 1000)
    assert [i.path for i in plan.oversized] == ["huge.jsonl"]
    assert [t.item.path for t in plan.takes] == ["ok"]


def test_empty_new_versions_are_always_taken() -> None:
    plan = select_batch([Item("a", "file", 1000), Item("e.jsonl", "append", 0)], 1000)
    assert [(t.item.path, t.nbytes) for t in plan.takes] == [("a", 1000), ("e.jsonl", 0)]


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        select_batch([], 0)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.now += s


@pytest.mark.parametrize("chunk", [4096, MB, 7 * MB])
def test_bucket_rate_is_exact_for_any_chunk_size(chunk: int) -> None:
    clock = VirtualClock()
    bucket = TokenBucket(32 * MB, clock=clock, sleep=clock.sleep)
    total = 256 * MB
    sent = 0
    while sent < total:
        n = min(chunk, total - sent)
        bucket.consume(n)
        sent += n
    rate = total / clock.now
    assert abs(rate / (32 * MB) - 1) < 0.01  # the only excess is the initial 50 ms burst


def test_bucket_refills_with_idle_time_up_to_the_burst_only() -> None:
    clock = VirtualClock()
    bucket = TokenBucket(MB, burst=MB / 10, clock=clock, sleep=clock.sleep)
    bucket.consume(MB // 10)
    assert clock.now == 0.0
    clock.now += 100.0  # a long idle time earns at most one burst
    bucket.consume(MB // 10)
    assert clock.now == 100.0
    bucket.consume(MB)
    assert clock.now == pytest.approx(101.0)


def test_bucket_rejects_a_non_positive_rate() -> None:
    with pytest.raises(ValueError):
        TokenBucket(0)
