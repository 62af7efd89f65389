"""A C kernel for the LoRA add of float32 tokens on CPU: y[p] += (x[p] A_s^T) B_s for a list of
token positions p, each with its adapter slot s, in one call per linear (model/lora.py's layout: A
transposed `[slots, in, W]`, B in chunks `[slots, chunks, rank, C]`).

torch's batched matmuls need the tokens gathered into equal groups first (padding the smaller
ones) and their result scattered back, and its small products run far below the machine's rate
(decode on bench/lora.py's model: the add cost 30% of a step over the base model's). This kernel
reads each token's input row and adds into its output row where they lie, takes the tokens in
tiles of up to four of one slot (the positions come sorted by slot), so that each loaded weight
vector feeds four tokens, and keeps the tile's A product (W values a token) on the stack.

Built at first use like the other CPU kernels (cpu_attention: the machine's `cc` or `$CC`,
-march=native then `$CFLAGS`, cached per source, flags, compiler and CPU), one thread. It takes
W and C multiples of the vector width (16 floats with AVX-512, 8 with AVX2); other shapes, other
dtypes, no compiler or a failed build: the caller keeps torch's path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from tito_engine.model.cpu_attention import load_c_library

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>

#if defined(__AVX512F__)
#define LANES 16
#define BLOCK 4
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float v) { return _mm512_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define BLOCK 2
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset1(float v) { return _mm256_set1_ps(v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
#else
#error "the LoRA kernel needs AVX2 with FMA or AVX-512"
#endif

#define TILE 4

int tito_lora_lanes(void) { return LANES; }

/* xa[t][v0..v0 + NB * LANES) = x[t] . A^T[:, that range] for T tokens (A^T is [in, w]): NB vectors of
   A's row k loaded once feed the T tokens. Specialized per (T, NB) so the accumulators stay in
   registers. */
#define SHRINK(T, NB)                                                                                   \
static void shrink_##T##_##NB(const float *const *xs, const float *at, int64_t in, int64_t w, int64_t v0, \
                              float *xa) {                                                              \
    vf acc[T][NB];                                                                                      \
    for (int t = 0; t < T; t++)                                                                         \
        for (int b = 0; b < NB; b++) acc[t][b] = vzero();                                               \
    for (int64_t k = 0; k < in; k++) {                                                                  \
        const float *row = at + k * w + v0;                                                             \
        vf a[NB];                                                                                       \
        for (int b = 0; b < NB; b++) a[b] = vload(row + b * LANES);                                     \
        for (int t = 0; t < T; t++) {                                                                   \
            vf xv = vset1(xs[t][k]);                                                                    \
            for (int b = 0; b < NB; b++) acc[t][b] = vfma(xv, a[b], acc[t][b]);                         \
        }                                                                                               \
    }                                                                                                   \
    for (int t = 0; t < T; t++)                                                                         \
        for (int b = 0; b < NB; b++) vstore(xa + t * w + v0 + b * LANES, acc[t][b]);                   \
}

/* y[t][chunk c] += xa[t][c's part] . B[c] for T tokens (B is [chunks, rank, chunk]): each vector of
   B loaded once feeds the T tokens. */
#define EXPAND(T)                                                                                       \
static void expand_##T(float *const *ys, const float *xa, int64_t w, const float *b, int64_t chunks,     \
                       int64_t rank, int64_t chunk, const int64_t *chunk_parts) {                       \
    for (int64_t c = 0; c < chunks; c++) {                                                              \
        const float *bc = b + c * rank * chunk;                                                         \
        const float *xc = xa + chunk_parts[c] * rank;                                                   \
        for (int64_t v = 0; v < chunk; v += LANES) {                                                    \
            vf acc[T];                                                                                  \
            for (int t = 0; t < T; t++) acc[t] = vload(ys[t] + c * chunk + v);                          \
            for (int64_t j = 0; j < rank; j++) {                                                        \
                vf bv = vload(bc + j * chunk + v);                                                      \
                for (int t = 0; t < T; t++) acc[t] = vfma(vset1(xc[t * w + j]), bv, acc[t]);            \
            }                                                                                           \
            for (int t = 0; t < T; t++) vstore(ys[t] + c * chunk + v, acc[t]);                          \
        }                                                                                               \
    }                                                                                                   \
}

#define TOKENS(T)                                                                                       \
SHRINK(T, BLOCK)                                                                                        \
SHRINK(T, 1)                                                                                            \
EXPAND(T)                                                                                               \
static void add_##T(const float *const *xs, float *const *ys, const float *at, int64_t in, int64_t w,    \
                    const float *b, int64_t chunks, int64_t rank, int64_t chunk, const int64_t *chunk_parts, \
                    float *xa) {                                                                        \
    int64_t v0 = 0;                                                                                     \
    for (; v0 + BLOCK * LANES <= w; v0 += BLOCK * LANES) shrink_##T##_##BLOCK(xs, at, in, w, v0, xa);   \
    for (; v0 < w; v0 += LANES) shrink_##T##_1(xs, at, in, w, v0, xa);                                  \
    expand_##T(ys, xa, w, b, chunks, rank, chunk, chunk_parts);                                         \
}

TOKENS(1)
TOKENS(2)
TOKENS(3)
TOKENS(4)

/* For each of the n tokens (positions sorted by slot): y[p] += (x[p] A_s^T) B_s. */
void tito_lora_add_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const int64_t *positions,
                       const int64_t *slots, int64_t n, const float *a, int64_t in, int64_t w, const float *b,
                       int64_t chunks, int64_t rank, int64_t chunk, const int64_t *chunk_parts) {
    float xa[TILE * w];
    for (int64_t first = 0; first < n;) {
        int64_t slot = slots[first];
        int tile = 0;
        const float *xs[TILE];
        float *ys[TILE];
        while (tile < TILE && first + tile < n && slots[first + tile] == slot) {
            xs[tile] = x + positions[first + tile] * x_stride;
            ys[tile] = y + positions[first + tile] * y_stride;
            tile++;
        }
        const float *at = a + slot * in * w, *bs = b + slot * chunks * rank * chunk;
        switch (tile) {
        case 4: add_4(xs, ys, at, in, w, bs, chunks, rank, chunk, chunk_parts, xa); break;
        case 3: add_3(xs, ys, at, in, w, bs, chunks, rank, chunk, chunk_parts, xa); break;
        case 2: add_2(xs, ys, at, in, w, bs, chunks, rank, chunk, chunk_parts, xa); break;
        default: add_1(xs, ys, at, in, w, bs, chunks, rank, chunk, chunk_parts, xa); break;
        }
        first += tile;
    }
}
"""

_P, _I = ctypes.c_void_p, ctypes.c_int64


class LoraKernel:
    """The loaded kernel: `add(y, x, a, b, chunk_parts, positions, slots)` adds each listed token's
    adapter in place (float32 CPU tensors; `takes` says which stack shapes it runs)."""

    def __init__(self, function, lanes: int):
        self._function, self.lanes = function, lanes

    def takes(self, width: int, chunk: int) -> bool:
        return width % self.lanes == 0 and chunk % self.lanes == 0

    def add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, chunk_parts: torch.Tensor,
            positions: torch.Tensor, slots: torch.Tensor) -> None:
        if x.stride(1) != 1:
            x = x.contiguous()
        _, in_features, width = a.shape
        _, chunks, rank, chunk = b.shape
        self._function(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), positions.data_ptr(),
                       slots.data_ptr(), positions.shape[0], a.data_ptr(), in_features, width, b.data_ptr(),
                       chunks, rank, chunk, chunk_parts.data_ptr())


@functools.cache
def load_lora_kernel() -> LoraKernel | None:
    """The compiled kernel, built once per machine and cached; None (logged once) when it cannot be."""
    library = load_c_library("lora_add", SOURCE, what="the LoRA add kernel",
                             fallback="the LoRA add runs on torch's batched matmuls")
    if library is None:
        return None
    function = library.tito_lora_add_f32
    function.argtypes = (_P, _I, _P, _I, _P, _P, _I, _P, _I, _I, _P, _I, _I, _I, _P)
    function.restype = None
    library.tito_lora_lanes.restype = ctypes.c_int
    return LoraKernel(function, library.tito_lora_lanes())
