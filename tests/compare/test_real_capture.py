"""Compare over real captures: two runs of a small training script through torchrun (2 ranks, gloo),
captured by opguard's own bootstrap (opguard.capture.bootstrap.child_env, as opguard-run --capture
arranges it), in the variants the issue lists."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from opguard.compare.pairing import REASONS
from opguard.compare.perfetto_export import Export, read_export
from tests.compare.helpers import ops_of, run_compare
from tests.conftest import BIN

pytestmark = [pytest.mark.torch]
TEMPLATE = (Path(__file__).parent / "progs" / "train_template.py").read_text()
TORCHRUN = BIN / "torchrun"


GPT = (Path(__file__).parent / "progs" / "gpt_template.py").read_text()


def _variant(name: str) -> str:
    if name.startswith("gpt"):
        src = GPT
        if name == "gpt-tanh":
            src = src.replace("h = F.gelu(self.fc(x))  # <gelu>",
                              "h = F.gelu(self.fc(x), approximate='tanh')  # <gelu>")
            assert src != GPT
        return src
    src = TEMPLATE
    if name == "changed-arg":
        src = src.replace("loss = F.mse_loss(s, b)", "loss = F.mse_loss(s, b, reduction='sum')")
    elif name == "numeric":
        src = src.replace("s = torch.add(z, a)  # <numeric>", "s = torch.add(z, a, alpha=1.01)  # <numeric>")
    elif name == "inserted-line":
        src = src.replace("        # <inserted-line>\n", "        # <inserted-line>\n        t = torch.zeros(4, 16)\n")
    elif name in ("silu", "mish"):        # the <first> line calls another function (the base: sigmoid)
        src = src.replace("a = torch.sigmoid(h)  # <first>", f"a = F.{name}(h)  # <first>")
    elif name == "reordered":
        first = "        a = torch.sigmoid(h)  # <first>\n"
        second = "        b = torch.tanh(z)  # <second>\n"
        src = src.replace(first + second, second + first)
    assert name in ("base", "extra-call") or src != TEMPLATE
    return src


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(root: Path, variant: str, nproc: int = 2, extra: dict[str, str] | None = None
           ) -> tuple[Path, subprocess.Popen[str]]:
    from opguard.capture.bootstrap import child_env
    from opguard.capture.options import CaptureOptions

    script_dir = root / "src"
    script_dir.mkdir(parents=True)
    script = script_dir / "train.py"
    script.write_text(_variant(variant))
    base = root / "traces"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPGUARD_", "SLURM_", "OMPI_", "PMI_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH"):
        env.pop(k, None)
    env.update({"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{env.get('PATH', '')}", "OPGUARD_TRACE_OUTPUT_BASE": str(base),
                **(extra or {})})
    env = child_env(env, CaptureOptions(buffer=64))
    p = subprocess.Popen([str(TORCHRUN), "--nnodes=1", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
                          f"--master-port={_free_port()}", str(script)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    return base, p


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not installed in this virtualenv (pip install torch, CPU build)")
    root = tmp_path_factory.mktemp("runs")
    # the seven runs start together (each a real torchrun with its own port) and are awaited
    started = {name: _start(root / name, variant, **kw)  # type: ignore[arg-type]
               for name, variant, kw in [
                   ("a", "base", {}), ("b", "base", {}), ("numeric", "numeric", {}),
                   ("inserted-line", "inserted-line", {}),
                   ("extra-call", "extra-call", {"extra": {"RELU_TIMES": "2"}}),
                   ("reordered", "reordered", {}), ("one-rank", "base", {"nproc": 1}),
                   ("changed-arg", "changed-arg", {}),
                   ("gpt", "gpt", {"nproc": 1}), ("gpt-rerun", "gpt", {"nproc": 1}),
                   ("gpt-tanh", "gpt-tanh", {"nproc": 1})]}
    failed = []
    for name, (_, proc) in started.items():
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failed.append(f"{name}: exit {proc.returncode}: {err[-2000:]}")
    assert not failed, "\n".join(failed)
    return {name: base for name, (base, _) in started.items()}


def _compare(runs: dict[str, Path], b: str, tmp_path: Path, a: str = "a") -> tuple[str, Export]:
    out = tmp_path / f"{b}.pftrace"
    p = run_compare(runs[a], runs[b], out, extra=["--json", str(tmp_path / f"{b}.json")])
    assert p.returncode == 0, p.stderr
    return p.stderr, read_export(out)


def _first(tmp_path: Path, b: str, rank: int) -> dict[str, Any] | None:
    """The first introduced divergence of a rank, from --json."""
    doc = json.loads((tmp_path / f"{b}.json").read_text())
    fd: dict[str, Any] | None = next(r for r in doc["ranks"] if r["rank"] == rank)["first_divergence"]
    return fd


def _check_no_false_pairs(export: Export) -> None:
    ids = export.by_id()
    for op in export.ops:
        c = op.args["correspondence"]
        if c["state"] == "paired":
            other = ids[c["other"]]
            assert other.name == op.name
            if c["basis"] != "input-anchor":
                assert other.args["callsite"]["identity"] == op.args["callsite"]["identity"]
        else:
            assert c["reason"] in REASONS and op.args["status"] == "unaligned" and "diff" not in op.args


def _capture_version() -> int:
    from opguard.capture.records import VERSION

    return VERSION


V2 = pytest.mark.skipif(_capture_version() < 2, reason="capture writes schema v1 here: non-tensor arguments "
                        "are recorded from capture schema v2 on (docs/capture.md §3; issue 12)")


def test_identical_rerun_no_divergence(runs: dict[str, Path], tmp_path: Path) -> None:
    """(d) an identical rerun of the seeded program."""
    err, export = _compare(runs, "b", tmp_path)
    assert len(export.ops) > 100
    assert all(op.args["correspondence"]["state"] == "paired" and op.args["status"] == "ok" for op in export.ops)
    assert {op.args["correspondence"]["basis"] for op in export.ops} == {"equal-sequence"}
    assert {op.args["rank"] for op in export.ops} == {0, 1}
    assert any(op.args.get("collective") for op in export.ops)
    assert _first(tmp_path, "b", 0) is None and _first(tmp_path, "b", 1) is None
    assert err.count("no divergence: every pair's compared fields agree") == 2


def _train_line(text: str) -> int:
    return next(i for i, x in enumerate(TEMPLATE.splitlines(), 1) if text in x)


def test_edited_line_first_divergence_is_that_call(runs: dict[str, Path], tmp_path: Path) -> None:
    """(a) `s = torch.add(z, a)` edited in place to `torch.add(z, a, alpha=1.01)`."""
    err, export = _compare(runs, "numeric", tmp_path)
    _check_no_false_pairs(export)
    line = _train_line("s = torch.add(z, a)")
    for rank in (0, 1):
        a = ops_of(export, "A", rank)
        first = next(op for op in a if op.args["status"] == "mismatch")
        assert first.name == "torch.add" and first.args["diff"]["inputs_equal"] is True
        assert all(op.args["status"] == "ok" for op in a[: a.index(first)])
        fd = _first(tmp_path, "numeric", rank)
        assert fd is not None
        assert (fd["function"], fd["record_a"], fd["line_map_b"]) == \
            ("torch.add", first.record_id, f"edited A:{line}")
        assert fd["where"].endswith(f"/a/src/train.py:{line}")
        assert fd["where_b"].endswith(f"/numeric/src/train.py:{line}")
        if _capture_version() >= 2:
            assert fd["kind"] == "arguments differ" and fd["args"] == ["alpha: absent -> 1.01"]
        else:
            assert fd["kind"] == "outputs differ, inputs and arguments equal" and fd["args"] == []
        assert fd["unresolved_before"] == 0
    assert err.count("first divergence: torch.add at ") == 2


def test_inserted_line_shifts_identities_no_divergence(runs: dict[str, Path], tmp_path: Path) -> None:
    """(b) an unused `t = torch.zeros(4, 16)` inserted: every later line shifts by one and keeps its
    identity; the new op has no counterpart; nothing computed differs."""
    err, export = _compare(runs, "inserted-line", tmp_path)
    _check_no_false_pairs(export)
    # the summary names the first operation of the line only B has (both ranks)
    assert err.count("B's first operation A does not make (on a line A does not have or has elsewhere, or a call "
                     "A's run does not make there): run B torch.zeros at ") == 2, err
    doc = json.loads((tmp_path / "inserted-line.json").read_text())
    assert all(r["first_new_in_b"].startswith("run B torch.zeros at ") for r in doc["ranks"])
    for rank in (0, 1):
        b = ops_of(export, "B", rank)
        zeros = [op for op in b if op.name == "torch.zeros"]
        assert len(zeros) == 2
        assert all(op.args["correspondence"]["state"] == "undetermined" for op in zeros)
        assert all(op.args["callsite"]["identity"].startswith("train.py:+") for op in zeros)
        # step 1's zeros sits alone between two anchors; step 0's shares the segment before the first
        # anchor with the setup calls and draws (no tensor inputs, so no anchors): its key is the only
        # one A's segment lacks, so it is set aside and the draws pair (docs/compare.md §2 rule 6)
        assert zeros[1].args["correspondence"]["reason"] == "no-counterpart-in-segment"
        assert zeros[0].args["correspondence"]["reason"] == "not-in-other-segment"
        und = [op for op in b if op.args["correspondence"]["state"] == "undetermined"]
        assert und == zeros, [op.name for op in und]
        paired = [op for op in b if op.args["correspondence"]["state"] == "paired"]
        assert all(op.args["status"] == "ok" for op in paired)
        assert len(paired) + 2 == len(b)
        at = _train_line("# <inserted-line>") + 1          # the inserted line's number in B
        for op in paired:
            cs = op.args["callsite"]
            if cs["file"].endswith("train.py"):
                assert cs["line_map"] == ("same" if cs["line"] < at else f"shifted A:{cs['line'] - 1}"), cs
        assert _first(tmp_path, "inserted-line", rank) is None
    assert err.count("no divergence") == 2


def test_changed_argument_first_divergence(runs: dict[str, Path], tmp_path: Path) -> None:
    """(c) `F.mse_loss(s, b)` -> `F.mse_loss(s, b, reduction='sum')`: equal inputs, other outputs."""
    _err, export = _compare(runs, "changed-arg", tmp_path)
    _check_no_false_pairs(export)
    for rank in (0, 1):
        fd = _first(tmp_path, "changed-arg", rank)
        assert fd is not None and fd["function"] == "torch.nn.functional.mse_loss"
        assert fd["where"].endswith(f"train.py:{_train_line('loss = F.mse_loss(s, b)')}")
        a = ops_of(export, "A", rank)
        k = next(i for i, op in enumerate(a) if op.record_id == fd["record_a"])
        assert all(op.args["status"] == "ok" for op in a[:k])


@V2
def test_changed_argument_is_named(runs: dict[str, Path], tmp_path: Path) -> None:
    err, _export = _compare(runs, "changed-arg", tmp_path)
    for rank in (0, 1):
        fd = _first(tmp_path, "changed-arg", rank)
        assert fd is not None and fd["kind"] == "arguments differ"
        # F.mse_loss hands its defaults on to the torch function mode: A's record holds reduction='mean'
        assert fd["args"] == ["reduction: 'mean' -> 'sum'"]
    assert "arguments differ: reduction: 'mean' -> 'sum'" in err


V2_UNINIT = pytest.mark.skipif(_capture_version() < 2, reason="capture writes schema v1 here: torch.empty and "
                               "friends (module initialisation) are marked uninitialized from capture schema v2 on "
                               "(docs/capture.md §3; issue 12); before, their garbage is the first difference")


@V2_UNINIT
def test_gpt_identical_rerun_no_divergence(runs: dict[str, Path], tmp_path: Path) -> None:
    err, export = _compare(runs, "gpt-rerun", tmp_path, a="gpt")
    assert len(export.ops) > 200
    assert any(op.name == "torch.nn.functional.scaled_dot_product_attention" for op in export.ops)
    assert _first(tmp_path, "gpt-rerun", 0) is None, err
    assert "no divergence" in err


@V2_UNINIT
def test_gpt_changed_gelu_argument_first_divergence_is_the_gelu(runs: dict[str, Path], tmp_path: Path) -> None:
    err, export = _compare(runs, "gpt-tanh", tmp_path, a="gpt")
    _check_no_false_pairs(export)
    fd = _first(tmp_path, "gpt-tanh", 0)
    assert fd is not None, err
    line = next(i for i, x in enumerate(GPT.splitlines(), 1) if "# <gelu>" in x)
    assert fd["function"] == "torch.nn.functional.gelu", err
    assert fd["where"].endswith(f"gpt/src/train.py:{line}") and fd["module"] == "GPT.blocks.0.mlp"
    assert fd["unresolved_before"] == 0
    a = ops_of(export, "A", 0)
    k = next(i for i, op in enumerate(a) if op.record_id == fd["record_a"])
    assert all(op.args["status"] == "ok" for op in a[:k])
    assert "first divergence: torch.nn.functional.gelu at " in err


@V2
def test_gpt_changed_gelu_argument_is_named(runs: dict[str, Path], tmp_path: Path) -> None:
    _err, _export = _compare(runs, "gpt-tanh", tmp_path, a="gpt")
    fd = _first(tmp_path, "gpt-tanh", 0)
    assert fd is not None and fd["kind"] == "arguments differ"
    assert fd["args"] == ["approximate: absent -> 'tanh'"] and fd["step"] == 0


def test_extra_call(runs: dict[str, Path], tmp_path: Path) -> None:
    _err, export = _compare(runs, "extra-call", tmp_path)
    _check_no_false_pairs(export)
    for rank in (0, 1):
        a, b = ops_of(export, "A", rank), ops_of(export, "B", rank)
        und = [op for op in b if op.args["correspondence"]["state"] == "undetermined"]
        assert [op.name for op in und] == ["torch.relu", "torch.relu"]          # one extra call per step
        # the first step's extra call lies between anchors; the second's, in a segment without any (an
        # anchor pairs the same occurrence of its call site only: docs/compare.md §2)
        assert [op.args["correspondence"]["reason"] for op in und] == ["no-counterpart-in-segment", "segment-differs"]
        assert all(op.args["correspondence"]["state"] == "paired" for op in a)


def test_reordered_independent_calls(runs: dict[str, Path], tmp_path: Path) -> None:
    _err, export = _compare(runs, "reordered", tmp_path)
    _check_no_false_pairs(export)
    a = ops_of(export, "A", 0)
    moved = [op for op in a if op.name in ("torch.sigmoid", "torch.tanh")]
    states = [(op.name, op.args["correspondence"].get("basis") or op.args["correspondence"]["reason"])
              for op in moved]
    # of two swapped calls one keeps its anchor; the other's anchor disagrees in order: undetermined
    assert sorted(s for _, s in states) == ["anchor-order-conflict"] * 2 + ["input-anchor"] * 2, states


def test_rank_present_in_one_run_only(runs: dict[str, Path], tmp_path: Path) -> None:
    err, export = _compare(runs, "one-rank", tmp_path)
    assert all(op.args["correspondence"] == {"state": "undetermined", "reason": "no-corresponding-file"}
               for op in ops_of(export, "A", 1))
    assert "rank 1 [capture]: only in run A" in err
    rank0 = ops_of(export, "A", 0)
    assert all(op.args["correspondence"]["state"] == "paired" for op in rank0)


@pytest.fixture(scope="module")
def fn_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not installed in this virtualenv (pip install torch, CPU build)")
    root = tmp_path_factory.mktemp("fn-runs")
    started = {name: _start(root / name, name) for name in ("silu", "mish")}
    for name, (_, proc) in started.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}: {err[-2000:]}"
    return {name: base for name, (base, _) in started.items()}


def test_a_line_that_calls_another_function_is_the_divergence(fn_runs: dict[str, Path], tmp_path: Path) -> None:
    """`a = F.silu(h)` edited in place to `a = F.mish(h)`: the two calls (same mapped line, equal inputs)
    pair with basis function-differs and are each rank's first introduced divergence; every other
    operation pairs with an operation of its own function, in order (before: 318 ops undetermined,
    segment-differs, and the summary pointed at first_unresolved)."""
    err, export = _compare(fn_runs, "mish", tmp_path, a="silu")
    line = _train_line("a = torch.sigmoid(h)")
    ids = export.by_id()
    for rank in (0, 1):
        fd = _first(tmp_path, "mish", rank)
        assert fd is not None, err
        assert (fd["kind"], fd["function"], fd["function_b"], fd["step"], fd["unresolved_before"]) == \
            ("function differs", "torch.nn.functional.silu", "torch.nn.functional.mish", 0, 0), fd
        assert fd["where"].endswith(f"/silu/src/train.py:{line}") and fd["line_map_b"] == f"edited A:{line}"
        a, b = ops_of(export, "A", rank), ops_of(export, "B", rank)
        assert all(op.args["correspondence"]["state"] == "paired" for op in a + b), err
        first = next(op for op in a if op.args["status"] == "mismatch")
        assert (first.record_id, first.name) == (fd["record_a"], "torch.nn.functional.silu")
        assert all(op.args["status"] == "ok" for op in a[: a.index(first)])
        assert ids[first.args["correspondence"]["other"]].name == "torch.nn.functional.mish"
        for op in a:
            c = op.args["correspondence"]
            other = ids[c["other"]]
            assert int(other.args["index"]) == int(op.args["index"])       # the same program: in order
            if c["basis"] == "function-differs":
                assert op.args["callsite"]["identity"] == other.args["callsite"]["identity"] == f"train.py:{line}"
            else:
                assert other.name == op.name
        # the op after it that reads its output pairs too, its difference inherited
        add = next(op for op in a[a.index(first):] if op.name == "torch.add")
        assert add.args["status"] == "mismatch" and add.args["diff"]["introduced"] is False
    assert err.count(": function differs: torch.nn.functional.silu -> torch.nn.functional.mish") == 2, err
