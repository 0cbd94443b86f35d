"""The launchers under examples/ for several machines, checked for what can be checked without Slurm or Kubernetes:
the Slurm batch script run with stand-ins for srun, scontrol and the two CLIs (the commands it issues, on which
node), and the KubeRay RayJob's fields; each against the config its run would load and the room its cluster has.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

from relax_gym.trainer.cluster.preflight import role_asks, shortfalls
from relax_gym.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "ray_train.sbatch"
RAYJOB = ROOT / "examples" / "kuberay" / "rayjob.yaml"

#: stand-ins that log their argv as one JSON line each; srun also answers `hostname --ip-address`
RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["LAUNCH_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
if os.path.basename(sys.argv[0]) == "scontrol":
    print("gpu-node-0\\ngpu-node-1\\ngpu-node-2")
if os.path.basename(sys.argv[0]) == "srun" and "hostname" in sys.argv:
    print("10.0.0.1 fe80::1")
"""


def test_the_slurm_script_starts_ray_on_every_node_and_runs_the_config_against_its_head(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "launch.jsonl"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "ray", "relax-gym", "sleep"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LAUNCH_LOG": str(log),
           "SLURM_JOB_NODELIST": "gpu-node-[0-2]", "SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "16"}
    done = subprocess.run(["bash", str(SBATCH), "cluster.engines.count=4"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    on = {c[c.index("-w") + 1]: c[c.index("-w") + 2:] for c in calls if c[0] == "srun" and "ray" in c}
    assert on["gpu-node-0"] == ["ray", "start", "--head", "--node-ip-address=10.0.0.1", "--port=6379",
                                   "--num-cpus=16", "--num-gpus=0", "--block"]
    for worker in ("gpu-node-1", "gpu-node-2"):
        assert on[worker] == ["ray", "start", "--address=10.0.0.1:6379", "--num-cpus=16", "--num-gpus=0",
                                 "--block"]
    runs = [c[1:] for c in calls if c[0] == "relax-gym"]
    assert [r[:2] for r in runs] == [["cluster", "check"], ["train", "examples/configs/quickstart.yaml"]]
    assert runs[0][2:] == runs[1][1:]  # the preflight checks exactly what the run loads
    cfg = load_config(ROOT / runs[1][1], runs[1][2:])
    assert cfg.cluster is not None and cfg.cluster.address == "10.0.0.1:6379" and cfg.cluster.engines.count == 4
    assert str(cfg.run_dir) == str(ROOT / "runs" / "slurm-42")
    assert shortfalls(role_asks(cfg), {"CPU": 3 * 16.0}) == []


def test_the_rayjob_runs_the_config_on_a_cluster_with_room_for_it_and_its_paths_on_a_shared_volume():
    job = yaml.safe_load(RAYJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    program, command, config, *overrides = shlex.split(job["spec"]["entrypoint"])
    assert (program, command) == ("relax-gym", "train")
    cfg = load_config(ROOT / config, overrides)  # the image's working folder holds the repository's examples/
    assert cfg.cluster is not None and cfg.cluster.address == "auto"  # the job's driver runs on the head

    spec = job["spec"]["rayClusterSpec"]
    major, minor = (int(x) for x in spec["rayVersion"].split(".")[:2])
    assert (major, minor) >= (2, 50)  # pyproject's floor for the ray extra
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    room = sum(int(g["replicas"]) * float(g["rayStartParams"]["num-cpus"]) for g in spec["workerGroupSpecs"])
    assert shortfalls(role_asks(cfg), {"CPU": room}) == []
    pods = [spec["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in spec["workerGroupSpecs"])]
    for pod in pods:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        for container in pod["containers"]:
            mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims]
            for path in (str(cfg.run_dir), cfg.model.path):
                assert any(path.startswith(mount + "/") for mount in mounts), (container["name"], path)
