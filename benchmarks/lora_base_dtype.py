"""Whether a LoRA run's frozen base should be held in bfloat16 on this CPU: one training forward and backward of
a rank-16 adapter (every linear layer) over the same batch, with the base in float32 (the run's path: oneDNN
linears) and in bfloat16 under autocast (the adapter kept in float32, as peft keeps it), and the gap between the
two bases' token logprobs.

Each base is built twice and timed three times per build (the minimum kept), alternating, so a slow spell of the
machine hits both. The adapter's B is drawn small and nonzero, as a trained adapter's is.

    python benchmarks/lora_base_dtype.py --model ~/.cache/relax_gym/models/SmolLM2-135M-Instruct --rows 16 --len 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from lora_vs_full import cpu_name

from relax_gym.cpu.onednn_linear import use_onednn_linears
from relax_gym.models import load_model
from relax_gym.models.lora import LoraSpec, add_adapter


def build(model: str, bf16_base: bool) -> torch.nn.Module:
    torch.manual_seed(1)
    net = load_model(model, dtype=torch.float32).model
    if not bf16_base:
        use_onednn_linears(net)
    add_adapter(net, LoraSpec(rank=16), model)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
            elif bf16_base and not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return net


def step(net: torch.nn.Module, ids: torch.Tensor, bf16_base: bool) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_base):
        logits = net(input_ids=ids).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logprobs.mean().backward()
    net.zero_grad(set_to_none=True)
    return time.perf_counter() - start, logprobs.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--len", type=int, default=128)
    args = parser.parse_args()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    logprobs: dict[bool, torch.Tensor] = {}
    ids = None
    for bf16_base in (False, True, False, True):
        net = build(args.model, bf16_base)
        if ids is None:  # random tokens of the model's vocabulary, the same for every build
            vocab = net.get_input_embeddings().num_embeddings
            ids = torch.randint(min(100, vocab // 2), min(20000, vocab), (args.rows, args.len),
                                generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(3):
            took, logprobs[bf16_base] = step(net, ids, bf16_base)
            times.append(took)
        seconds[bf16_base].append(min(times))
    gap = (logprobs[True] - logprobs[False]).abs()
    fp32, bf16 = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"CPU: {cpu_name()}; {args.model}, {args.rows} x {args.len} tokens, LoRA r=16 on every linear layer")
    print(f"forward + backward: float32 base {fp32:.2f} s, bfloat16 base {bf16:.2f} s "
          f"(bf16 / fp32 = {bf16 / fp32:.2f}x)")
    print(f"token logprob gap, bfloat16 base against float32: max {gap.max():.4f}, mean {gap.mean():.5f}")


if __name__ == "__main__":
    main()
