/*
 * opguard.capture._hostkernel: the digest sum and the statistics of a contiguous host (CPU)
 * tensor in one pass over its bytes (docs/capture.md §5.2).
 *
 * summary(addr, nbytes, code, digest, stats) -> (S or None, (min, max, sum, sumsq, nonfinite, inf) or None)
 *
 *   addr, nbytes   the tensor's data: nbytes readable bytes at addr (a contiguous CPU tensor's
 *                  data_ptr() and numel() * element_size(); the caller keeps the tensor alive)
 *   code           element type for the statistics (CODE_* below; -1 with stats false: bytes only)
 *   digest         compute S of mix64-v1 (docs/capture.md §5.1) over the bytes, as an unsigned int
 *   stats          compute the statistics row over the elements
 *
 * strided(addr, itemsize, shape, stride, code, digest, stats) -> summary()'s result, or None
 *
 *   the same values over the logical element sequence (row-major order of shape) of a strided
 *   tensor whose element (i0, i1, ...) is at addr + (i0*stride0 + i1*stride1 + ...) * itemsize
 *   (strides in elements, >= 0), gathered piecewise (no copy of the whole tensor); None when the
 *   statistics' sum is not finite (the caller then summarises a contiguous copy with summary()).
 *
 * entry(addr, n, code, stats) -> (digest hex, statistics dict | row | None)
 *
 *   the finished entry values of a new contiguous tensor of n elements of element type code (the
 *   common case of capture's tensor entries, one call): the printed digest fmix64(S ^ fmix64(n)) as
 *   16 lowercase hex digits, and with stats the JSON statistics {"min", "max", "mean", "std",
 *   "absmax", "nan", "inf"} computed exactly as the host's all-finite formula (docs/capture.md
 *   §3.3); when an element is not finite or mean/std overflow, the raw row of summary() instead,
 *   for the host's general formula.
 *
 * The values are exactly those of the definition, whatever the instruction set: the loops work
 * lane-wise on explicit 8-lane vectors (GCC vector extensions) in a fixed order, floating-point
 * contraction is off (-ffp-contract=off in setup.py), and every target clone runs the same
 * operations. Sums of floats accumulate in float64, in 8 lanes (element i in lane i mod 8 of its
 * group), reduced lane 0..7 at the end.
 *
 * No Python object is touched while the GIL is released (tensors of 1 MiB and more).
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define TABLE_BITS 16
#define TABLE_LEN ((size_t)1 << TABLE_BITS)
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define TABLE_SEED 0x6F70677561726431ULL
#define BLOCK_SEED 0x6F70677561726432ULL
#define NOGIL_BYTES ((size_t)1 << 20)

enum {
    CODE_F32 = 0, CODE_F64 = 1, CODE_F16 = 2, CODE_BF16 = 3, CODE_I8 = 4, CODE_U8 = 5,
    CODE_I16 = 6, CODE_I32 = 7, CODE_I64 = 8,
};

#if !defined(OPGUARD_NO_CLONES) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__GLIBC__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

typedef uint64_t v8u __attribute__((vector_size(64)));
typedef int64_t v8i __attribute__((vector_size(64)));
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef int16_t v8i16 __attribute__((vector_size(16)));
typedef int8_t v8i8 __attribute__((vector_size(8)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));

static uint64_t table[TABLE_LEN];

static uint64_t splitmix_output(uint64_t seed, uint64_t k) {
    /* output k (from 0) of splitmix64 seeded with seed */
    uint64_t z = seed + (k + 1) * GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint64_t block_constant(uint64_t q) { return q ? splitmix_output(BLOCK_SEED, q - 1) : 0; }

/* ---- element loads: 8 elements at p as float64 lanes (exact conversions) --------------------- */
INLINE v8d load_f64(const uint8_t *p) { v8d d; memcpy(&d, p, 64); return d; }
INLINE v8d load_f32(const uint8_t *p) { v8f f; memcpy(&f, p, 32); return __builtin_convertvector(f, v8d); }
INLINE v8d load_bf16(const uint8_t *p) {
    v8u16 h; memcpy(&h, p, 16);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;
    v8f f; memcpy(&f, &w, 32);
    return __builtin_convertvector(f, v8d);
}
INLINE v8d load_f16(const uint8_t *p) {
    /* IEEE binary16 -> binary32, exact for every input (F. Giesen's half_to_float_fast5 scheme,
       lane-wise): exponent rebias, Inf/NaN widened, subnormals renormalised by one subtraction */
    v8u16 h; memcpy(&h, p, 16);
    v8u32 x = __builtin_convertvector(h, v8u32);
    v8u32 o = (x & 0x7fffu) << 13;
    v8u32 e = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    v8u32 infnan = (v8u32)(e == 0x0f800000u);
    o += infnan & ((uint32_t)(128 - 16) << 23);
    v8u32 sub = (v8u32)(e == 0u);
    v8u32 os = o + (1u << 23);
    v8f fs; memcpy(&fs, &os, 32);
    v8f magic = {0};
    uint32_t mbits = 113u << 23; float mf; memcpy(&mf, &mbits, 4);
    magic += mf;
    fs -= magic;
    v8u32 us; memcpy(&us, &fs, 32);
    o = (us & sub) | (o & ~sub);
    o |= (x & 0x8000u) << 16;
    v8f f; memcpy(&f, &o, 32);
    return __builtin_convertvector(f, v8d);
}
INLINE v8d load_i8(const uint8_t *p) { v8i8 v; memcpy(&v, p, 8); return __builtin_convertvector(v, v8d); }
INLINE v8d load_u8(const uint8_t *p) { v8u8 v; memcpy(&v, p, 8); return __builtin_convertvector(v, v8d); }
INLINE v8d load_i16(const uint8_t *p) { v8i16 v; memcpy(&v, p, 16); return __builtin_convertvector(v, v8d); }
INLINE v8d load_i32(const uint8_t *p) { v8i32 v; memcpy(&v, p, 32); return __builtin_convertvector(v, v8d); }
INLINE v8d load_i64(const uint8_t *p) { v8i v; memcpy(&v, p, 64); return __builtin_convertvector(v, v8d); }

/* ---- accumulators -------------------------------------------------------------------------- */
typedef struct {
    v8u s;             /* digest sum lanes (mod 2^64) */
    v8d sum, sq, mn, mx;
} acc_t;

typedef struct {
    uint64_t s;
    double mn, mx, sum, sq;
    uint64_t nonfinite, inf;
} result_t;

INLINE v8d blend(v8i mask, v8d a, v8d b) {
    /* a where mask is all ones, else b */
    v8i ia, ib; memcpy(&ia, &a, 64); memcpy(&ib, &b, 64);
    v8i r = (ia & mask) | (ib & ~mask);
    v8d d; memcpy(&d, &r, 64); return d;
}

INLINE void stats8(acc_t *a, v8d d) {
    a->sum += d;
    a->sq += d * d;
    a->mn = blend((v8i)(d < a->mn), d, a->mn);  /* NaN never wins: counted separately */
    a->mx = blend((v8i)(d > a->mx), d, a->mx);
}

INLINE void digest8(acc_t *a, const uint8_t *p, const uint64_t *w, uint64_t c) {
    v8u u, t; memcpy(&u, p, 64); memcpy(&t, w, 64);
    v8u x = (u ^ t ^ c) * GOLDEN;
    a->s += x ^ (v8u)((v8i)x >> 32);
}

static uint64_t digest_word(uint64_t u, uint64_t i) {
    uint64_t x = (u ^ table[i & (TABLE_LEN - 1)] ^ block_constant(i >> TABLE_BITS)) * GOLDEN;
    return x ^ (uint64_t)((int64_t)x >> 32);
}

static double scalar_load(const uint8_t *p, int code) {
    /* one element as float64, through the same lane load (the rest of the group is zero) */
    uint8_t buf[64] = {0};
    size_t size = code == CODE_F64 || code == CODE_I64 ? 8 : code == CODE_F32 || code == CODE_I32 ? 4
                : code == CODE_I8 || code == CODE_U8 ? 1 : 2;
    memcpy(buf, p, size);
    v8d d;
    switch (code) {
    case CODE_F64: d = load_f64(buf); break;
    case CODE_F32: d = load_f32(buf); break;
    case CODE_F16: d = load_f16(buf); break;
    case CODE_BF16: d = load_bf16(buf); break;
    case CODE_I8: d = load_i8(buf); break;
    case CODE_U8: d = load_u8(buf); break;
    case CODE_I16: d = load_i16(buf); break;
    case CODE_I32: d = load_i32(buf); break;
    default: d = load_i64(buf); break;
    }
    return d[0];
}

static size_t itemsize(int code) {
    switch (code) {
    case CODE_F64: case CODE_I64: return 8;
    case CODE_F32: case CODE_I32: return 4;
    case CODE_F16: case CODE_BF16: case CODE_I16: return 2;
    default: return 1;
    }
}

/* The fused pass: for every 64-byte chunk, the digest of its 8 words and the statistics of its
 * 64/size elements (in groups of 8). c0 is the chunk's index in the whole byte sequence (0 for a
 * contiguous tensor; the strided path feeds its gathered pieces with their running offset): it
 * selects the table words and the block constant. DIG and STS are constants in every instantiation. */
#define BODY(LOAD, SIZE, DIG, STS)                                                              \
    do {                                                                                        \
        size_t chunks = nbytes / 64;                                                            \
        acc_t l = *a; /* in registers: stores through a could alias the bytes read (uint8_t) */  \
        size_t k = 0;                                                                           \
        while (k < chunks) {                                                                    \
            size_t g = c0 + k, off = g % (TABLE_LEN / 8);                                       \
            size_t m = TABLE_LEN / 8 - off < chunks - k ? TABLE_LEN / 8 - off : chunks - k;     \
            uint64_t c = block_constant(g / (TABLE_LEN / 8));                                   \
            const uint64_t *w = table + off * 8;                                                \
            const uint8_t *base = p + k * 64;                                                   \
            for (size_t j = 0; j < m; j++) {                                                    \
                const uint8_t *q = base + j * 64;                                               \
                if (DIG) digest8(&l, q, w + j * 8, c);                                          \
                if (STS) {                                                                      \
                    for (size_t e = 0; e < 64 / (8 * (SIZE)); e++)                              \
                        stats8(&l, LOAD(q + e * 8 * (SIZE)));                                   \
                }                                                                               \
            }                                                                                   \
            k += m;                                                                             \
        }                                                                                       \
        *a = l;                                                                                 \
    } while (0)

#define KERNEL(NAME, LOAD, SIZE)                                                                \
    CLONES static void NAME##_both(const uint8_t *p, size_t nbytes, acc_t *a, size_t c0) { BODY(LOAD, SIZE, 1, 1); } \
    CLONES static void NAME##_stats(const uint8_t *p, size_t nbytes, acc_t *a, size_t c0) { BODY(LOAD, SIZE, 0, 1); }

KERNEL(f64, load_f64, 8)
KERNEL(f32, load_f32, 4)
KERNEL(f16, load_f16, 2)
KERNEL(bf16, load_bf16, 2)
KERNEL(i8, load_i8, 1)
KERNEL(u8, load_u8, 1)
KERNEL(i16, load_i16, 2)
KERNEL(i32, load_i32, 4)
KERNEL(i64, load_i64, 8)

CLONES static void digest_only(const uint8_t *p, size_t nbytes, acc_t *a, size_t c0) { BODY(load_u8, 1, 1, 0); }

typedef void (*kernel_fn)(const uint8_t *, size_t, acc_t *, size_t);

static kernel_fn pick(int code, int dig, int sts) {
    if (!sts) return digest_only;
#define CASE(C, NAME) case C: return dig ? NAME##_both : NAME##_stats;
    switch (code) {
    CASE(CODE_F64, f64) CASE(CODE_F32, f32) CASE(CODE_F16, f16) CASE(CODE_BF16, bf16)
    CASE(CODE_I8, i8) CASE(CODE_U8, u8) CASE(CODE_I16, i16) CASE(CODE_I32, i32) CASE(CODE_I64, i64)
    default: return NULL;
    }
#undef CASE
}

/* Count NaN and ±Inf elements (only run when the sum is not finite: a finite sum proves none). */
static void count_nonfinite(const uint8_t *p, size_t n, int code, uint64_t *nonfinite, uint64_t *inf) {
    size_t size = itemsize(code);
    uint64_t nf = 0, ni = 0;
    for (size_t i = 0; i < n; i++) {
        double d = scalar_load(p + i * size, code);
        if (d != d) nf++;
        else if (isinf(d)) { nf++; ni++; }
    }
    *nonfinite = nf;
    *inf = ni;
}

static void acc_init(acc_t *a) {
    memset(a, 0, sizeof *a);
    for (int i = 0; i < 8; i++) { a->mn[i] = INFINITY; a->mx[i] = -INFINITY; }
}

/* The last rest < 64 bytes of the sequence, which starts at byte offset at (a multiple of 64):
 * zero-padded to whole words for the digest; its elements in the lanes of a full group. */
static void acc_tail(const uint8_t *p, size_t rest, size_t at, int code, int dig, int sts, acc_t *a) {
    if (!rest) return;
    uint8_t buf[64] = {0};
    memcpy(buf, p, rest);
    if (dig) {
        uint64_t s = 0;
        for (size_t j = 0; j < (rest + 7) / 8; j++) {
            uint64_t u; memcpy(&u, buf + j * 8, 8);
            s += digest_word(u, at / 8 + j);
        }
        a->s[0] += s;
    }
    if (sts) {
        size_t size = itemsize(code);
        for (size_t j = 0; j < rest / size; j++) {
            double d = scalar_load(buf + j * size, code);
            size_t lane = j % 8;  /* the same lane as in a full group */
            a->sum[lane] += d;
            a->sq[lane] += d * d;
            if (d < a->mn[lane]) a->mn[lane] = d;
            if (d > a->mx[lane]) a->mx[lane] = d;
        }
    }
}

static void acc_finish(const acc_t *a, result_t *r) {
    uint64_t s = 0;
    double sum = 0, sq = 0, mn = INFINITY, mx = -INFINITY;
    for (int i = 0; i < 8; i++) {
        s += a->s[i];
        sum += a->sum[i];
        sq += a->sq[i];
        if (a->mn[i] < mn) mn = a->mn[i];
        if (a->mx[i] > mx) mx = a->mx[i];
    }
    r->s = s;
    r->sum = sum;
    r->sq = sq;
    r->mn = mn;
    r->mx = mx;
    r->nonfinite = r->inf = 0;
}

static void run(const uint8_t *p, size_t nbytes, int code, int dig, int sts, result_t *r) {
    acc_t a;
    acc_init(&a);
    size_t body = nbytes - nbytes % 64;
    if (body && (dig || sts)) pick(code, dig, sts)(p, body, &a, 0);
    acc_tail(p + body, nbytes - body, body, code, dig, sts, &a);
    acc_finish(&a, r);
    if (sts && !isfinite(r->sum)) {
        size_t size = itemsize(code);
        count_nonfinite(p, nbytes / size, code, &r->nonfinite, &r->inf);
        if (r->nonfinite > r->inf) { r->mn = NAN; r->mx = NAN; }  /* a NaN element: torch semantics */
    }
}

/* The same pass over a strided tensor's logical element sequence (row-major order of its shape):
 * the elements are gathered into a buffer of GATHER bytes (a multiple of 64, so chunks, groups of
 * 8 elements and table positions are those of the contiguous copy) and each full buffer is fed to
 * the kernel with its running chunk offset. Returns 0, or 1 when the statistics' sum is not finite
 * (the NaN/Inf counts need a second pass over the elements: the caller uses a contiguous copy). */
#define GATHER ((size_t)1 << 14)
#define MAX_DIMS 16

static int run_strided(const uint8_t *p, size_t size, int ndim, const Py_ssize_t *shape, const Py_ssize_t *stride,
                       int code, int dig, int sts, result_t *r) {
    acc_t a;
    acc_init(&a);
    uint8_t buf[GATHER] __attribute__((aligned(64)));
    size_t fill = 0, c0 = 0;
    kernel_fn fn = (dig || sts) ? pick(code, dig, sts) : NULL;
    Py_ssize_t idx[MAX_DIMS] = {0};
    size_t n = 1;
    for (int d = 0; d < ndim; d++) n *= (size_t)shape[d];
    if (n) {
        Py_ssize_t inner = ndim ? shape[ndim - 1] : 1, istride = ndim ? stride[ndim - 1] : 0;
        size_t rows = n / (size_t)inner;
        for (size_t row = 0; row < rows; row++) {
            const uint8_t *src = p;
            for (int d = 0; d < ndim - 1; d++) src += idx[d] * stride[d] * (Py_ssize_t)size;
            Py_ssize_t done = 0;
            while (done < inner) {
                size_t room = (GATHER - fill) / size;
                size_t take = (size_t)(inner - done) < room ? (size_t)(inner - done) : room;
                if (istride == 1) {
                    memcpy(buf + fill, src + done * (Py_ssize_t)size, take * size);
                } else {
                    for (size_t e = 0; e < take; e++)
                        memcpy(buf + fill + e * size, src + (done + (Py_ssize_t)e) * istride * (Py_ssize_t)size, size);
                }
                fill += take * size;
                done += (Py_ssize_t)take;
                if (fill == GATHER) {
                    if (fn) fn(buf, GATHER, &a, c0);
                    c0 += GATHER / 64;
                    fill = 0;
                }
            }
            for (int d = ndim - 2; d >= 0; d--) {  /* the next row index */
                if (++idx[d] < shape[d]) break;
                idx[d] = 0;
            }
        }
    }
    size_t body = fill - fill % 64;
    if (body && fn) fn(buf, body, &a, c0);
    acc_tail(buf + body, fill - body, c0 * 64 + body, code, dig, sts, &a);
    acc_finish(&a, r);
    return sts && !isfinite(r->sum);
}

/* (S or None, (min, max, sum, sumsq, nonfinite, inf) or None): the result of summary() and strided() */
static PyObject *summary_result(const result_t *r, int dig, int sts) {
    PyObject *d = dig ? PyLong_FromUnsignedLongLong(r->s) : (Py_INCREF(Py_None), Py_None);
    if (d == NULL) return NULL;
    PyObject *st;
    if (sts) {
        st = Py_BuildValue("(ddddKK)", r->mn, r->mx, r->sum, r->sq, (unsigned long long)r->nonfinite,
                           (unsigned long long)r->inf);
        if (st == NULL) { Py_DECREF(d); return NULL; }
    } else {
        Py_INCREF(Py_None);
        st = Py_None;
    }
    PyObject *out = PyTuple_New(2);
    if (out == NULL) { Py_DECREF(d); Py_DECREF(st); return NULL; }
    PyTuple_SetItem(out, 0, d);
    PyTuple_SetItem(out, 1, st);
    return out;
}

static PyObject *summary(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr;
    Py_ssize_t nbytes;
    int code, dig, sts;
    if (!PyArg_ParseTuple(args, "Knipp", &addr, &nbytes, &code, &dig, &sts)) return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    if (sts && (pick(code, 1, 1) == NULL || (size_t)nbytes % itemsize(code))) {
        PyErr_Format(PyExc_ValueError, "unsupported element code %d for %zd bytes", code, nbytes);
        return NULL;
    }
    if (nbytes && !addr) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return NULL;
    }
    result_t r;
    const uint8_t *p = (const uint8_t *)(uintptr_t)addr;
    if ((size_t)nbytes >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        run(p, (size_t)nbytes, code, dig, sts, &r);
        Py_END_ALLOW_THREADS
    } else {
        run(p, (size_t)nbytes, code, dig, sts, &r);
    }
    return summary_result(&r, dig, sts);
}

static int dims(PyObject *seq, Py_ssize_t *out, const char *what) {
    if (!PyTuple_Check(seq) || PyTuple_Size(seq) > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s must be a tuple of at most %d ints", what, MAX_DIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_Size(seq); i++) {
        out[i] = PyLong_AsSsize_t(PyTuple_GetItem(seq, i));
        if (out[i] == -1 && PyErr_Occurred()) return -1;
        if (out[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s must not hold negative values", what);
            return -1;
        }
    }
    return (int)PyTuple_Size(seq);
}

static PyObject *strided(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr;
    Py_ssize_t size;
    PyObject *shape_o, *stride_o;
    int code, dig, sts;
    if (!PyArg_ParseTuple(args, "KnO!O!ipp", &addr, &size, &PyTuple_Type, &shape_o, &PyTuple_Type, &stride_o,
                          &code, &dig, &sts)) return NULL;
    Py_ssize_t shape[MAX_DIMS], stride[MAX_DIMS];
    int nd = dims(shape_o, shape, "shape");
    if (nd < 0) return NULL;
    int ns = dims(stride_o, stride, "stride");
    if (ns < 0) return NULL;
    if (nd != ns || size <= 0 || size > 8 || (sts && (pick(code, 1, 1) == NULL || (size_t)size != itemsize(code)))) {
        PyErr_Format(PyExc_ValueError, "strided needs shape and stride of one length and an element size "
                     "matching the code (%d dims, %d strides, size %zd, code %d)", nd, ns, size, code);
        return NULL;
    }
    size_t n = 1;
    for (int d = 0; d < nd; d++) n *= (size_t)shape[d];
    if (n && !addr) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return NULL;
    }
    result_t r;
    int nonfinite;
    const uint8_t *p = (const uint8_t *)(uintptr_t)addr;
    if (n * (size_t)size >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        nonfinite = run_strided(p, (size_t)size, nd, shape, stride, code, dig, sts, &r);
        Py_END_ALLOW_THREADS
    } else {
        nonfinite = run_strided(p, (size_t)size, nd, shape, stride, code, dig, sts, &r);
    }
    if (nonfinite) Py_RETURN_NONE;
    return summary_result(&r, dig, sts);
}

static uint64_t fmix64(uint64_t z) {
    z ^= z >> 33;
    z *= 0xFF51AFD7ED558CCDULL;
    z ^= z >> 33;
    z *= 0xC4CEB9FE1A85EC53ULL;
    z ^= z >> 33;
    return z;
}

static PyObject *k_min, *k_max, *k_mean, *k_std, *k_absmax, *k_nan, *k_inf, *zero;

static int put(PyObject *d, PyObject *key, PyObject *v) {
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(d, key, v);
    Py_DECREF(v);
    return rc;
}

static PyObject *entry(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr;
    Py_ssize_t n;
    int code, sts;
    if (!PyArg_ParseTuple(args, "Knip", &addr, &n, &code, &sts)) return NULL;
    if (n <= 0 || pick(code, 1, 1) == NULL) {
        PyErr_Format(PyExc_ValueError, "entry needs n > 0 and a known element code (n %zd, code %d)", n, code);
        return NULL;
    }
    if (!addr) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return NULL;
    }
    size_t nbytes = (size_t)n * itemsize(code);
    result_t r;
    const uint8_t *p = (const uint8_t *)(uintptr_t)addr;
    if (nbytes >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        run(p, nbytes, code, 1, sts, &r);
        Py_END_ALLOW_THREADS
    } else {
        run(p, nbytes, code, 1, sts, &r);
    }
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fmix64(r.s ^ fmix64((uint64_t)n)));
    PyObject *h = PyUnicode_FromStringAndSize(hex, 16);
    if (h == NULL) return NULL;
    PyObject *st = NULL;
    if (sts) {
        double mean = r.sum / (double)n, std = 0.0;
        if (n > 1) {
            double var = (r.sq - r.sum * r.sum / (double)n) / (double)(n - 1);
            std = var > 0.0 ? pow(var, 0.5) : 0.0;  /* Python's var ** 0.5 is libm's pow */
        }
        if (r.nonfinite == 0 && isfinite(mean) && isfinite(std)) {
            double amn = fabs(r.mn), amx = fabs(r.mx);
            st = PyDict_New();
            if (st != NULL && (put(st, k_min, PyFloat_FromDouble(r.mn)) < 0 ||
                               put(st, k_max, PyFloat_FromDouble(r.mx)) < 0 ||
                               put(st, k_mean, PyFloat_FromDouble(mean)) < 0 ||
                               put(st, k_std, PyFloat_FromDouble(std)) < 0 ||
                               put(st, k_absmax, PyFloat_FromDouble(amx > amn ? amx : amn)) < 0 ||
                               PyDict_SetItem(st, k_nan, zero) < 0 || PyDict_SetItem(st, k_inf, zero) < 0)) {
                Py_CLEAR(st);
            }
        } else {
            st = Py_BuildValue("(ddddKK)", r.mn, r.mx, r.sum, r.sq, (unsigned long long)r.nonfinite,
                               (unsigned long long)r.inf);
        }
        if (st == NULL) { Py_DECREF(h); return NULL; }
    } else {
        Py_INCREF(Py_None);
        st = Py_None;
    }
    PyObject *out = PyTuple_New(2);
    if (out == NULL) { Py_DECREF(h); Py_DECREF(st); return NULL; }
    PyTuple_SetItem(out, 0, h);
    PyTuple_SetItem(out, 1, st);
    return out;
}

static PyMethodDef methods[] = {
    {"summary", summary, METH_VARARGS,
     "summary(addr, nbytes, code, digest, stats) -> (S | None, (min, max, sum, sumsq, nonfinite, inf) | None)"},
    {"strided", strided, METH_VARARGS,
     "strided(addr, itemsize, shape, stride, code, digest, stats) -> summary()'s result over the logical "
     "element sequence of a strided tensor (strides in elements), or None when the statistics' sum is not finite"},
    {"entry", entry, METH_VARARGS,
     "entry(addr, n, code, stats) -> (digest hex, statistics dict | (min, max, sum, sumsq, nonfinite, inf) | None)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hostkernel",
    "Fused mix64-v1 digest sum and statistics of contiguous host tensors (docs/capture.md §5.2).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostkernel(void) {
    for (size_t j = 0; j < TABLE_LEN; j++) table[j] = splitmix_output(TABLE_SEED, j);
    k_min = PyUnicode_InternFromString("min");
    k_max = PyUnicode_InternFromString("max");
    k_mean = PyUnicode_InternFromString("mean");
    k_std = PyUnicode_InternFromString("std");
    k_absmax = PyUnicode_InternFromString("absmax");
    k_nan = PyUnicode_InternFromString("nan");
    k_inf = PyUnicode_InternFromString("inf");
    zero = PyLong_FromLong(0);
    if (!k_min || !k_max || !k_mean || !k_std || !k_absmax || !k_nan || !k_inf || !zero) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "TABLE_BITS", TABLE_BITS) < 0 ||
        PyModule_AddIntConstant(m, "ABI", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
