"""A C kernel for the decode rows' attention on CPU: every one-token row of a step, in one call
per layer, straight from the paged KV cache.

The torch path (attention.py) gathers each decode group's blocks into a padded copy with
`index_select` and runs SDPA over it under a mask: per layer that is a copy of every row's
K/V, a mask over the padding and a few calls' fixed costs. This kernel reads each row's blocks in
place through its block table, stops at the row's own length (no padding, no mask) and keeps a
running softmax per query head (one pass over K/V, as flash-decoding does), the query heads that
share a KV head reading it once. Measured on tiny-qwen2-h256 (float32, one thread, 32 rows of
200-240 tokens): a layer's decode attention 176 us against 438 us, the whole decode step 3.8 ms
against 4.6 ms with the torch path.

The source is compiled at first use with the machine's C compiler (`cc`, or `$CC`) for this
CPU (-march=native) and cached under ~/.cache/tito/kernels (or $XDG_CACHE_HOME), keyed by the
source, the flags, the compiler and the CPU; no compiler, or a failed build, leaves the torch
path in place (logged). It runs float32 caches only, on one thread: by default it is used where
the core runs one intra-op thread (cpu_runtime.plan_cpus gives small models one), since SDPA
spreads its work over torch's threads (32 rows on two threads: 3.4 ms a step on the torch path).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# -ffast-math lets the compiler vectorize the dot products and sums (reassociation); the shared
# object is linked without it, since gcc then links crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (subnormals everywhere else would become 0).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c99")
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
"""

_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


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


def _build(compiler: str, target: Path) -> None:
    """Compile SOURCE to `target`, through a temporary file renamed into place (processes that
    build at once each write their own, and a reader never sees half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source, obj, shared = Path(work, "kernel.c"), Path(work, "kernel.o"), Path(work, "kernel.so")
        source.write_text(SOURCE)
        for command in ([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                        [compiler, *LINK_FLAGS, str(obj), "-o", str(shared), "-lm"]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(shared, target)


@functools.cache
def load_decode_kernel() -> "DecodeKernel | None":
    """The compiled kernel, built once per machine and cached; None (logged once) when it cannot be
    built or loaded, and the torch path then runs."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, or $CC) found: decode attention runs on the torch path (install gcc "
                    "for the faster CPU kernel, or pass --no-cpu-decode-kernel to silence this)")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join((SOURCE, *COMPILE_FLAGS, *LINK_FLAGS, compiler, version, _cpu_identity()))
                             .encode()).hexdigest()[:24]
        target = _cache_dir() / f"paged_decode_{key}.so"
        if not target.exists():
            _build(compiler, target)
            log.info("built the CPU decode attention kernel: %s", target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the CPU decode attention kernel could not be built or loaded (%s): decode attention runs on "
                    "the torch path", exc)
        return None
    function = library.tito_paged_decode_f32
    function.argtypes, function.restype = _ARGTYPES, None
    return DecodeKernel(function)


class DecodeKernel:
    """The loaded kernel, called once per layer for all of a step's decode rows."""

    def __init__(self, function):
        self._function = function

    @staticmethod
    def supports(cache_dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and cache_dtype == torch.float32

    def __call__(self, q: torch.Tensor, out: torch.Tensor, rows: "DecodeRows", key_cache: torch.Tensor,
                 value_cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int, scale: float,
                 window: int | None) -> None:
        """Write the attention of `rows` (one token each; queries q [T, heads, hd], any token
        stride) into out [T, heads * hd] at the rows' token indices; `window`: a sliding layer's."""
        if q.stride(2) != 1 or q.stride(1) != head_dim or not (out.is_contiguous() and key_cache.is_contiguous()
                                                                and value_cache.is_contiguous()):
            raise ValueError("decode kernel: q needs contiguous heads and out and the caches must be contiguous")
        self._function(q.data_ptr(), q.stride(0), out.data_ptr(), rows.index.data_ptr(), rows.count,
                       key_cache.data_ptr(), value_cache.data_ptr(), rows.tables.data_ptr(), rows.tables.shape[1],
                       rows.lengths.data_ptr(), key_cache.shape[1], heads, kv_heads, head_dim, window or 0,
                       scale)


class DecodeRows:
    """A step's decode rows as the kernel reads them: token index, block table and length per row
    (int64 tensors, built once per step and shared by every layer)."""

    def __init__(self, token_index: list[int], tables: list[list[int]], lengths: list[int]):
        width = max(len(table) for table in tables)
        self.count = len(token_index)
        self.index = torch.tensor(token_index, dtype=torch.long)
        self.tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.long)
        self.lengths = torch.tensor(lengths, dtype=torch.long)
