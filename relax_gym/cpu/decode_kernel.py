"""A float32 decode-step attention kernel in C, compiled on first use with the machine's C compiler.

`decode_attention`'s two matmuls send each (row, key head) pair's `[T, D] x [D, G]` and `[G, T] x [T, D]`
products through MKL's batched small GEMM, and at G = 3 query heads a key head (SmolLM2) MKL runs them well off
the time it takes to read the keys and values once: 30 layers of 64 rows at 384 positions took 49-52 ms where
summing the same keys and values takes 27-30 ms (2 cores). A loop that reads each row's keys and values once,
with the group's queries and sums in registers, takes 30 ms: the read. No maintained library does this on a CPU
in float32 (torch's flash kernel is slower still, 61 ms), so it is written here, 50 lines.

It is built per (G, D), so the compiler unrolls the inner loops, with `-march=native` for this machine's vector
width, into a temporary directory (0.2 s), and it runs its rows on the OpenMP runtime torch loaded (libgomp's
soname matches, so the loader reuses torch's copy: one pool of workers, which `release_openmp_workers` ends).
Where there is no compiler, or the build fails, `attend` answers None and says why once, in a log warning; the
caller then runs the matmuls. `-ffast-math` lets the compiler vectorize `expf` (glibc's libmvec); masked
positions take a finite floor rather than -inf, which that mode does not keep. It applies to compiling only:
linked with it, the library would turn on flush-to-zero in the thread that loads it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shlex
import subprocess
import tempfile
from collections.abc import Callable

import torch

__all__ = ["attend", "build"]

logger = logging.getLogger("relax_gym.engines")

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* query, out: [rows, kv_heads * GROUP, DIM] contiguous; keys and values: [rows, kv_heads, length, DIM] at the
   given strides (the last dimension contiguous); mask: [rows, length] bytes at `mask_row` apart (1: attend), or
   null; scratch: rows * kv_heads * GROUP * length floats. */
void decode_attention_f32(const float *query, const float *keys, const float *values, const uint8_t *mask,
                          float *out, float *scratch, int64_t rows, int64_t kv_heads, int64_t length,
                          int64_t key_row, int64_t key_head, int64_t key_pos, int64_t value_row,
                          int64_t value_head, int64_t value_pos, int64_t mask_row, float scale, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t pair = 0; pair < rows * kv_heads; pair++) {
        const int64_t row = pair / kv_heads, head = pair % kv_heads;
        const float *q = query + pair * GROUP * DIM;
        const float *k = keys + row * key_row + head * key_head, *v = values + row * value_row + head * value_head;
        const uint8_t *m = mask ? mask + row * mask_row : 0;
        float *s = scratch + pair * GROUP * length;
        float top[GROUP], total[GROUP], acc[GROUP * DIM];
        for (int g = 0; g < GROUP; g++) top[g] = -1e30f;
        for (int64_t t = 0; t < length; t++) {
            const float *kt = k + t * key_pos;
            for (int g = 0; g < GROUP; g++) {
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int d = 0; d < DIM; d++) dot += kt[d] * q[g * DIM + d];
                dot = (m && !m[t]) ? -1e30f : dot * scale;
                s[g * length + t] = dot;
                top[g] = dot > top[g] ? dot : top[g];
            }
        }
        for (int g = 0; g < GROUP; g++) {
            float *sg = s + g * length, sum = 0.f;
            const float most = top[g];
            #pragma omp simd reduction(+:sum)
            for (int64_t t = 0; t < length; t++) {
                const float e = expf(sg[t] - most);
                sg[t] = e;
                sum += e;
            }
            total[g] = sum;
        }
        for (int i = 0; i < GROUP * DIM; i++) acc[i] = 0.f;
        for (int64_t t = 0; t < length; t++) {
            const float *vt = v + t * value_pos;
            for (int g = 0; g < GROUP; g++) {
                const float w = s[g * length + t];
                #pragma omp simd
                for (int d = 0; d < DIM; d++) acc[g * DIM + d] += w * vt[d];
            }
        }
        float *o = out + pair * GROUP * DIM;
        for (int g = 0; g < GROUP; g++)
            for (int d = 0; d < DIM; d++) o[g * DIM + d] = acc[g * DIM + d] / total[g];
    }
}
"""

_I64 = ctypes.c_int64


@functools.cache
def build(group: int, dim: int) -> Callable[..., None] | None:
    """The kernel for `group` query heads a key head and `dim` channels a head, or None (logged once) where it
    cannot be built here. `CC` names the compiler, as for any C build; `cc` by default."""
    compiler = shlex.split(os.environ.get("CC", "cc"))
    with tempfile.TemporaryDirectory(prefix="relax_gym_kernel_") as folder:
        source, objects, library = (os.path.join(folder, name) for name in ("decode.c", "decode.o", "decode.so"))
        with open(source, "w") as file:
            file.write(SOURCE)
        # two steps: `-ffast-math` when linking adds gcc's crtfastmath, whose constructor turns on flush-to-zero
        # for the thread that loads the library, changing every float op it runs after (denormals become zero)
        commands = [[*compiler, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", f"-DGROUP={group}",
                     f"-DDIM={dim}", "-c", source, "-o", objects],
                    [*compiler, "-shared", "-fopenmp", objects, "-o", library, "-lmvec", "-lm"]]
        try:
            for command in commands:
                subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
            kernel = ctypes.CDLL(library).decode_attention_f32  # loaded: the file may go with the folder
        except (OSError, subprocess.SubprocessError) as err:
            lines = (getattr(err, "stderr", None) or str(err)).strip().splitlines() or [repr(err)]
            logger.warning("decode attention runs through torch's matmuls: building its C kernel with %s failed: %s",
                           compiler[0], next((line for line in lines if "error" in line), lines[-1]))
            return None
    kernel.argtypes = [ctypes.c_void_p] * 6 + [_I64] * 10 + [ctypes.c_float, ctypes.c_int]
    kernel.restype = None
    return kernel


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor | None:
    """One decode step's attention, [B, 1, H, D] from query [B, H, 1, D] and key and value [B, Hkv, T, D] (a
    boolean mask [B, 1, 1, T] marks what may be attended), or None where the kernel does not apply: not float32
    on a CPU, a mask of another kind, or no kernel built here."""
    rows, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if not (query.dtype == key.dtype == value.dtype == torch.float32 and query.device.type == "cpu"
            and key.stride(-1) == 1 and value.stride(-1) == 1 and heads % kv_heads == 0
            and key.shape == value.shape == (rows, kv_heads, length, dim)):  # C reads by these shapes: no broadcast
        return None
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[-1] < length:
            return None
        mask = mask[:, 0, -1, :length]
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask_row = mask.stride(0) if mask.shape[0] == rows else 0  # one row broadcast to all
    kernel = build(heads // kv_heads, dim)
    if kernel is None:
        return None
    query = query.contiguous()
    out = query.new_empty(rows, 1, heads, dim)
    scratch = query.new_empty(rows * heads * length)
    kernel(query.data_ptr(), key.data_ptr(), value.data_ptr(), None if mask is None else mask.data_ptr(),
           out.data_ptr(), scratch.data_ptr(), rows, kv_heads, length, *key.stride()[:3], *value.stride()[:3],
           0 if mask is None else mask_row, scale, torch.get_num_threads())
    return out
