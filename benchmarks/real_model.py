"""A real pretrained model's engine and trainer speed, each against plain transformers on the same work, in one run.

- engine: for each task of `--tasks` and each N of `--requests`, N chat-templated prompts (`sums`: 2-digit sums,
  the SmolLM2 example's task, answers of a few tokens; `stories`: a short story each, answers that run long),
  `--new-tokens` sampled each (ending early at end of turn), through the embedded engine (continuous batching)
  against one batched HF `generate` of the same prompts, and against the engine as it was before its KV cache grew
  in place and before shared prefixes were prefilled once (`--before`); generated tokens/s and the ratios.
- decode step: one step of N rows at a context of `--context` tokens, against two floors measured in the same run:
  reading the weights once (their bytes over this machine's copy bandwidth) and their multiply-adds at the best
  fp32 matmul rate measured here (a 2048-square product through oneDNN, as the engine's linears run it; torch's
  own `@` beside it).
- trainer: one optimizer step on `--train-seqs` sequences of `--train-len` tokens (the last quarter trained):
  `TorchBackend.train_step` (GRPO loss) against the plain step a user writes (HF forward with labels, backward,
  AdamW); tokens/s and the ratio, the median of `--repeats` steps after one warm-up each. With `--train-groups`
  G > 1 the sequences come in groups of G sharing their untrained three quarters, as a GRPO group shares its
  prompt, and the backend also runs without prefix sharing (`share_prefixes=False`).

    python benchmarks/real_model.py --model ~/.cache/relax_gym/models/SmolLM2-135M-Instruct --before
    python benchmarks/real_model.py --model tiny --requests 4 --new-tokens 8 --train-seqs 2 --train-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import math
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
from gpu_path import engine_tokens_per_s, generate, train_samples
from transformers.cache_utils import DynamicLayer

from relax_gym import messages as M
from relax_gym.cpu import onednn_linear
from relax_gym.cpu.process import prepare_process
from relax_gym.cpu.threads import release_openmp_workers
from relax_gym.engines import EmbeddedEngine, GenerateRequest, SamplingParams, continuous
from relax_gym.models import LoadedModel, load_model, render_ids
from relax_gym.trainer.algorithms import AlgorithmConfig, make_loss_fn
from relax_gym.trainer.backends.torch_backend import TorchBackend
from relax_gym.trainer.batch import Sample


def sum_prompts(loaded: LoadedModel, n: int, seed: int = 0) -> list[list[int]]:
    """n chat-templated prompts "What is A + B? Reply with just the integer." (2-digit A, B)."""
    rng = random.Random(seed)
    return [render_ids(loaded, [M.message("user", f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Reply "
                                                  "with just the integer.")], add_generation_prompt=True)
            for _ in range(n)]


STORY_SUBJECTS = ("a lighthouse keeper", "a lost robot", "two rival bakers", "a river that runs uphill",
                  "a cat who audits taxes", "the last train of the night", "a map with a missing town",
                  "a violin that remembers")


def story_prompts(loaded: LoadedModel, n: int, seed: int = 0) -> list[list[int]]:
    """n chat-templated prompts asking for a short story: answers that run to hundreds of tokens."""
    rng = random.Random(seed)
    return [render_ids(loaded, [M.message("user", f"Write a short story about {rng.choice(STORY_SUBJECTS)} in "
                                                  f"{rng.randint(3, 9)} paragraphs.")], add_generation_prompt=True)
            for _ in range(n)]


TASKS = {"sums": sum_prompts, "stories": story_prompts}


@contextlib.contextmanager
def engine_before() -> Iterator[None]:
    """The embedded engine as it was before this benchmark's levers: a KV cache that concatenates at every step
    (transformers' own `DynamicLayer.update`) and no shared-prefix prefill."""
    saved = continuous.SlackLayer.update, continuous.MIN_PREFIX_TOKENS_SAVED
    continuous.SlackLayer.update = DynamicLayer.update  # type: ignore[method-assign]
    continuous.MIN_PREFIX_TOKENS_SAVED = 1 << 62
    try:
        yield
    finally:
        continuous.SlackLayer.update, continuous.MIN_PREFIX_TOKENS_SAVED = saved  # type: ignore[method-assign]


def logprob_gap(loaded: LoadedModel, engine: EmbeddedEngine, requests: list[GenerateRequest]) -> tuple[float, float]:
    """Mean and max |engine logprob - float32 model logprob| over the tokens `engine` samples for `requests`, the
    model's from one unpadded forward of each prompt and answer (what the trainer recomputes)."""
    outputs = asyncio.run(generate(engine, requests))
    gaps = []
    with torch.no_grad():
        for request, out in zip(requests, outputs, strict=True):
            if not out.output_ids:
                continue
            ids = torch.tensor([request.input_ids + out.output_ids])
            logits = loaded.model(input_ids=ids).logits[0, len(request.input_ids) - 1:-1].float()
            model = logits.div(request.sampling.temperature).log_softmax(-1).gather(1, ids[0, len(request.input_ids):,
                                                                                         None])[:, 0]
            gaps.append((model - torch.tensor(out.logprobs)).abs())
    every = torch.cat(gaps)
    return every.mean().item(), every.max().item()


def copy_gb_per_s(megabytes: int = 512) -> float:
    """This machine's memory bandwidth as torch sees it: bytes read and written by a large copy, best of 5."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best / 1e9


def matmul_gflops(size: int = 2048) -> tuple[float, float]:
    """The fp32 matmul rates here, a size-square product, best of 5: torch's `@` (MKL) and oneDNN's (the engine's and
    the trainer's linears, `relax_gym.cpu.onednn_linear`; the same as `@` where oneDNN does not apply)."""
    a = torch.randn(size, size)
    routed = onednn_linear.onednn_available()
    rates = []
    for product in (lambda: a @ a, lambda: onednn_linear.onednn_product(a, a.t(), None) if routed else a @ a):
        product()
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
        rates.append(2 * size**3 / best / 1e9)
    return rates[0], rates[1]


def decode_step_s(model: torch.nn.Module, loaded: LoadedModel, rows: int, context: int, steps: int = 10) -> float:
    """One decode step of `model` (the engine's) over `rows` rows at about `context` tokens of KV cache, median of
    `steps`."""
    prompt = [loaded.tokenizer.eos_token_id or 0] * context
    batch, logits = continuous.RunningBatch(model, 0).prefill([[i % 7 + 100, *prompt] for i in range(rows)])
    batch.last = logits.argmax(-1)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        batch.last = batch.step().argmax(-1)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def hf_generate_tokens_per_s(loaded: LoadedModel, ids: list[list[int]], new_tokens: int, stop: list[int]) -> float:
    """One left-padded batch through `model.generate`, sampled at temperature 1 (seeded: a row that rambles to the
    token limit keeps every row decoding, so an unseeded run's rate varies twofold); tokens up to each row's stop."""
    model, pad = loaded.model, loaded.tokenizer.pad_token_id or 0
    torch.manual_seed(0)
    width = max(map(len, ids))
    batch = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": pad,
              "eos_token_id": stop}
    with torch.no_grad():
        model.generate(batch[:1], attention_mask=mask[:1], max_new_tokens=2, **kwargs)  # warm-up
        start = time.perf_counter()
        out = model.generate(batch, attention_mask=mask, max_new_tokens=new_tokens, **kwargs)
        elapsed = time.perf_counter() - start
    generated = 0
    for row in out[:, width:].tolist():
        ends = [i for i, token in enumerate(row) if token in stop]
        generated += ends[0] + 1 if ends else len(row)
    return generated / elapsed


def grouped(samples: list[Sample], size: int) -> list[Sample]:
    """`samples` in groups of `size` that share their untrained tokens (the first sample's), as a GRPO group's
    samples share their prompt."""
    out = []
    for i, sample in enumerate(samples):
        first = samples[i - i % size]
        prompt = sample.loss_mask.index(1)
        out.append(replace(sample, token_ids=first.token_ids[:prompt] + sample.token_ids[prompt:]))
    return out


def backend_step_s(loaded: LoadedModel, samples: list[Sample], repeats: int, share_prefixes: bool = True) -> float:
    backend = TorchBackend(replace(loaded, model=copy.deepcopy(loaded.model)), lr=1e-6, device="cpu",
                           micro_batch_tokens=sum(len(s.token_ids) for s in samples), share_prefixes=share_prefixes)
    loss_fn = make_loss_fn(AlgorithmConfig())
    backend.train_step(samples, loss_fn)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.train_step(samples, loss_fn)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plain_step_s(loaded: LoadedModel, samples: list[Sample], repeats: int) -> float:
    """The loop a user writes with transformers alone: forward with labels on the trained tokens, backward,
    gradient clipping, AdamW."""
    model = copy.deepcopy(loaded.model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.tensor([s.token_ids for s in samples])
    labels = ids.masked_fill(torch.tensor([s.loss_mask for s in samples]) == 0, -100)

    def step() -> None:
        model(input_ids=ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a name or folder load_model takes")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["sums"])
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--before", action="store_true", help="also the engine before its in-place KV cache and "
                                                              "shared-prefix prefill")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                        help="the engine's weights (rollout.engine_dtype)")
    parser.add_argument("--context", type=int, default=128, help="KV cache length of the decode-step timing")
    parser.add_argument("--train-seqs", type=int, default=8)
    parser.add_argument("--train-len", type=int, default=128)
    parser.add_argument("--train-groups", type=int, nargs="+", default=[1, 4], metavar="G",
                        help="trainer steps whose samples come in groups of G sharing their untrained tokens "
                             "(1: no two samples share a token)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    prepare_process()  # glibc's heaps as the CLI sets them, for both sides
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    params = sum(p.numel() for p in loaded.model.parameters())
    print(f"{loaded.name}: {params / 1e6:.1f}M parameters, {args.threads} threads\n")
    before_columns = (" before | now / before |", "---:|---:|") if args.before else ("", "")
    print(f"| part | work | relax-gym | plain transformers | ratio |{before_columns[0]}\n|---|---|---:|---:|---:|"
          f"{before_columns[1]}")
    engines = {dtype: EmbeddedEngine(replace(loaded, model=copy.deepcopy(loaded.model)), dtype=getattr(torch, dtype),
                                     max_batch_size=max(args.requests)) for dtype in args.dtypes}
    stop = sorted(next(iter(engines.values())).eos_token_ids)
    gaps: dict[str, tuple[float, float]] = {}
    try:
        for task in args.tasks:
            for n in args.requests:
                ids = TASKS[task](loaded, n)
                sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
                requests = [GenerateRequest(row, replace(sampling, seed=i)) for i, row in enumerate(ids)]
                theirs = hf_generate_tokens_per_s(loaded, ids, args.new_tokens, stop)
                release_openmp_workers()  # each side computes alone, as in a run (`relax_gym.cpu.threads`)
                for dtype, engine in engines.items():
                    ours = asyncio.run(engine_tokens_per_s(engine, requests))
                    row = (f"| engine, {dtype} | {task}, N={n}, up to {args.new_tokens} new tokens | {ours:,.1f} "
                           f"tokens/s | {theirs:,.1f} tokens/s (HF generate, float32) | {ours / theirs:.2f}x |")
                    if args.before and dtype == "float32":
                        with engine_before():
                            before = asyncio.run(engine_tokens_per_s(engine, requests))
                        row += f" {before:,.1f} tokens/s | {ours / before:.2f}x |"
                    print(row, flush=True)
                    if dtype not in gaps:
                        gaps[dtype] = logprob_gap(loaded, engine, requests[:8])
    finally:
        for engine in engines.values():
            asyncio.run(engine.close())
    print("\nlogprob gap to the float32 model (the trainer's), teacher-forced over each engine's own samples:\n")
    print("| weights | mean abs gap | max abs gap |\n|---|---:|---:|")
    for dtype, (mean, worst) in gaps.items():
        print(f"| {dtype} | {mean:.2e} | {worst:.2e} |")
    if "float32" not in engines:  # the decode step is the float32 engine's model as the engine prepared it
        engines["float32"] = EmbeddedEngine(replace(loaded, model=copy.deepcopy(loaded.model)))
        asyncio.run(engines["float32"].close())
    engine_model = engines["float32"].model
    unique = {t.data_ptr(): t for t in loaded.model.state_dict().values()}  # tied embeddings are one tensor
    weights_gb = sum(t.numel() * t.element_size() for t in unique.values()) / 1e9
    bandwidth, (torch_gflops, gflops) = copy_gb_per_s(), matmul_gflops()
    flops_per_row = 2 * sum(m.weight.numel() for m in loaded.model.modules() if isinstance(m, torch.nn.Linear))
    print(f"\ndecode step at a {args.context}-token cache; floors: weights {weights_gb:.2f} GB read once at "
          f"{bandwidth:.0f} GB/s (copy), multiply-adds at {gflops:.0f} GFLOP/s (fp32 matmul, oneDNN where it applies; "
          f"torch's own @ {torch_gflops:.0f})\n")
    print("| rows | step | read-once floor | compute floor | step / larger floor |\n|---:|---:|---:|---:|---:|")
    for n in args.requests:
        step = decode_step_s(engine_model, loaded, n, args.context)
        read, compute = weights_gb / bandwidth, n * flops_per_row / gflops / 1e9
        print(f"| {n} | {step * 1e3:.1f} ms | {read * 1e3:.1f} ms | {compute * 1e3:.1f} ms | "
              f"{step / max(read, compute):.2f}x |", flush=True)
    print()
    vocab = loaded.model.get_input_embeddings().num_embeddings
    tokens = args.train_seqs * args.train_len
    print("| part | work | relax-gym | plain transformers | ratio |\n|---|---|---:|---:|---:|")
    for size in args.train_groups:
        samples = grouped(train_samples(args.train_seqs, args.train_len, vocab), size)
        ours_s, theirs_s = backend_step_s(loaded, samples, args.repeats), plain_step_s(loaded, samples, args.repeats)
        work = f"{args.train_seqs} x {args.train_len} tokens" + (f", groups of {size} sharing their untrained "
                                                                 f"{3 * args.train_len // 4}" if size > 1 else "")
        print(f"| trainer | {work}, one AdamW step | {tokens / ours_s:,.0f} tokens/s | {tokens / theirs_s:,.0f} "
              f"tokens/s (forward with labels, backward, AdamW) | {theirs_s / ours_s:.2f}x |", flush=True)
        if size > 1:
            plain_s = backend_step_s(loaded, samples, args.repeats, share_prefixes=False)
            print(f"| trainer without prefix sharing | the same | {tokens / plain_s:,.0f} tokens/s | | "
                  f"{theirs_s / plain_s:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
