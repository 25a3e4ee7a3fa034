/* One pass over a weight tensor's bytes for what the transports do with them (services/common/checksum.py).
 *
 * copy_sum(dst, src)              -> (s1, s2): the word sums of src's bytes, copied into dst
 * copy_sum_nonfinite(dst, src, k) -> (s1, s2, whether any element is inf or NaN), src copied into dst;
 *                                    k: the element type, 8 float64, 4 float32, 2 bfloat16, -2 float16
 * sum_nonfinite(src, k)           -> the same, reading src only
 *
 * The word sums of the bytes read as little-endian u64 words w_0..w_{N-1} (the last partial word
 * zero-padded), all mod 2^64: s1 = sum of w_i, s2 = sum of (N - i) * w_i, what `s1 += w; s2 += s1` over the
 * words in order gives (Fletcher's second sum: it depends on each word's place); the same values as
 * checksum.py's torch path. Each word is loaded once, stored, added and tested in registers, so the copy
 * costs what a copy costs (the checks ride along) instead of a copy and one or two more reads of the landed
 * bytes. Independent lanes keep the adds off one dependency chain; a run of lanes is folded into the running
 * sums with the chaining rule (`chain_run`). The GIL is released while the loop runs. Buffers may be
 * unaligned (loads and stores go through memcpy, which compilers turn into plain moves).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Copies at least this large store around the cache (non-temporal stores): a copy's destination is read
 * again only much later (a parameter at the next forward, a segment after a whole bucket), and a store
 * that first reads its line doubles the traffic. Two such copies at once (the trainer's and the replica's)
 * measured 63 ms each with ordinary stores and 30 ms each with these, for 575 MiB on the 2-core machines. */
#define STREAM_BYTES (256 * 1024)

/* Non-finite elements without a compare per element: a lane's exponent e (all ones means inf or NaN), shifted
 * down to the bottom of its lane and masked, plus one, sets the bit just above the exponent only when e is all
 * ones. OR-ing those values over every word keeps that bit if any element had it (no carries cross words),
 * and the loop stays shifts, ands and adds that compilers vectorise with plain SSE2. */
typedef struct {
    int shift;      /* bits from a lane's start to its exponent */
    uint64_t field; /* the exponent's width of ones at the bottom of every lane */
    uint64_t one;   /* 1 at the bottom of every lane */
    int width;      /* exponent bits */
} Layout;

static const Layout F64 = {52, 0x7ffULL, 1ULL, 11};
static const Layout F32 = {23, 0x000000ff000000ffULL, 0x0000000100000001ULL, 8};
static const Layout BF16 = {7, 0x00ff00ff00ff00ffULL, 0x0001000100010001ULL, 8};
static const Layout F16 = {10, 0x001f001f001f001fULL, 0x0001000100010001ULL, 5};

typedef struct {
    uint64_t s1, s2;
} Sums;

/* Appends a run of m words whose own sums are t1, t2 to the sums of the words before it. */
static inline void chain_run(Sums *s, uint64_t t1, uint64_t t2, uint64_t m) {
    s->s2 += m * s->s1 + t2;
    s->s1 += t1;
}

static inline void add_word(Sums *s, uint64_t w) {
    s->s1 += w;
    s->s2 += s->s1;
}

static inline __attribute__((always_inline)) Sums run_layout(
        unsigned char *dst, const unsigned char *src, Py_ssize_t n, const int check, const Layout L, int *nonfinite) {
    Sums s = {0, 0};
    uint64_t f0 = 0, f1 = 0;
    Py_ssize_t words = n / 8, i = 0;
#ifdef __SSE2__
    if (!dst || (n >= STREAM_BYTES && (uintptr_t)dst % 8 == 0)) {
        /* Word-sized steps up to a 16-byte aligned destination, then streaming stores 32 bytes at a time; the
         * words keep their places relative to the buffer's start, so the sum is the same. Reading only: the
         * same loop without stores. */
        for (; dst && i < words && (uintptr_t)(dst + 8 * i) % 16; i++) {
            uint64_t a;
            memcpy(&a, src + 8 * i, 8);
            memcpy(dst + 8 * i, &a, 8);
            add_word(&s, a);
            if (check) f0 |= ((a >> L.shift) & L.field) + L.one;
        }
        /* Four lanes: sa holds words 4k and 4k+1, sb 4k+2 and 4k+3; ta, tb their running second sums. */
        const Py_ssize_t first = i;
        __m128i sa = _mm_setzero_si128(), sb = sa, ta = sa, tb = sa, fa = sa, fb = sa;
        const __m128i field = _mm_set1_epi64x((long long)L.field), one = _mm_set1_epi64x((long long)L.one);
        for (; i + 4 <= words; i += 4) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 8 * i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 8 * i + 16));
            if (dst) {
                _mm_stream_si128((__m128i *)(dst + 8 * i), a);
                _mm_stream_si128((__m128i *)(dst + 8 * i + 16), b);
            }
            sa = _mm_add_epi64(sa, a);
            sb = _mm_add_epi64(sb, b);
            ta = _mm_add_epi64(ta, sa);
            tb = _mm_add_epi64(tb, sb);
            if (check) {
                fa = _mm_or_si128(fa, _mm_add_epi64(_mm_and_si128(_mm_srli_epi64(a, L.shift), field), one));
                fb = _mm_or_si128(fb, _mm_add_epi64(_mm_and_si128(_mm_srli_epi64(b, L.shift), field), one));
            }
        }
        _mm_sfence(); /* the streamed stores are visible before the caller says the copy is done */
        /* Over K rounds lane l's word of round k sits at 4k + l of the run's 4K words: its weight 4K - 4k - l is
         * 4 times its lane weight K - k, less l; so the run's second sum is the sum of 4 t_l - l s_l. */
        uint64_t s1l[4], s2l[4];
        _mm_storeu_si128((__m128i *)s1l, sa);
        _mm_storeu_si128((__m128i *)(s1l + 2), sb);
        _mm_storeu_si128((__m128i *)s2l, ta);
        _mm_storeu_si128((__m128i *)(s2l + 2), tb);
        chain_run(&s, s1l[0] + s1l[1] + s1l[2] + s1l[3],
                  4 * (s2l[0] + s2l[1] + s2l[2] + s2l[3]) - s1l[1] - 2 * s1l[2] - 3 * s1l[3], (uint64_t)(i - first));
        uint64_t lanes[2];
        _mm_storeu_si128((__m128i *)lanes, _mm_or_si128(fa, fb));
        f1 |= lanes[0] | lanes[1];
    }
#endif
    /* Two lanes (even and odd words of the run): the run's second sum is 2 (ta + tb) - sb. */
    const Py_ssize_t pairs_from = i;
    uint64_t sa = 0, sb = 0, ta = 0, tb = 0;
    for (; i + 2 <= words; i += 2) {
        uint64_t a, b;
        memcpy(&a, src + 8 * i, 8);
        memcpy(&b, src + 8 * i + 8, 8);
        if (dst) {
            memcpy(dst + 8 * i, &a, 8);
            memcpy(dst + 8 * i + 8, &b, 8);
        }
        sa += a;
        sb += b;
        ta += sa;
        tb += sb;
        if (check) {
            f0 |= ((a >> L.shift) & L.field) + L.one;
            f1 |= ((b >> L.shift) & L.field) + L.one;
        }
    }
    chain_run(&s, sa + sb, 2 * (ta + tb) - sb, (uint64_t)(i - pairs_from));
    Py_ssize_t done = 8 * i;
    if (done < n) {
        /* The rest holds whole elements (element sizes divide n); zero padding is finite for every layout. */
        for (; done < n; done += 8) {
            uint64_t a = 0;
            size_t k = (size_t)(n - done < 8 ? n - done : 8);
            memcpy(&a, src + done, k);
            if (dst) memcpy(dst + done, src + done, k);
            add_word(&s, a);
            if (check) f0 |= ((a >> L.shift) & L.field) + L.one;
        }
    }
    if (check) *nonfinite = ((f0 | f1) & (L.one << L.width)) != 0;
    return s;
}

/* kind: 0 (bytes, no check), 8 (float64), 4 (float32), 2 (bfloat16), -2 (float16). dst may be NULL (read only). */
static Sums run(unsigned char *dst, const unsigned char *src, Py_ssize_t n, int kind, int *nonfinite) {
    switch (kind) {
        case 8: return run_layout(dst, src, n, 1, F64, nonfinite);
        case 4: return run_layout(dst, src, n, 1, F32, nonfinite);
        case 2: return run_layout(dst, src, n, 1, BF16, nonfinite);
        case -2: return run_layout(dst, src, n, 1, F16, nonfinite);
        default: return run_layout(dst, src, n, 0, F32, nonfinite);
    }
}

static int check_kind(int kind) {
    if (kind == 0 || kind == 8 || kind == 4 || kind == 2 || kind == -2) return 1;
    PyErr_Format(PyExc_ValueError, "element kind %d is not one of 8, 4, 2 (bfloat16), -2 (float16)", kind);
    return 0;
}

static PyObject *copy_impl(PyObject *args, int with_kind) {
    PyObject *dst_obj, *src_obj;
    int kind = 0;
    if (with_kind ? !PyArg_ParseTuple(args, "OOi", &dst_obj, &src_obj, &kind)
                  : !PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj))
        return NULL;
    if (!check_kind(kind)) return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "cannot copy %zd bytes into %zd", src.len, dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Sums sum;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    sum = run((unsigned char *)dst.buf, (const unsigned char *)src.buf, src.len, kind, &bad);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (!with_kind) return Py_BuildValue("(KK)", (unsigned long long)sum.s1, (unsigned long long)sum.s2);
    return Py_BuildValue("(KKO)", (unsigned long long)sum.s1, (unsigned long long)sum.s2, bad ? Py_True : Py_False);
}

static PyObject *copy_sum(PyObject *self, PyObject *args) { return copy_impl(args, 0); }

static PyObject *copy_sum_nonfinite(PyObject *self, PyObject *args) { return copy_impl(args, 1); }

static PyObject *sum_nonfinite(PyObject *self, PyObject *args) {
    PyObject *src_obj;
    int kind;
    if (!PyArg_ParseTuple(args, "Oi", &src_obj, &kind)) return NULL;
    if (!check_kind(kind)) return NULL;
    Py_buffer src;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Sums sum;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    sum = run(NULL, (const unsigned char *)src.buf, src.len, kind, &bad);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return Py_BuildValue("(KKO)", (unsigned long long)sum.s1, (unsigned long long)sum.s2, bad ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"copy_sum", copy_sum, METH_VARARGS, "copy_sum(dst, src) -> (s1, s2): word sums of src, copied into dst"},
    {"copy_sum_nonfinite", copy_sum_nonfinite, METH_VARARGS,
     "copy_sum_nonfinite(dst, src, kind) -> (s1, s2, any inf or NaN), src copied into dst"},
    {"sum_nonfinite", sum_nonfinite, METH_VARARGS, "sum_nonfinite(src, kind) -> (s1, s2, any inf or NaN)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wordcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wordcopy(void) { return PyModule_Create(&module); }
