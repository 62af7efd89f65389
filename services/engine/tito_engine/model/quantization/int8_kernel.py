"""A C kernel for weight-only int8 linears in float32: y = (x . q^T) * scale (+ bias), the int8
weight widened to float32 in registers (one load of a byte per weight, never a float copy). The
scales are per output channel (int8) or per group of inputs (int4 values held as int8, int4.py).

torch has no fast float32 path for int8 weights on CPU: `_weight_int8pack_mm` vectorizes bfloat16
activations only (measured here, one thread, [1, 896] x [4864, 896]: 21.8 ms in float32 against
0.95 ms in bfloat16), and `_int_mm` quantizes the activations too (a W8A8 scheme, and it needs 17
rows or more). This kernel tiles 4 activation rows (3 on AVX2) by 4 weight rows, so each weight
byte, once widened, feeds several rows. Measured on AMD EPYC (AVX-512, one thread, weights cache-hot): one row
[1, 896] x [4864, 896] 157 us against 383 us for the oneDNN-packed float32 weight (2.4x), 4 rows
408 against 513 us, 32 rows 3.4 against 2.7 ms (compute-bound: the widening costs as much as the
multiply-add); built as an AVX2 machine gets it (`CFLAGS=-mno-avx512f`): one row 175 against 469 us,
32 rows 4.6 against 3.8 ms (5.5 ms with 4-row tiles: AVX2's 16 registers spill them).

It is compiled at first use like the attention kernels (cpu_attention: the machine's `cc` or `$CC`,
-march=native then `$CFLAGS`, cached per source, flags, compiler and CPU) with OpenMP, the runtime
torch already loaded (libgomp), splitting the weight rows over torch's intra-op threads; where
OpenMP cannot be built, without it (one thread). No compiler, or a failed build: None, and the
caller takes torch's path (logged).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from tito_engine.model.cpu_attention import _compile_flags, _compiler, built_library

log = logging.getLogger(__name__)

#: OpenMP for the split over weight rows; the other flags are the attention kernels' (cpu_attention).
EXTRA_FLAGS = ("-fopenmp",)
LINK_FLAGS = ("-shared", "-fopenmp")

SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#else
#define LANES 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vload(const float *p) { return *p; }
static inline vf vload_i8(const int8_t *p) { return (float)*p; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf v) { return v; }
#endif

static inline vf vbroadcast(float v) {
#if defined(__AVX512F__)
    return _mm512_set1_ps(v);
#elif defined(__AVX2__) && defined(__FMA__)
    return _mm256_set1_ps(v);
#else
    return v;
#endif
}

/* Activation rows per tile: with four weight rows, ROWS x 4 accumulators stay in registers (AVX-512
 * has 32 vector registers, AVX2 16: measured at 32 rows, 4 and 3 rows are the fastest tiles there). */
#if LANES == 16
#define ROWS 4
#else
#define ROWS 3
#endif

/* out[i, j] = sum over groups g of scale[j, g] * sum_{k in g} x[i, k] * w[j, k] (+ bias[j]) for MB
 * activation rows by NB weight rows; `group` inputs per scale (K: one scale per row), `groups` = K / group.
 * `prefetch` (the first pass over these weight rows): while reading them, ask for the next NB rows, a
 * cache line at a time. One thread streaming a few short rows at once keeps too few reads in flight
 * for the hardware prefetcher alone (measured: a one-row [1, 896] x [9728, 896] from memory 2.5 -> 1.8 ms). */
#define TILE(MB, NB) TILE_(MB, NB)
#define TILE_(MB, NB) \
static void tile_##MB##x##NB(const float *x, const int8_t *w, int64_t K, int64_t group, const float *scale, \
                             int64_t groups, const float *bias, float *out, int64_t ldo, int prefetch) { \
    vf total[MB][NB]; \
    for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) total[i][j] = vzero(); \
    for (int64_t g = 0; g < groups; g++) { \
        vf acc[MB][NB]; \
        for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) acc[i][j] = vzero(); \
        for (int64_t k = g * group; k < (g + 1) * group; k += LANES) { \
            vf wf[NB]; \
            if (prefetch && (k & 63) == 0) \
                for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(w + (NB + j) * K + k), _MM_HINT_T0); \
            for (int j = 0; j < NB; j++) wf[j] = vload_i8(w + j * K + k); \
            for (int i = 0; i < MB; i++) { \
                vf xv = vload(x + i * K + k); \
                for (int j = 0; j < NB; j++) acc[i][j] = vfma(xv, wf[j], acc[i][j]); \
            } \
        } \
        for (int j = 0; j < NB; j++) { \
            vf s = vbroadcast(scale[j * groups + g]); \
            for (int i = 0; i < MB; i++) total[i][j] = vfma(acc[i][j], s, total[i][j]); \
        } \
    } \
    for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) \
        out[i * ldo + j] = vsum(total[i][j]) + (bias ? bias[j] : 0.0f); \
}
#define TILE_NAME(MB, NB) TILE_NAME_(MB, NB)
#define TILE_NAME_(MB, NB) tile_##MB##x##NB
TILE(ROWS, 4)
TILE(1, 4)
TILE(ROWS, 1)
TILE(1, 1)

/* The K and group sizes the kernel takes are multiples of this (the caller checks). */
int tito_int8_lanes(void) { return LANES; }

static void weight_rows(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t n, int64_t width,
                        int64_t group, const float *scale, const float *bias, float *out, int64_t N) {
    const float *b = bias ? bias + n : 0;
    int64_t groups = K / group;
    const float *s = scale + n * groups;
    int64_t m = 0;
    if (width == 4) {
        for (; m + ROWS <= M; m += ROWS)
            TILE_NAME(ROWS, 4)(x + m * K, w + n * K, K, group, s, groups, b, out + m * N + n, N, m == 0);
        for (; m < M; m++) tile_1x4(x + m * K, w + n * K, K, group, s, groups, b, out + m * N + n, N, m == 0);
    } else {
        for (; m + ROWS <= M; m += ROWS)
            TILE_NAME(ROWS, 1)(x + m * K, w + n * K, K, group, s, groups, b, out + m * N + n, N, 0);
        for (; m < M; m++) tile_1x1(x + m * K, w + n * K, K, group, s, groups, b, out + m * N + n, N, 0);
    }
}

/* out [M, N] = x [M, K] . (w [N, K] * scale [N, K / group] per group)^T (+ bias [N]); rows contiguous.
 * `threads` share the weight rows (each reads its own part of the weight once) when the weight is
 * large enough to be worth waking them. */
void tito_int8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t N, int64_t group,
                          const float *scale, const float *bias, float *out, int threads) {
    int64_t blocks = N / 4;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * K >= (1 << 20))
    for (int64_t block = 0; block < blocks; block++)
        weight_rows(x, M, K, w, block * 4, 4, group, scale, bias, out, N);
    for (int64_t n = blocks * 4; n < N; n++)
        weight_rows(x, M, K, w, n, 1, group, scale, bias, out, N);
}
"""

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Int8Kernel:
    """The loaded kernel: `linear(x, q, scale, bias)` for float32 x [M, K] and int8 q [N, K] with
    scale [N] (per output channel) or [N, K / group] (per group of inputs); K and the group a
    multiple of `lanes`."""

    def __init__(self, function, lanes: int):
        self._function, self.lanes = function, lanes

    def takes(self, in_features: int, group: int | None = None) -> bool:
        return in_features % self.lanes == 0 and (group or in_features) % self.lanes == 0

    def linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
        group = q.shape[1] // (scale.shape[1] if scale.dim() == 2 else 1)
        self._function(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), q.shape[0], group, scale.data_ptr(),
                       bias.data_ptr() if bias is not None else None, out.data_ptr(), torch.get_num_threads())
        return out


@functools.cache
def load_int8_kernel() -> Int8Kernel | None:
    """The compiled kernel, built once per machine and cached; None (logged once) when it cannot be."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, or $CC) found: float32 int8 linears run on torch's slower path")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        try:
            library = built_library("int8_linear", SOURCE, compiler, version, (*_compile_flags(), *EXTRA_FLAGS),
                                    LINK_FLAGS)
        except RuntimeError as exc:  # no OpenMP for this compiler: the kernel runs on one thread
            log.info("the int8 linear kernel is built without OpenMP (%s)", str(exc)[-200:])
            library = built_library("int8_linear", SOURCE, compiler, version, _compile_flags(), ("-shared",))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the int8 linear kernel could not be built or loaded (%s): float32 int8 linears run on "
                    "torch's slower path", exc)
        return None
    function = library.tito_int8_linear_f32
    function.argtypes, function.restype = (_P, _I, _I, _P, _I, _I, _P, _P, _P, ctypes.c_int), None
    library.tito_int8_lanes.restype = ctypes.c_int
    return Int8Kernel(function, library.tito_int8_lanes())
