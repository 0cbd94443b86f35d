"""Placement groups: each engine reserves its resources as one unit, the trainer ranks theirs together.

An engine's GPUs (its tensor-parallel group) sit in one STRICT_PACK bundle, so they are on one node, are
reserved before the actor starts (a scale-out that cannot fit fails with a message instead of waiting forever),
survive a restart of the engine (the new process lands on the same GPUs) and are released exactly at scale-in.
Trainer ranks are PACKed, to keep their collectives on as few nodes as possible. Rollout workers need no
reservation: they are SPREAD over the nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from relax_gym.trainer.cluster.config import ClusterSection

#: how long a restart waits for Ray to settle the nodes of its reservation (Ray's own health checks declare a
#: silent node dead within about 30 s by default)
SETTLE_TIMEOUT_S = 60.0


class PlacementError(RuntimeError):
    """The cluster has no room for a role's reservation (the message names what was asked)."""


def bundle(num_cpus: float, num_gpus: float, custom: dict[str, float] | None = None) -> dict[str, float]:
    """One bundle's resources; an empty one still reserves a sliver of CPU (Ray refuses empty bundles)."""
    resources = {"CPU": num_cpus} if num_cpus else {}
    if num_gpus:
        resources["GPU"] = num_gpus
    resources.update(custom or {})
    return resources or {"CPU": 0.01}


async def reserve(bundles: list[dict[str, float]], strategy: str, timeout_s: float, what: str) -> PlacementGroup:
    """A placement group of `bundles`, once the cluster has placed it; PlacementError (and nothing reserved)
    when it cannot within `timeout_s`."""
    group = placement_group(bundles, strategy=strategy)
    try:
        await asyncio.wait_for(group.ready(), timeout_s)
    except TimeoutError:
        remove_placement_group(group)
        raise PlacementError(f"{what}: the cluster could not place {bundles} ({strategy}) within {timeout_s:g} s; "
                             "free resources or add a node") from None
    except BaseException:
        remove_placement_group(group)
        raise
    return group


def engine_bundles(c: ClusterSection) -> list[dict[str, float]]:
    """One engine's reservation (STRICT_PACK: its tensor-parallel GPUs on one node)."""
    return [bundle(c.engines.num_cpus, c.engines.num_gpus * c.engines.tp, c.engines.resources)]


def trainer_bundles(c: ClusterSection) -> list[dict[str, float]]:
    """The trainer ranks' reservation, one bundle per rank (PACK)."""
    return [bundle(c.trainer.num_cpus, c.trainer.num_gpus, c.trainer.resources)] * c.trainer.world_size


def on_node(node_id: str) -> dict[str, Any]:
    """Task or actor options that run it on that node only (never elsewhere, if the node is gone)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def in_group(group: PlacementGroup, index: int = 0) -> dict[str, Any]:
    """Actor options that place it in bundle `index` of `group` (its own resources must fit that bundle)."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group,
                                                                    placement_group_bundle_index=index)}


def release(group: PlacementGroup | None) -> None:
    if group is not None:
        remove_placement_group(group)


def nodes_of(group: PlacementGroup | None) -> set[str]:
    """The ids of the nodes holding `group`'s bundles (none for no group)."""
    return set(placement_group_table(group).get("bundles_to_node_id", {}).values()) if group is not None else set()


async def settled(nodes: Iterable[str], timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Returns once each of `nodes` runs a task, or Ray has declared it dead, at most `timeout_s`. A role lost with
    its node was on a node Ray still counts alive until its health checks fail: a replacement placed there
    meanwhile (the role's reservation is there, or the scheduler sees free room there) would die with that node,
    a failed first restart."""
    await asyncio.gather(*(_answered(node, timeout_s) for node in set(nodes)))


@ray.remote(num_cpus=0, max_retries=0)
def _here() -> None:
    """Nothing, on the node it is pinned to: it runs there only if that node answers."""


async def _answered(node_id: str, timeout_s: float) -> None:
    ref = _here.options(**on_node(node_id)).remote()
    try:
        await asyncio.wait_for(ref, timeout_s)
    except TimeoutError:
        ray.cancel(ref, force=True)
    except ray.exceptions.RayError:
        pass  # the node is gone, and Ray knows it
