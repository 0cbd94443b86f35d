"""The GPU path's figures on random-weight models of real shapes: engine and trainer speed, the engine-trainer
logprob gap, weight-sync speed and the longest trainable sequence. `scripts/gpu_check.sh` runs it on a GPU;
`--shape tiny` runs the same code on a CPU in seconds (what the test suite checks).

For one shape (Qwen3-0.6B, -1.7B, -4B layouts with their 151,936-token vocabulary; weights random, built in
code, nothing downloaded), on `--device` (default: the GPU if there is one), it prints one markdown table:

- engine tokens/s: for each N of `--requests`, N prompts of `--prompt-tokens` random ids, `--new-tokens`
  sampled each, through the embedded engine (continuous batching, all N in one running batch) against one
  batched HF `generate` of the same prompts (the ratio);
- trainer tokens/s and MFU: `TorchBackend.train_step` on `--train-seqs` sequences of `--train-len` tokens
  (the last quarter trained), MFU = 6 × parameters × tokens/s / `--peak-tflops` (H100 bf16 dense: 989); the
  same for `MegatronBackend` (one rank, bf16 with float32 main params on a GPU), measured last, alone;
- logprob gap: the engine's sampled-token logprobs against the trainer's recomputation of the same tokens
  (mean and max |difference|) at the first N, which in bf16 is the off-policy noise every GPU run carries;
  then split: the engine against one forward of its own model (same weights and dtype: what the KV cache and
  batching add), and each side against one full-fp32 forward of the trainer's weights (TF32 off);
- weight sync: seconds per GB for `EmbeddedEngine.update_weights` from the trainer's `hf_state_dict()`;
- longest trainable sequence: the longest one-sequence train step (doubling, then bisecting) before the
  device runs out of memory (GPU only).

    python benchmarks/gpu_path.py --shape tiny                  # any machine: does it run
    python benchmarks/gpu_path.py --shape qwen3-0.6b            # on a GPU
    python benchmarks/gpu_path.py --shape qwen3-4b --train-seqs 8
    python benchmarks/gpu_path.py --shape qwen3-1.7b --requests 64 256 --parts engine   # the engine alone

`--parts` picks what runs: `engine` (tokens/s, the logprob gap, weight sync), `train` (trainer tokens/s and
MFU), `longest`; Megatron by `--megatron`. `--profile` times a decode step at the first N (the engine's own
batch and sampler, run on the main thread) and prints torch.profiler's top operators over 16 of them. The
models are built on `--device` directly (a random init of billions of parameters on a CPU takes minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import time
from dataclasses import replace
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_gym.engines import EmbeddedEngine, GenerateOutput, GenerateRequest, SamplingParams
from relax_gym.models import LoadedModel, build_tokenizer
from relax_gym.trainer.algorithms import AlgorithmConfig, make_loss_fn
from relax_gym.trainer.backends.torch_backend import TorchBackend, enable_tf32
from relax_gym.trainer.batch import Sample

#: Qwen3 layouts (hidden, layers, heads, kv heads, intermediate); head_dim 128 and the vocabulary are shared
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 128),
    "small": (512, 4, 8, 4, 1536),  # the full vocabulary with few layers: weight-sync figures on a CPU
    "qwen3-0.6b": (1024, 28, 16, 8, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 9728),
}
VOCAB = 151_936


def build(shape: str, device: str | torch.device = "cpu") -> LoadedModel:
    """A random-weight Qwen3 of `shape` in fp32, made on `device` (the engine and the trainer move their copies)."""
    hidden, layers, heads, kv_heads, intermediate = SHAPES[shape]
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128 if shape != "tiny" else 16,
        max_position_embeddings=40_960, tie_word_embeddings=shape == "qwen3-0.6b",
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return LoadedModel(model.eval(), tokenizer, None, ("text",), f"random {shape}")


def clone(loaded: LoadedModel) -> LoadedModel:
    """A copy of `loaded`'s model on its device (a copy, not a second random init)."""
    return replace(loaded, model=copy.deepcopy(loaded.model).eval())


def prompts(n: int, length: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """n rows of `length` random ids of a `vocab`-token vocabulary, clear of its low (often special) ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(min(1000, vocab // 2), vocab, (n, length), generator=generator).tolist()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def generate(engine: EmbeddedEngine, requests: list[GenerateRequest]) -> list[GenerateOutput]:
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


async def engine_tokens_per_s(engine: EmbeddedEngine, requests: list[GenerateRequest]) -> float:
    await engine.generate(replace(requests[0], sampling=replace(requests[0].sampling, max_new_tokens=2)))  # warm-up
    start = time.perf_counter()
    outputs = await generate(engine, requests)
    return sum(len(o.output_ids) for o in outputs) / (time.perf_counter() - start)


def rollout_sample(request: GenerateRequest, out: GenerateOutput) -> Sample:
    """What the trainer gets for one engine output: the prompt (not trained), then the sampled tokens."""
    return Sample(token_ids=request.input_ids + out.output_ids,
                  loss_mask=[0] * len(request.input_ids) + [1] * len(out.output_ids),
                  rollout_logprobs=[0.0] * len(request.input_ids) + out.logprobs)


def hf_generate_tokens_per_s(model: torch.nn.Module, ids: list[list[int]], new_tokens: int) -> float:
    device = next(model.parameters()).device
    batch = torch.tensor(ids, device=device)
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(batch[:1], attention_mask=torch.ones_like(batch[:1]), max_new_tokens=2, **kwargs)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **kwargs)
        synchronize(device)
    return (out.shape[1] - batch.shape[1]) * batch.shape[0] / (time.perf_counter() - start)


def logprob_gap(sample: Sample, recomputed: torch.Tensor) -> torch.Tensor:
    """|engine logprob - trainer logprob| of each sampled token."""
    trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
    return (recomputed.float().cpu()[trained] - torch.tensor(sample.rollout_logprobs)[trained]).abs()


def forward_logprobs(model: torch.nn.Module, sample: Sample) -> torch.Tensor:
    """Each token's logprob under one forward of `model` over the whole sample, aligned with its tokens (the
    first, which nothing predicts, gets 0), in the model's own dtype with TF32 off: the reference the engine's
    cached decode and the trainer's autocast forward are each measured against."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.token_ids], device=device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return torch.cat([logprobs.new_zeros(1), logprobs.gather(1, ids[0, 1:, None]).squeeze(1)])


def gap_rows(label: str, gaps: torch.Tensor) -> list[tuple[str, str]]:
    return [(f"{label}, mean", f"{gaps.mean():.2e}"), (f"{label}, max", f"{gaps.max():.2e}")]


def train_samples(n: int, length: int, vocab: int = VOCAB) -> list[Sample]:
    """n random sequences of `length` tokens, the last quarter trained, advantages alternating +-1."""
    trained = max(1, length // 4)
    return [Sample(token_ids=ids, loss_mask=[0] * (length - trained) + [1] * trained,
                   rollout_logprobs=[0.0] * (length - trained) + [-1.0] * trained, advantage=1.0 if i % 2 else -1.0)
            for i, ids in enumerate(prompts(n, length, seed=1, vocab=vocab))]


def longest_trainable(backend: TorchBackend, loss_fn: Any, limit: int) -> int:
    """The longest single sequence one train step takes before CUDA runs out of memory (0 on other devices)."""
    if backend.device.type != "cuda":
        return 0

    def fits(length: int) -> bool:
        try:
            backend.train_step(train_samples(1, length), loss_fn)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    low, high = 0, 1024
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 256:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def train_tokens_per_s(backend: Any, args: argparse.Namespace, device: torch.device) -> float:
    """Tokens per second of one `train_step` on `--train-seqs` sequences of `--train-len`, after a warm-up step."""
    loss_fn = make_loss_fn(AlgorithmConfig())
    samples = train_samples(args.train_seqs, args.train_len)
    backend.train_step(samples, loss_fn)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    backend.train_step(samples, loss_fn)
    synchronize(device)
    return args.train_seqs * args.train_len / (time.perf_counter() - start)


def megatron_tokens_per_s(base: LoadedModel, args: argparse.Namespace, device: torch.device) -> float:
    """`train_tokens_per_s` of `MegatronBackend` (one rank, its default dtype: bf16 on a GPU)."""
    from relax_gym.trainer.backends.megatron import MegatronBackend

    backend = MegatronBackend(clone(base), lr=1e-6, micro_batch_tokens=args.train_seqs * args.train_len)
    return train_tokens_per_s(backend, args, device)


PARTS = ("engine", "train", "longest")


def print_profile(engine: EmbeddedEngine, requests: list[GenerateRequest], device: torch.device,
                  steps: int = 16) -> None:
    """Where a decode step of `requests` goes: the engine's own pieces (`RunningBatch` and `RowSampler`, as its
    worker runs them) timed apart on this thread, then torch.profiler's top operators over `steps` steps. Run
    here rather than through the engine, whose worker thread the profiler does not see."""
    from torch.profiler import ProfilerActivity, profile

    from relax_gym.engines.continuous import RunningBatch
    from relax_gym.engines.sampling import RowSampler, seeded_generators

    params = [r.sampling for r in requests]
    generators = seeded_generators(params, device)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        sampler = RowSampler(params, device=device, generator=engine._generator, row_generators=generators)
        tokens, logprobs = sampler.sample(logits)
        torch.stack([tokens.double(), logprobs.double()]).tolist()  # the engine reads them back every step
        return tokens

    batch, logits = RunningBatch(engine.model, engine.pad_token_id).prefill([r.input_ids for r in requests])
    batch.last = sample(logits)
    forward_s = sample_s = 0.0
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        logits = batch.step()
        synchronize(device)
        middle = time.perf_counter()
        batch.last = sample(logits)
        forward_s, sample_s = forward_s + middle - start, sample_s + time.perf_counter() - middle
    print(f"profile: N={len(requests)}, per decode step: forward {1e3 * forward_s / steps:.1f} ms, "
          f"sampling and read-back {1e3 * sample_s / steps:.1f} ms")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            batch.last = sample(batch.step())
        synchronize(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


def engine_rows(base: LoadedModel, args: argparse.Namespace, device: torch.device) -> list[tuple[str, str]]:
    """Engine tokens/s against HF `generate` at each N, then the engine-trainer logprob gap at the first N and
    the in-process weight sync (the trainer's weights, two steps on when `train` runs too)."""
    engine = EmbeddedEngine(clone(base), device=device, max_batch_size=max(args.requests))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    rows: list[tuple[str, str]] = []
    try:
        for n in args.requests:
            ids = prompts(n, args.prompt_tokens)
            requests = [GenerateRequest(p, replace(sampling, seed=i)) for i, p in enumerate(ids)]
            if args.profile and n == args.requests[0]:
                print_profile(engine, requests, device)
            engine_tps = asyncio.run(engine_tokens_per_s(engine, requests))
            hf_tps = hf_generate_tokens_per_s(engine.model, ids, args.new_tokens)
            rows += [(f"engine tokens/s, N={n} (continuous batching)", f"{engine_tps:,.0f}"),
                     (f"HF generate tokens/s, N={n} (one batch)", f"{hf_tps:,.0f}"),
                     (f"engine / HF generate, N={n}", f"{engine_tps / hf_tps:.2f}x")]
            if device.type == "cuda":
                torch.cuda.empty_cache()

        backend = TorchBackend(clone(base), lr=1e-6, device=device,
                               micro_batch_tokens=args.train_seqs * args.train_len)
        if "train" in args.parts:
            train_tps = train_tokens_per_s(backend, args, device)
            rows.append(("trainer tokens/s (fwd + bwd + AdamW)", f"{train_tps:,.0f}"))
            if device.type == "cuda":
                params = sum(p.numel() for p in base.model.parameters())
                rows.append(("trainer MFU", f"{6 * params * train_tps / (args.peak_tflops * 1e12):.1%}"))

        state = backend.hf_state_dict()
        asyncio.run(engine.update_weights(state, 1))  # the trainer's weights into the engine
        ids = prompts(args.requests[0], args.prompt_tokens, seed=2)
        requests = [GenerateRequest(p, replace(sampling, seed=i)) for i, p in enumerate(ids)]
        generated = [rollout_sample(r, o) for r, o in zip(requests, asyncio.run(generate(engine, requests)),
                                                            strict=True)]
        recomputed = [out.logprobs for out in backend.logprobs(generated, temperature=1.0)]
        n = args.requests[0]
        rows += gap_rows(f"logprob gap engine vs trainer, N={n}",
                         torch.cat([logprob_gap(s, lp) for s, lp in zip(generated, recomputed, strict=True)]))
        # where the gap comes from: the engine's own model in one forward, and the trainer's weights in full fp32
        own = [forward_logprobs(engine.model, s) for s in generated]
        full = [forward_logprobs(backend.model, s) for s in generated]
        rows += gap_rows(f"logprob gap engine vs one forward of its own model, N={n}",
                         torch.cat([logprob_gap(s, lp) for s, lp in zip(generated, own, strict=True)]))
        rows += gap_rows(f"logprob gap engine vs fp32 forward, N={n}",
                         torch.cat([logprob_gap(s, lp) for s, lp in zip(generated, full, strict=True)]))
        trainer_vs_fp32 = [logprob_gap(replace(s, rollout_logprobs=lp.float().cpu().tolist()), f)
                           for s, lp, f in zip(generated, recomputed, full, strict=True)]
        rows += gap_rows(f"logprob gap trainer vs fp32 forward, N={n}", torch.cat(trainer_vs_fp32))
        del own, full

        gigabytes = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
        start = time.perf_counter()
        asyncio.run(engine.update_weights(backend.hf_state_dict(), 2))
        synchronize(device)
        rows.append(("weight sync, in-process state dict", f"{(time.perf_counter() - start) / gigabytes:.2f} s/GB "
                                                           f"({gigabytes:.2f} GB)"))
        if "longest" in args.parts and device.type == "cuda":
            rows.append(("longest trainable sequence (1 per step)",
                         f"{longest_trainable(backend, make_loss_fn(AlgorithmConfig()), args.longest_limit):,} tokens"))
        del backend, state
    finally:
        asyncio.run(engine.close())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, nargs="+", default=[64],
                        help="concurrent requests, one measurement per number (the gap is measured at the first)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-seqs", type=int, default=16)
    parser.add_argument("--train-len", type=int, default=2048)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's bf16 dense peak (H100: 989)")
    parser.add_argument("--longest-limit", type=int, default=131_072)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (engine always runs: the gap needs it)")
    parser.add_argument("--profile", action="store_true", help="print the engine's top operators at the first N")
    parser.add_argument("--megatron", action=argparse.BooleanOptionalAction,
                        default=importlib.util.find_spec("megatron") is not None,
                        help="also time the Megatron backend (default: when megatron-core is installed)")
    args = parser.parse_args()
    args.parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if unknown := args.parts - set(PARTS):
        parser.error(f"--parts: {', '.join(sorted(unknown))} (expected some of {', '.join(PARTS)})")
    if args.shape == "tiny":
        args.requests, args.prompt_tokens, args.new_tokens, args.train_seqs, args.train_len = [4], 16, 8, 4, 32
    device = torch.device(args.device)
    enable_tf32(device)
    base = build(args.shape, device)
    params = sum(p.numel() for p in base.model.parameters())
    rows: list[tuple[str, str]] = [("shape", f"{args.shape} ({params / 1e9:.2f} B parameters)"),
                                   ("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
                                   ("workload", f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens")]
    rows += engine_rows(base, args, device)
    if args.megatron:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        megatron_tps = megatron_tokens_per_s(base, args, device)
        rows.append(("Megatron trainer tokens/s (bf16 on a GPU, fwd + bwd + distributed Adam)", f"{megatron_tps:,.0f}"))
        if device.type == "cuda":
            rows.append(("Megatron trainer MFU", f"{6 * params * megatron_tps / (args.peak_tflops * 1e12):.1%}"))
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
