"""torch's float32 linear (MKL) against `OneDNNLinear` on a real model's layer shapes, forward and backward.

    python benchmarks/onednn_linear.py [--threads 2] [--rows 16 64 1536] [--budget-s 0.3]

For each distinct (in, out) of SmolLM2-135M's linears (its config, no weights needed) and each row count (16 and 64:
decode steps; 1536: a training micro-batch), the GFLOP/s of `F.linear` and of `OneDNNLinear` on the same tensors,
forward alone and forward plus backward (input and weight gradients), best of a few repeats, and their ratio.
A 2048-square matmul heads the table: torch's `@` against oneDNN's product.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from relax_gym.cpu import onednn_linear
from relax_gym.cpu.onednn_linear import use_onednn_linears

# SmolLM2-135M: hidden 576, 9 query heads and 3 key/value heads of 64, MLP 1536, vocabulary 49152
SHAPES = {"q, o": (576, 576), "k, v": (576, 192), "gate, up": (576, 1536), "down": (1536, 576),
          "head": (576, 49152)}


def best_s(work: Callable[[], object], budget_s: float = 0.3) -> float:
    """Best time of `work` over repeats filling about `budget_s` (at least 3), after one warm-up call."""
    work()
    best, spent, runs = math.inf, 0.0, 0
    while runs < 3 or spent < budget_s:
        start = time.perf_counter()
        work()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best


def layer_rates(rows: int, in_features: int, out_features: int,
                budget_s: float) -> tuple[float, float, float, float]:
    """GFLOP/s of (F.linear forward, oneDNN forward, F.linear forward+backward, oneDNN forward+backward)."""
    plain = nn.Linear(in_features, out_features, bias=False)
    routed = nn.Linear(in_features, out_features, bias=False)
    routed.load_state_dict(plain.state_dict())
    use_onednn_linears(routed)
    x = torch.randn(rows, in_features, requires_grad=True)
    grad = torch.randn(rows, out_features)
    flops = 2 * rows * in_features * out_features

    def forward(layer: nn.Linear) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return layer(x)
        return run

    def both(layer: nn.Linear) -> Callable[[], object]:
        def run() -> object:
            layer(x).backward(grad)
            x.grad = layer.weight.grad = None
            return None
        return run

    return (flops / best_s(forward(plain), budget_s) / 1e9, flops / best_s(forward(routed), budget_s) / 1e9,
            3 * flops / best_s(both(plain), budget_s) / 1e9, 3 * flops / best_s(both(routed), budget_s) / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 1536])
    parser.add_argument("--budget-s", type=float, default=0.3, help="seconds of repeats per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not onednn_linear.onednn_available():
        raise SystemExit("oneDNN linears do not apply on this machine (not x86, no oneDNN, or RELAX_GYM_ONEDNN=0)")
    square = torch.randn(2048, 2048)
    flops = 2 * 2048**3
    mkl = flops / best_s(lambda: square @ square, args.budget_s) / 1e9
    dnn = flops / best_s(lambda: onednn_linear.onednn_product(square, square.t(), None), args.budget_s) / 1e9
    print(f"{args.threads} threads; 2048-square matmul: torch @ {mkl:.0f} GFLOP/s, oneDNN {dnn:.0f} GFLOP/s "
          f"({dnn / mkl:.2f}x)\n")
    print("| layers | rows | F.linear forward | oneDNN forward | ratio | F.linear fwd+bwd | oneDNN fwd+bwd | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        for name, (fan_in, fan_out) in SHAPES.items():
            if rows > 64 and name == "head":
                continue  # the trainer projects only trained positions onto the vocabulary
            f_fwd, d_fwd, f_both, d_both = layer_rates(rows, fan_in, fan_out, args.budget_s)
            print(f"| {name} ({fan_in} -> {fan_out}) | {rows} | {f_fwd:.0f} GFLOP/s | {d_fwd:.0f} | "
                  f"{d_fwd / f_fwd:.2f}x | {f_both:.0f} | {d_both:.0f} | {d_both / f_both:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
