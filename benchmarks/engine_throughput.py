"""Embedded engine throughput: N concurrent requests batched vs the same requests one at a time.

Both modes run in the same process on the same engine, greedy (so both produce
the same tokens), after a warm-up, alternating for `--repeats` rounds; the best
round of each counts, since other load on a shared machine only ever slows a
round down. Prints a markdown table of generated tokens per second and the ratio.

    python benchmarks/engine_throughput.py [--n 8 32] [--max-new-tokens 64] [--repeats 3]
                                           [--threads T] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_gym import messages as M
from relax_gym.engines import EmbeddedEngine, GenerateRequest, SamplingParams
from relax_gym.models import LoadedModel, build_tokenizer, load_model, render_ids


def _wider(device: str) -> LoadedModel:
    """The tiny Qwen3 scaled up to hidden 256 / 4 layers, on the same tokenizer."""
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device).eval()
    return LoadedModel(model, tokenizer, None, ("text",), "qwen3-h256-l4")


def _requests(loaded: LoadedModel, n: int, max_new_tokens: int) -> list[GenerateRequest]:
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    return [
        GenerateRequest(render_ids(loaded, [M.user(f"Question {i}: what is {i} * {i + 3}?")]), params) for i in range(n)
    ]


async def _tokens_per_s(engine: EmbeddedEngine, requests: list[GenerateRequest], batched: bool) -> float:
    start = time.perf_counter()
    if batched:
        outputs = await asyncio.gather(*(engine.generate(r) for r in requests))
    else:
        outputs = [await engine.generate(r) for r in requests]
    return sum(len(o.output_ids) for o in outputs) / (time.perf_counter() - start)


async def _measure(loaded: LoadedModel, n: int, max_new_tokens: int, repeats: int) -> tuple[float, float]:
    engine = EmbeddedEngine(loaded, max_batch_size=n)
    try:
        requests = _requests(loaded, n, max_new_tokens)
        await _tokens_per_s(engine, requests[:2], batched=True)  # warm-up
        rounds = [
            (await _tokens_per_s(engine, requests, batched=False), await _tokens_per_s(engine, requests, batched=True))
            for _ in range(repeats)
        ]
        return max(r[0] for r in rounds), max(r[1] for r in rounds)
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8, 32], help="concurrent requests")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    models = [load_model("tiny", device=args.device), _wider(args.device)]
    print(
        f"device: {args.device}, torch threads: {torch.get_num_threads()}, greedy, "
        f"max_new_tokens={args.max_new_tokens}, best of {args.repeats} rounds\n"
    )
    print("| model | params | N | one at a time (tok/s) | batched (tok/s) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for loaded in models:
        params = sum(p.numel() for p in loaded.model.parameters())
        for n in args.n:
            one_by_one, batched = asyncio.run(_measure(loaded, n, args.max_new_tokens, args.repeats))
            print(
                f"| {loaded.name} | {params / 1e6:.2f} M | {n} | {one_by_one:,.0f} | {batched:,.0f} | "
                f"{batched / one_by_one:.1f}x |"
            )


if __name__ == "__main__":
    main()
