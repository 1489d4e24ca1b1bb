"""The native host kernel (``opguard.capture._hostkernel``, docs/capture.md §5.2): the same digest
sum as the PyTorch-ops path and the pure-Python definition, the same statistics, for every element
type, length, alignment and instruction-set variant; a session gives the same trace either way."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

import opguard.capture as oc  # noqa: E402
from opguard.capture import hostkernel  # noqa: E402
from opguard.capture.digest import MASK64, Digester, reference_sum, reference_words, stats_row  # noqa: E402
from opguard.capture.options import CaptureOptions  # noqa: E402
from opguard.errors import ConfigError  # noqa: E402
from tests.capture.helpers import ops, read_trace  # noqa: E402
from tests.capture.progs import calls  # noqa: E402
from tests.capture.progs.models import MLP  # noqa: E402

pytestmark = [pytest.mark.torch]
SOURCE = Path(hostkernel.__file__).with_name("_hostkernel.c")
# lengths around the 64-byte chunk, the 8-element group and the 65536-word table block
LENGTHS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 129, 1000, 65536 * 2 + 3, 140_001, 300_007]


@pytest.fixture(scope="module")
def hk():  # type: ignore[no-untyped-def]
    return pytest.importorskip("opguard.capture._hostkernel",
                               reason="the native host kernel is not built (pip install -e . needs a C compiler)")


def torch_sum(t: torch.Tensor) -> int:
    s = Digester("full")._full(t)
    return int(s.item()) & MASK64


def sample(dtype: torch.dtype, n: int, offset: int) -> torch.Tensor:
    """``n`` elements starting ``offset`` elements into a fresh tensor (an unaligned data pointer)."""
    g = torch.Generator().manual_seed(n * 31 + offset)
    if dtype.is_floating_point:
        base = (torch.randn(n + offset, dtype=torch.float64, generator=g) * 3).to(dtype)
    elif dtype == torch.bool:
        base = torch.rand(n + offset, generator=g) > 0.5
    else:
        info = torch.iinfo(dtype)
        base = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), (n + offset,), dtype=dtype, generator=g)
    return base[offset:]


def check_row(row: tuple[float, ...], t: torch.Tensor) -> None:
    """Native (min, max, sum, sumsq, nonfinite, inf) against the PyTorch-ops row (min, max, sum, norm, ...)."""
    mn, mx, s, q, nonfinite, inf = row
    ref = stats_row(t).tolist()
    same = (lambda a, b: (math.isnan(a) and math.isnan(b)) or a == b)  # noqa: E731
    assert same(mn, ref[0]) and same(mx, ref[1]), (row, ref)  # exact (NaN propagates)
    assert (nonfinite, inf) == (int(ref[4]), int(ref[5]))  # exact counts
    if math.isfinite(ref[2]):
        scale = float(t.double().abs().sum()) if t.dtype != torch.bool else float(t.sum())
        assert abs(s - ref[2]) <= 1e-5 * max(scale, 1.0)  # accumulation order differs: approximate
        exact = float(torch.linalg.vector_norm(t.double()))
        assert math.sqrt(q) == pytest.approx(exact, rel=1e-9)  # float64 lanes: as good as float64
        assert math.sqrt(q) == pytest.approx(ref[3], rel=1e-5 if t.element_size() >= 4 else 1e-3)
    else:
        assert same(s, ref[2]) or (math.isinf(s) and math.isinf(ref[2]))


@pytest.mark.parametrize("dtype", list(hostkernel.CODES))
def test_digest_sum_and_statistics_equal_the_torch_path(hk, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    code = hostkernel.CODES[dtype]
    for n in LENGTHS:
        for offset in (0, 1, 3):
            t = sample(dtype, n, offset)
            S, row = hk.summary(t.data_ptr(), t.numel() * t.element_size(), code, True, True)
            assert torch_sum(t) == S, (dtype, n, offset)
            check_row(row, t)
            # digest only / statistics only give the same parts
            assert hk.summary(t.data_ptr(), t.numel() * t.element_size(), -1, True, False) == (S, None)
            assert hk.summary(t.data_ptr(), t.numel() * t.element_size(), code, False, True) == (None, row)


def test_digest_sum_equals_the_pure_python_definition(hk) -> None:  # type: ignore[no-untyped-def]
    for nbytes in range(0, 200):
        data = bytes((i * 37 + nbytes) % 256 for i in range(nbytes))
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        S, _ = hk.summary(buf.data_ptr(), nbytes, -1, True, False)
        assert reference_sum(reference_words(data)) & MASK64 == S, nbytes


def test_every_float16_value_converts_exactly(hk) -> None:  # type: ignore[no-untyped-def]
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    halves = bits.view(torch.float16)
    exact = halves.double().tolist()
    for i in range(0, 65536):
        h = halves[i:i + 1]
        _, (mn, mx, _s, _q, nonfinite, inf) = hk.summary(h.data_ptr(), 2, hostkernel.CODES[torch.float16], False, True)
        if math.isnan(exact[i]):
            assert math.isnan(mn) and (nonfinite, inf) == (1, 0)
        else:
            assert mn == mx == exact[i] and math.copysign(1, mn) == math.copysign(1, exact[i]), hex(i)
            assert (nonfinite, inf) == ((1, 1) if math.isinf(exact[i]) else (0, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_and_inf_follow_torch_semantics(hk, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    cases = [[1.0, math.nan, 2.0] * 11, [1.0, math.inf, -3.0] * 11, [math.inf, -math.inf] * 9,
             [math.nan] * 17, [-0.0, 0.0] * 10, [5.0]]
    for values in cases:
        t = torch.tensor(values, dtype=dtype)
        _, row = hk.summary(t.data_ptr(), t.numel() * t.element_size(), hostkernel.CODES[dtype], True, True)
        check_row(row, t)


def test_bad_arguments_are_refused(hk) -> None:  # type: ignore[no-untyped-def]
    t = torch.ones(3)
    with pytest.raises(ValueError, match="unsupported element code"):
        hk.summary(t.data_ptr(), 12, 99, False, True)
    with pytest.raises(ValueError, match="unsupported element code"):
        hk.summary(t.data_ptr(), 10, hostkernel.CODES[torch.float32], False, True)  # not whole elements
    with pytest.raises(ValueError, match="nbytes"):
        hk.summary(t.data_ptr(), -1, -1, True, False)
    with pytest.raises(ValueError, match="null"):
        hk.summary(0, 8, -1, True, False)


@pytest.mark.parametrize("dtype", list(hostkernel.CODES))
def test_entry_equals_summary_with_the_hosts_finish(hk, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """``entry`` (one call: printed digest and JSON statistics) gives exactly what ``summary`` and
    the host's ``finish`` / ``_moments_json`` give, bit for bit; non-finite data and overflowing
    moments come back as the raw row, which the host's general formula finishes."""
    from opguard.capture.digest import finish, finish_moments
    from opguard.capture.session import _json_stats, _moments_json
    code = hostkernel.CODES[dtype]
    cases = [sample(dtype, n, 3) for n in LENGTHS]
    if dtype.is_floating_point:
        cases += [torch.tensor([1.0, math.nan, 2.0]).to(dtype), torch.tensor([math.inf, -1.0]).to(dtype),
                  torch.full((9,), torch.finfo(dtype).max, dtype=dtype)]
    for t in cases:
        n = t.numel()
        for stats in (True, False):
            S, row = hk.summary(t.data_ptr(), n * t.element_size(), code if stats else -1, True, stats)
            hexed, values = hk.entry(t.data_ptr(), n, code, stats)
            assert hexed == finish(S, n)
            if not stats:
                assert values is None
                continue
            want = _moments_json(*row, n)
            got = values if type(values) is dict else _json_stats(finish_moments(*values, n))
            assert list(got) == list(want)
            for k in want:
                both_nan = got[k] != got[k] and want[k] != want[k]
                assert type(got[k]) is type(want[k]) and (got[k] == want[k] or both_nan)
    with pytest.raises(ValueError, match="known element code"):
        hk.entry(cases[0].data_ptr(), 3, 99, True)
    with pytest.raises(ValueError, match="n > 0"):
        hk.entry(cases[0].data_ptr(), 0, code, True)
    with pytest.raises(ValueError, match="null"):
        hk.entry(0, 3, code, True)


def test_a_kernel_without_entry_writes_the_same_trace(tmp_path: Path, hk,  # type: ignore[no-untyped-def]
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel built before ``entry`` existed (only ``summary``): the host finishes, same trace."""
    new = _train({"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "n")}, "native")

    class Old:
        summary = staticmethod(hk.summary)
    monkeypatch.setattr(hostkernel, "_module", Old())
    old = _train({"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "o")}, "native")
    assert len(new) == len(old) > 30
    for a, b in zip(new, old, strict=True):
        assert a["inputs"] == b["inputs"] and a["outputs"] == b["outputs"]


def _strided_views(t: torch.Tensor) -> list[torch.Tensor]:
    """Non-contiguous views of ``t`` (2-D or 3-D): transposes, steps, a split's middle part (GPT's
    q/k/v), a broadcast (stride 0), a flipped transpose."""
    out = [t.transpose(0, -1), t[..., ::2], t.split(max(1, t.shape[-1] // 3), -1)[-1],
           t.unsqueeze(0).expand(3, *t.shape), t.flip(0).transpose(0, -1)]
    return [v for v in out if not v.is_contiguous()]


@pytest.mark.parametrize("dtype", list(hostkernel.CODES))
def test_strided_equals_summary_of_the_contiguous_copy(hk, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The in-place read of a non-contiguous tensor gives exactly the digest sum and statistics row
    of its contiguous copy: rows split across gather buffers, tails, table blocks (> 512 KiB)."""
    code = hostkernel.CODES[dtype]
    cases = 0
    for shape in ((3, 5), (7, 9), (8, 64, 192), (17, 1031), (1025, 257), (2, 700, 400)):
        base = sample(dtype, math.prod(shape), 1).reshape(shape)
        for v in _strided_views(base):
            c = v.contiguous()
            ref = hk.summary(c.data_ptr(), c.numel() * c.element_size(), code, True, True)
            got = hk.strided(v.data_ptr(), v.element_size(), tuple(v.shape), tuple(v.stride()), code, True, True)
            assert got == ref, (dtype, shape, v.shape, v.stride())
            digest_only = hk.strided(v.data_ptr(), v.element_size(), tuple(v.shape), tuple(v.stride()), -1, True, False)
            assert digest_only == (ref[0], None)
            cases += 1
    assert cases >= 20


def test_strided_leaves_a_non_finite_sum_to_the_copy(hk, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(50, 40)
    x[3, 7] = math.nan
    t = x.t()
    assert hk.strided(t.data_ptr(), 4, tuple(t.shape), tuple(t.stride()), 0, True, True) is None
    with pytest.raises(ValueError, match="element size"):
        hk.strided(t.data_ptr(), 8, tuple(t.shape), tuple(t.stride()), 0, True, True)
    with pytest.raises(ValueError, match="negative"):
        hk.strided(t.data_ptr(), 4, (40, 50), (1, -40), 0, True, True)
    # through capture: the copy path counts the NaN exactly
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        x.t().mul(1.0).t()
    out = [r for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.t"][-1]["outputs"][0]
    assert out["stats"]["nan"] == 1 and out["digest"] == oc_digest_of(x.t().mul(1.0).t())


def oc_digest_of(t: torch.Tensor) -> str:
    from opguard.capture.digest import finish

    c = t.contiguous()
    return finish(torch_sum(c), c.numel())


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_every_instruction_set_variant_gives_the_same_values(tmp_path: Path, hk) -> None:  # type: ignore[no-untyped-def]
    """The clones (x86-64-v4, v3, baseline) run the same lane-wise operations without contraction:
    the kernel compiled for each level this CPU can run gives bit-identical digests and rows."""
    if sys.platform != "linux" or not sysconfig.get_config_var("CC"):
        pytest.skip("needs the C compiler Python was built with")
    flags = _cpu_flags()
    levels = ["x86-64"] if platform.machine() == "x86_64" else [""]
    if levels == ["x86-64"] and {"avx2", "fma", "bmi2"} <= flags:
        levels.append("x86-64-v3")
    if levels[-1] == "x86-64-v3" and {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
        levels.append("x86-64-v4")
    include = sysconfig.get_paths()["include"]
    tensors = [sample(dt, n, 1) for dt in hostkernel.CODES for n in (65536 * 2 + 3, 1000, 33)]
    tensors += [torch.tensor([1.0, math.nan, math.inf, -0.0] * 40)]
    results = []
    for march in levels:
        so = tmp_path / (march or "native") / f"_hostkernel{importlib.machinery.EXTENSION_SUFFIXES[0]}"
        so.parent.mkdir()
        arch = [f"-march={march}"] if march else []
        subprocess.run(["gcc", "-O3", "-std=gnu11", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-psabi", *arch,
                        "-DOPGUARD_NO_CLONES", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(so)],
                       check=True)
        spec = importlib.util.spec_from_file_location("_hostkernel", so)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out = []
        for t in tensors:
            code = hostkernel.CODES[t.dtype]
            out.append(repr(mod.summary(t.data_ptr(), t.numel() * t.element_size(), code, True, True)))
        results.append(out)
    installed = [repr(hk.summary(t.data_ptr(), t.numel() * t.element_size(), hostkernel.CODES[t.dtype], True, True))
                 for t in tensors]
    for out in results:
        assert out == installed


def _train(env: dict[str, str], kernel: str) -> list[dict]:  # type: ignore[type-arg]
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    with oc.capture(env=env, host_kernel=kernel, buffer=16) as cap:
        calls.mlp_train(model, x, y, 3, step_fn=oc.step)
    meta = (cap.path / "meta.json").read_text()
    assert f'"host_kernel": "{kernel}"' in meta
    return ops(read_trace(cap.path))


def test_native_and_torch_paths_write_the_same_trace(tmp_path: Path, hk) -> None:  # type: ignore[no-untyped-def]
    native = _train({"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "n")}, "native")
    plain = _train({"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")}, "torch")
    assert len(native) == len(plain) > 30
    for a, b in zip(native, plain, strict=True):
        assert (a["fn"], a["line"], a["seq"]) == (b["fn"], b["line"], b["seq"])
        for ea, eb in zip(a["inputs"] + a["outputs"], b["inputs"] + b["outputs"], strict=True):
            assert ea["digest"] == eb["digest"] and ea["digest"] is not None
            sa, sb = ea.get("stats"), eb.get("stats")
            assert (sa is None) == (sb is None)
            if sa is not None:
                assert (sa["min"], sa["max"], sa["absmax"], sa["nan"], sa["inf"]) == \
                       (sb["min"], sb["max"], sb["absmax"], sb["nan"], sb["inf"])
                assert sa["mean"] == pytest.approx(sb["mean"], rel=1e-5, abs=1e-6)
                assert sa["std"] == pytest.approx(sb["std"], rel=1e-4, abs=1e-6)


def test_choice_of_kernel_is_validated_and_never_silent(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="OPGUARD_CAPTURE_HOST_KERNEL") as e:
        CaptureOptions.from_env({"OPGUARD_CAPTURE_HOST_KERNEL": "fast"})
    assert "'fast'" in str(e.value)
    monkeypatch.setattr(hostkernel, "_module", None)
    monkeypatch.setattr(hostkernel, "LOAD_ERROR", "ImportError: simulated")
    with pytest.raises(ConfigError, match=r"not built .*simulated"):
        hostkernel.resolve("native")
    assert hostkernel.resolve("auto") is None
    err = capsys.readouterr().err
    assert "native host kernel" in err and "simulated" in err and "OPGUARD_CAPTURE_HOST_KERNEL=torch" in err
    assert hostkernel.resolve("torch") is None and capsys.readouterr().err == ""


def test_launcher_refuses_native_without_the_kernel_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    from opguard.capture import bootstrap

    monkeypatch.setattr(bootstrap, "native_kernel_present", lambda: False)
    with pytest.raises(ConfigError, match="OPGUARD_CAPTURE_HOST_KERNEL=native"):
        bootstrap.child_env({"OPGUARD_CAPTURE_HOST_KERNEL": "native"})
    assert bootstrap.child_env({"OPGUARD_CAPTURE_HOST_KERNEL": "auto"})["OPGUARD_CAPTURE_HOST_KERNEL"] == "auto"


def test_element_types_the_kernel_does_not_read_still_get_digest_and_statistics(tmp_path: Path) -> None:
    """float8 (no reductions of its own on CPU) and uint16 outputs: the program runs on, the digest is
    the same on both paths, the statistics come from the PyTorch ops (float8 on a float32 copy)."""
    got = {}
    for kernel in ("native", "torch") if hostkernel.available() else ("torch",):
        with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / kernel)}, host_kernel=kernel) as cap:
            a = torch.tensor([1.0, -2.0, 0.5, 448.0]).to(torch.float8_e4m3fn).clone()
            b = torch.tensor([1.0, math.nan]).to(torch.float8_e5m2).clone()
            c = torch.arange(5, dtype=torch.int32).to(torch.uint16).clone()
        assert a.dtype == torch.float8_e4m3fn and b.numel() == 2 and c.numel() == 5
        clones = [r["outputs"][0] for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.clone"]
        assert [e["dtype"] for e in clones] == ["float8_e4m3fn", "float8_e5m2", "uint16"]
        assert clones[0]["stats"]["min"] == -2.0 and clones[0]["stats"]["max"] == 448.0
        assert clones[1]["stats"]["nan"] == 1 and clones[1]["stats"]["max"] == "nan"
        assert clones[2]["stats"]["max"] == 4.0 and clones[2]["stats"]["mean"] == 2.0
        got[kernel] = [(e["digest"], e["stats"]) for e in clones]
    assert len(set(map(repr, got.values()))) == 1


def test_a_failing_summary_never_breaks_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """Capture's own tensor work raising (a dtype or device without a kernel): the user's call
    returns its result, the entry says why it has no digest and statistics, stderr says it once."""
    from opguard.capture import session

    def broken(t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"no reduction for {t.dtype}")

    monkeypatch.setattr(session, "stats_row", broken)
    monkeypatch.setattr(hostkernel, "CODES", {})  # every dtype goes through (the broken) stats_row
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "o")}) as cap:
        x = torch.ones(4).mul(3)
        y = x.add(1)
    assert torch.equal(y, torch.full((4,), 4.0))
    outs = [r["outputs"][0] for r in ops(read_trace(cap.path)) if r["fn"] in ("Tensor.mul", "Tensor.add")]
    assert len(outs) == 2
    for e in outs:
        assert e["digest"] is None and e["stats"] is None
        assert e["reason"] == "summary failed: NotImplementedError: no reduction for torch.float32"
    err = capfd.readouterr().err
    assert err.count("summarising a float32 tensor on cpu failed") == 1


def test_a_record_with_a_string_that_is_not_utf8_is_kept() -> None:
    from opguard.capture import records

    line = records.encode({"v": 1, "kind": "op", "file": os.fsdecode(b"/x/tr\xffin.py"), "seq": 3})
    assert line.endswith(b"\n") and json.loads(line)["file"] == os.fsdecode(b"/x/tr\xffin.py")


def _gpt_trace(env: dict[str, str]) -> list[dict]:  # type: ignore[type-arg]
    from tests.capture.progs.zoo import TinyGPT

    torch.manual_seed(0)
    gpt = TinyGPT(vocab=17, width=16, layers=1, heads=2, seq=8)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 17, (2, 8), generator=g)
    with oc.capture(env=env, buffer=8) as cap:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = gpt(idx, torch.roll(idx, -1, 1))
            loss.backward()
            opt.step()
    return ops(read_trace(cap.path))


def test_non_contiguous_tensors_take_the_in_place_path_with_the_general_paths_values(
        tmp_path: Path, hk, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Transposes and split parts (GPT's q/k/v) are read in place by ``Session._entry_strided``:
    every entry of the trace (digest, statistics, reasons) equals the general path's."""
    from opguard.capture import session

    used = []
    fast = session.Session._entry_strided

    def counting(self, *a):  # type: ignore[no-untyped-def]
        e = fast(self, *a)
        used.append(e is not None)
        return e
    monkeypatch.setattr(session.Session, "_entry_strided", counting)
    new = _gpt_trace({"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "n")})
    assert sum(used) > 20  # the path was taken (transposes, split parts, their uses as inputs)
    monkeypatch.setattr(session.Session, "_entry_strided", lambda *a: None)
    old = _gpt_trace({"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "o")})
    assert len(new) == len(old) > 60
    for a, b in zip(new, old, strict=True):
        assert (a["fn"], a["inputs"], a["outputs"]) == (b["fn"], b["inputs"], b["outputs"])


@pytest.mark.parametrize("strided_path", [True, False])
def test_an_in_place_change_of_strides_is_never_served_from_the_cache(
        tmp_path: Path, hk, monkeypatch: pytest.MonkeyPatch, strided_path: bool) -> None:  # type: ignore[no-untyped-def]
    """``y.t_()`` keeps the object, its data pointer, shape (square) and version: the next use of ``y``
    is digested in its new element order, on the in-place path and on the general path alike."""
    from opguard.capture import session

    if not strided_path:
        monkeypatch.setattr(session.Session, "_entry_strided", lambda *a: None)
    x = torch.arange(16.0).reshape(4, 4)
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        y = x.add(0)
        y.mul(1)  # y cached, same object
        y.t_()
        y.mul(1)
        x.t().contiguous()
    rec = {r["fn"]: r for r in ops(read_trace(cap.path)) if r["fn"] != "Tensor.mul"}
    muls = [r for r in ops(read_trace(cap.path)) if r["fn"] == "Tensor.mul"]
    assert muls[0]["inputs"][0]["digest"] == rec["Tensor.add"]["outputs"][0]["digest"]
    assert muls[1]["inputs"][0]["digest"] == rec["Tensor.contiguous"]["outputs"][0]["digest"] != \
        muls[0]["inputs"][0]["digest"]
