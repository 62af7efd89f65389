"""C kernels for attention on CPU straight from the paged KV cache: every one-token (decode) row
of a step in one call per layer, and each prefill chunk in one call per layer.

The torch path (attention.py) gathers each decode group's blocks into a padded copy with
`index_select` and runs SDPA over it under a mask: per layer that is a copy of every row's
K/V, a mask over the padding and a few calls' fixed costs. The decode kernel reads each row's
blocks in place through its block table, stops at the row's own length (no padding, no mask) and
keeps a running softmax per query head (one pass over K/V, as flash-decoding does), the query heads
that share a KV head reading it once. Measured on tiny-qwen2-h256 (float32, one thread, 32 rows of
200-240 tokens): a layer's decode attention 176 us against 438 us, the whole decode step 3.8 ms
against 4.6 ms with the torch path.

The prefill kernel (AVX-512 only; elsewhere prefill chunks stay on the torch path) tiles a chunk's
queries with the query heads that share a KV head, so each 16-key slice of the (once transposed)
keys feeds up to eight rows; causality and sliding windows are lane masks, not a [chunk, context]
mask tensor. Per layer of tiny-qwen2-h256 (4 heads / 2 KV heads, head size 64), against SDPA:
a 138-token prompt 139 us against 369 us, 512 tokens 1.97 ms against 3.67 ms, 100 tokens after
200 cached 398 us against 539 us, 300 tokens in a 64-token window 350 us against 1,448 us.

The source is compiled at first use with the machine's C compiler (`cc`, or `$CC`) for this
CPU (-march=native, then `$CFLAGS`, so `CFLAGS=-mno-avx512f` builds what an AVX2 machine gets) and
cached under ~/.cache/tito/kernels (or $XDG_CACHE_HOME), keyed by the source, the flags, the
compiler and the CPU; no compiler, or a failed build, leaves the torch path in place (logged).
It runs float32 caches only, on one thread: by default it is used where the core runs one
intra-op thread (cpu_runtime.plan_cpus gives small models one), since SDPA spreads its work over
torch's threads (32 rows on two threads: 3.4 ms a step on the torch path).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# -ffast-math lets the compiler vectorize the dot products and sums (reassociation); the shared
# object is linked without it, since gcc then links crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (subnormals everywhere else would become 0). A call of an
# undeclared function (C99 assumes it returns int: a truncated pointer) fails the build instead.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c99", "-Werror=implicit-function-declaration")
LINK_FLAGS = ("-shared",)

SOURCE = r"""
#include <stdint.h>
#include <math.h>

/* exp(x) for x <= 0, as 0 where it would be subnormal (x < -87.3): without flush-to-zero, a
 * multiply by a subnormal takes a microcode assist of ~100 cycles, and peaked scores (a row whose
 * keys differ by more than 87 after scaling) make many of them; their weight is below 2^-126. */
static inline float softmax_weight(float x) { return x < -87.0f ? 0.0f : expf(x); }

/* One query token per row attends over its own context in the paged cache.
 * q:      the step's packed queries; row b's heads start at q + q_index[b] * q_stride
 * out:    [tokens, heads * dim]; row b's output goes to out + q_index[b] * heads * dim
 * keys, values: [num_blocks, block_size, kv_heads, dim]
 * tables: [batch, table_width] block ids; lengths: [batch] context length (the query included)
 * window: > 0 keeps the keys at positions >= length - window (sliding attention), else all
 * A block's K (then V) is read once, front to back, for every head (its tokens are contiguous),
 * while the next block is prefetched: decode attention is bound by memory, not arithmetic. */
static inline __attribute__((always_inline)) void
paged_decode(const float *q, int64_t q_stride, float *out, const int64_t *q_index,
             int64_t batch, const float *keys, const float *values,
             const int64_t *tables, int64_t table_width, const int64_t *lengths,
             int64_t block_size, int64_t heads, int64_t kv_heads, const int64_t dim,
             int64_t window, float scale)
{
    const int64_t group = heads / kv_heads;
    const int64_t token_stride = kv_heads * dim;
    const int64_t block_stride = block_size * token_stride;
    float scores[heads * block_size];
    float acc[heads * dim];
    float running_max[heads];
    float running_sum[heads];
    for (int64_t b = 0; b < batch; b++) {
        const int64_t length = lengths[b];
        const int64_t first = (window > 0 && length > window) ? length - window : 0;
        const float *q_row = q + q_index[b] * q_stride;
        float *out_row = out + q_index[b] * heads * dim;
        const int64_t *table = tables + b * table_width;
        for (int64_t i = 0; i < heads * dim; i++) acc[i] = 0.0f;
        for (int64_t h = 0; h < heads; h++) { running_max[h] = 0.0f; running_sum[h] = 0.0f; }
        for (int64_t block = first / block_size; block * block_size < length; block++) {
            const int64_t base = block * block_size;
            const int64_t t0 = (first > base ? first : base) - base;
            const int64_t t1 = (length < base + block_size ? length : base + block_size) - base;
            const int64_t n = t1 - t0;
            const float *k_block = keys + table[block] * block_stride + t0 * token_stride;
            const float *v_block = values + table[block] * block_stride + t0 * token_stride;
            if ((block + 1) * block_size < length) {
                const float *k_next = keys + table[block + 1] * block_stride;
                const float *v_next = values + table[block + 1] * block_stride;
                for (int64_t i = 0; i < block_stride; i += 16) {
                    __builtin_prefetch(k_next + i);
                    __builtin_prefetch(v_next + i);
                }
            }
            for (int64_t t = 0; t < n; t++) {
                const float *k_token = k_block + t * token_stride;
                for (int64_t h = 0; h < heads; h++) {
                    const float *qh = q_row + h * dim;
                    const float *k = k_token + (h / group) * dim;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < dim; d++) dot += qh[d] * k[d];
                    scores[h * block_size + t] = dot * scale;
                }
            }
            for (int64_t h = 0; h < heads; h++) {
                float *s = scores + h * block_size;
                float block_max = s[0];
                for (int64_t t = 1; t < n; t++) block_max = s[t] > block_max ? s[t] : block_max;
                if (running_sum[h] == 0.0f) {
                    running_max[h] = block_max;  /* the first keys of this head */
                } else if (block_max > running_max[h]) {
                    const float rescale = softmax_weight(running_max[h] - block_max);
                    running_sum[h] *= rescale;
                    float *a = acc + h * dim;
                    for (int64_t d = 0; d < dim; d++) a[d] *= rescale;
                    running_max[h] = block_max;
                }
                float sum = 0.0f;
                for (int64_t t = 0; t < n; t++) { s[t] = softmax_weight(s[t] - running_max[h]); sum += s[t]; }
                running_sum[h] += sum;
            }
            for (int64_t t = 0; t < n; t++) {
                const float *v_token = v_block + t * token_stride;
                for (int64_t h = 0; h < heads; h++) {
                    const float p = scores[h * block_size + t];
                    const float *v = v_token + (h / group) * dim;
                    float *a = acc + h * dim;
                    for (int64_t d = 0; d < dim; d++) a[d] += p * v[d];
                }
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            const float inverse = running_sum[h] > 0.0f ? 1.0f / running_sum[h] : 0.0f;
            float *o = out_row + h * dim;
            const float *a = acc + h * dim;
            for (int64_t d = 0; d < dim; d++) o[d] = a[d] * inverse;
        }
    }
}

/* The common head sizes get a copy with `dim` a constant, whose loops the compiler unrolls into
 * whole vectors; any other size runs the generic copy. */
void tito_paged_decode_f32(const float *q, int64_t q_stride, float *out, const int64_t *q_index,
                           int64_t batch, const float *keys, const float *values,
                           const int64_t *tables, int64_t table_width, const int64_t *lengths,
                           int64_t block_size, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t window, float scale)
{
#define TITO_DECODE(DIM) paged_decode(q, q_stride, out, q_index, batch, keys, values, tables, table_width, \
                                      lengths, block_size, heads, kv_heads, DIM, window, scale)
    switch (dim) {
    case 64: TITO_DECODE(64); break;
    case 128: TITO_DECODE(128); break;
    case 256: TITO_DECODE(256); break;
    default: TITO_DECODE(dim); break;
    }
#undef TITO_DECODE
}

/* ---------------------------------------------------------------- prefill chunks (AVX-512)
 *
 * A prefill chunk's `count` queries (positions start .. start + count - 1) attend causally over
 * their prompt so far in the paged cache, this chunk's K/V included (written before the call).
 * One KV head at a time: its keys are copied once into a transposed buffer kt[dim][positions], so
 * that 16 consecutive keys' scores are 16 lanes of one FMA chain; then blocks of rows (a few
 * consecutive queries x the query heads that read this KV head, at most TITO_MAX_ROWS) go over the
 * keys in chunks of 16: scores, a lane mask for causality and the window, an online softmax with a
 * vectorized exp, and P.V into per-row accumulators; each key chunk is loaded once per row block.
 * The torch path (SDPA under an additive mask) copies the context's K/V out of the cache and
 * builds a [count, context] mask per chunk; this reads them in place. */
#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdlib.h>

#define TITO_CHUNK 16
#define TITO_MAX_ROWS 8
#define TITO_MAX_DIM 256
/* below any score: the sources are built with -ffast-math, which assumes no infinities */
#define TITO_NO_SCORE (-1.0e30f)

/* exp(x) for 16 lanes, x <= 0: Cody-Waite range reduction by ln 2, a degree-6 polynomial and
 * scalef for 2^n (relative error ~2e-7); 0 below -87, as softmax_weight. */
static inline __m512 exp16(__m512 x)
{
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

/* Rows r = (query qi, head h0 + j) for qi < nq, j < heads_at_once: the query at position pos0 + qi.
 * ktg: this KV head's keys transposed, [dim][padded]; slot[p]: key p's offset in the cache. */
static inline __attribute__((always_inline)) void
prefill_rows(const float *q, int64_t q_stride, float *out, int64_t out_stride, int64_t pos0, int64_t nq,
             int64_t heads_at_once, int64_t h0, const float *ktg, int64_t padded, const float *values,
             const int64_t *slot, int64_t value_offset, const int64_t dim, int64_t window, float scale)
{
    const int64_t rows = nq * heads_at_once;
    const float *qr[TITO_MAX_ROWS];
    int64_t row_pos[TITO_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        qr[r] = q + (r / heads_at_once) * q_stride + (h0 + r % heads_at_once) * dim;
        row_pos[r] = pos0 + r / heads_at_once;
    }
    const int64_t last = pos0 + nq - 1;
    const int64_t lo = (window > 0 && pos0 - window + 1 > 0) ? pos0 - window + 1 : 0;
    float acc[TITO_MAX_ROWS][TITO_MAX_DIM] __attribute__((aligned(64)));
    float running_max[TITO_MAX_ROWS], running_sum[TITO_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t d = 0; d < dim; d++) acc[r][d] = 0.0f;
        running_max[r] = TITO_NO_SCORE;
        running_sum[r] = 0.0f;
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t c = lo / TITO_CHUNK * TITO_CHUNK; c <= last; c += TITO_CHUNK) {
        __m512 scores[TITO_MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) scores[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m512 k = _mm512_loadu_ps(ktg + d * padded + c);
            for (int64_t r = 0; r < rows; r++) scores[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k, scores[r]);
        }
        float weights[TITO_MAX_ROWS][TITO_CHUNK];
        for (int64_t r = 0; r < rows; r++) {
            const int64_t pos = row_pos[r];
            const int64_t row_lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
            /* lane j holds key c + j: inside when row_lo <= c + j <= pos */
            const __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int)(c - pos)), lane);
            const __mmask16 inside = _mm512_cmple_epi32_mask(at, _mm512_setzero_si512())
                                     & _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32((int)(row_lo - pos)));
            const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(TITO_NO_SCORE), inside,
                                                _mm512_mul_ps(scores[r], _mm512_set1_ps(scale)));
            const float chunk_max = inside ? _mm512_reduce_max_ps(s) : TITO_NO_SCORE;
            if (chunk_max > running_max[r]) {
                if (running_sum[r] > 0.0f) {
                    const float rescale = softmax_weight(running_max[r] - chunk_max);
                    running_sum[r] *= rescale;
                    for (int64_t d = 0; d < dim; d++) acc[r][d] *= rescale;
                }
                running_max[r] = chunk_max;
            }
            const __m512 w = inside ? exp16(_mm512_sub_ps(s, _mm512_set1_ps(running_max[r]))) : _mm512_setzero_ps();
            running_sum[r] += _mm512_reduce_add_ps(w);
            _mm512_storeu_ps(weights[r], w);
        }
        const int64_t keys_here = last - c + 1 < TITO_CHUNK ? last - c + 1 : TITO_CHUNK;
        for (int64_t k = 0; k < dim; k += 16) {
            __m512 o[TITO_MAX_ROWS];
            for (int64_t r = 0; r < rows; r++) o[r] = _mm512_load_ps(acc[r] + k);
            for (int64_t j = 0; j < keys_here; j++) {
                const __m512 v = _mm512_loadu_ps(values + slot[c + j] + value_offset + k);
                for (int64_t r = 0; r < rows; r++) o[r] = _mm512_fmadd_ps(_mm512_set1_ps(weights[r][j]), v, o[r]);
            }
            for (int64_t r = 0; r < rows; r++) _mm512_store_ps(acc[r] + k, o[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inverse = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;
        float *o = out + (r / heads_at_once) * out_stride + (h0 + r % heads_at_once) * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = acc[r][d] * inverse;
    }
}

static inline __attribute__((always_inline)) int
paged_prefill(const float *q, int64_t q_stride, float *out, int64_t count, int64_t start,
              const float *keys, const float *values, const int64_t *table, int64_t block_size,
              int64_t heads, int64_t kv_heads, const int64_t dim, int64_t window, float scale)
{
    const int64_t group = heads / kv_heads;
    const int64_t token_stride = kv_heads * dim;
    const int64_t block_stride = block_size * token_stride;
    const int64_t end = start + count;
    const int64_t padded = (end + TITO_CHUNK - 1) / TITO_CHUNK * TITO_CHUNK;
    const int64_t first_key = (window > 0 && start - window + 1 > 0) ? start - window + 1 : 0;
    const int64_t key0 = first_key / TITO_CHUNK * TITO_CHUNK;
    float *kt = malloc((size_t)(dim * padded) * sizeof(float));
    int64_t *slot = malloc((size_t)padded * sizeof(int64_t));
    if (kt == 0 || slot == 0) { free(kt); free(slot); return -1; }
    for (int64_t p = key0; p < end; p++)
        slot[p] = table[p / block_size] * block_stride + (p % block_size) * token_stride;
    const int64_t heads_at_once = group < TITO_MAX_ROWS ? group : TITO_MAX_ROWS;
    const int64_t per_block = TITO_MAX_ROWS / heads_at_once;  /* queries per row block */
    for (int64_t g = 0; g < kv_heads; g++) {
        for (int64_t p = key0; p < end; p++) {
            const float *k = keys + slot[p] + g * dim;
            for (int64_t d = 0; d < dim; d++) kt[d * padded + p] = k[d];
        }
        for (int64_t i = 0; i < count; i += per_block) {
            const int64_t nq = count - i < per_block ? count - i : per_block;
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += heads_at_once) {
                const int64_t these = (g + 1) * group - h0 < heads_at_once ? (g + 1) * group - h0 : heads_at_once;
                prefill_rows(q + i * q_stride, q_stride, out + i * heads * dim, heads * dim, start + i, nq, these,
                             h0, kt, padded, values, slot, g * dim, dim, window, scale);
            }
        }
    }
    free(kt);
    free(slot);
    return 0;
}

int tito_paged_prefill_supported(int64_t dim) { return dim > 0 && dim % 16 == 0 && dim <= TITO_MAX_DIM; }

/* 0 when done; -1 when the key buffer could not be allocated; -2 for a head size it does not take. */
int tito_paged_prefill_f32(const float *q, int64_t q_stride, float *out, int64_t count, int64_t start,
                           const float *keys, const float *values, const int64_t *table, int64_t block_size,
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t window, float scale)
{
#define TITO_PREFILL(DIM) paged_prefill(q, q_stride, out, count, start, keys, values, table, block_size, heads, \
                                        kv_heads, DIM, window, scale)
    if (!tito_paged_prefill_supported(dim)) return -2;
    switch (dim) {
    case 64: return TITO_PREFILL(64);
    case 128: return TITO_PREFILL(128);
    case 256: return TITO_PREFILL(256);
    default: return TITO_PREFILL(dim);
    }
#undef TITO_PREFILL
}
#else  /* no AVX-512: prefill chunks stay on the torch path */
int tito_paged_prefill_supported(int64_t dim) { (void)dim; return 0; }
int tito_paged_prefill_f32(const float *q, int64_t q_stride, float *out, int64_t count, int64_t start,
                           const float *keys, const float *values, const int64_t *table, int64_t block_size,
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t window, float scale)
{
    return -2;
}
#endif
"""

_P, _I = ctypes.c_void_p, ctypes.c_int64
_DECODE_ARGTYPES = (_P, _I, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float)
_PREFILL_ARGTYPES = (_P, _I, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _compile_flags() -> tuple[str, ...]:
    """The fixed flags, then the caller's `$CFLAGS` (as any C build honours them; later flags win)."""
    return (*COMPILE_FLAGS, *shlex.split(os.environ.get("CFLAGS", "")))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tito" / "kernels"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), else the machine."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    wanted = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted)) or platform.machine()


def _build(compiler: str, target: Path, compile_flags: tuple[str, ...], code: str = SOURCE,
           link_flags: tuple[str, ...] = (*LINK_FLAGS, "-lm")) -> None:
    """Compile `code` (these kernels' SOURCE, or another kernel's) to `target`, through a temporary
    file renamed into place (processes that build at once each write their own, and a reader never
    sees half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source, obj, shared = Path(work, "kernel.c"), Path(work, "kernel.o"), Path(work, "kernel.so")
        source.write_text(code)
        for command in ([compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
                        [compiler, str(obj), "-o", str(shared), *link_flags]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(shared, target)


def built_library(name: str, code: str, compiler: str, version: str, compile_flags: tuple[str, ...],
                  link_flags: tuple[str, ...]) -> ctypes.CDLL:
    """`code` built with these flags into the kernel cache (one file per source, flags, compiler and
    CPU, built once), loaded."""
    key = hashlib.sha256("\0".join((code, *compile_flags, *link_flags, compiler, version, _cpu_identity()))
                         .encode()).hexdigest()[:24]
    target = _cache_dir() / f"{name}_{key}.so"
    if not target.exists():
        _build(compiler, target, compile_flags, code, link_flags)
        log.info("built the %s kernel: %s", name, target)
    return ctypes.CDLL(str(target))


def load_c_library(name: str, code: str, *, what: str, fallback: str) -> ctypes.CDLL | None:
    """A kernel library built with the usual flags (one thread), or None, logged once as `what`
    could not be had and `fallback` runs instead."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, or $CC) found for %s: %s", what, fallback)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        return built_library(name, code, compiler, version, _compile_flags(), LINK_FLAGS)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s could not be built or loaded (%s): %s", what, exc, fallback)
        return None


@functools.cache
def load_attention_kernel() -> "AttentionKernel | None":
    """The compiled kernels, built once per machine and cached; None (logged once) when they
    cannot be built or loaded, and the torch path then runs."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, or $CC) found: attention runs on the torch path (install gcc "
                    "for the faster CPU kernels, or pass --no-cpu-decode-kernel to silence this)")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        library = built_library("paged_attention", SOURCE, compiler, version, _compile_flags(), (*LINK_FLAGS, "-lm"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the CPU attention kernels could not be built or loaded (%s): attention runs on "
                    "the torch path", exc)
        return None
    decode, prefill = library.tito_paged_decode_f32, library.tito_paged_prefill_f32
    decode.argtypes, decode.restype = _DECODE_ARGTYPES, None
    prefill.argtypes, prefill.restype = _PREFILL_ARGTYPES, ctypes.c_int
    library.tito_paged_prefill_supported.argtypes = (_I,)
    library.tito_paged_prefill_supported.restype = ctypes.c_int
    return AttentionKernel(decode, prefill, library.tito_paged_prefill_supported)


def _check_layout(q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  head_dim: int) -> None:
    if q.stride(2) != 1 or q.stride(1) != head_dim or not (out.is_contiguous() and key_cache.is_contiguous()
                                                            and value_cache.is_contiguous()):
        raise ValueError("attention kernel: q needs contiguous heads and out and the caches must be contiguous")


class AttentionKernel:
    """The loaded kernels: decode rows (all of a step's, once per layer) and prefill chunks (one
    call per chunk and layer)."""

    def __init__(self, decode, prefill, prefill_supported):
        self._decode, self._prefill, self._prefill_supported = decode, prefill, prefill_supported

    @staticmethod
    def supports(cache_dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and cache_dtype == torch.float32

    def prefills(self, head_dim: int) -> bool:
        """Whether the prefill kernel runs here for this head size (AVX-512, a multiple of 16 up to 256)."""
        return bool(self._prefill_supported(head_dim))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, rows: "DecodeRows", key_cache: torch.Tensor,
                 value_cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int, scale: float,
                 window: int | None) -> None:
        """Write the attention of `rows` (one token each; queries q [T, heads, hd], any token
        stride) into out [T, heads * hd] at the rows' token indices; `window`: a sliding layer's."""
        _check_layout(q, out, key_cache, value_cache, head_dim)
        self._decode(q.data_ptr(), q.stride(0), out.data_ptr(), rows.index.data_ptr(), rows.count,
                     key_cache.data_ptr(), value_cache.data_ptr(), rows.tables.data_ptr(), rows.tables.shape[1],
                     rows.lengths.data_ptr(), key_cache.shape[1], heads, kv_heads, head_dim, window or 0, scale)

    def prefill(self, q: torch.Tensor, out: torch.Tensor, chunk: "PrefillChunk", key_cache: torch.Tensor,
                value_cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int, scale: float,
                window: int | None) -> None:
        """Write the causal attention of `chunk`'s queries (q [T, heads, hd] of the whole step)
        over its prompt so far in the cache (this chunk's K/V already written) into out [T, heads * hd]
        at the chunk's tokens; `window`: a sliding layer's."""
        _check_layout(q, out, key_cache, value_cache, head_dim)
        offset = chunk.offset
        status = self._prefill(q[offset:].data_ptr(), q.stride(0), out[offset:].data_ptr(), chunk.count, chunk.start,
                               key_cache.data_ptr(), value_cache.data_ptr(), chunk.table.data_ptr(),
                               key_cache.shape[1], heads, kv_heads, head_dim, window or 0, scale)
        if status == -1:
            raise MemoryError(f"attention kernel: no memory for the keys of a {chunk.start + chunk.count}-token prompt")
        if status != 0:
            raise ValueError(f"attention kernel: the prefill kernel does not take head size {head_dim}")


class PrefillChunk:
    """A prefill chunk as the kernel reads it: its first packed token, its tokens, its first
    position and the block table of its prompt so far (built once per step, shared by every layer)."""

    def __init__(self, offset: int, count: int, start: int, table: list[int]):
        self.offset, self.count, self.start = offset, count, start
        self.table = torch.tensor(table, dtype=torch.long)


class DecodeRows:
    """A step's decode rows as the kernel reads them: token index, block table and length per row
    (int64 tensors, built once per step and shared by every layer)."""

    def __init__(self, token_index: list[int], tables: list[list[int]], lengths: list[int]):
        width = max(len(table) for table in tables)
        self.count = len(token_index)
        self.index = torch.tensor(token_index, dtype=torch.long)
        self.tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.long)
        self.lengths = torch.tensor(lengths, dtype=torch.long)
