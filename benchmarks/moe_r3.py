"""Rollout routing replay (R3) on a mixture-of-experts policy: what it fixes and what it costs.

The engine runs the policy in bfloat16 and the trainer in float32 (a GPU run's precisions), both on this
machine's CPU. One rollout (Arithmetic-v0, `--groups` groups of `--group-size`, routes recorded) gives the
trajectories; then, with replay off and on:

- the fraction of (token, layer) routes where the trainer's top-k differs from the engine's, and of tokens
  with any layer differing;
- the engine-vs-trainer logprob gap on the trained tokens (mean, p99, max |difference|);
- the trainer's step time (`TorchBackend.train_step`, GRPO loss) on the same samples, replay on and off
  interleaved `--repeats` times (alternating which goes first); the overhead is median(on) / median(off) - 1
  (anchor: Relax reports 1.9 %). Run it on a quiet machine: other jobs move a 1 s step by more than that.

    python benchmarks/moe_r3.py                     # tiny-moe: 2 layers, 8 experts of width 32, top 2
    python benchmarks/moe_r3.py --shape small-moe   # 4 layers of 256, 32 experts of width 128, top 4
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time
from typing import Any

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from relax_gym.engines import EmbeddedEngine, SamplingParams
from relax_gym.models import LoadedModel, build_tokenizer, load_model
from relax_gym.models.moe_routing import recording
from relax_gym.rollout import RolloutManager
from relax_gym.trainer.algorithms import AlgorithmConfig, make_loss_fn
from relax_gym.trainer.backends.torch_backend import TorchBackend
from relax_gym.trainer.batch import Sample
from relax_gym.trajectory import Trajectory


def policy(shape: str) -> LoadedModel:
    if shape == "tiny-moe":
        return load_model("tiny-moe")
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=128, decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return LoadedModel(Qwen3MoeForCausalLM(config).eval(), tokenizer, None, ("text",), shape)


def rollout(loaded: LoadedModel, groups: int, group_size: int, new_tokens: int) -> list[Trajectory]:
    in_bf16 = copy.deepcopy(loaded)
    in_bf16.model.to(torch.bfloat16)
    manager = RolloutManager(EmbeddedEngine(in_bf16), loaded, routed_experts=True, sampling_seed=0,
                             sampling=SamplingParams(max_new_tokens=new_tokens, temperature=1.0))
    return asyncio.run(manager.run("relax/Arithmetic-v0", groups, group_size))


def samples_of(trajs: list[Trajectory], replay: bool) -> list[Sample]:
    return [Sample(t.token_ids, t.loss_mask, t.rollout_logprobs, advantage=1.0 if i % 2 else -1.0,
                   routed_experts=t.routed_experts if replay else None) for i, t in enumerate(trajs)]


def agreement(backend: TorchBackend, trajs: list[Trajectory], replay: bool) -> dict[str, float]:
    """Route disagreement and logprob gap of the trainer's forward against the engine's (one micro-batch)."""
    width = max(len(t.token_ids) for t in trajs)
    budget, backend.micro_batch_tokens = backend.micro_batch_tokens, len(trajs) * width
    try:
        with recording(backend.model) as taken:
            out = backend.logprobs(samples_of(trajs, replay))
    finally:
        backend.micro_batch_tokens = budget
    grid = torch.stack([layer[0] for layer in taken])  # [layers, rows x width, top_k], as `batch_routes` lays it
    layers = grid.shape[0]
    grid = grid.reshape(layers, len(trajs), width, -1)
    differing_routes = differing_tokens = routed = 0
    for i, t in enumerate(trajs):
        engine = torch.as_tensor(t.routed_experts).permute(1, 0, 2).long()  # [layers, tokens, top_k]
        mine = grid[:, i, : engine.shape[1]]
        differs = (mine.sort(-1).values != engine.sort(-1).values).any(-1)  # [layers, tokens]: another expert set
        differing_routes += int(differs.sum())
        differing_tokens += int(differs.any(0).sum())
        routed += engine.shape[1]
    gaps = torch.cat([(o.logprobs - torch.tensor(t.rollout_logprobs))[torch.tensor(t.loss_mask, dtype=torch.bool)]
                      .abs() for o, t in zip(out, trajs, strict=True)])
    return {"route_diff": differing_routes / (routed * layers), "token_diff": differing_tokens / routed,
            "gap_mean": gaps.mean().item(), "gap_p99": gaps.quantile(0.99).item(), "gap_max": gaps.max().item()}


def step_times(backend: TorchBackend, trajs: list[Trajectory], repeats: int) -> dict[bool, list[float]]:
    loss_fn = make_loss_fn(AlgorithmConfig(algorithm="grpo"))
    times: dict[bool, list[float]] = {False: [], True: []}
    backend.train_step(samples_of(trajs, True), loss_fn)  # warm-up
    for repeat in range(repeats):
        for replay in ((False, True) if repeat % 2 else (True, False)):  # neither always runs second
            samples = samples_of(trajs, replay)
            start = time.perf_counter()
            backend.train_step(samples, loss_fn)
            times[replay].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny-moe", "small-moe"), default="tiny-moe")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    loaded = policy(args.shape)
    trajs = rollout(loaded, args.groups, args.group_size, args.new_tokens)
    backend = TorchBackend(copy.deepcopy(loaded), replay_routes=True, micro_batch_tokens=8192, lr=1e-5)
    rows: dict[bool, dict[str, Any]] = {replay: agreement(backend, trajs, replay) for replay in (False, True)}
    times = step_times(backend, trajs, args.repeats)
    tokens = sum(len(t.token_ids) for t in trajs)
    print(f"{args.shape}: {len(trajs)} trajectories, {tokens} tokens; engine bfloat16, trainer float32 (CPU)\n")
    print("| replay | routes differing (token, layer) | tokens with any layer differing | logprob gap mean | "
          "p99 | max | train step s (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for replay in (False, True):
        r = rows[replay]
        print(f"| {'on' if replay else 'off'} | {r['route_diff']:.2%} | {r['token_diff']:.2%} | {r['gap_mean']:.2e} | "
              f"{r['gap_p99']:.2e} | {r['gap_max']:.2e} | {statistics.median(times[replay]):.3f} |")
    overhead = statistics.median(times[True]) / statistics.median(times[False]) - 1
    print(f"\nR3 step-time overhead: {overhead:+.1%} (median of {args.repeats} interleaved steps each; "
          "Relax reports 1.9 %)")


if __name__ == "__main__":
    main()
