"""The distributed run's rules that need no Ray: what the health manager kills, the config, and that an
in-process run never imports Ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax_gym.trainer.cluster.budget import RestartBudget
from relax_gym.trainer.cluster.health import engines_to_replace, is_stalled
from relax_gym.trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_a_probe_failure_replaces_the_engine():
    assert engines_to_replace(["engine-1"], active=4, max_kill_fraction=0.25) == (["engine-1"], None)


def test_at_most_a_fraction_of_the_engines_is_replaced_per_round():
    victims, why = engines_to_replace(["e3", "e1", "e2"], active=8, max_kill_fraction=0.25)
    assert victims == ["e1", "e2"] and why is None


def test_when_most_engines_fail_at_once_none_is_killed():
    victims, why = engines_to_replace(["e0", "e1", "e2"], active=4, max_kill_fraction=1.0)
    assert victims == [] and "killing none" in (why or "")


def test_a_lone_engine_that_fails_is_replaced():
    assert engines_to_replace(["e0"], active=1, max_kill_fraction=0.25) == (["e0"], None)


def test_a_stall_is_work_in_flight_without_progress():
    assert is_stalled({"inflight": 2, "idle_s": 10.0}, stall_s=5)
    assert not is_stalled({"inflight": 0, "idle_s": 1e9}, stall_s=5)  # idle is not stuck
    assert not is_stalled({"inflight": 2, "idle_s": 1.0}, stall_s=5)


def test_a_restart_budget_allows_its_limit_per_window_and_counts_the_run_total():
    budget = RestartBudget(limit=2, window_s=3600)
    assert [budget.spend() for _ in range(3)] == [True, True, False]
    assert budget.total == budget.in_window == 2


def test_the_cluster_section_is_absent_unless_asked_for():
    envs = "envs=[{id: relax/Arithmetic-v0}]"
    assert load_config(None, [envs]).cluster is None
    cfg = load_config(None, [envs, "cluster.mode=ray", "cluster.engines.count=3"])
    assert cfg.cluster is not None and cfg.cluster.engines.count == 3 and cfg.cluster.rollout_workers.count == 1
    assert cfg.cluster.control.host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"cluster\.engines\.cont"):
        load_config(None, [envs, "cluster.engines.cont=2"])


def test_a_run_caps_the_engines_a_scale_out_may_reach():
    envs = "envs=[{id: relax/Arithmetic-v0}]"
    assert load_config(None, [envs, "cluster.mode=ray"]).cluster.control.max_engines == 64
    with pytest.raises(ConfigError, match=r"engines\.count \(9\) is over cluster\.control\.max_engines \(8\)"):
        load_config(None, [envs, "cluster.engines.count=9", "cluster.control.max_engines=8"])


@pytest.mark.timeout(300)
def test_an_in_process_run_never_imports_ray(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from relax_gym.trainer.config import load_config
        from relax_gym.trainer.launch import train
        cfg = load_config({str(ROOT / "examples/configs/quickstart.yaml")!r},
                          ["run_dir={tmp_path / 'run'}", "trainer.total_steps=1", "trainer.eval_every=0",
                           "rollout.groups_per_step=2", "rollout.group_size=2"])
        train(cfg)
        assert "ray" not in sys.modules, "an in-process run imported ray"
        print("no ray")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=280)
    assert done.returncode == 0 and "no ray" in done.stdout, done.stderr[-2000:]


def test_a_call_that_could_not_fetch_its_argument_is_told_from_the_role_dying():
    # Ray's own errors, as a role's call raises them: the weights' maker gone (a task error whose cause is that
    # actor's) is not the engine's death, which is an actor error of its own
    pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayTaskError

    from relax_gym.trainer.cluster.ray_handles import source_lost

    def task_error(cause: Exception) -> Exception:
        return RayTaskError("EngineService.update_weights", "Traceback ...", cause).as_instanceof_cause()

    assert source_lost(task_error(ActorUnavailableError("the trainer rank is unavailable", b"\0" * 16)))
    assert source_lost(task_error(ObjectLostError("0" * 56, "owner", "call site")))
    assert not source_lost(ActorDiedError())  # the engine itself
    assert not source_lost(task_error(ValueError("a bad weight name")))


def test_the_preflight_names_what_a_node_runs_or_sees_otherwise():
    pytest.importorskip("ray")
    from relax_gym.trainer.cluster.preflight import NodeReport, RoleAsk, compare, shortfalls

    here = {"versions": {"relax_gym": "0.1.0", "torch": "2.13.0"}, "model": "abc", "run_dir_writable": True}
    node = NodeReport("f" * 56, "10.0.0.7", {"CPU": 8},
                      seen={"versions": {"relax_gym": "0.1.0", "torch": "2.9.1"}, "model": None,
                            "run_dir_writable": False})
    compare(node, here, "/data/model", model_is_path=True)
    assert node.problems == [
        "runs torch 2.9.1, this process 2.13.0",
        "does not see the model /data/model as this process does (fingerprint missing, here abc): paths must be "
        "absolute, on a file system every node shares",
        "cannot write the run folder (checkpoints and `weight_sync: disk` need it on a shared file system)"]
    hub_id = NodeReport("e" * 56, "10.0.0.8", {"CPU": 8}, seen={**here, "model": None})
    compare(hub_id, here, "HuggingFaceTB/SmolLM2-135M", model_is_path=False)  # a hub id: each node fetches it
    assert hub_id.problems == []
    asks = [RoleAsk("engine", 2, {"CPU": 1.0, "GPU": 1.0}, "STRICT_PACK"), RoleAsk("trainer rank", 1, {"CPU": 1.0},
                                                                                      "PACK")]
    assert shortfalls(asks, {"CPU": 8.0, "GPU": 1.0}) == [
        "the run asks 2 GPU in all (2 engines x 1); the cluster has 1"]


def test_roles_ask_for_custom_resources_that_keep_them_on_some_nodes():
    pytest.importorskip("ray")
    from relax_gym.trainer.cluster.preflight import announced, role_asks, shortfalls

    envs = "envs=[{id: relax/Arithmetic-v0}]"
    cfg = load_config(None, [envs, "cluster.mode=ray", "cluster.trainer.resources={train_box: 1}",
                             "cluster.engines.resources={serve_box: 0.5}",
                             "cluster.rollout_workers.resources.env_box=1"])
    assert {a.role: a.resources for a in role_asks(cfg)} == {
        "engine": {"CPU": 0.5, "serve_box": 0.5}, "rollout worker": {"CPU": 0.5, "env_box": 1.0},
        "trainer rank": {"CPU": 0.5, "train_box": 1.0}}
    cluster = announced({"CPU": 8.0, "memory": 1e9, "object_store_memory": 1e9, "node:10.0.0.7": 1.0,
                         "node:__internal_head__": 1.0, "serve_box": 1.0, "env_box": 1.0})
    assert cluster == {"CPU": 8.0, "serve_box": 1.0, "env_box": 1.0}
    assert shortfalls(role_asks(cfg), cluster) == [
        "the run asks 1 train_box in all (1 trainer rank x 1); the cluster has 0"]
    with pytest.raises(ConfigError, match=r"cluster\.engines\.resources: GPU is not a custom resource \(set "
                                          r"cluster\.engines\.num_cpus / num_gpus instead\)"):
        load_config(None, [envs, "cluster.engines.resources={GPU: 1}"])
