"""The loss's logprob kernel (`trainer/backends/logprob_kernel.py`) against plain autograd through `log_softmax`,
forward and backward, on one device: seconds (best of `--repeats`, alternating) and the ratio.

    python benchmarks/logprob_kernel.py --rows 2048 --vocab 49152 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from relax_gym.trainer.backends.logprob_kernel import token_logprobs


def autograd(logits: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    logp = (logits / temperature).log_softmax(-1)
    picked = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1] if with_entropy else None
    return picked, entropy


def kernel(logits: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    return token_logprobs(logits, ids, temperature, with_entropy=with_entropy)


def step_s(fn, logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool) -> float:
    leaf = logits.clone().requires_grad_()
    start = time.perf_counter()
    logprobs, entropy = fn(leaf, ids, 0.7, with_entropy)
    (logprobs.sum() + (entropy.sum() if entropy is not None else 0)).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(1, args.rows, args.vocab)
    ids = torch.randint(0, args.vocab, (1, args.rows))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.rows} rows x {args.vocab} vocabulary")
    print("| with entropy | autograd s | kernel s | ratio |\n|---|---|---|---|")
    for with_entropy in (False, True):
        best = {"autograd": float("inf"), "kernel": float("inf")}
        for _ in range(args.repeats):
            for name, fn in (("autograd", autograd), ("kernel", kernel)):
                best[name] = min(best[name], step_s(fn, logits, ids, with_entropy))
        print(f"| {with_entropy} | {best['autograd']:.3f} | {best['kernel']:.3f} | "
              f"{best['kernel'] / best['autograd']:.2f}x |")


if __name__ == "__main__":
    main()
