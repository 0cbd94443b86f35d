"""LoRA against full fine-tuning on one model, in one run, as users start it (`relax-gym train CONFIG`, checkpoints
and logs on): seconds per step, the training phase's seconds, peak RSS, the bytes each weight push sends, and the
held-out pass@1 before and after the same steps.

Each variant runs the CLI in a fresh process (`train_memory.peak_rss_gb`), with an eval at step 0 and at the last
step. The bytes pushed are counted from the model: every parameter for a full run (a tied tensor once), the
adapted layers' merged weights for LoRA (`relax_gym.models.lora.merged_weights`: what reaches the engine).

    python benchmarks/lora_vs_full.py --config examples/configs/smollm2_arithmetic.yaml --steps 10 \\
        --model ~/.cache/relax_gym/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from train_memory import peak_rss_gb

from relax_gym.models import load_model
from relax_gym.models.lora import LoraSpec, adapter_tensors, add_adapter, merged_weights

VARIANTS = {
    "full": ["trainer.lr=5e-6"],
    "lora r=16": ["trainer.lora={rank: 16}", "trainer.lr=1e-4"],
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def pushed_bytes(model: str, rank: int | None) -> tuple[int, int]:
    """What one weight push carries to the embedded engine (all weights, or the merged adapted layers) and to vLLM
    (all weights, or the adapter alone)."""
    loaded = load_model(model, dtype=torch.float32)  # as the trainer holds it, whatever dtype the folder saved
    if rank is None:
        full = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in loaded.model.parameters()}.values())
        return full, full
    peft_model = add_adapter(loaded.model, LoraSpec(rank=rank), model)
    return (sum(t.numel() * t.element_size() for t in merged_weights(loaded.model).values()),
            sum(t.numel() * t.element_size() for t in adapter_tensors(peft_model).values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; config {args.config}, model {args.model}, {args.steps} steps\n")
    print("| variant | s/step (median) | train_s (median) | peak RSS | bytes pushed / step (embedded; vLLM) | "
          "held-out pass@1 |\n|---|---:|---:|---:|---:|---|")
    for name, overrides in VARIANTS.items():
        with tempfile.TemporaryDirectory() as run_dir:
            peak = peak_rss_gb([sys.executable, "-m", "relax_gym.cli", "train", args.config, f"run_dir={run_dir}",
                                f"model={args.model}", f"trainer.total_steps={args.steps}",
                                f"trainer.eval_every={args.steps}", f"trainer.checkpoint_every={args.steps}",
                                "trainer.mode=sync", "trainer.max_staleness=0", *overrides])
            rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r.get("type") == "train"]
        evals = {r["step"]: r["reward_mean"] for r in rows if r.get("type") == "eval"}
        step_s = statistics.median(r["step_time_s"] for r in train[1:] or train)
        train_s = statistics.median(r["train_s"] for r in train)
        rank = 16 if name.startswith("lora") else None
        embedded, vllm = (n / 1e6 for n in pushed_bytes(args.model, rank))
        print(f"| {name} ({' '.join(overrides)}) | {step_s:.2f} | {train_s:.2f} | {peak:.2f} GB | {embedded:.0f} MB; "
              f"{vllm:.1f} MB | "
              f"{evals.get(0, float('nan')):.3f} -> {evals.get(args.steps, float('nan')):.3f} |", flush=True)


if __name__ == "__main__":
    main()
