"""Helpers shared by the engine tests: requests as the rollout manager builds them, the
teacher-forced logprobs the trainer would recompute for what an engine generated, and a served engine."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import torch
import uvicorn

from relax_gym import messages as M
from relax_gym.engines import EmbeddedEngine, ServerLimits, create_app
from relax_gym.engines.base import GenerateRequest, SamplingParams
from relax_gym.engines.server import uvicorn_config
from relax_gym.models import MEDIA_KEYS, LoadedModel, load_model, processor_inputs, sequence_inputs


def make_request(loaded: LoadedModel, conversation: list[M.Message], sampling: SamplingParams) -> GenerateRequest:
    """Exact ids, raw media, and the processor's media outputs."""
    inputs = processor_inputs(loaded, conversation)
    parts = [p for message in conversation for p in message["content"]]
    return GenerateRequest(
        inputs["input_ids"][0].tolist(),
        sampling,
        images=[p["image"] for p in parts if p["type"] == "image"],
        audios=[(p["audio"], p["sampling_rate"]) for p in parts if p["type"] == "audio"],
        mm_inputs={k: inputs[k] for k in MEDIA_KEYS if k in inputs} or None,
        videos=[p["video"] for p in parts if p["type"] == "video"],
    )


def chaotic_model(name: str) -> LoadedModel:
    """A tiny model with N(0, 0.3) matrices, so greedy outputs vary from token to token (deterministic)."""
    loaded = load_model(name)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in loaded.model.parameters():
            if param.ndim > 1:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return loaded


def teacher_forced(loaded: LoadedModel, request: GenerateRequest, output_ids: list[int]) -> torch.Tensor:
    """log softmax(logits / T) of the generated tokens, from one unpadded forward pass."""
    mm_inputs = [request.mm_inputs] if request.mm_inputs else []
    with torch.no_grad():
        logits = loaded.model(**sequence_inputs(loaded, request.input_ids + output_ids, mm_inputs)).logits[0].float()
    scaled = logits[len(request.input_ids) - 1 : -1] / (request.sampling.temperature or 1.0)
    return scaled.log_softmax(-1).gather(1, torch.tensor(output_ids)[:, None]).squeeze(1)


KEY = "test-key"  # every server here is started with it, every client sends it
AUTH = {"Authorization": f"Bearer {KEY}"}


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, headers=AUTH, **kwargs)


def get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, headers=AUTH, **kwargs)


@contextmanager
def weight_session(url: str) -> Iterator[None]:
    """A weight-update session on the server at `url` (SGLang 0.5.21+'s and relax-gym serve's rule: tensor and
    distributed updates load only inside one), for tests that post those routes themselves."""
    assert post(f"{url}/begin_weight_update", json={}, timeout=10).status_code == 200
    try:
        yield
    finally:
        post(f"{url}/end_weight_update", json={}, timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Served:
    """A `relax-gym serve` app running in a thread: its URL, its engine, and a way to stop it early."""

    url: str
    engine: EmbeddedEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def started(config: uvicorn.Config) -> tuple[uvicorn.Server, threading.Thread]:
    """`config`'s server running in a daemon thread, once it accepts connections."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    return server, thread


@contextmanager
def serving_app(app) -> Iterator[str]:
    """Any ASGI app under uvicorn in a background thread on loopback; yields its URL."""
    port = free_port()
    server, thread = started(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def served(
    loaded: LoadedModel, port: int | None = None, limits: ServerLimits | None = None, **engine_kwargs
) -> Iterator[Served]:
    """`create_app` under uvicorn (as `serve` configures it) in a background thread on loopback."""
    limits = limits or ServerLimits()
    engine = EmbeddedEngine(loaded, **engine_kwargs)
    port = port or free_port()
    app = create_app(engine, api_key=KEY, limits=limits)
    server, thread = started(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning"))
    try:
        yield Served(f"http://127.0.0.1:{port}", engine, server, thread)
    finally:
        server.should_exit = True
        thread.join(10)
        asyncio.run(engine.close())


@contextmanager
def serving(
    loaded: LoadedModel, port: int | None = None, limits: ServerLimits | None = None, **engine_kwargs
) -> Iterator[tuple[str, EmbeddedEngine]]:
    """`served`, as (URL, engine)."""
    with served(loaded, port, limits, **engine_kwargs) as s:
        yield s.url, s.engine

