"""A decode step's attention over all of a model's layers: `decode_kernel` against the matmuls it replaces,
torch's fused attention, and reading the keys and values once (the floor), in one run.

    python benchmarks/decode_attention.py [--rows 64] [--positions 128 384] [--threads 2 1]

SmolLM2-135M's shapes (30 layers, 9 query heads over 3 key heads of 64), float32, random values: each layer's keys
and values are views of buffers with a quarter more room, as the engine's cache holds them, and a boolean mask
leaves out some rows' first positions (left padding). Each layer has its own buffers, so a pass over the 30 layers
reads them from memory, not cache, as a decode step does. Median of 7 passes after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from relax_gym.cpu import decode_kernel
from relax_gym.cpu.decode_attention import grouped_matmuls

LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64


def pass_ms(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object],
            caches: list[tuple[torch.Tensor, torch.Tensor]], query: torch.Tensor, repeats: int = 7) -> float:
    attend(query, *caches[0])  # warm-up (the kernel builds on its first call)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for key, value in caches:
            attend(query, key, value)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare(rows: int, positions: int, thread_counts: list[int]) -> None:
    """Prints a table row per thread count for `rows` rows over `positions` cached positions."""
    room = positions + positions // 4
    caches = [(torch.randn(rows, KV_HEADS, room, DIM)[:, :, :positions],
               torch.randn(rows, KV_HEADS, room, DIM)[:, :, :positions]) for _ in range(LAYERS)]
    query = torch.randn(rows, HEADS, 1, DIM)
    mask = torch.ones(rows, 1, 1, positions, dtype=torch.bool)
    mask[: rows // 8, ..., : positions // 8] = False
    scale = DIM**-0.5

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return decode_kernel.attend(q, k, v, mask, scale)

    def matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return grouped_matmuls(q, k, v, mask, scale)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return k.sum() + v.sum()

    assert kernel(query, *caches[0]) is not None, "the kernel did not build here (see the log)"
    for threads in thread_counts:
        torch.set_num_threads(threads)
        floor, ours, theirs, fused = (pass_ms(f, caches, query) for f in (read, kernel, matmuls, sdpa))
        print(f"| {threads} | {positions} | {floor:.1f} | {ours:.1f} | {theirs:.1f} | {fused:.1f} | "
              f"{ours / theirs:.2f} | {ours / floor:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--positions", type=int, nargs="+", default=[128, 384])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    args = parser.parse_args()
    print(f"{LAYERS} layers, {args.rows} rows, {HEADS}/{KV_HEADS} heads of {DIM}, float32; ms a pass\n")
    print("| threads | positions | keys and values read once | decode_kernel | two matmuls | torch sdpa | "
          "kernel / matmuls | kernel / read |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    for positions in args.positions:
        compare(args.rows, positions, args.threads)


if __name__ == "__main__":
    main()
