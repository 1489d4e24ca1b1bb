"""The plan's formulas (opguard.launcher.schedule): stagger offsets and the derived sizing numbers."""

from __future__ import annotations

import math

import pytest

from opguard.launcher import schedule

MIB = 1 << 20


def test_stagger_spreads_nodes_evenly_over_the_interval() -> None:
    n, interval = 1000, 60.0
    offsets = [schedule.stagger_offset(k, n, interval, "run-1") for k in range(n)]
    slot = interval / n
    for k, off in enumerate(offsets):
        assert k * slot <= off < k * slot + schedule.JITTER_FRACTION * slot + 1e-12
    assert offsets == sorted(offsets)  # the jitter never reorders nodes
    assert offsets[-1] < interval


def test_stagger_is_deterministic_and_salted() -> None:
    a = [schedule.stagger_offset(k, 16, 60.0, "run-1") for k in range(16)]
    assert a == [schedule.stagger_offset(k, 16, 60.0, "run-1") for k in range(16)]
    assert a != [schedule.stagger_offset(k, 16, 60.0, "run-2") for k in range(16)]


@pytest.mark.parametrize(("k", "n"), [(-1, 4), (4, 4), (0, 0)])
def test_stagger_refuses_an_index_outside_the_job(k: int, n: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        schedule.stagger_offset(k, n, 60.0)


def test_basic_formulas() -> None:
    assert schedule.per_node_cap(32_000, 1000) == 32.0
    assert schedule.per_node_cap(100, 0) == 100.0  # never divides by zero
    assert schedule.upload_seconds(256 * MIB, 32) == 8.0
    assert schedule.drain_seconds(64 * MIB, 32) == 2.0
    assert schedule.keeps_up(60, 256 * MIB, 32)
    assert not schedule.keeps_up(60, 256 * MIB, 4)  # 64 s per batch > 60 s interval
    assert schedule.periodic_capacity_bytes_per_s(60, 256 * MIB, 4) == 4 * MIB
    assert schedule.periodic_capacity_bytes_per_s(60, 60 * MIB, 32) == 1 * MIB  # one stream: one batch
    assert schedule.periodic_capacity_bytes_per_s(60, 60 * MIB, 32, streams=9) == 9 * MIB
    assert schedule.ideal_peak_in_flight(1000, 8.0, 60.0) == 134  # ⌈133.3⌉
    assert schedule.ideal_peak_in_flight(1000, 0.0, 60.0) == 0
    assert schedule.ideal_peak_in_flight(3, 0.001, 60.0) == 1


def test_warning_seconds_has_a_floor_and_a_margin() -> None:
    assert schedule.warning_seconds(0, 32) == 30
    assert schedule.warning_seconds(32 * MIB * 40, 32) == 60  # 40 s drain × 1.5
    assert schedule.warning_seconds(32 * MIB * 40, 32, margin=1.0, floor=0) == 40


def test_backlog_growth_is_zero_when_periodic_syncs_keep_up() -> None:
    assert schedule.backlog_growth_bytes_per_s(3 * MIB, 60, 256 * MIB, 32, streams=9) == 0.0
    # the cap limits: 40 MiB/s of data against a 32 MiB/s cap
    assert schedule.backlog_growth_bytes_per_s(40 * MIB, 60, 256 * MIB, 32, streams=9) == pytest.approx(8 * MIB)
    # the batch limits: one stream, one 16 MiB batch per 60 s, 1 MiB/s of data
    assert schedule.backlog_growth_bytes_per_s(1 * MIB, 60, 16 * MIB, 32) == pytest.approx(MIB - 16 * MIB / 60)


def test_worst_case_backlog_and_metadata_rate() -> None:
    assert schedule.worst_case_backlog_bytes(2 * MIB, 60, 256 * MIB, 32, 9) == 120 * MIB
    grown = schedule.worst_case_backlog_bytes(40 * MIB, 60, 256 * MIB, 32, 9, elapsed_s=100)
    assert grown == pytest.approx(40 * MIB * 60 + 8 * MIB * 100 + 256 * MIB)  # + the batch in flight
    assert schedule.metadata_ops_per_minute(1000, 8, 60) == 16_000
    assert schedule.metadata_ops_per_minute(1000, 8, 30) == 32_000


def test_cluster_sizing_for_the_issue_defaults() -> None:
    """1,000 nodes × 8 ranks at 0.45 MiB/s per rank, 60 s / 256 MiB / 32 MiB/s."""
    z = schedule.ClusterSizing(node_count=1000, ranks_per_node=8, node_bytes_per_s=8 * 0.45 * MIB, interval=60,
                               batch_bytes=256 * MIB, cap_mib_s=32, job_seconds=3600, kill_wait=30)
    assert z.streams_per_node == 9
    assert z.upload_s == pytest.approx(6.75)
    assert z.keeps_up
    assert z.ideal_peak_in_flight == math.ceil(1000 * 6.75 / 60) == 113
    assert z.mean_in_flight == pytest.approx(112.5)
    assert z.aggregate_bytes_per_s == pytest.approx(3600 * MIB)
    assert z.drain_aggregate_bytes_per_s == 32_000 * MIB
    assert z.metadata_ops_per_minute == 16_000
    assert z.worst_drain_s == pytest.approx(6.75)
    assert z.worst_early_drain_s == pytest.approx(216 / (32 - 3.6))
    assert z.drain_fits_kill_wait
    assert z.warning_s == 30


def test_cluster_sizing_when_the_cap_is_too_low() -> None:
    z = schedule.ClusterSizing(node_count=10, ranks_per_node=8, node_bytes_per_s=8 * MIB, interval=60,
                               batch_bytes=256 * MIB, cap_mib_s=4, job_seconds=3600, kill_wait=30)
    assert not z.keeps_up
    assert z.upload_s == pytest.approx(120)
    assert z.ideal_peak_in_flight == 10  # every node always uploading, never more than N
    assert z.aggregate_bytes_per_s == pytest.approx(10 * 4 * MIB)
    assert z.worst_backlog_bytes == pytest.approx(8 * MIB * 60 + 4 * MIB * 3600 + 256 * MIB)
    assert not z.drain_fits_kill_wait
    assert z.worst_early_drain_s == math.inf  # the ranks write faster than the cap: never catches up
    assert z.warning_s == math.ceil(1.5 * z.worst_drain_s)


def test_warning_covers_an_early_drain_when_the_rate_is_close_to_the_cap() -> None:
    z = schedule.ClusterSizing(node_count=10, ranks_per_node=8, node_bytes_per_s=30 * MIB, interval=60,
                               batch_bytes=256 * MIB, cap_mib_s=32, job_seconds=3600, kill_wait=30)
    assert z.keeps_up
    assert z.worst_drain_s == pytest.approx(56.25)
    assert z.worst_early_drain_s == pytest.approx(900)  # 1800 MiB at a spare 2 MiB/s
    assert z.warning_s == 900
