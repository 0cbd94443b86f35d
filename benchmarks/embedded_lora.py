"""Whether the embedded engine should hold a LoRA run's adapter merged into its weights (what a run does: each push
copies the adapted layers' merged weights in) or unmerged beside them (`ResidentAdapters`, what multi-LoRA needs):
decode throughput of the same requests both ways, and the cost of one push both ways.

Both engines start from the same base and the same rank-16 adapter on every linear layer (B drawn small and
nonzero, as a trained adapter's is). The requests are GRPO's shape: `--rows` concurrent samples of one prompt,
seeded, `--new` tokens at most. Each way decodes them `--repeats` times, alternating, and the fastest pass
counts, so a slow spell of the machine hits both; one engine serves both ways, its base restored between them. A
push is, merged, `update_weights` of the adapted layers' merged weights (what the trainer sends); unmerged,
writing the adapter folder and loading it.

    python benchmarks/embedded_lora.py --model ~/.cache/relax_gym/models/SmolLM2-135M-Instruct --rows 16 --new 64
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from lora_vs_full import cpu_name

from relax_gym.engines import GenerateRequest, SamplingParams
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.models import load_model
from relax_gym.models.lora import LoraSpec, adapter_tensors, add_adapter, merged_weights, write_adapter

SPEC = LoraSpec(rank=16)
PROMPT = "Write a short story about a robot who learns to paint, in plain words."


def adapted(model: str, seed: int) -> tuple[object, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The base with a drawn adapter, its adapter tensors (peft's names) and its adapted layers merged."""
    loaded = load_model(model, dtype=torch.float32)
    peft_model = add_adapter(loaded.model, SPEC, model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return loaded, adapter_tensors(peft_model), merged_weights(loaded.model)


async def decode(engine: EmbeddedEngine, ids: list[int], rows: int, new: int, adapter: str | None) -> tuple[float, int]:
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(
        ids, SamplingParams(temperature=1.0, max_new_tokens=new, seed=i), adapter=adapter)) for i in range(rows)))
    return time.perf_counter() - start, sum(len(o.output_ids) for o in outs)


async def run(args: argparse.Namespace) -> None:
    tokenizer = load_model(args.model).tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    _, tensors, merged = adapted(args.model, 1)
    _, tensors2, merged2 = adapted(args.model, 2)
    folder = Path(tempfile.mkdtemp())
    base = load_model(args.model, dtype=torch.float32)

    # one engine both ways (two engines' worker threads in one process slowed whichever ran second)
    engine = EmbeddedEngine(load_model(args.model, dtype=torch.float32), max_batch_size=args.rows)
    originals = {name: engine.model.state_dict()[name].clone() for name in merged}
    rates: dict[str, list[float]] = {"merged": [], "unmerged": []}
    pushes: dict[str, list[float]] = {"merged": [], "unmerged": []}
    for repeat in range(args.repeats):
        version = 2 * repeat + 1
        start = time.perf_counter()
        await engine.update_weights(merged if repeat % 2 else merged2, version)
        pushes["merged"].append(time.perf_counter() - start)
        seconds, tokens = await decode(engine, ids, args.rows, args.new, None)
        rates["merged"].append(tokens / seconds)
        await engine.update_weights(originals, version + 1)
        start = time.perf_counter()
        name = f"v{version + 1}"
        write_adapter(folder / name, tensors if repeat % 2 else tensors2, SPEC, base.model, args.model)
        await engine.load_adapter(name, folder / name)
        pushes["unmerged"].append(time.perf_counter() - start)
        seconds, tokens = await decode(engine, ids, args.rows, args.new, name)
        rates["unmerged"].append(tokens / seconds)
        await engine.unload_adapter(name)
    await engine.close()

    best = {kind: max(r) for kind, r in rates.items()}
    push = {kind: min(p) for kind, p in pushes.items()}
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model}, "
          f"{args.rows} rows x {args.new} new tokens, rank {SPEC.rank} on every linear layer")
    print(f"decode: merged {best['merged']:.1f} tok/s, unmerged {best['unmerged']:.1f} tok/s "
          f"(unmerged / merged = {best['unmerged'] / best['merged']:.2f}x)")
    print(f"push: merged {push['merged'] * 1000:.0f} ms, unmerged {push['unmerged'] * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
