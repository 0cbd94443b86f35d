"""Several Ray nodes for real: Ray's multi-node test cluster (a head and two worker nodes, each its own raylet on
this machine), the run submitted to it as a user submits one (`ray job submit -- relax-gym train ...
cluster.address=auto`, docs/distributed.md), and a worker node removed without grace mid-run (its raylet and
every process on it SIGKILLed, as a machine that loses power).

The removed node is the one holding the trainer rank, so the run loses its trainer, the weights it published
(their copy lived there) and whatever engine or rollout worker Ray placed beside it. The run must bring each
lost role back on the surviving node at its first try and train each task exactly once; then a new node joins,
the next scale-out (past the survivor's room) places an engine on it, and `ray job stop` ends the run as a user
ends one: its running step finished and checkpointed.
"""

from __future__ import annotations

import json
import socket
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
from support.cluster import WARM_START, events, records, trained_tasks  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
#: more steps than the test lets it take: it stops the job once the new node serves
STEPS, GROUPS, GROUP_SIZE = 1000, 4, 4
KILL_AFTER_STEP = 4
#: the test's own deadline for the run, inside pytest-timeout's: past it, the roles and last events are printed
RUN_DEADLINE_S = 240
#: what each role's actor is called in its process title, and the event that says it came back
RECOVERY = {"TrainerRank": "trainer_restarted", "EngineService": "engine_restarted",
            "RolloutWorker": "worker_restarted"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def cluster(monkeypatch):
    """A head with no CPUs for roles (the run's driver runs there, as on a login node) and Ray's job server on
    loopback, and two worker nodes with 3 logical CPUs each: the run's 5 roles (0.5 CPU each) fit on either node
    alone once the other is gone. `ray job stop` gives the run 60 s to finish its step (Ray's default is 3 s,
    then SIGKILL), as docs/distributed.md says to set it on a head."""
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "60")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port()})
    for _ in range(2):
        cluster.add_node(num_cpus=3)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def roles_on(node) -> list[str]:
    """The role actors running on `node`: the process titles (`ray::Class` or `ray::Class.method`) of its raylet's
    children."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    titles = []
    for process in raylet.children(recursive=True):
        try:
            titles += [arg[5:].split(".")[0] for arg in process.cmdline() if arg.startswith("ray::")]
        except psutil.Error:
            continue
    return sorted(t for t in titles if t in RECOVERY)


def recovered(run_dir: Path, lost: list[str]) -> bool:
    """Whether each role lost has its recovery event."""
    kinds = Counter(e["event"] for e in events(run_dir))
    return all(kinds[RECOVERY[role]] >= count for role, count in Counter(lost).items())


def overdue(run_dir: Path, logs: str, placed: dict) -> str:
    """What a run past its deadline was doing: where each role was, its last events and its log's tail."""
    last = [json.dumps(e) for e in events(run_dir)[-10:]]
    return f"the run did not end within {RUN_DEADLINE_S} s; roles by node: {placed}\nlast events:\n" + "\n".join(
        last) + f"\nlog tail:\n{logs[-3000:]}"


def test_a_run_submitted_as_a_ray_job_survives_losing_the_node_with_its_trainer_and_scales_onto_a_new_one(
        cluster, tmp_path):
    run_dir = tmp_path / "run"
    dashboard = f"http://{cluster.head_node.address_info['webui_url']}"
    train = [
        str(Path(sys.executable).parent / "relax-gym"), "train", str(ROOT / "examples/configs/quickstart.yaml"),
        f"run_dir={run_dir}", f"model={WARM_START}", f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=4",
        "trainer.eval_every=0", f"rollout.groups_per_step={GROUPS}", f"rollout.group_size={GROUP_SIZE}",
        "cluster.mode=ray", "cluster.address=auto", "cluster.engines.count=2", "cluster.rollout_workers.count=2",
        "cluster.health.poll_s=0.2", "cluster.health.stall_s=3", "cluster.health.probe_timeout_s=2",
    ]
    submitted = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", dashboard, "--submission-id",
         "relax-gym-nodes", "--no-wait", "--", *train], capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    jobs = JobSubmissionClient(dashboard)
    nodes = list(cluster.worker_nodes)
    placed: dict[str, list[str]] = {}
    lost: list[str] = []
    added, scaled, stopped = None, None, None
    deadline = time.monotonic() + RUN_DEADLINE_S
    while jobs.get_job_status("relax-gym-nodes") not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        if time.monotonic() > deadline:
            jobs.stop_job("relax-gym-nodes")
            pytest.fail(overdue(run_dir, jobs.get_job_logs("relax-gym-nodes"), placed))
        if not lost and (run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= KILL_AFTER_STEP:
            placed = {n.node_id[:8]: roles_on(n) for n in nodes}
            victim = next(n for n in nodes if "TrainerRank" in roles_on(n))
            lost = roles_on(victim)
            cluster.remove_node(victim, allow_graceful=False)
        if lost and added is None and recovered(run_dir, lost):
            # a node joins, and the next scale-out (past the survivor's room) uses it
            added = cluster.add_node(num_cpus=3)
            scaled = subprocess.run([str(Path(sys.executable).parent / "relax-gym"), "cluster", "scale-out",
                                     "--run-dir", str(run_dir), "--engines", "4", "--wait"], capture_output=True,
                                    text=True, timeout=120)
            placed["added"] = roles_on(added)
            stopped = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "stop", "--address", dashboard,
                                      "relax-gym-nodes"], capture_output=True, text=True, timeout=120)
        time.sleep(0.2)
    logs = jobs.get_job_logs("relax-gym-nodes")
    assert jobs.get_job_status("relax-gym-nodes") == JobStatus.STOPPED, logs[-3000:]
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert lost, f"the run ended before step {KILL_AFTER_STEP}"

    assert scaled is not None and scaled.returncode == 0, (scaled, placed)
    assert "EngineService" in placed["added"], placed
    # the roles were spread as docs/distributed.md says: the rollout workers on different nodes
    assert all(roles.count("RolloutWorker") == 1 for node, roles in placed.items() if node != "added"), placed
    # stopped as a user stops it: the running step finished and was checkpointed
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > KILL_AFTER_STEP, steps
    assert (run_dir / "checkpoints" / f"step_{len(steps)}").is_dir()
    per_task = trained_tasks(run_dir)
    assert len(per_task) == len(steps) * GROUPS and set(per_task.values()) == {GROUP_SIZE}, per_task

    seen = events(run_dir)
    assert recovered(run_dir, lost), (lost, seen)
    recoveries = [e for e in seen if e["event"] in RECOVERY.values()]
    assert all(e["time_to_recover_s"] > 0 for e in recoveries), recoveries
    assert not [e for e in seen if e["event"].endswith("restart_failed")], seen  # each came back at its first try


def test_cluster_check_says_what_fits_where_before_a_run(cluster, tmp_path):
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
