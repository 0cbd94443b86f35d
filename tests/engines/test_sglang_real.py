"""The SGLang client against a real `python -m sglang.launch_server`.

Skipped where `sglang` is not importable, which includes every machine this
project is developed on (SGLang's wheels pin other torch versions
and its CPU backend needs Intel AMX). Where it is installed (a GPU machine),
the server is launched on a real checkpoint: the folder in
RELAX_GYM_SGLANG_MODEL (e.g. a local Qwen3-0.6B) if set, else the tiny Qwen3
saved with `save_model` (random weights, but a real Qwen3ForCausalLM checkpoint,
loaded with SGLang's torch-native attention since its head_dim is 16). Extra
server flags can be given in RELAX_GYM_SGLANG_ARGS. These tests have not been
run against a live SGLang yet: nothing here can install it.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from relax_gym import messages as M
from relax_gym.engines import GenerateRequest, SamplingParams, SGLangEngine, launch_sglang_server
from relax_gym.models import LoadedModel, load_model, render_ids, save_model

pytest.importorskip("sglang")
pytestmark = pytest.mark.slow

TINY_ARGS = "--attention-backend torch_native --disable-cuda-graph --dtype float32 --mem-fraction-static 0.2"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if folder := os.environ.get("RELAX_GYM_SGLANG_MODEL"):
        return Path(folder)
    return save_model(load_model("tiny"), tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LoadedModel:
    return load_model(str(checkpoint), dtype=torch.float32)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[str]:
    default = "" if os.environ.get("RELAX_GYM_SGLANG_MODEL") else TINY_ARGS
    args = shlex.split(os.environ.get("RELAX_GYM_SGLANG_ARGS", default))
    with launch_sglang_server(checkpoint, _free_port(), *args, timeout_s=900) as launched:
        yield launched.url


def _run(url: str, use):
    async def main():
        client = SGLangEngine(url, timeout_s=120)
        try:
            return await use(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_tokens_and_logprobs_match_a_transformers_forward(server, model):
    """SGLang's kernels differ from transformers', so logprobs agree to a tolerance, not exactly."""
    prompt = render_ids(model, [M.user("What is 6*7?")])
    request = GenerateRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=16))
    out = _run(server, lambda client: client.generate(request))
    assert out.finish_reason in ("stop", "length") and 0 < len(out.output_ids) <= 16
    assert len(out.logprobs) == len(out.output_ids)
    ids = torch.tensor([prompt + out.output_ids], device=model.model.device)
    with torch.no_grad():
        logits = model.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    expected = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1).cpu()
    assert (expected - torch.tensor(out.logprobs)).abs().max() < 2e-2


def test_weight_update_from_disk_bumps_the_version(server, model, tmp_path):
    save_model(model, tmp_path / "step-1")
    request = GenerateRequest(render_ids(model, [M.user("Hi")]), SamplingParams(temperature=0, max_new_tokens=4))

    async def use(client: SGLangEngine):
        await client.update_weights(tmp_path / "step-1", 1)
        return await client.generate(request)

    out = _run(server, use)
    assert out.weight_version == 1


def test_pause_continue_and_health(server):
    async def use(client: SGLangEngine):
        assert await client.health()
        await client.pause()
        await client.resume()
        return await client.generate(GenerateRequest([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=2)))

    assert len(_run(server, use).output_ids) == 2
