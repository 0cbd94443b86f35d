"""Placement groups: each engine reserves its resources as one unit, the trainer ranks theirs together.

An engine's GPUs (its tensor-parallel group) sit in one STRICT_PACK bundle, so they are on one node, are
reserved before the actor starts (a scale-out that cannot fit fails with a message instead of waiting forever),
survive a restart of the engine (the new process lands on the same GPUs) and are released exactly at scale-in.
Trainer ranks are PACKed, to keep their collectives on as few nodes as possible. Rollout workers need no
reservation: they are SPREAD over the nodes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class PlacementError(RuntimeError):
    """The cluster has no room for a role's reservation (the message names what was asked)."""


def bundle(num_cpus: float, num_gpus: float) -> dict[str, float]:
    """One bundle's resources; an empty one still reserves a sliver of CPU (Ray refuses empty bundles)."""
    resources = {"CPU": num_cpus} if num_cpus else {}
    if num_gpus:
        resources["GPU"] = num_gpus
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


def in_group(group: PlacementGroup, index: int = 0) -> dict[str, Any]:
    """Actor options that place it in bundle `index` of `group` (its own resources must fit that bundle)."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group,
                                                                    placement_group_bundle_index=index)}


def release(group: PlacementGroup | None) -> None:
    if group is not None:
        remove_placement_group(group)
