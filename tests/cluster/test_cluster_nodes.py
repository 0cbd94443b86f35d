"""Several Ray nodes for real: Ray's multi-node test cluster (a head and worker nodes, each its own raylet on this
machine), the run joining it by address as a user's does (`ray job submit -- relax-gym train ...
cluster.address=auto`, docs/distributed.md), and worker nodes removed without grace mid-run (a raylet and every
process on it SIGKILLed, as a machine that loses power).

Which roles a removed node holds is made certain the way a user makes it on a real cluster: roles ask for custom
resources (`cluster.trainer.resources`, `cluster.engines.resources`) that only some nodes announce. A spare node
announcing the same ones stands by, as an autoscaler's replacement would, so the lost roles' reservations have
somewhere to go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.job_submission import JobStatus, JobSubmissionClient  # noqa: E402
from support.cluster import GROUP_SIZE as SMALL_GROUP_SIZE  # noqa: E402
from support.cluster import GROUPS_PER_STEP as SMALL_GROUPS  # noqa: E402
from support.cluster import WARM_START, events, records, trained_tasks  # noqa: E402
from support.engines import free_port  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: more steps than the test lets it take: it stops the job once the new node serves
STEPS, GROUPS, GROUP_SIZE = 1000, 4, 4
KILL_AFTER_STEP = 4
#: the test's own deadline for the run, inside pytest-timeout's: past it, the roles and last events are printed
RUN_DEADLINE_S = 240
#: what each role's actor is called in its process title, and the event that says it came back
RECOVERY = {"TrainerRank": "trainer_restarted", "EngineService": "engine_restarted",
            "RolloutWorker": "worker_restarted"}
#: the custom resources that keep the trainer rank and the engines on the nodes announcing them
PINNED = ["cluster.trainer.resources={train_box: 1}", "cluster.engines.resources={serve_box: 1}"]


@pytest.fixture
def cluster(monkeypatch):
    """A head with no CPUs for roles (the run's driver runs there, as on a login node) and Ray's job server on
    loopback; each test adds its worker nodes. `ray job stop` gives the run 60 s to finish its step (Ray's
    default is 3 s, then SIGKILL), as docs/distributed.md says to set it on a head."""
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "60")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port()})
    yield cluster
    cluster.shutdown()


def add(cluster: Cluster, cpus: float, **resources: float):
    node = cluster.add_node(num_cpus=cpus, resources=resources)
    cluster.wait_for_nodes()
    return node


def submit(dashboard: str, name: str, command: list[str]) -> subprocess.CompletedProcess:
    """`ray job submit --no-wait`, tried again while the head's job agent is not up yet (a fresh head on a loaded
    machine answers "No available agent to submit job, please try again later" for a while)."""
    deadline = time.monotonic() + 120
    while True:
        done = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", dashboard, "--submission-id", name,
                               "--no-wait", "--", *command], capture_output=True, text=True, timeout=60)
        if done.returncode == 0 or "No available agent" not in done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(1)


def roles_on(node) -> list[str]:
    """The role actors running on `node`: the process titles (`ray::Class` or `ray::Class.method`) of its raylet's
    children."""
    return sorted(role for role, _ in processes_on(node))


def processes_on(node) -> list[tuple[str, int]]:
    """Each role actor on `node` and its pid."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    found = []
    for process in raylet.children(recursive=True):
        try:
            found += [(arg[5:].split(".")[0], process.pid) for arg in process.cmdline() if arg.startswith("ray::")]
        except psutil.Error:
            continue
    return [(role, pid) for role, pid in found if role in RECOVERY]


def recovered(run_dir: Path, lost: list[str]) -> bool:
    """Whether each role lost has its recovery event."""
    kinds = Counter(e["event"] for e in events(run_dir))
    return all(kinds[RECOVERY[role]] >= count for role, count in Counter(lost).items())


def overdue(run_dir: Path, logs: str, placed: dict) -> str:
    """What a run past its deadline was doing: where each role was, its last events and its log's tail."""
    last = [json.dumps(e) for e in events(run_dir)[-10:]]
    return f"the run did not end within {RUN_DEADLINE_S} s; roles by node: {placed}\nlast events:\n" + "\n".join(
        last) + f"\nlog tail:\n{logs[-3000:]}"


def assert_recovered_once_each(run_dir: Path, lost: list[str]) -> None:
    """Each lost role came back, at its first try, and says how long it took."""
    seen = events(run_dir)
    assert recovered(run_dir, lost), (lost, seen)
    recoveries = [e for e in seen if e["event"] in RECOVERY.values()]
    assert all(e["time_to_recover_s"] > 0 for e in recoveries), recoveries
    assert not [e for e in seen if e["event"].endswith("restart_failed")], seen


def test_a_run_submitted_as_a_ray_job_survives_losing_the_node_with_its_trainer_engines_and_a_worker(
        cluster, tmp_path):
    """The trainer rank and both engines ask for resources only node A (and the spare) announce, the rollout
    workers are spread over A and B: removing A takes the trainer rank, both engines, one worker and the
    weights last published. Each comes back on the spare at its first try; a node added then takes the engines
    of the next scale-out (the spare is full); `ray job stop` ends the run as a user ends one."""
    nodes = {"A": add(cluster, 3, train_box=1, serve_box=2), "B": add(cluster, 3)}
    run_dir = tmp_path / "run"
    dashboard = f"http://{cluster.head_node.address_info['webui_url']}"
    train = [
        str(BIN / "relax-gym"), "train", str(ROOT / "examples/configs/quickstart.yaml"),
        f"run_dir={run_dir}", f"model={WARM_START}", f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=4",
        "trainer.eval_every=0", f"rollout.groups_per_step={GROUPS}", f"rollout.group_size={GROUP_SIZE}",
        "cluster.mode=ray", "cluster.address=auto", "cluster.engines.count=2", "cluster.rollout_workers.count=2",
        "cluster.health.poll_s=0.2", "cluster.health.stall_s=3", "cluster.health.probe_timeout_s=2", *PINNED,
    ]
    submitted = submit(dashboard, "relax-gym-nodes", train)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    jobs = JobSubmissionClient(dashboard)
    placed: dict[str, list[str]] = {}
    lost: list[str] = []
    scaled, stopped = None, None
    deadline = time.monotonic() + RUN_DEADLINE_S
    while jobs.get_job_status("relax-gym-nodes") not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        if time.monotonic() > deadline:
            jobs.stop_job("relax-gym-nodes")
            pytest.fail(overdue(run_dir, jobs.get_job_logs("relax-gym-nodes"), placed))
        if not lost and (run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= KILL_AFTER_STEP:
            placed = {name: roles_on(node) for name, node in nodes.items()}
            nodes["spare"] = add(cluster, 3, train_box=1, serve_box=2)
            lost = roles_on(nodes["A"])
            cluster.remove_node(nodes.pop("A"), allow_graceful=False)
        if lost and scaled is None and recovered(run_dir, lost):
            # a node joins, and the next scale-out (past the spare's room for engines) uses it
            nodes["added"] = add(cluster, 2, serve_box=2)
            scaled = subprocess.run([str(BIN / "relax-gym"), "cluster", "scale-out", "--run-dir", str(run_dir),
                                     "--engines", "4", "--wait"], capture_output=True, text=True, timeout=120)
            placed.update({name: roles_on(nodes[name]) for name in ("spare", "added")})
            stopped = subprocess.run([str(BIN / "ray"), "job", "stop", "--address", dashboard, "relax-gym-nodes"],
                                     capture_output=True, text=True, timeout=120)
        time.sleep(0.2)
    logs = jobs.get_job_logs("relax-gym-nodes")
    assert jobs.get_job_status("relax-gym-nodes") == JobStatus.STOPPED, logs[-3000:]
    assert stopped is not None and stopped.returncode == 0, (stopped, logs[-3000:])
    assert lost, f"the run ended before step {KILL_AFTER_STEP}"

    # the roles were where their resources put them, the rollout workers spread as docs/distributed.md says
    assert placed["A"] == ["EngineService", "EngineService", "RolloutWorker", "TrainerRank"], placed
    assert placed["B"] == ["RolloutWorker"], placed
    assert {"EngineService", "TrainerRank"} <= set(placed["spare"]), placed
    assert scaled is not None and scaled.returncode == 0, (scaled, placed)
    assert placed["added"].count("EngineService") == 2, placed
    # stopped as a user stops it: the running step finished and was checkpointed
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > KILL_AFTER_STEP, steps
    assert (run_dir / "checkpoints" / f"step_{len(steps)}").is_dir()
    per_task = trained_tasks(run_dir)
    assert len(per_task) == len(steps) * GROUPS and set(per_task.values()) == {GROUP_SIZE}, per_task
    assert_recovered_once_each(run_dir, lost)


def test_the_trainer_node_lost_while_a_weight_push_is_in_flight(cluster, tmp_path):
    """The push of version 3 is held in flight (its calls sent to stopped engine processes, on node B) while the
    trainer rank's node A goes, with the only copy of those weights. The engines then find the weights lost:
    no engine is blamed (each keeps serving what it holds), the trainer rank restarts on the spare from step 2's
    checkpoint and publishes again, and the run ends at its last step with every task trained once."""
    nodes = {"A": add(cluster, 2, train_box=1), "B": add(cluster, 2, serve_box=2)}
    run_dir = tmp_path / "run"
    held = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/support/held_push_run.py"), str(run_dir), cluster.address, "3",
         "trainer.total_steps=6", *PINNED, "cluster.health.stall_s=30", "cluster.health.probe_timeout_s=30"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = run_dir / "push_in_flight"
    lost: list[str] = []
    try:
        deadline = time.monotonic() + RUN_DEADLINE_S
        while not marker.exists() and held.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the push was never held"
        in_flight = json.loads(marker.read_text())
        assert sorted(pid for role, pid in processes_on(nodes["B"]) if role == "EngineService") == sorted(
            in_flight["engine_pids"])
        nodes["spare"] = add(cluster, 2, train_box=1)
        lost = roles_on(nodes["A"])
        cluster.remove_node(nodes.pop("A"), allow_graceful=False)
        for pid in in_flight["engine_pids"]:
            os.kill(pid, signal.SIGCONT)
        output, _ = held.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if held.poll() is None:
            held.kill()
    assert held.returncode == 0, output[-3000:]
    assert "TrainerRank" in lost, lost

    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, 7)), steps
    per_task = trained_tasks(run_dir)
    assert len(per_task) == 6 * SMALL_GROUPS and set(per_task.values()) == {SMALL_GROUP_SIZE}, per_task
    seen = events(run_dir)
    restarts = [e for e in seen if e["event"] == "trainer_restarted"]
    assert len(restarts) == 1 and "no engine could fetch the weights of version 3" in restarts[0]["reason"], seen
    assert restarts[0]["resumes_from_step"] == 2, restarts
    assert not [e for e in seen if e["event"] in ("publish_failed", "engine_restarted")], seen  # no engine blamed
    assert_recovered_once_each(run_dir, lost)


def test_cluster_check_says_what_fits_where_before_a_run(cluster, tmp_path):
    add(cluster, 3)
    add(cluster, 3)
    relax_gym = str(Path(sys.executable).parent / "relax-gym")
    base = [relax_gym, "cluster", "check", str(ROOT / "examples/configs/quickstart.yaml"),
            f"run_dir={tmp_path / 'run'}", f"model={WARM_START}", f"cluster.address={cluster.address}",
            "cluster.engines.count=2", "cluster.rollout_workers.count=2"]
    done = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and len(report["nodes"]) == 3, report  # the head and two worker nodes
    here = report["nodes"][0]["seen"]["versions"]
    assert all(node["seen"]["versions"] == here and node["seen"]["model"] for node in report["nodes"]), report
    workers = {n.node_id[:8] for n in cluster.worker_nodes}
    assert set(report["placed"]) == {"engine 0", "engine 1", "trainer ranks"}, report["placed"]
    placed_on = {where.split("(")[1].rstrip(")") for nodes in report["placed"].values() for where in nodes}
    assert placed_on <= workers, report["placed"]  # the head has no CPU for roles

    # more than the cluster has: one line per resource, exit 1, nothing reserved
    done = subprocess.run([*base, "cluster.engines.count=12", "cluster.engines.num_cpus=1"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("problem: the run asks 13.5 CPU in all (12 engines x 1, 2 rollout workers x 0.5, 1 trainer rank x 0.5); "
            "the cluster has 6") in " ".join(done.stdout.split()), done.stdout
