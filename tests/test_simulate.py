"""bench/simulate_cluster.py: a small cluster simulation agrees with the plan's formulas, and it
really drives the project's stagger, batch selection and token bucket (swap one out and the
result changes)."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from opguard.launcher import schedule
from opguard.staging import batchplan as batch_plan
from tests.conftest import REPO

MIB = 1 << 20


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simulate_cluster", REPO / "bench" / "simulate_cluster.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["simulate_cluster"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sim = _load()
# 240 nodes × 4 ranks, a 15-minute job, the defaults (60 s, 256 MiB, 32 MiB/s)
SMALL = sim.Workload(nodes=240, ranks=4, job_seconds=900.0)


def _run(w: Any, fn: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = sim.summarize(w, sim.simulate(w, fn or sim.simulate_node_ours))
    return out


@pytest.fixture(scope="module")
def small() -> Any:
    return sim.run(SMALL)


def test_peak_in_flight_matches_the_plans_ideal(small: Any) -> None:
    ideal = small.plan["ideal_peak_in_flight"]
    assert ideal == schedule.ideal_peak_in_flight(240, SMALL.sizing().upload_s, 60.0) == 14
    peak = small.ours["in_flight_periodic"]["peak"]
    assert ideal - 1 <= peak <= 1.1 * ideal, (peak, ideal)
    # the time-averaged concurrency is N·t_upload/interval
    assert small.ours["in_flight_periodic"]["mean_steady"] == pytest.approx(small.plan["mean_in_flight"], rel=0.03)


def test_reference_policy_bunches_its_first_cycle(small: Any) -> None:
    ours, ref = small.ours["in_flight_periodic"]["peak"], small.reference["in_flight_periodic"]["peak"]
    assert ref >= 2 * ours, (ref, ours)
    # the same data and cap: the same long-run aggregate rate
    assert small.reference["aggregate_mib_s"]["mean_steady"] == pytest.approx(
        small.ours["aggregate_mib_s"]["mean_steady"], rel=0.05)


def test_aggregate_rate_and_metadata_ops_match_the_plan(small: Any) -> None:
    assert small.ours["aggregate_mib_s"]["mean_steady"] == pytest.approx(small.plan["aggregate_mib_s"], rel=0.02)
    assert small.ours["metadata_ops_per_min"]["mean_steady"] == pytest.approx(
        small.plan["metadata_ops_per_min"], rel=0.02)
    # the start-up burst: one node claim per node (create + link) plus format.json, at once
    assert small.ours["metadata_ops_per_min"]["peak"] >= 2 * SMALL.nodes + 2


def test_drain_times_stay_within_the_plans_bounds(small: Any) -> None:
    worst = small.plan["worst_drain_s"]
    term = small.ours["drain_s"]["drain-term"]
    assert 0 < term["p50"] < term["max"] <= worst * 1.02, (term, worst)
    assert small.ours["drain_over_kill_wait"] == 0
    warned = small.ours_warned
    assert warned["_warning"] == small.plan["warning_s"] == 30
    assert warned["drain_over_warning"] == 0
    # an early drain also carries what the ranks write meanwhile: at most backlog / (cap - rate)
    assert warned["drain_s"]["drain-warning"]["max"] <= small.plan["worst_early_drain_s"] * 1.02
    # everything produced before the warning went out with the warning's drain: only 30 s are left
    # (30 s of JSON lines and at most ⌈30 / period⌉ whole files per rank)
    left = SMALL.ranks * (SMALL.jsonl_bytes_per_s * 30 + math.ceil(30 / SMALL.file_period) * SMALL.file_bytes)
    assert warned["drain_backlog_mib"]["drain-term"]["max"] <= left / MIB


def test_every_byte_produced_is_published() -> None:
    w = replace(SMALL, nodes=12)
    rec = sim.simulate(w, sim.simulate_node_ours)
    produced = 0.0
    for k in range(w.nodes):
        import random

        rng = random.Random(f"{w.seed}:{k}")
        for _ in range(w.ranks):
            d = sim.RankData(w, rng.uniform(0, w.file_period))
            produced += d.backlog(w.job_seconds)
        produced += w.node_meta_bytes
    assert sum(rec.nbytes) == pytest.approx(produced, abs=1)
    assert len(rec.drain[sim.DRAIN_TERM]) == w.nodes


def test_the_simulation_drives_the_real_stagger(monkeypatch: pytest.MonkeyPatch) -> None:
    w = replace(SMALL, job_seconds=300.0)
    calls: list[tuple[int, int]] = []
    real = schedule.stagger_offset

    def spy(k: int, n: int, interval: float, salt: str = "") -> float:
        calls.append((k, n))
        return real(k, n, interval, salt)

    monkeypatch.setattr(schedule, "stagger_offset", spy)
    staggered = _run(w)["in_flight_periodic"]["peak"]
    assert sorted(calls) == [(k, w.nodes) for k in range(w.nodes)]
    monkeypatch.setattr(schedule, "stagger_offset", lambda k, n, interval, salt="": 0.0)
    assert _run(w)["in_flight_periodic"]["peak"] == w.nodes > 5 * staggered


def test_the_simulation_uses_the_uploaders_batch_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    w = replace(SMALL, nodes=8, job_seconds=300.0)
    calls: list[int] = []

    def spy(items: Any, limit: int) -> Any:
        calls.append(limit)
        return batch_plan.select_batch(items, limit)

    monkeypatch.setattr(sim, "select_batch", spy)
    sim.simulate(w, sim.simulate_node_ours)
    assert calls and set(calls) == {w.batch_bytes}
    # a batch limit below one interval's data per stream: one batch per stream per sync cannot keep up,
    # and the backlog grows as the plan says (the drain then needs several batches per stream)
    tight = replace(w, batch_bytes=8 * MIB)
    z = tight.sizing()
    assert not z.keeps_up
    growth = schedule.backlog_growth_bytes_per_s(z.node_bytes_per_s, 60, 8 * MIB, 32, streams=tight.ranks)
    rec = sim.simulate(tight, sim.simulate_node_ours)
    backlog = np.asarray(rec.drain_backlog[sim.DRAIN_TERM])
    assert np.all(backlog >= 0.9 * growth * tight.job_seconds)
    assert np.all(backlog <= z.worst_backlog_bytes)
    assert max(rec.nbytes) <= 8 * MIB


def test_the_token_bucket_sets_upload_times_whatever_the_chunk_size() -> None:
    w = replace(SMALL, nodes=6, job_seconds=300.0)
    whole = sim.simulate(w, sim.simulate_node_ours)
    chunked = sim.simulate(replace(w, chunk_bytes=MIB), sim.simulate_node_ours)
    assert np.allclose(whole.end, chunked.end, atol=1e-6)
    # and the time is the cap's: bytes / rate, less the bucket's 50 ms burst at most
    dur = np.asarray(whole.end) - np.asarray(whole.start)
    ideal = np.asarray(whole.nbytes) / (w.cap_mib_s * MIB)
    assert np.all(dur <= ideal + 1e-9) and np.all(dur >= ideal - 0.05 - 1e-9)


def test_not_keeping_up_grows_the_backlog_as_planned() -> None:
    w = replace(SMALL, nodes=10, cap_mib_s=1.0, job_seconds=600.0)
    z = w.sizing()
    assert not z.keeps_up
    rec = sim.simulate(w, sim.simulate_node_ours)
    growth = schedule.backlog_growth_bytes_per_s(z.node_bytes_per_s, 60, w.batch_bytes, 1.0, z.streams_per_node)
    backlog = np.asarray(rec.drain_backlog[sim.DRAIN_TERM])
    assert np.all(backlog >= growth * w.job_seconds)
    assert np.all(backlog <= z.worst_backlog_bytes)
    drains = np.asarray(rec.drain[sim.DRAIN_TERM])
    assert np.all(drains > w.kill_wait)  # the plan said so: drain_fits_kill_wait is False
    assert not z.drain_fits_kill_wait


@pytest.mark.parametrize(("field", "value"), [("nodes", 0), ("interval", -1.0), ("warning_s", 5000.0)])
def test_a_bad_workload_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        replace(SMALL, **{field: value})


def test_cli_writes_the_plot_and_the_figures(tmp_path: Path) -> None:
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    argv = ["--nodes", "20", "--ranks", "2", "--hours", "0.1", "--jobs", "1", "--png", str(png), "--json", str(js)]
    assert sim.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import json

    data = json.loads(js.read_text())
    assert data["plan"]["ideal_peak_in_flight"] >= 1
    assert data["ours"]["in_flight_periodic"]["peak"] >= 1
    assert data["reference"]["drain_s"]["drain-term"]["max"] >= 0


def test_a_drain_that_continues_until_sigterm_makes_the_warning_sufficient() -> None:
    """At 7× the data (r·I/c = 48 s > KillWait), the plan's warning is enough only if the wrapper
    keeps draining after the warning; resuming periodic syncs leaves up to r·I for SIGTERM."""
    w = replace(SMALL, nodes=8, ranks=8, jsonl_bytes_per_s=3 * MIB, job_seconds=900.0)
    z = w.sizing()
    assert z.keeps_up and z.worst_drain_s > w.kill_wait
    warned = replace(w, warning_s=float(z.warning_s))
    resumed = sim.simulate(warned, sim.simulate_node_ours)
    continuous = sim.simulate(replace(warned, continuous_after_warning=True), sim.simulate_node_ours)
    for rec in (resumed, continuous):
        assert max(rec.drain[sim.DRAIN_WARNING]) <= z.worst_early_drain_s
    assert max(resumed.drain[sim.DRAIN_TERM]) > 0.5 * w.kill_wait
    # what is left at SIGTERM is at most what the ranks wrote during one short last pass
    assert max(continuous.drain[sim.DRAIN_TERM]) < 0.1 * w.kill_wait


def test_cli_refuses_a_bad_option_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sim.main(["--nodes", "0", "--jobs", "1"])
    assert exc.value.code == 2
    assert "nodes=0 must be > 0" in capsys.readouterr().err
