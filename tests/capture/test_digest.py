"""Digests (mix64-v1 and the cheaper modes) and the fused statistics, against plain definitions."""

from __future__ import annotations

import math
import struct

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

from opguard.capture.digest import (  # noqa: E402
    TABLE_LEN,
    Digester,
    finish,
    finish_stats,
    reference_sum,
    reference_words,
    stats_row,
)

pytestmark = [pytest.mark.torch]


def digest(t: torch.Tensor, mode: str = "full") -> str:
    d = Digester(mode)
    assert d.compute is not None
    return finish(int(d.compute(t)), Digester.count(t))


def ref_digest(t: torch.Tensor) -> str:
    """docs/capture.md §5 written out: logical bytes, little-endian 64-bit words, mix, element count."""
    v = torch.view_as_real(t) if t.is_complex() else t
    raw = bytes(v.contiguous().reshape(-1).view(torch.uint8).tolist())
    return finish(reference_sum(reference_words(raw)), v.numel())


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5, 7),
    lambda: torch.randn(7, 5).t(),                       # non-contiguous
    lambda: torch.randn(4, 6)[:, 1:4],                   # storage offset + strides
    lambda: torch.arange(-20, 20, dtype=torch.int64),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.randn(9).to(torch.bfloat16),
    lambda: torch.randn(9, dtype=torch.float64),
    lambda: torch.randn(3, dtype=torch.complex64),
    lambda: torch.randint(0, 255, (11,), dtype=torch.uint8),
    lambda: torch.randn(7)[1:],                          # contiguous, odd storage offset
    lambda: torch.randn(5).to(torch.float16),            # padded last word
    lambda: torch.zeros(0),
])
def test_mix64_matches_the_documented_definition(make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    assert digest(t) == ref_digest(t)


def test_mix64_multi_block_matches_definition() -> None:
    g = torch.Generator().manual_seed(3)
    t = torch.randn(2 * TABLE_LEN + 5, generator=g)           # more 64-bit words than the table
    assert digest(t) == ref_digest(t)
    t2 = t.clone()
    t2[2 * TABLE_LEN + 2] = -t2[2 * TABLE_LEN + 2]
    assert digest(t2) != digest(t)


def test_layout_independent_equal_iff_bitwise_equal() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 33, generator=g)
    assert digest(a) == digest(a.clone()) == digest(a.t().contiguous().t())
    # one ulp apart in one element
    b = a.clone()
    b[10, 3] = torch.nextafter(b[10, 3], torch.tensor(math.inf))
    assert digest(b) != digest(a)
    # -0.0 vs 0.0
    z, nz = torch.zeros(8), torch.zeros(8)
    nz[5] = -0.0
    assert torch.equal(z, nz) and digest(z) != digest(nz)
    # NaN payloads
    n1 = torch.tensor([struct.unpack("<f", struct.pack("<I", 0x7FC00000))[0]] * 4)
    n2 = n1.clone().view(torch.int32)
    n2[2] = 0x7FC00001
    n2 = n2.view(torch.float32)
    assert math.isnan(n2[2].item()) and digest(n1) != digest(n2)
    # two sign flips (a pattern that cancels in linear hashes), and a swap of two elements
    c = a.clone()
    c[0, 0], c[1, 1] = -c[0, 0], -c[1, 1]
    assert digest(c) != digest(a)
    c = a.clone()
    c[0, 0], c[0, 1] = -c[0, 0], -c[0, 1]                     # both halves of one 64-bit word
    assert digest(c) != digest(a)
    s = a.clone()
    s[0, 0], s[0, 1] = a[0, 1].clone(), a[0, 0].clone()
    assert digest(s) != digest(a)


def test_cheaper_modes_give_up_what_the_doc_says() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(10000, generator=g)
    perm = a.flip(0)
    assert digest(perm, "xor") == digest(a, "xor")        # xor: order is lost
    # no element: digested as the full mode digests it (torch.hash_tensor raises on it)
    for empty in (torch.zeros(0), torch.zeros(3, 0, dtype=torch.bool), torch.zeros(0, dtype=torch.complex64)):
        assert digest(empty, "xor") == digest(torch.zeros(0, dtype=torch.int8), "xor")
    assert digest(perm, "full") != digest(a, "full")
    b = a.clone()
    idx = next(i for i in range(1, 10000) if i * 4096 // 10000 != (i - 1) * 4096 // 10000 and
               all(k * 10000 // 4096 != i for k in range(4096)))
    b[idx] += 1.0                                           # an element the sample does not read
    assert digest(b, "sample") == digest(a, "sample") and digest(b) != digest(a)
    b[0] += 1.0                                             # element 0 is always sampled
    assert digest(b, "sample") != digest(a, "sample")
    small = torch.randn(100, generator=g)                    # <= 4096 elements: every element is read
    bits = [int(x) for x in Digester.elements(small).tolist()]
    assert digest(small, "sample") == finish(reference_sum(bits), 100)


def test_no_global_rng_use() -> None:
    state = torch.get_rng_state()
    d = Digester("full")
    d.table(torch.device("cpu"))
    digest(torch.ones(3))
    assert torch.equal(state, torch.get_rng_state())


def stats(t: torch.Tensor) -> dict[str, float | int]:
    return finish_stats(stats_row(t).tolist(), t.numel())


def test_stats_match_torch() -> None:
    g = torch.Generator().manual_seed(2)
    t = torch.randn(37, 19, generator=g) * 3 + 1
    s = stats(t)
    assert s["min"] == t.min().item() and s["max"] == t.max().item()
    assert s["absmax"] == t.abs().max().item()
    assert s["mean"] == pytest.approx(t.double().mean().item(), rel=1e-6)
    assert s["std"] == pytest.approx(t.double().std().item(), rel=1e-5)
    assert s["nan"] == 0 and s["inf"] == 0
    one = stats(torch.tensor([2.5]))
    assert one["std"] == 0.0 and one["mean"] == 2.5
    ints = stats(torch.tensor([1, 5, -3]))
    assert (ints["min"], ints["max"], ints["mean"], ints["nan"]) == (-3.0, 5.0, 1.0, 0)


def test_nan_and_inf_counts_are_exact() -> None:
    t = torch.randn(1000)
    t[3] = math.nan
    t[7] = math.nan
    t[9] = math.inf
    t[11] = -math.inf
    t[13] = -math.inf
    s = stats(t)
    assert (s["nan"], s["inf"]) == (2, 3)
    assert math.isnan(s["min"]) and math.isnan(s["mean"])
    only_inf = torch.tensor([1.0, math.inf, 2.0])
    s = stats(only_inf)
    assert (s["nan"], s["inf"], s["max"], s["min"]) == (0, 1, math.inf, 1.0)
    s = stats(torch.tensor([1.0, math.nan], dtype=torch.float16))
    assert (s["nan"], s["inf"]) == (1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.bool])
def test_strided_views_of_narrow_elements_digest_as_their_contiguous_copy(dtype: torch.dtype) -> None:
    """The torch path (the host kernel ``torch``, the one GPUs use) viewed a flattened view as int64
    words: a column ``x[:, 0]``, ``x[:, ::2]``, a diagonal (flattened without a copy, last stride
    not 1) raised "self.stride(-1) must be 1 to view Float as Long", and the entry had no digest."""
    x = (torch.arange(48, dtype=torch.float32).reshape(6, 8) * 0.37).to(dtype)
    for v in (x[:, 0], x[:, ::2], x.diagonal(), x[::2, 1::3]):
        assert digest(v) == digest(v.contiguous())
    z = torch.randn(4, 4, dtype=torch.cfloat)
    assert digest(z.real) == digest(z.real.contiguous())


def test_xor_digests_a_lazily_conjugated_tensor_as_its_resolved_copy() -> None:
    z = torch.randn(3, 3, dtype=torch.cfloat, generator=torch.Generator().manual_seed(1))
    assert z.conj().is_conj()
    assert digest(z.conj(), "xor") == digest(z.conj().resolve_conj(), "xor")
    assert digest(z.mH, "xor") == digest(z.mH.resolve_conj(), "xor")
