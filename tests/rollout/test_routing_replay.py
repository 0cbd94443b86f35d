"""Rollout routing replay (R3) end to end: the rollout manager keeps the engine's routed experts in each
trajectory, and a backend made with `replay_routes` makes its routers take them, so the trainer routes every
token as the engine did. The engine here runs in bfloat16 and the trainer in float32, as on a GPU: their
routers then disagree on some tokens, and replay removes both that disagreement and the logprob gap it
causes. Numbers here are for the fixed seeds below; the benchmark (benchmarks/moe_r3.py) measures them."""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from support.engine_doubles import EndsEachTurn

from relax_gym.engines import EmbeddedEngine, SamplingParams
from relax_gym.errors import StartupError
from relax_gym.models import load_model
from relax_gym.models.moe_routing import batch_routes, recording, routers, shaped_routes
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.trainer.backends.torch_backend import TorchBackend
from relax_gym.trainer.batch import Sample
from relax_gym.trainer.config import load_config
from relax_gym.trainer.loop import Trainer
from relax_gym.trajectory import Trajectory

SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def policy():
    return load_model("tiny-moe")


@pytest.fixture(scope="module")
def rollout(policy):
    """Multi-turn GuessNumber episodes from a bfloat16 engine, routes recorded."""
    in_bf16 = copy.deepcopy(policy)
    in_bf16.model.to(torch.bfloat16)
    end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = EndsEachTurn(EmbeddedEngine(in_bf16), end)
    manager = RolloutManager(engine, policy, sampling=SAMPLING, limits=RolloutLimits(max_turns=3), sampling_seed=0,
                             routed_experts=True)
    trajs = asyncio.run(manager.run("relax/GuessNumber-v0", 4, 2))
    return trajs, engine.requests


def _trainer_routes(backend: TorchBackend, samples: list[Sample]) -> tuple[list, list[torch.Tensor]]:
    """The backend's logprobs of `samples` in one micro-batch and each sample's routes as its routers took
    them, [tokens, layers, top_k]."""
    with recording(backend.model) as taken:
        out = backend.logprobs(samples)
    assert len(taken[0]) == 1  # one micro-batch
    width = max(len(s.token_ids) for s in samples)
    flat = torch.stack([layer[0] for layer in taken])  # [layers, rows x width, top_k]
    per_row = flat.reshape(flat.shape[0], len(samples), width, -1).permute(1, 2, 0, 3)
    return out, [per_row[i, : len(s.token_ids)] for i, s in enumerate(samples)]


def test_trajectories_keep_the_routes_of_their_last_request(rollout, policy):
    trajs, requests = rollout
    layers, top_k = policy.model.config.num_hidden_layers, policy.model.config.num_experts_per_tok
    assert any(t.metrics["turns"] > 1 for t in trajs)
    for traj in trajs:
        last_request, last_out = [(r, o) for r, o in requests if r.rid.startswith(f"{traj.group_id}/")
                                  and r.input_ids == traj.token_ids[: len(r.input_ids)]][-1]
        ran = len(last_request.input_ids) + len(last_out.output_ids) - 1
        assert traj.routed_experts.shape == (ran, layers, top_k)  # the whole conversation but the last token
        assert ran == len(traj.token_ids) - 1
        assert np.array_equal(traj.routed_experts.reshape(-1), last_out.routed_experts)


def test_with_replay_the_trainer_routes_every_token_as_the_engine_and_the_logprob_gap_shrinks(rollout, policy):
    trajs, _ = rollout
    backend = TorchBackend(copy.deepcopy(policy), replay_routes=True)
    gaps, differing = {}, {}
    for replay in (False, True):
        samples = [Sample(t.token_ids, t.loss_mask, t.rollout_logprobs,
                          routed_experts=t.routed_experts if replay else None) for t in trajs]
        out, taken = _trainer_routes(backend, samples)
        differing[replay] = sum(int((mine[: len(t.routed_experts)] != torch.as_tensor(t.routed_experts))
                                    .any(-1).sum()) for t, mine in zip(trajs, taken, strict=True))
        trained = [torch.tensor(t.loss_mask, dtype=torch.bool) for t in trajs]
        gaps[replay] = torch.cat([(o.logprobs - torch.tensor(t.rollout_logprobs))[m].abs()
                                  for o, t, m in zip(out, trajs, trained, strict=True)])
    assert differing[False] > 0  # bf16 vs fp32 routers disagree somewhere
    assert differing[True] == 0  # every (token, layer) routed as the engine routed it
    assert gaps[True].max() < gaps[False].max()


def test_replay_trains_the_routers_and_every_expert_it_routes_to(rollout, policy):
    trajs, _ = rollout
    backend = TorchBackend(copy.deepcopy(policy), replay_routes=True, lr=1e-2)
    samples = [Sample(t.token_ids, t.loss_mask, t.rollout_logprobs, advantage=1.0,
                      routed_experts=t.routed_experts) for t in trajs]
    before = [r.weight.detach().clone() for r in routers(backend.model)]

    def loss_fn(mb):
        return -(mb.logprobs * mb.mask).sum() / mb.step_tokens, {}

    metrics = backend.train_step(samples, loss_fn)
    assert metrics["skipped"] == 0
    assert all(not torch.equal(b, r.weight) for b, r in zip(before, routers(backend.model), strict=True))


def test_routes_survive_jsonl_and_a_bad_shape_is_refused(rollout, tmp_path):
    from relax_gym.trajectory import read_jsonl, write_jsonl

    traj = rollout[0][0]
    write_jsonl([traj], tmp_path / "t.jsonl")
    back = next(read_jsonl(tmp_path / "t.jsonl"))
    assert back.routed_experts.dtype == np.int16
    assert np.array_equal(back.routed_experts, traj.routed_experts)
    record = json.loads((tmp_path / "t.jsonl").read_text())
    record["routed_experts"]["shape"][0] += 1
    (tmp_path / "bad.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        next(read_jsonl(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="routed_experts of shape"):
        Trajectory.from_json({**traj.to_json(), "token_ids": traj.token_ids[:5], "loss_mask": traj.loss_mask[:5],
                              "rollout_logprobs": traj.rollout_logprobs[:5], "versions": traj.versions[:5]}).check()


def test_batch_routes_lay_rows_out_as_the_routers_see_the_padded_batch():
    a = np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2)  # 2 tokens, 3 layers, top 2
    routes = batch_routes([a, None], width=4, layers=3, top_k=2)
    assert routes.shape == (3, 8, 2)
    assert torch.equal(routes[1, :2], torch.as_tensor(a[:, 1]).long())  # row 0's tokens, layer 1
    assert (routes[:, 2:] == -1).all()  # row 0's padding and all of row 1: the routers' own choice
    with pytest.raises(ValueError, match="row 0"):
        batch_routes([a], width=1, layers=3, top_k=2)
    with pytest.raises(ValueError, match="do not divide"):
        shaped_routes(np.zeros(10, dtype=np.int32), 3, 2)


def test_an_engine_without_routes_aborts_the_episode_with_why(policy):
    class NoRoutes(EndsEachTurn):
        async def generate(self, request):
            return replace(await self.inner.generate(request), routed_experts=None)

    manager = RolloutManager(NoRoutes(EmbeddedEngine(copy.deepcopy(policy)), 0), policy, sampling=SAMPLING,
                             routed_experts=True)
    [traj] = asyncio.run(manager.run("relax/GuessNumber-v0", 1))
    assert traj.status == "aborted" and "no routed experts" in traj.status_reason
    with pytest.raises(ValueError, match="not a mixture of experts"):
        RolloutManager(EmbeddedEngine(load_model("tiny")), load_model("tiny"), routed_experts=True)


def test_routing_replay_is_refused_for_a_dense_model(tmp_path):
    base = ["envs=[{id: relax/Arithmetic-v0}]", f"run_dir={tmp_path / 'run'}", "algorithm.routing_replay=true"]
    with pytest.raises(StartupError, match="routing_replay: model 'tiny' is not a mixture of experts"):
        Trainer(load_config(None, [*base, "model.path=tiny"]))
    with pytest.raises(ValueError, match="no mixture-of-experts routers"):
        TorchBackend(load_model("tiny"), replay_routes=True)
