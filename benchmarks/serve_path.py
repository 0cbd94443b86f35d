"""The served path on one host: many concurrent requests through `relax-gym serve` with the SGLang client, and
weight sync to that server by each strategy. Runs on a CPU or a GPU alike (`--device`: where the served model,
the baseline engine and the pushed weights live; on a GPU the served model is bf16, as SGLang serves it).

- concurrency: `--requests` (512) requests at once, each `--prompt-tokens` random ids and `--new-tokens` sampled,
  from one `SGLangEngine` (its pool is unlimited and never times out) to a `relax-gym serve` in its own process,
  once with `max_pending` above the load (all admitted) and once at the server's default (256: the rest get 503
  and the client waits them out). Baseline: the same requests through an in-process `EmbeddedEngine` (the
  same default batch size as the served one). Reported: completed / failed, the client's outages, tokens/s
  and its ratio to the baseline, p50 and p99 latency. `--model` is a tiny name, a folder, or a shape of
  `gpu_path.SHAPES` (random weights at that shape, saved to a temporary folder).
- weight sync: the `--sync-shape` model's state dict (in the served dtype, on `--device`) to a served copy, by
  each of `--strategies`: `tensor` (SGLang's serialized_named_tensors: shared memory from a CPU, CUDA IPC
  handles from a GPU), `safetensors` (base64 in the request body, as to a server on another host), `disk` (an
  HF folder written, then loaded by path), `gloo` and `nccl` (a process group, SGLang's
  /update_weights_from_distributed; NCCL needs a GPU); seconds per GB (median of `--repeats`) and the ratio
  to `tensor`. A strategy that fails is reported with its error, and the others still run.

    python benchmarks/serve_path.py                       # both parts, tiny model for concurrency
    python benchmarks/serve_path.py --skip-sync --requests 1024
    python benchmarks/serve_path.py --model qwen3-0.6b --sync-shape qwen3-0.6b --strategies tensor,disk,nccl
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch
from gpu_path import SHAPES, build, prompts, synchronize

from relax_gym.engines import EmbeddedEngine, GenerateRequest, SamplingParams, SGLangEngine
from relax_gym.engines.base import API_KEY_ENV
from relax_gym.engines.embedded import MAX_BATCH_SIZE, engine_device
from relax_gym.models import load_model
from relax_gym.models.loading import save_model
from relax_gym.trainer.weight_publish import DistributedPublisher

KEY = "serve-path-bench"
STRATEGIES = ("tensor", "safetensors", "disk", "gloo", "nccl")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(model: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "relax_gym.cli", "serve", "--model", model, "--port", str(port),
                                *extra], env={**os.environ, API_KEY_ENV: KEY}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "serve exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError("relax-gym serve did not come up")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def requests_of(n: int, prompt_tokens: int, new_tokens: int, vocab: int) -> list[GenerateRequest]:
    ids = [[1000 + t % (vocab - 1000) for t in row] for row in prompts(n, prompt_tokens)]
    return [GenerateRequest(row, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i))
            for i, row in enumerate(ids)]


async def timed(engine: Any, requests: list[GenerateRequest]) -> dict[str, float]:
    latencies: list[float] = []
    failed = 0

    async def one(request: GenerateRequest) -> int:
        nonlocal failed
        start = time.perf_counter()
        try:
            out = await engine.generate(request)
        except Exception:  # counted: the benchmark's claim is that there are none
            failed += 1
            return 0
        latencies.append(time.perf_counter() - start)
        return len(out.output_ids)

    await engine.generate(replace(requests[0], sampling=replace(requests[0].sampling, max_new_tokens=2)))  # warm-up
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(r) for r in requests)))
    wall = time.perf_counter() - start
    latencies.sort()
    return {"completed": len(latencies), "failed": failed, "wall_s": wall, "tokens_per_s": tokens / wall,
            "p50_s": latencies[len(latencies) // 2] if latencies else float("nan"),
            "p99_s": latencies[int(len(latencies) * 0.99)] if latencies else float("nan")}


def served_dtype(device: str) -> torch.dtype:
    """The dtype `relax-gym serve` holds its model in on `device` (the embedded engine's choice)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def shape_folder(shape: str, device: str) -> str:
    """A random-weight model of `shape` (`gpu_path.SHAPES`), saved in the served dtype to a temporary folder."""
    loaded = build(shape, device)
    loaded.model.to(served_dtype(device))
    folder = Path(tempfile.mkdtemp(prefix="serve-path-model-")) / shape
    save_model(loaded, folder)
    return str(folder)


def model_folder(model: str, device: str) -> str:
    """`model` as `load_model` takes it: a shape of `SHAPES` (not tiny, a name `load_model` knows) is saved."""
    return shape_folder(model, device) if model in SHAPES and model != "tiny" else model


def concurrency(args: argparse.Namespace) -> list[str]:
    model = model_folder(args.model, args.device)
    loaded = load_model(model)
    requests = requests_of(args.requests, args.prompt_tokens, args.new_tokens, loaded.model.config.vocab_size)

    async def in_process() -> dict[str, float]:
        engine = EmbeddedEngine(loaded, device=args.device)  # serve's batch size: the engine's default
        try:
            return await timed(engine, requests)
        finally:
            await engine.close()

    baseline = asyncio.run(in_process())
    rows = [f"| in-process engine (baseline) | {baseline['completed']:.0f} | {baseline['failed']:.0f} | - | "
            f"{baseline['tokens_per_s']:.0f} | 1.00 | {baseline['p50_s']:.2f} | {baseline['p99_s']:.2f} |"]
    for label, pending in ((f"serve, max_pending {2 * args.requests}", 2 * args.requests), ("serve, default "
                                                                                              "max_pending 256", None)):
        process, url = start_serve(model, "--device", args.device,
                                   *(["--max-pending", str(pending)] if pending else []))
        try:
            client = SGLangEngine(url, api_key=KEY, backoff_s=0.05, max_backoff_s=0.5)

            async def through_http(client: SGLangEngine = client) -> dict[str, float]:
                try:
                    return await timed(client, requests)
                finally:
                    await client.close()

            got = asyncio.run(through_http())
        finally:
            stop(process)
        rows.append(f"| {label} | {got['completed']:.0f} | {got['failed']:.0f} | {client.outages} | "
                    f"{got['tokens_per_s']:.0f} | {got['tokens_per_s'] / baseline['tokens_per_s']:.2f} | "
                    f"{got['p50_s']:.2f} | {got['p99_s']:.2f} |")
    head = [f"{args.requests} concurrent requests, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
            f"model {args.model}, engine batch {MAX_BATCH_SIZE}, {device_name(args.device)}", "",
            "| path | completed | failed | client outages | tokens/s | vs in-process | p50 s | p99 s |",
            "|---|---|---|---|---|---|---|---|"]
    return head + rows


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU"


def weight_sync(args: argparse.Namespace) -> list[str]:
    dtype = served_dtype(args.device)
    loaded = build(args.sync_shape, args.device)
    loaded.model.to(dtype)
    with torch.no_grad():
        for param in loaded.model.parameters():
            param.mul_(1.001)  # not the served weights, so each update changes something
    weights = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    gigabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    folder = Path(tempfile.mkdtemp(prefix="serve-path-"))
    # base64 safetensors of the whole model in one body: over serve's default 32 MB cap (max_body_mb)
    process, url = start_serve(shape_folder(args.sync_shape, args.device), "--device", args.device,
                               "--max-body-mb", str(int(3 * gigabytes * 1000) + 64))
    times: dict[str, list[float]] = {name: [] for name in args.strategies}
    failures: dict[str, str] = {}
    version = 0

    async def push(name: str, shared: SGLangEngine, inline: SGLangEngine,
                   publishers: dict[str, DistributedPublisher]) -> None:
        nonlocal version
        version += 1
        if name == "tensor":
            await shared.update_weights(weights, version)
        elif name == "safetensors":
            await inline.update_weights(weights, version)
        elif name == "disk":
            target = folder / f"v{version}"
            loaded.model.save_pretrained(target)
            await shared.update_weights(str(target), version)
        else:
            await publishers[name].publish(weights, version)

    async def connect(name: str, shared: SGLangEngine, publishers: dict[str, DistributedPublisher]) -> None:
        """The group of a distributed strategy, formed once before its first (timed) push, as a run forms it."""
        if name in ("gloo", "nccl") and name not in publishers:
            publisher = DistributedPublisher([shared], backend=name, group_name=f"bench-{name}",
                                             timeout_s=args.group_timeout)
            await asyncio.wait_for(publisher.connect(), 2 * args.group_timeout)
            publishers[name] = publisher

    async def run() -> None:
        shared, inline = SGLangEngine(url, api_key=KEY), SGLangEngine(url, api_key=KEY, share_tensors=False)
        publishers: dict[str, DistributedPublisher] = {}
        try:
            for repeat in range(args.repeats):
                for name in times:
                    if name in failures:
                        continue
                    try:
                        await connect(name, shared, publishers)
                        start = time.perf_counter()
                        await asyncio.wait_for(push(name, shared, inline, publishers), 2 * args.group_timeout)
                    except Exception as err:  # reported in the table: the claim is which strategies work here
                        failures[name] = f"{type(err).__name__}: {err}".splitlines()[0][:800]
                        print(f"serve_path: {name} failed: {failures[name]}", file=sys.stderr, flush=True)
                        continue
                    synchronize(torch.device(args.device))
                    times[name].append(time.perf_counter() - start)
                    # as it goes: a strategy that takes the process down (a GPU fault) leaves the others' figures
                    print(f"serve_path: {name} push {repeat + 1}: {times[name][-1]:.3f} s", file=sys.stderr,
                          flush=True)
        finally:
            for publisher in publishers.values():
                await asyncio.wait_for(publisher.close(), args.group_timeout)
            await shared.close()
            await inline.close()

    try:
        asyncio.run(run())
    finally:
        stop(process)
    medians = {name: statistics.median(ts) for name, ts in times.items() if ts}
    rows = [f"weight sync of {args.sync_shape} ({gigabytes:.2f} GB {str(dtype).removeprefix('torch.')}) to "
            f"`relax-gym serve` on this host, {device_name(args.device)}, median of {args.repeats}", "",
            "| strategy | s | s/GB | vs tensor |", "|---|---|---|---|"]
    for name in times:
        if name in medians:
            seconds = medians[name]
            ratio = f"{seconds / medians['tensor']:.2f}" if "tensor" in medians else "-"
            rows.append(f"| {name} | {seconds:.3f} | {seconds / gigabytes:.3f} | {ratio} |")
        else:
            rows.append(f"| {name} | failed: {failures[name].replace('|', '/')} | - | - |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="served for the concurrency part (a tiny name or a folder)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--sync-shape", choices=list(SHAPES), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the served model, the baseline engine and the pushed weights live")
    parser.add_argument("--strategies", default=None,
                        help=f"comma-separated, of {', '.join(STRATEGIES)} (default: all that the device allows)")
    parser.add_argument("--group-timeout", type=float, default=120.0,
                        help="seconds to form a gloo / NCCL group, or for one broadcast (a hang fails after it)")
    parser.add_argument("--skip-concurrency", action="store_true")
    parser.add_argument("--skip-sync", action="store_true")
    args = parser.parse_args()
    try:
        args.device = str(engine_device(args.device))
    except ValueError as err:
        parser.error(f"--device: {err}")
    on_gpu = torch.device(args.device).type == "cuda"
    args.strategies = [s.strip() for s in (args.strategies or ",".join(
        name for name in STRATEGIES if on_gpu or name != "nccl")).split(",") if s.strip()]
    if unknown := set(args.strategies) - set(STRATEGIES):
        parser.error(f"--strategies: {', '.join(sorted(unknown))} (expected some of {', '.join(STRATEGIES)})")
    torch.manual_seed(0)
    if not args.skip_concurrency:
        print("\n".join([*concurrency(args), ""]), flush=True)
    if not args.skip_sync:
        print("\n".join(weight_sync(args)), flush=True)


if __name__ == "__main__":
    main()
