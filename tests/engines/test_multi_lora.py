"""Multi-LoRA: one engine serves several adapters of one base at once, each request naming its own, unmerged
(`relax_gym.engines.resident_adapters`); `relax-gym serve` and the SGLang double load and unload them by SGLang's
routes; the SGLang client pushes a LoRA run's adapters by name and keeps `max_staleness + 1` of them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from support.engines import AUTH, KEY, chaotic_model, serving_app, teacher_forced
from support.fake_sglang_server import sglang_app

from relax_gym.engines import API_KEY_ENV, GenerateRequest, RequestError, SamplingParams, SGLangEngine
from relax_gym.engines.embedded import EmbeddedEngine
from relax_gym.engines.pushed_adapters import adapter_name
from relax_gym.models import LoadedModel, load_model
from relax_gym.models.lora import LoraSpec, add_adapter, merged_adapter, save_adapter

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=10, seed=7)


RANK_4 = LoraSpec(rank=4)


def _adapter(folder: Path, seed: int, model: str = "tiny", spec: LoraSpec = RANK_4) -> Path:
    """A PEFT adapter folder of `model` whose B matrices are random (a fresh adapter changes nothing)."""
    loaded = chaotic_model(model)
    peft_model = add_adapter(loaded.model, spec, model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    save_adapter(peft_model, loaded.tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": _adapter(root / "a", 1), "b": _adapter(root / "b", 2)}


@pytest.fixture(scope="module")
def merged(adapters: dict[str, Path]) -> dict[str | None, LoadedModel]:
    """Each adapter merged into its own copy of the base, and the base itself: what each row must match."""
    out: dict[str | None, LoadedModel] = {None: chaotic_model("tiny")}
    for name, folder in adapters.items():
        base = chaotic_model("tiny")
        base.model = merged_adapter(base.model, folder)
        out[name] = base
    return out


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer(text)["input_ids"] for text in ("hello world", "the cat sat", "one two three four")]


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_rows_of_different_adapters_share_a_batch_and_each_matches_its_merged_model(adapters, merged, batching):
    """Requests naming adapter a, b or none run together; each one's tokens are its merged model's greedy ones and
    its logprobs that model's, so no row sees another's adapter (nor the shared prompt prefix's cache of another)."""
    loaded = chaotic_model("tiny")
    engine = EmbeddedEngine(loaded, batching=batching)
    plan = [(ids, name, params) for ids in _prompts(loaded) for name in (None, "a", "b")
            for params in (GREEDY, SAMPLED)]

    async def run() -> list:
        before = await engine.generate(GenerateRequest(plan[0][0], GREEDY))
        await engine.load_adapter("a", adapters["a"])
        await engine.load_adapter("b", adapters["b"])
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(ids, params, adapter=name))
                                      for ids, name, params in plan))
        await engine.unload_adapter("a")
        await engine.unload_adapter("b")
        after = await engine.generate(GenerateRequest(plan[0][0], GREEDY))
        await engine.close()
        return [before, after, *outs]

    before, after, *outs = asyncio.run(run())
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs
    for (ids, name, params), out in zip(plan, outs, strict=True):
        request = GenerateRequest(ids, params)
        judged = teacher_forced(merged[name], request, out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), judged, atol=1e-4), (name, params)
        if params is GREEDY:
            assert out.output_ids == _argmax(merged[name], ids, out.output_ids), name
    assert len({tuple(o.output_ids) for o, (_, _, p) in zip(outs, plan, strict=True) if p is GREEDY}) > 3
    assert "base_layer" not in " ".join(loaded.model.state_dict())  # a plain model again


def _argmax(loaded: LoadedModel, ids: list[int], output_ids: list[int]) -> list[int]:
    """The tokens `loaded` ranks first after `ids` and each prefix of `output_ids`: the greedy continuation."""
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids + output_ids])).logits[0]
    return logits[len(ids) - 1 : -1].argmax(-1).tolist()


def _chat_logprobs(judge: LoadedModel, said: list[float]) -> list[float]:
    """`judge`'s greedy logprobs of a reply as long as `said` to "hi", through the model's own template."""
    ids = judge.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    out: list[int] = []
    with torch.no_grad():
        for _ in said:
            out.append(int(judge.model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return teacher_forced(judge, GenerateRequest(ids, GREEDY), out).tolist()


def test_bad_adapters_and_names_are_refused_naming_the_field(adapters, tmp_path):
    other = _adapter(tmp_path / "audio", 3, "tiny-audio", LoraSpec(rank=4, target_modules=["q_proj"]))
    (tmp_path / "empty").mkdir()
    ia3 = tmp_path / "ia3"
    ia3.mkdir()
    (ia3 / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    (ia3 / "adapter_model.safetensors").write_bytes(b"")
    engine = EmbeddedEngine(chaotic_model("tiny"))
    ids = [5, 9, 13]

    async def run() -> None:
        with pytest.raises(RequestError, match=r"lora_path: .*empty is no PEFT adapter folder"):
            await engine.load_adapter("x", tmp_path / "empty")
        with pytest.raises(RequestError, match=r"lora_path: the adapter at .*audio does not fit this model"):
            await engine.load_adapter("x", other)
        with pytest.raises(RequestError, match=r"lora_path: .*ia3 holds a IA3 adapter; only LoRA adapters are served"):
            await engine.load_adapter("x", ia3)
        assert not engine.adapters
        await engine.load_adapter("a", adapters["a"])
        with pytest.raises(RequestError, match=r"lora_name: an adapter named 'a' is already loaded"):
            await engine.load_adapter("a", adapters["b"])
        with pytest.raises(RequestError, match=r"lora_path: no adapter named 'b' is loaded; loaded: \['a'\]"):
            await engine.generate(GenerateRequest(ids, GREEDY, adapter="b"))
        with pytest.raises(RequestError, match=r"update_weights: LoRA adapters are loaded \(\['a'\]\)"):
            await engine.update_weights({"model.norm.weight": torch.ones(64)}, 1)
        await engine.unload_adapter("a")
        with pytest.raises(RequestError, match=r"lora_name: no adapter named 'a' is loaded"):
            await engine.unload_adapter("a")
        await engine.update_weights({"model.norm.weight": torch.ones(64)}, 1)  # a plain model takes updates again
        await engine.close()

    asyncio.run(run())


def test_the_sglang_double_loads_serves_and_unloads_adapters_by_sglangs_routes(adapters, merged):
    """SGLang's `/load_lora_adapter` {lora_name, lora_path, pinned}, `/generate` with `lora_path` naming one and
    `/unload_lora_adapter`, each answering {success, error_message, loaded_adapters}; the routes need the key."""
    engine = EmbeddedEngine(chaotic_model("tiny"))
    ids = _prompts(merged[None])[0]
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    try:
        with serving_app(sglang_app(engine, api_key=KEY, model_path="tiny")) as url:
            load = {"lora_name": "a", "lora_path": str(adapters["a"]), "pinned": True}
            assert httpx.post(f"{url}/load_lora_adapter", json=load).status_code == 401
            loaded = httpx.post(f"{url}/load_lora_adapter", headers=AUTH, json=load)
            assert loaded.status_code == 200 and loaded.json() == {
                "success": True, "error_message": None, "loaded_adapters": {"a": str(adapters["a"])}}
            again = httpx.post(f"{url}/load_lora_adapter", headers=AUTH, json=load)
            assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
            served = httpx.post(f"{url}/generate", headers=AUTH, json={**body, "lora_path": "a"}).json()
            out_ids = served["output_ids"]
            judged = teacher_forced(merged["a"], GenerateRequest(ids, GREEDY), out_ids)
            logprobs = torch.tensor([p[0] for p in served["meta_info"]["output_token_logprobs"]])
            assert torch.allclose(logprobs, judged, atol=1e-4)
            unknown = httpx.post(f"{url}/generate", headers=AUTH, json={**body, "lora_path": "zz"})
            assert unknown.status_code == 400 and "no adapter named 'zz' is loaded" in unknown.text
            models = {m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]}
            assert models == {"tiny", "a"}
            chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 6,
                    "logprobs": True}
            for model, judge in (("a", merged["a"]), ("tiny", merged[None])):  # vLLM's way: `model` names one
                answer = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={**chat, "model": model}).json()
                said = [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
                assert answer["model"] == model and said == pytest.approx(_chat_logprobs(judge, said), abs=1e-4)
            gone = httpx.post(f"{url}/unload_lora_adapter", headers=AUTH, json={"lora_name": "a"})
            assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {}
    finally:
        asyncio.run(engine.close())


def test_the_sglang_client_pushes_adapters_by_name_keeps_the_newest_and_reports_their_versions(adapters, merged):
    """`update_weights` of an adapter folder loads it as `relax-gym-{run}-v{version}`; requests run on the newest
    and every token has its version; the newest `keep_adapters` stay loaded; a version pushed again (a resume, the
    server still holding it) loads again."""
    engine = EmbeddedEngine(chaotic_model("tiny"))
    ids = _prompts(merged[None])[1]

    async def run(url: str) -> list:
        client = SGLangEngine(url, api_key=KEY, keep_adapters=2)
        try:
            await client.connect()
            seen = []
            for version, name in ((1, "a"), (2, "b"), (3, "a"), (3, "a")):
                await client.update_weights(str(adapters[name]), version)
                seen.append((sorted(engine.adapters.folders), await client.generate(GenerateRequest(ids, GREEDY))))
                assert client.weight_version == version  # the pushed adapter's, not the server's base's
            return seen
        finally:
            await client.close()

    try:
        with serving_app(sglang_app(engine, api_key=KEY, model_path="tiny")) as url:
            seen = asyncio.run(run(url))
    finally:
        asyncio.run(engine.close())
    v1, v2, v3 = (adapter_name(adapters["a"], v) for v in (1, 2, 3))
    assert [names for names, _ in seen] == [[v1], sorted([v1, v2]), sorted([v2, v3]), sorted([v2, v3])]
    for (_, out), (version, name) in zip(seen, ((1, "a"), (2, "b"), (3, "a"), (3, "a")), strict=True):
        assert out.weight_version == version and set(out.versions()) == {version}
        judged = teacher_forced(merged[name], GenerateRequest(ids, GREEDY), out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), judged, atol=1e-4)
    assert engine.weight_version == 0  # the base never changed


def test_a_pickled_client_and_a_noting_one_run_on_the_adapter_another_client_loaded(adapters, merged, tmp_path):
    """A cluster's way: the fleet's client loads each push; a rollout worker's copy of it (pickled, as Ray sends
    it) carries the adapters the server holds, and a worker's older client `note`s a later push; both then send
    the newest as `lora_path`, so their tokens are that adapter's and carry its version."""
    import pickle
    import shutil

    engine = EmbeddedEngine(chaotic_model("tiny"))
    ids = _prompts(merged[None])[0]
    pushes = {v: shutil.copytree(adapters[name], tmp_path / "run" / "weights" / f"v{v}")
              for v, name in ((1, "a"), (2, "b"))}

    async def run(url: str) -> tuple:
        fleet = SGLangEngine(url, api_key=KEY, keep_adapters=2)
        worker_old = SGLangEngine(url, api_key=KEY, keep_adapters=2)
        try:
            await fleet.connect()
            await fleet.update_weights(str(pushes[1]), 1)
            worker_new = pickle.loads(pickle.dumps(fleet))  # a worker that learns of the engine now
            await fleet.update_weights(str(pushes[2]), 2)
            worker_old.adapters.note(pushes[1], 1)
            worker_old.adapters.note(pushes[2], 2)  # what `RolloutWorker.adopt_adapter` does on each push
            try:
                return (await worker_new.generate(GenerateRequest(ids, GREEDY)),
                        await worker_old.generate(GenerateRequest(ids, GREEDY)))
            finally:
                await worker_new.close()
        finally:
            await fleet.close()
            await worker_old.close()

    try:
        with serving_app(sglang_app(engine, api_key=KEY, model_path="tiny")) as url:
            on_first, on_second = asyncio.run(run(url))
    finally:
        asyncio.run(engine.close())
    for out, version, name in ((on_first, 1, "a"), (on_second, 2, "b")):
        assert out.weight_version == version and set(out.versions()) == {version}
        judged = teacher_forced(merged[name], GenerateRequest(ids, GREEDY), out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), judged, atol=1e-4)


def test_two_runs_push_to_one_server_under_their_own_names_and_each_runs_on_its_own(adapters, merged, tmp_path):
    """Two LoRA runs share a server: each one's pushes (from its own weights folder) load under names of its own,
    so the same version of the other run replaces nothing, and each run's requests are its own adapter's."""
    import shutil

    engine = EmbeddedEngine(chaotic_model("tiny"))
    ids = _prompts(merged[None])[2]
    pushes = {}
    for run, name in (("run-1", "a"), ("run-2", "b")):
        pushes[run] = tmp_path / run / "weights" / "v1"
        shutil.copytree(adapters[name], pushes[run])

    async def run(url: str) -> dict:
        clients = {run: SGLangEngine(url, api_key=KEY, keep_adapters=1) for run in pushes}
        try:
            for run, client in clients.items():
                await client.connect()
                await client.update_weights(str(pushes[run]), 1)
            return {run: await client.generate(GenerateRequest(ids, GREEDY)) for run, client in clients.items()}
        finally:
            for client in clients.values():
                await client.close()

    try:
        with serving_app(sglang_app(engine, api_key=KEY, model_path="tiny")) as url:
            outs = asyncio.run(run(url))
            resident = set(engine.adapters.folders)
    finally:
        asyncio.run(engine.close())
    assert resident == {adapter_name(pushes["run-1"], 1), adapter_name(pushes["run-2"], 1)} and len(resident) == 2
    for run, name in (("run-1", "a"), ("run-2", "b")):
        judged = teacher_forced(merged[name], GenerateRequest(ids, GREEDY), outs[run].output_ids)
        assert torch.allclose(torch.tensor(outs[run].logprobs), judged, atol=1e-4), run
    assert outs["run-1"].output_ids != outs["run-2"].output_ids


def test_serve_loads_its_lora_paths_at_start_and_stops_in_one_line_on_one_that_does_not_load(adapters, tmp_path,
                                                                                              capsys):
    """`relax-gym serve --lora-paths NAME=FOLDER ...` (SGLang's flag): loaded before it serves; a malformed entry or
    a folder that is no adapter stops it with exit 2 and one line naming it, before anything listens."""
    from relax_gym.cli import main
    from relax_gym.engines.server_adapters import load_adapters
    from relax_gym.errors import StartupError

    assert main(["serve", "--lora-paths", f"a={adapters['a']}", f"a={adapters['b']}"]) == 2
    assert "relax-gym serve --lora-paths: " in capsys.readouterr().out
    engine = EmbeddedEngine(chaotic_model("tiny"))
    try:
        asyncio.run(load_adapters(engine, {"a": str(adapters["a"]), "b": str(adapters["b"])}))
        assert sorted(engine.adapters.folders) == ["a", "b"]
        with pytest.raises(StartupError, match=r"--lora-paths c=.*: lora_path: .* is no PEFT adapter folder"):
            asyncio.run(load_adapters(engine, {"c": str(tmp_path)}))
    finally:
        asyncio.run(engine.close())


def test_a_push_to_an_sglang_launched_without_lora_says_how_to_launch_it(adapters):
    engine = EmbeddedEngine(chaotic_model("tiny"))

    async def run(url: str) -> None:
        client = SGLangEngine(url, api_key=KEY)
        try:
            await client.connect()
            with pytest.raises(RequestError, match=r"cannot load LoRA adapters: launch SGLang with --enable-lora"):
                await client.update_weights(str(adapters["a"]), 1)
        finally:
            await client.close()

    try:
        with serving_app(sglang_app(engine, api_key=KEY, model_path="tiny", enable_lora=False)) as url:
            asyncio.run(run(url))
    finally:
        asyncio.run(engine.close())


def test_a_lora_run_on_an_sglang_server_pushes_only_adapters_and_trains_on_their_versions(tmp_path, capsys,
                                                                                         monkeypatch):
    """`trainer.lora` with `rollout.engine: sglang` (the 0.5.23 double): each push is an adapter folder loaded by
    name, the server holds at most max_staleness + 1 of them, and the episodes of step 2 are adapter 1's."""
    from relax_gym.cli import main

    loaded = load_model(str(ROOT / "examples" / "checkpoints" / "tiny-arithmetic"))
    engine = EmbeddedEngine(loaded)
    run = tmp_path / "run"
    monkeypatch.setenv(API_KEY_ENV, KEY)
    try:
        with serving_app(sglang_app(engine, api_key=KEY, model_path=loaded.name)) as url:
            code = main(["train", str(ROOT / "examples" / "configs" / "quickstart.yaml"), f"run_dir={run}",
                         f"model={loaded.name}", "rollout.engine=sglang", f"rollout.engine_url={url}",
                         "rollout.group_size=2", "rollout.groups_per_step=2",
                         "trainer.mode=sync", "trainer.max_staleness=0", "trainer.total_steps=3",
                         "trainer.eval_every=0", "trainer.checkpoint_every=3", "trainer.lora={rank: 4}",
                         "trainer.lr=1e-3"])
            assert code == 0, capsys.readouterr().out
            resident = sorted(engine.adapters.folders)
    finally:
        asyncio.run(engine.close())
    assert resident == [adapter_name(run / "weights" / "v3", 3)] and engine.weight_version == 0
    assert {f.name for f in (run / "weights" / "v3").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    trajectories = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    by_step = {(t["step"], v) for t in trajectories for v in t["versions"] if v >= 0}
    assert {v for step, v in by_step if step == 2} == {1} and {v for step, v in by_step if step == 3} == {2}, by_step
