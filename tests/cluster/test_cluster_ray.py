"""The distributed run on a real local Ray cluster: parity with the in-process run, and recovery from faults.

Every scenario trains the warm-start tiny model strictly on-policy (`max_staleness: 0`, one request per engine
batch, per-request seeds), so whatever is killed, the run must train on exactly the batches of an uninterrupted
in-process run and reach exactly its losses: nothing lost, nothing trained twice, no stale weights served.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from support.cluster import (  # noqa: E402
    STEPS,
    WARM_START,
    assert_exactly_once,
    config,
    events,
    losses,
    records,
    reference_run,
    restarted,
    train_cluster,
)

from relax_gym.errors import RunStopped  # noqa: E402
from relax_gym.trainer.cluster.run import ClusterTrainer, Faults  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted in-process run every scenario must reproduce."""
    return reference_run(tmp_path_factory)


@pytest.fixture
def external_server(monkeypatch):
    """A `relax-gym serve` outside the cluster (the warm start, one request per batch, as the run's engines), with
    its key exported as an operator would for the run to reach it."""
    from support.engines import KEY, served

    from relax_gym.models import load_model

    monkeypatch.setenv("RELAX_GYM_API_KEY", KEY)
    with served(load_model(str(WARM_START)), max_batch_size=1) as server:
        yield server

def test_the_ray_run_trains_exactly_like_the_in_process_run(ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    summary = train_cluster(config(run_dir))
    rows = records(run_dir)
    assert losses(rows) == losses(reference)
    assert summary["steps"] == STEPS
    assert rows[-1]["cluster/engines_active"] == 2
    assert rows[-1]["cluster/published_version"] == STEPS - 1  # the last step's weights are published after it
    assert_exactly_once(run_dir)
    assert (run_dir / "checkpoints" / f"step_{STEPS}").is_dir()


def test_engines_killed_mid_rollout_lose_nothing(ray_cluster, reference, tmp_path):
    """One engine is killed through Ray, the other SIGKILLed, while groups are in flight."""
    run_dir = tmp_path / "run"

    async def chaos(run: ClusterTrainer) -> None:
        if run.step == 1:
            ray.kill(run.fleet.slots["engine-0"].actor)
        if run.step == 2:
            await restarted(run, "engine-0")
            pid = ray.get(run.fleet.slots["engine-1"].actor.ready.remote())["pid"]
            os.kill(pid, signal.SIGKILL)
        if run.step == 3:
            await restarted(run, "engine-1")

    train_cluster(config(run_dir), on_step=chaos)
    rows = records(run_dir)
    assert losses(rows) == losses(reference)
    assert_exactly_once(run_dir)
    statuses = Counter(s for r in rows for s, n in r["status"].items() for _ in range(n))
    assert "aborted" not in statuses and "failed" not in statuses
    kinds = Counter(e["event"] for e in events(run_dir))
    assert kinds["engine_lost"] >= 2 and kinds["engine_restarted"] >= 2, kinds
    back = [e for e in events(run_dir) if e["event"] == "engine_restarted"]
    assert all(e["version"] >= e["step"] - 1 for e in back)  # synced to the published weights first


def test_a_rollout_worker_killed_with_groups_in_flight_loses_none(ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"

    async def chaos(run: ClusterTrainer) -> None:
        slot = run.workers.slots["rollout-0"]
        if run.step == 1:
            ray.kill(slot.actor)
        if run.step == STEPS - 1:  # it is recreated in the background while the other worker plays on

            async def back() -> None:
                while not (slot.alive and slot.restarts.total):
                    await asyncio.sleep(0.1)

            await asyncio.wait_for(back(), 60)

    train_cluster(config(run_dir), on_step=chaos)
    assert losses(records(run_dir)) == losses(reference)
    assert_exactly_once(run_dir)
    kinds = Counter(e["event"] for e in events(run_dir))
    assert kinds["worker_restarted"] == 1, kinds


def test_a_lost_trainer_rank_resumes_from_its_checkpoint(ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    summary = train_cluster(config(run_dir), faults=Faults(trainer={"crash_at_step": 3}))
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # step 3 was logged once
    assert losses(rows) == losses(reference)
    assert_exactly_once(run_dir)
    restarts = [e for e in events(run_dir) if e["event"] == "trainer_restarted"]
    assert len(restarts) == 1 and restarts[0]["resumes_from_step"] == 2
    assert summary["steps"] == STEPS


def test_a_trainer_that_keeps_dying_stops_the_run_after_its_budget(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(run_dir, "cluster.health.max_trainer_restarts=2")
    with pytest.raises(RunStopped, match="after 2 restarts"):
        train_cluster(cfg, faults=Faults(trainer={"crash_at_step": 1}, trainer_times=10))
    assert sum(e["event"] == "trainer_restarted" for e in events(run_dir)) == 2


def test_an_error_in_the_trainer_is_fatal_not_restarted(ray_cluster, tmp_path):
    """A deterministic exception (here: a sample the backend rejects) is a bug to report, not a lost process."""
    run_dir = tmp_path / "run"
    with pytest.raises(Exception, match="raise_at_step"):
        train_cluster(config(run_dir), faults=Faults(trainer={"raise_at_step": 2}))
    assert not any(e["event"] == "trainer_restarted" for e in events(run_dir))


def test_a_hung_engine_is_found_probed_and_replaced(ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    async def wait(run: ClusterTrainer) -> None:
        if run.step == STEPS - 1:
            await restarted(run, "engine-0")

    train_cluster(config(run_dir), faults=Faults(engines={"engine-0": {"hang_after": 4}}), on_step=wait)
    assert losses(records(run_dir)) == losses(reference)
    kinds = Counter(e["event"] for e in events(run_dir))
    assert kinds["probe_failed"] >= 1 and kinds["engine_restarted"] >= 1, kinds


def test_the_control_api_scales_engines_out_and_in_while_training(ray_cluster, reference, tmp_path):
    """Refuses an unauthenticated request; an authenticated scale-out adds an engine synced to the published
    weights (a repeat is a no-op, a concurrent one a 409); scale-in drains the newest engine (LIFO)."""
    import httpx

    from relax_gym.cli import main

    run_dir = tmp_path / "run"
    ops: dict[str, dict] = {}

    async def until_done(client, op_id: str) -> dict:
        for _ in range(600):
            record = (await client.get(f"/v1/ops/{op_id}")).json()
            if record["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
                return record
            await asyncio.sleep(0.1)
        raise AssertionError(f"op {op_id} did not finish")

    async def operate(run: ClusterTrainer) -> None:
        if run.step not in (1, 2):
            return
        url = json.loads((run_dir / "control.json").read_text())["url"]
        token = (run_dir / "control_token").read_text().strip()
        assert url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}) as client:
            if run.step == 1:
                refused = await httpx.AsyncClient(base_url=url).post("/v1/engines/scale_out", json={"num_engines": 3})
                assert refused.status_code == 401
                started = await client.post("/v1/engines/scale_out", json={"num_engines": 3})
                assert started.status_code == 202, started.text
                busy = await client.post("/v1/engines/scale_in", json={"num_engines": 2})
                assert busy.status_code == 409
                ops["out"] = await until_done(client, started.json()["op_id"])
                again = await client.post("/v1/engines/scale_out", json={"num_engines": 3})
                assert again.status_code == 200 and again.json()["state"] == "NOOP"
            else:  # through the product's client, as an operator would (in a thread: this loop serves the API)
                assert await asyncio.to_thread(main, ["cluster", "status", "--run-dir", str(run_dir)]) == 0
                assert await asyncio.to_thread(main, ["cluster", "scale-in", "--run-dir", str(run_dir), "--engines",
                                                      "2", "--drain-timeout", "30", "--wait"]) == 0
                ops["in"] = (await client.get("/v1/ops")).json()[0]
                ops["engines"] = (await client.get("/v1/engines")).json()

    train_cluster(config(run_dir, "cluster.control.enabled=true"), on_step=operate)
    assert ops["out"]["state"] == "COMPLETED" and ops["out"]["engine_ids"] == ["engine-2"]
    assert ops["out"]["version_on_activate"] == {"engine-2": 1}  # the weights published after step 1
    assert ops["in"]["state"] == "COMPLETED" and ops["in"]["engine_ids"] == ["engine-2"]
    assert ops["in"]["aborted"] in ({}, {"engine-2": 0})
    assert sorted(e["engine_id"] for e in ops["engines"]) == ["engine-0", "engine-1"]
    assert losses(records(run_dir)) == losses(reference)
    assert_exactly_once(run_dir)


def test_served_engines_with_disk_weights_fail_over_and_take_in_an_external_server(ray_cluster, reference, tmp_path,
                                                                                    external_server):
    """Engines serve SGLang's HTTP routes from their actors and load weights from the run's folder: one killed
    fails over over HTTP and comes back synced; an external `relax-gym serve` registered by URL joins at the
    published version."""
    run_dir = tmp_path / "run"
    joined: dict = {}

    async def operate(run: ClusterTrainer) -> None:
        if run.step == 1:
            ray.kill(run.fleet.slots["engine-0"].actor)
            await restarted(run, "engine-0")
        if run.step == 2:
            engine_id = await run.fleet.add_engine(url=external_server.url)
            joined.update(version=run.fleet.slots[engine_id].version, loaded=external_server.engine.weight_version)

    train_cluster(config(run_dir, "cluster.engines.kind=serve", "cluster.weight_sync=disk"), on_step=operate)
    assert losses(records(run_dir)) == losses(reference)
    assert_exactly_once(run_dir)
    assert joined["version"] == joined["loaded"] == 2  # synced from the newest folder before serving
    assert external_server.engine.weight_version == STEPS  # it took the later publications too
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == [f"v{STEPS - 1}", f"v{STEPS}"]  # pruned


def test_distributed_weight_sync_reaches_served_engines_and_regroups_after_a_kill(ray_cluster, reference, tmp_path,
                                                                                   external_server):
    """The trainer rank broadcasts over gloo to engines that joined through SGLang's routes; a killed engine is
    left out of the group, its successor catches up through a group of its own and rejoins at the next step; an
    external `relax-gym serve` registered by URL joins the same way."""
    run_dir = tmp_path / "run"
    joined: dict = {}

    async def chaos(run: ClusterTrainer) -> None:
        if run.step == 1:
            ray.kill(run.fleet.slots["engine-1"].actor)
            await restarted(run, "engine-1")
        if run.step == 2:
            engine_id = await run.fleet.add_engine(url=external_server.url)
            joined["version"] = run.fleet.slots[engine_id].version

    train_cluster(config(run_dir, "cluster.engines.kind=serve", "cluster.weight_sync=distributed"), on_step=chaos)
    assert joined["version"] == 2 and external_server.engine.weight_version == STEPS  # it took later broadcasts
    assert losses(records(run_dir)) == losses(reference)
    assert_exactly_once(run_dir)
    assert not (run_dir / "weights").exists()  # nothing went through the disk


@pytest.mark.timeout(600)
def test_megatron_ranks_as_ray_actors_train_and_restart_when_a_follower_is_lost(ray_cluster, tmp_path):
    """Megatron TP=2 with its two ranks as Ray actors instead of torchrun (rank 0 drives, rank 1 follows); rank 1
    killed between steps: the loop restarts both ranks from the last checkpoint and trains on."""
    pytest.importorskip("megatron.core")
    run_dir = tmp_path / "run"

    async def chaos(run: ClusterTrainer) -> None:
        if run.step == 2 and not run.trainer_restarts:
            ray.kill(run._trainer_ranks[1])

    cfg = config(run_dir, "trainer.backend=megatron", "trainer.megatron.tp=2", "cluster.trainer.world_size=2",
                 "cluster.engines.count=1", "cluster.rollout_workers.count=1", "trainer.total_steps=3",
                 "trainer.lr=3e-4")
    train_cluster(cfg, on_step=chaos)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and any(r["train/grad_norm"] > 0 for r in rows)
    restarts = [e for e in events(run_dir) if e["event"] == "trainer_restarted"]
    assert len(restarts) == 1 and restarts[0]["resumes_from_step"] == 2
    assert {"model_tp0_pp0.pt", "model_tp1_pp0.pt", "model.safetensors"} <= {
        p.name for p in (run_dir / "checkpoints" / "step_3").iterdir()}


def test_an_env_given_as_a_file_is_registered_in_the_workers_too(ray_cluster, tmp_path):
    """`envs[].id: file.py` registers its ids where the episodes run, not only in the controller."""
    env_file = tmp_path / "my_env.py"
    env_file.write_text(textwrap.dedent("""
        import relax_gym
        from relax_gym.envs.procedural import ArithmeticEnv

        class MyArithmetic(ArithmeticEnv):
            pass

        relax_gym.register("test/MyArithmetic-v0", MyArithmetic)
    """))
    run_dir = tmp_path / "run"
    summary = train_cluster(config(run_dir, f"envs=[{{id: {env_file}, kwargs: {{digits: 1}}}}]",
                                   "cluster.engines.count=1", "cluster.rollout_workers.count=1",
                                   "trainer.total_steps=1"))
    assert summary["steps"] == 1
    assert records(run_dir)[0]["status"].get("failed", 0) == 0


def test_a_stuck_trainer_rank_is_restarted_from_its_checkpoint(ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    train_cluster(config(run_dir, "cluster.health.trainer_stall_s=5"), faults=Faults(trainer={"hang_at_step": 3}))
    assert losses(records(run_dir)) == losses(reference)
    restarts = [e for e in events(run_dir) if e["event"] == "trainer_restarted"]
    assert len(restarts) == 1 and "did not answer for 5 s" in restarts[0]["reason"]


@ray.remote(num_cpus=0)
class _Gone:
    """A role ended before it answers: a call on it resolves to the error a lost copy of the weights gives."""

    def weights(self) -> dict:
        return {}


def test_a_trainer_lost_with_every_engine_and_its_weights_is_found_while_the_loop_waits(ray_cluster, reference,
                                                                                         tmp_path):
    """After step 2 the trainer rank and both engines are killed at once and the published weights become
    unfetchable, as when all of them lived on one node that went down with their only copy (one node cannot lose a
    copy, so the published reference is swapped for one whose maker is gone). The recreated engines wait for
    weights only a restarted trainer publishes, and the loop, waiting for their groups, calls no trainer: the
    trainer watch finds the lost rank and fails the data bus, the trainer restarts from step 2's checkpoint and
    publishes, and the run ends as the uninterrupted one does. (Without the watch the episodes waited
    `engine_wait_s` and the run stopped.)"""
    run_dir = tmp_path / "run"

    async def lose_everything(run: ClusterTrainer) -> None:
        if run.step == 2 and not run.trainer_restarts:
            gone = _Gone.remote()
            ray.kill(gone)
            run.fleet.published = gone.weights.remote()
            for slot in run.fleet.slots.values():
                ray.kill(slot.actor)
            ray.kill(run._trainer_actor)

    train_cluster(config(run_dir, "cluster.health.engine_wait_s=60"), on_step=lose_everything)
    assert losses(records(run_dir)) == losses(reference)
    assert_exactly_once(run_dir)
    seen = events(run_dir)
    restarts = [e for e in seen if e["event"] == "trainer_restarted"]
    assert len(restarts) == 1 and restarts[0]["resumes_from_step"] == 2, seen
    assert "a trainer rank's process is gone" in restarts[0]["reason"], restarts


def test_a_lora_run_pushes_its_adapter_alone_to_launched_sglang_servers(ray_cluster, tmp_path):
    """`trainer.lora` with `cluster.engines.kind=sglang` (a named fake of SGLang's launch command, given the LoRA
    flags `sglang.lora_args` writes): each publish is the adapter's folder alone, which the servers load by name;
    the workers' requests name the newest, so step n trains episodes of adapter n - 1; every task trains once."""
    import sys

    fake = str(Path(__file__).resolve().parents[1] / "support" / "fake_sglang_server.py")
    run_dir = tmp_path / "run"
    train_cluster(config(run_dir, "cluster.engines.kind=sglang", "cluster.weight_sync=disk",
                         f"cluster.engines.launch=[{sys.executable}, {fake}]", "trainer.lora={rank: 4}"))
    assert [r["step"] for r in records(run_dir)] == list(range(1, STEPS + 1))
    assert_exactly_once(run_dir)
    assert_adapters_pushed_and_run_on(run_dir)


def assert_adapters_pushed_and_run_on(run_dir: Path) -> None:
    """The newest pushed folder is a PEFT adapter alone, and (strictly on-policy) every token step n trained was
    generated by adapter n - 1, whichever server made it."""
    pushed = max((run_dir / "weights").iterdir(), key=lambda f: int(f.name[1:]))
    assert {f.name for f in pushed.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}, pushed
    trajectories = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    by_step: dict[int, set[int]] = {}
    for t in trajectories:
        by_step.setdefault(t["step"], set()).update(v for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m)
    assert by_step == {step: {step - 1} for step in by_step} and len(by_step) > 1, by_step


def test_sglang_engines_are_launched_supervised_and_replaced(ray_cluster, reference, tmp_path):
    """`cluster.engines.kind=sglang`: each engine actor starts a server from SGLang's launch command line (here
    a named fake of it that serves relax-gym's SGLang-compatible app), workers route to it over HTTP, weights go by
    disk; a killed actor takes its server with it, and the engine comes back synced."""
    import sys

    import httpx

    run_dir = tmp_path / "run"
    fake = str(Path(__file__).resolve().parents[1] / "support" / "fake_sglang_server.py")

    async def chaos(run: ClusterTrainer) -> None:
        if run.step == 1:
            url = run.fleet.slots["engine-0"].url
            ray.kill(run.fleet.slots["engine-0"].actor)
            await restarted(run, "engine-0")
            with pytest.raises(httpx.HTTPError):  # the old server died with its actor
                httpx.get(f"{url}/health", timeout=2)

    train_cluster(config(run_dir, "cluster.engines.kind=sglang", "cluster.weight_sync=disk",
                         f"cluster.engines.launch=[{sys.executable}, {fake}]"), on_step=chaos)
    assert losses(records(run_dir)) == losses(reference)
    assert_exactly_once(run_dir)


@pytest.mark.timeout(900)
def test_vllm_engines_are_launched_supervised_and_replaced(ray_cluster, smollm2, tmp_path):
    """`cluster.engines.kind=vllm` with a LoRA run: the engine actor starts a real vLLM server on the run's model
    (with its LoRA flags), workers route to it over HTTP, each step's adapter goes by disk alone and the server
    loads it by name; a killed actor takes its server with it, and the engine comes back on a new server synced to
    the published adapter. Every task trains exactly once, and the episodes after the first push carry the
    versions of the adapters they ran on (the workers' requests name them)."""
    import httpx

    run_dir = tmp_path / "run"

    async def chaos(run: ClusterTrainer) -> None:
        if run.step == 1:
            url = run.fleet.slots["engine-0"].url
            ray.kill(run.fleet.slots["engine-0"].actor)
            await restarted(run, "engine-0", timeout_s=300)
            with pytest.raises(httpx.HTTPError):  # the old server died with its actor
                httpx.get(f"{url}/health", timeout=2)

    train_cluster(config(run_dir, f"model={smollm2}", "cluster.engines.kind=vllm", "cluster.weight_sync=disk",
                         "cluster.engines.count=1", "cluster.rollout_workers.count=1", "rollout.max_new_tokens=24",
                         "trainer.lora={rank: 8}", "trainer.lr=1e-4", "cluster.health.stall_s=120",
                         "cluster.health.probe_timeout_s=30"),
                  on_step=chaos)
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]
    assert_exactly_once(run_dir)
    assert any(e["event"] == "engine_restarted" for e in events(run_dir)), events(run_dir)
    assert_adapters_pushed_and_run_on(run_dir)
