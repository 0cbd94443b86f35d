"""A distributed run's preflight (`relax-gym cluster check CONFIG`, and the path check at a joined run's start).

Before any step: whether the Ray cluster has what the config asks of it for each role, whether every node runs
the relax_gym, torch, transformers and Ray this process runs and sees the run's model and folder (a node that
cannot is found here, not as a role that dies at start), and where Ray places each role's reservation (the
placement groups are reserved for real, read, and released).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group_table

from relax_gym.trainer.cluster.placement import (
    PlacementError,
    bundle,
    engine_bundles,
    on_node,
    release,
    reserve,
    trainer_bundles,
)
from relax_gym.trainer.config import TrainConfig

#: how long a reservation may take to be placed before the preflight says it cannot be
PLACE_TIMEOUT_S = 15.0
#: how long a node has to answer the preflight's task
NODE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RoleAsk:
    """What one role asks: `count` actors of `resources` each, placed by Ray's `strategy`, in a placement group
    each (`group_each`) or all in one (an unreserved SPREAD role has none)."""

    role: str
    count: int
    resources: dict[str, float]
    strategy: str
    group_each: bool = False


def role_asks(cfg: TrainConfig) -> list[RoleAsk]:
    """Each role's actors and resources, as the run reserves them (docs/distributed.md)."""
    c = cfg.cluster
    assert c is not None
    return [RoleAsk("engine", c.engines.count, engine_bundles(c)[0], "STRICT_PACK", group_each=True),
            RoleAsk("rollout worker", c.rollout_workers.count,
                    bundle(c.rollout_workers.num_cpus, 0, c.rollout_workers.resources), "SPREAD"),
            RoleAsk("trainer rank", c.trainer.world_size, trainer_bundles(c)[0], "PACK")]


def total_ask(asks: list[RoleAsk]) -> dict[str, float]:
    total: dict[str, float] = {}
    for ask in asks:
        for name, amount in ask.resources.items():
            total[name] = total.get(name, 0.0) + amount * ask.count
    return total


def shortfalls(asks: list[RoleAsk], cluster: dict[str, float]) -> list[str]:
    """What the cluster lacks for the whole run, one line per resource."""
    return [f"the run asks {amount:g} {name} in all ({', '.join(_asking(asks, name))}); the cluster has "
            f"{cluster.get(name, 0):g}" for name, amount in total_ask(asks).items() if amount > cluster.get(name, 0)
            + 1e-9]


def _asking(asks: list[RoleAsk], name: str) -> list[str]:
    return [f"{a.count} {a.role}{'s' * (a.count != 1)} x {a.resources[name]:g}" for a in asks
            if name in a.resources and a.count]


def fingerprint(path: str) -> str | None:
    """The names and sizes of a model file or of a folder's files, hashed; None where `path` is not there."""
    where = Path(path)
    if where.is_file():
        entries = [(where.name, where.stat().st_size)]
    elif where.is_dir():
        entries = sorted((f.name, f.stat().st_size) for f in where.iterdir() if f.is_file())
    else:
        return None
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:12]


def what_a_node_sees(model: str, run_dir: str) -> dict[str, Any]:
    """Run on each node: the versions it imports, whether it sees the model as a path (`fingerprint`) and whether
    it can write the run folder (or the nearest existing folder above it). Paths are read as the roles read them:
    a relative one from that node's working directory."""
    import torch
    import transformers

    from relax_gym.version import __version__

    writable = Path(run_dir).absolute()
    while not writable.exists() and writable != writable.parent:
        writable = writable.parent
    return {"versions": {"relax_gym": __version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "ray": ray.__version__,
                         "python": platform.python_version()},
            "model": fingerprint(model),
            "run_dir_writable": os.access(writable, os.W_OK)}


@dataclass
class NodeReport:
    node_id: str
    address: str
    resources: dict[str, float]
    seen: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Preflight:
    asks: list[RoleAsk]
    nodes: list[NodeReport]
    placed: dict[str, list[str]]  # a role's reservation -> the nodes holding it, "ADDRESS (NODE_ID[:8])"
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def announced(resources: dict[str, float]) -> dict[str, float]:
    """A node's CPUs, GPUs and custom resources (what roles can ask for), without Ray's own bookkeeping ones."""
    return {k: v for k, v in resources.items() if k not in ("memory", "object_store_memory")
            and not k.startswith(("node:", "accelerator_type:"))}


async def visit(node: dict[str, Any], model: str, run_dir: str) -> NodeReport:
    """The node's answer to `what_a_node_sees`, or why it gave none."""
    report = NodeReport(node["NodeID"], node.get("NodeManagerAddress", "?"), announced(node.get("Resources", {})))
    remote = ray.remote(num_cpus=0, max_retries=0)(what_a_node_sees).options(**on_node(node["NodeID"]))
    try:
        report.seen = await asyncio.wait_for(remote.remote(model, run_dir), NODE_TIMEOUT_S)
    except TimeoutError:
        report.problems.append(f"did not run a task within {NODE_TIMEOUT_S:g} s")
    except Exception as err:  # its import of relax_gym, torch or transformers failed, or the node went away
        report.problems.append(f"cannot run relax_gym's preflight: {type(err).__name__}: "
                               f"{str(err).strip().splitlines()[-1][:200]}")
    return report


def compare(report: NodeReport, here: dict[str, Any], model: str, model_is_path: bool, *,
            versions: bool = True) -> None:
    """What differs on `report`'s node from this process (`here`), as problems of that node."""
    if report.seen is None:
        return
    for name, version in here["versions"].items() if versions else ():
        theirs = report.seen["versions"].get(name)
        if theirs != version:
            report.problems.append(f"runs {name} {theirs}, this process {version}")
    if model_is_path and report.seen["model"] != here["model"]:
        report.problems.append(f"does not see the model {model} as this process does (fingerprint "
                               f"{report.seen['model'] or 'missing'}, here {here['model']}): paths must be absolute, "
                               "on a file system every node shares")
    if not report.seen["run_dir_writable"]:
        report.problems.append("cannot write the run folder (checkpoints and `weight_sync: disk` need it on a shared "
                               "file system)")


async def place(asks: list[RoleAsk]) -> tuple[dict[str, list[str]], list[str]]:
    """Reserves each role's placement groups as the run would, reads where Ray put them, and releases them."""
    addresses = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    placed: dict[str, list[str]] = {}
    problems: list[str] = []
    groups = []
    try:
        for ask in asks:
            if ask.strategy == "SPREAD" or not ask.count:
                continue
            shapes = [[ask.resources]] * ask.count if ask.group_each else [[ask.resources] * ask.count]
            for index, bundles in enumerate(shapes):
                name = f"{ask.role} {index}" if ask.group_each else f"{ask.role}s"
                try:
                    group = await reserve(bundles, ask.strategy, PLACE_TIMEOUT_S, name)
                except PlacementError as err:
                    problems.append(str(err))
                    break  # the role's next groups are the same shape
                groups.append(group)
                nodes = placement_group_table(group).get("bundles_to_node_id", {}).values()
                placed[name] = [f"{addresses.get(n, '?')} ({n[:8]})" for n in nodes]
    finally:
        for group in groups:
            release(group)
    return placed, problems


async def preflight(cfg: TrainConfig) -> Preflight:
    """The whole check on the cluster this process is connected to."""
    asks = role_asks(cfg)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    short = shortfalls(asks, ray.cluster_resources())
    problems = list(short)
    model = cfg.model.path
    model_is_path = Path(model).exists()
    here = what_a_node_sees(model, str(cfg.run_dir))
    reports = list(await asyncio.gather(*(visit(n, model, str(cfg.run_dir)) for n in nodes)))
    for report in reports:
        compare(report, here, model, model_is_path)
        problems += [f"node {report.address} ({report.node_id[:8]}) {p}" for p in report.problems]
    placed, unplaced = await place(asks) if not short else ({}, [])  # short of resources: nothing would fit
    return Preflight(asks, reports, placed, problems + unplaced)


async def unseen_paths(cfg: TrainConfig) -> list[str]:
    """At a joined run's start: the nodes that cannot see its model or write its folder, one line each (empty when
    all can). A node that does not answer is left to the roles' own failures; versions are the preflight's."""
    model, run_dir = cfg.model.path, str(cfg.run_dir)
    here = what_a_node_sees(model, run_dir)
    reports = await asyncio.gather(*(visit(n, model, run_dir) for n in ray.nodes() if n.get("Alive")))
    lines = []
    for report in reports:
        report.problems.clear()  # only what it saw counts here
        compare(report, here, model, Path(model).exists(), versions=False)
        lines += [f"node {report.address} ({report.node_id[:8]}) {p}" for p in report.problems]
    return lines
