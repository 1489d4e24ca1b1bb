"""Content digests and fused output statistics, computed on the tensor's device (``docs/capture.md`` §5).

Nothing here synchronises with the device: every function returns small device tensors (an int64
scalar per digest, six values per statistics row, float32 or float64) that the session stacks and fetches
in batches. The final mixing of a digest (with the element count) happens on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
TABLE_SEED = 0x6F70677561726431  # "opguard1"
BLOCK_SEED = 0x6F70677561726432  # "opguard2"
TABLE_BITS = 16
TABLE_LEN = 1 << TABLE_BITS
SAMPLE = 4096
ALGORITHM = "mix64-v1"
EXACT_F32 = 1 << 24
PREFIX_ENTRIES = 4096

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---- host-side integer helpers ------------------------------------------------------------------
def signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def fmix64(z: int) -> int:
    z &= MASK64
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & MASK64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & MASK64
    z ^= z >> 33
    return z


_fmix_n: dict[int, int] = {}


def finish(s: int, n: int) -> str:
    """The printed digest from the fetched device sum ``s`` and the element count ``n``."""
    fn = _fmix_n.get(n)
    if fn is None:
        fn = fmix64(n)
        if len(_fmix_n) < 65536:
            _fmix_n[n] = fn
    z = (s & MASK64) ^ fn  # fmix64 inline (one call less per digest; the same value)
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & MASK64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & MASK64
    return f"{z ^ (z >> 33):016x}"


def splitmix64(seed: int, count: int) -> list[int]:
    """Reference (pure Python) splitmix64 outputs 0..count-1; used by tests and for block constants."""
    out = []
    state = seed
    for _ in range(count):
        state = (state + GOLDEN) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        out.append(z ^ (z >> 31))
    return out


def _lshr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix_table(seed: int, count: int) -> torch.Tensor:
    # state_k = seed + (k+1)*GOLDEN (mod 2^64), vectorised in wrapping int64 arithmetic
    k = torch.arange(1, count + 1, dtype=torch.int64)
    z = k * signed(GOLDEN) + signed(seed)
    z = (z ^ _lshr(z, 30)) * signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lshr(z, 27)) * signed(0x94D049BB133111EB)
    return z ^ _lshr(z, 31)


def reference_sum(words: list[int]) -> int:
    """Pure-Python ``S`` of mix64-v1 over signed 64-bit words (tests, docs)."""
    table = splitmix64(TABLE_SEED, min(len(words), TABLE_LEN))
    nblocks = (len(words) - 1) // TABLE_LEN if words else 0
    blocks = [0, *splitmix64(BLOCK_SEED, nblocks)]
    s = 0
    for i, u in enumerate(words):
        w = table[i % TABLE_LEN] ^ blocks[i // TABLE_LEN]
        x = ((u & MASK64) ^ w) * GOLDEN & MASK64
        xs = signed(x) >> 32  # arithmetic shift
        s = (s + (x ^ (xs & MASK64))) & MASK64
    return s


def reference_words(data: bytes) -> list[int]:
    """Little-endian signed 64-bit words of ``data``, the last one zero-padded."""
    data = data + b"\0" * (-len(data) % 8)
    return [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]


# ---- device-side work -----------------------------------------------------------------------------
class Digester:
    """Per-process state: the weight table per device (generated once, without touching the global RNG)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._table_cpu: torch.Tensor | None = None
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._blocks: list[int] = [0]
        self._samples: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._scratch: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        self._prefixes: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        fn: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "full": self._full, "sample": self._sample, "xor": self._xor}
        self.compute: Callable[[torch.Tensor], torch.Tensor] | None = fn.get(mode)

    def table(self, device: torch.device) -> torch.Tensor:
        t = self._tables.get(device)
        if t is None:
            if self._table_cpu is None:
                self._table_cpu = _splitmix_table(TABLE_SEED, TABLE_LEN)
            t = self._table_cpu.to(device)
            self._tables[device] = t
        return t

    def block(self, q: int) -> int:
        if q >= len(self._blocks):
            self._blocks = [0, *splitmix64(BLOCK_SEED, q + 1)]
        return signed(self._blocks[q])

    @staticmethod
    def elements(t: torch.Tensor) -> torch.Tensor:
        """The tensor as a same-shaped tensor of fixed-width signed integers (a view, never a copy)."""
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.dtype == torch.bool:
            t = t.view(torch.int8)
        return t.view(_INT_OF_SIZE[t.element_size()])

    @staticmethod
    def count(t: torch.Tensor) -> int:
        return t.numel() * (2 if t.is_complex() else 1)

    def scratch(self, device: torch.device, dtype: torch.dtype, slot: int, n: int) -> torch.Tensor:
        """A reusable 1-D work buffer of ``n`` <= TABLE_LEN elements: no allocation (and, on CPU, no
        fresh zero pages) per tensor; small (cache-resident), bounded extra memory per device. Safe
        to reuse because the work on a device is ordered (CPU: synchronous; CUDA: current stream)."""
        key = (device, dtype, slot)
        buf = self._scratch.get(key)
        if buf is None:
            buf = torch.empty(TABLE_LEN, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:n]

    def _mix_sum(self, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``S`` over ``v`` (<= TABLE_LEN elements, any layout) with weights ``w`` (1-D, logical order)."""
        n = v.numel()
        x = self.scratch(v.device, torch.int64, 0, n)
        y = self.scratch(v.device, torch.int64, 1, n)
        x.view(v.shape).copy_(v)  # sign-extends, and puts the elements in logical (row-major) order
        x.bitwise_xor_(w)
        x.mul_(signed(GOLDEN))
        torch.bitwise_right_shift(x, 32, out=y)
        x.bitwise_xor_(y)
        return x.sum()

    @staticmethod
    def words(t: torch.Tensor) -> torch.Tensor:
        """The tensor's logical element sequence as little-endian 64-bit words (1-D int64): a view
        for contiguous data whose size is a multiple of 8 bytes; otherwise one copy (non-contiguous
        data) and/or a zero-padded last word."""
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        size = t.element_size()
        ratio = 8 // size
        flat = t.reshape(-1)  # a view when the data is contiguous, else a copy in logical order
        if not flat.is_contiguous() or (flat.numel() and flat.stride(0) != 1):
            # flattened without a copy, elements apart (x[:, 0], a diagonal); or one element with a
            # stride other than 1 (z[:1, 0], jacrev's basis of a scalar output): "contiguous", yet
            # .view(int64) wants stride 1 (and .contiguous(), .clone() keep that stride)
            flat = flat.clone(memory_format=torch.contiguous_format)
        n = flat.numel()
        if ratio == 1:
            return flat if flat.dtype == torch.int64 else flat.view(torch.int64)
        if flat.storage_offset() % ratio:
            flat = flat.clone()
        full = n - n % ratio
        if full == n:
            return flat.view(torch.int64)
        head = flat[:full].view(torch.int64)
        tail = flat[full:].view(torch.uint8)
        pad = torch.zeros(8 - tail.numel(), dtype=torch.uint8, device=t.device)
        return torch.cat([head, torch.cat([tail, pad]).view(torch.int64)])

    def _prefix(self, device: torch.device, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, work buffer x, work buffer y) of length ``m`` <= TABLE_LEN: views cached per
        length, so a tensor costs no slicing dispatches (shapes repeat every step)."""
        key = (device, m)
        hit = self._prefixes.get(key)
        if hit is None:
            if len(self._prefixes) >= PREFIX_ENTRIES:
                self._prefixes.clear()
            hit = (self.table(device)[:m], self.scratch(device, torch.int64, 0, m),
                   self.scratch(device, torch.int64, 1, m))
            self._prefixes[key] = hit
        return hit

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        words = self.words(t)
        m = words.numel()
        if m <= TABLE_LEN:
            w, x, y = self._prefix(words.device, m)
            torch.bitwise_xor(words, w, out=x)
            x.mul_(signed(GOLDEN))
            torch.bitwise_right_shift(x, 32, out=y)
            x.bitwise_xor_(y)
            return x.sum()
        parts = []
        for q, start in enumerate(range(0, m, TABLE_LEN)):
            chunk = words[start:start + TABLE_LEN]
            w, x, y = self._prefix(words.device, chunk.numel())
            torch.bitwise_xor(chunk, w, out=x)
            if q:
                x.bitwise_xor_(self.block(q))  # the block constant: (u ^ t ^ b), no weight copy
            x.mul_(signed(GOLDEN))
            torch.bitwise_right_shift(x, 32, out=y)
            x.bitwise_xor_(y)
            parts.append(x.sum())
        return torch.stack(parts).sum()

    def _sample(self, t: torch.Tensor) -> torch.Tensor:
        v = self.elements(t)
        n = v.numel()
        if n <= SAMPLE:
            return self._mix_sum(v, self.table(v.device)[:n])
        key = (n, v.device)
        cached = self._samples.get(key)
        if cached is None:
            idx = torch.arange(SAMPLE, dtype=torch.int64) * n // SAMPLE
            table = self.table(torch.device("cpu"))
            w = table[idx % TABLE_LEN] ^ torch.tensor([self.block(int(q)) for q in (idx // TABLE_LEN).tolist()],
                                                      dtype=torch.int64)
            cached = (idx.to(v.device), w.to(v.device))
            self._samples[key] = cached
        idx, w = cached
        return self._mix_sum(torch.take(v, idx), w)

    @staticmethod
    def _xor(t: torch.Tensor) -> torch.Tensor:
        if t.is_conj() or t.is_neg():  # view_as_real refuses a lazily conjugated tensor
            t = t.resolve_conj().resolve_neg()
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        if t.numel() == 0:  # torch.hash_tensor raises on no element; 0 as the full digest gives
            return torch.zeros((), dtype=torch.int64, device=t.device)
        return torch.hash_tensor(t).view(torch.int64)


STAT_FIELDS = ("min", "max", "sum", "norm", "nonfinite", "inf")


_zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    z = _zeros.get((dtype, device))
    if z is None:
        z = _zeros[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
    return z


def stats_row(t: torch.Tensor) -> torch.Tensor:
    """Six values on the device: min, max, sum, 2-norm, non-finite count, Inf count (float32 for
    float32 data of < 2**24 elements, where every value is exact in float32; float64 otherwise).

    Only vectorised float passes (no boolean tensors, which are slow to reduce on CPU): the
    non-finite count is the sum of ``nan_to_num(x - x, nan=1)`` (x - x is NaN exactly for NaN and
    ±Inf), the Inf count the same over ``nan_to_num(x, nan=0)`` (NaN removed, ±Inf kept).
    """
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    x = torch.view_as_real(t) if t.is_complex() else t
    if x.is_floating_point() and x.element_size() == 1:
        x = x.to(torch.float32)  # float8 variants: no reductions of their own; every value is exact in float32
    if x.is_floating_point():
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        mn, mx = torch.aminmax(x)
        s = x.sum(dtype=acc)
        q = torch.linalg.vector_norm(x, dtype=acc)
        cnt = torch.float32 if x.numel() < EXACT_F32 else torch.float64  # sums of ones stay exact
        # one stack in a dtype that holds every value exactly; the host squares the norm
        common = torch.float64 if torch.float64 in (acc, cnt) else x.dtype if x.dtype == torch.float32 else None
        if x.device.type == "cpu" and math.isfinite(s.item()):
            # host memory: reading the sum costs no synchronisation. A finite sum proves there is
            # no NaN and no ±Inf element (either would make it NaN/Inf), so the counting passes
            # are skipped; on accelerators they always run on the device (no host sync).
            if common is not None and mn.dtype == common:
                z = _zero(common, x.device)
                return torch.stack([mn, mx, s if s.dtype == common else s.to(common),
                                    q if q.dtype == common else q.to(common), z, z])
            nonfinite = inf = _zero(cnt, x.device)
        else:
            nonfinite = torch.nan_to_num_(x - x, nan=1.0).sum(dtype=cnt)
            kept = torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)
            inf = torch.nan_to_num_(kept - kept, nan=1.0).sum(dtype=cnt)
        row = torch.float64 if common is None else common
        vals = [v if v.dtype == row else v.to(row) for v in (mn, mx, s, q, nonfinite, inf)]
        return torch.stack(vals)
    xd = x.to(torch.float64)
    mn, mx = torch.aminmax(xd)
    zero = _zero(torch.float64, x.device)
    return torch.stack([mn, mx, xd.sum(), torch.linalg.vector_norm(xd), zero, zero])


def finish_stats(row: list[float], n: int) -> dict[str, float | int]:
    """Host side: mean, std (n-1), absmax from the fetched row (min, max, sum, 2-norm, counts)."""
    mn, mx, s, norm, nonfinite, inf = row
    return finish_moments(mn, mx, s, norm * norm, int(nonfinite), int(inf), n)


def finish_moments(mn: float, mx: float, s: float, q: float, nonfinite: int, inf: int,
                   n: int) -> dict[str, float | int]:
    """mean, std (n-1), absmax from min, max, sum, sum of squares ``q`` and the counts."""
    nan = nonfinite - inf
    mean = s / n
    if n > 1:
        var = (q - s * s / n) / (n - 1)
        std = max(var, 0.0) ** 0.5 if var == var else float("nan")
    else:
        std = 0.0 if s == s else float("nan")
    absmax = max(abs(mn), abs(mx)) if (mn == mn and mx == mx) else float("nan")
    return {"min": mn, "max": mx, "mean": mean, "std": std, "absmax": absmax, "nan": int(nan), "inf": int(inf)}
