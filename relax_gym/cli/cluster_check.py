"""`relax-gym cluster check`: before a distributed run, whether the cluster has what its config asks."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape

from relax_gym.cli.console import console


def cmd_cluster_check(args: argparse.Namespace) -> int:
    """The preflight of a distributed run's config against the cluster it would join; exit 1 on any problem."""
    import asyncio
    import dataclasses

    import ray

    from relax_gym.trainer.cluster.preflight import announced, preflight
    from relax_gym.trainer.cluster.run import start_ray
    from relax_gym.trainer.config import load_config

    cfg = load_config(args.config, args.overrides)
    if cfg.cluster is None:
        console.print("[red]error: the config runs in one process: add a cluster section (or cluster.mode=ray) to "
                      "check a cluster[/red]", highlight=False, soft_wrap=True)
        return 2
    start_ray(cfg.cluster)
    try:
        report = asyncio.run(preflight(cfg))
        resources = announced(ray.cluster_resources())
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "ok": report.ok}, indent=2))
        return 0 if report.ok else 1
    where = cfg.cluster.address or "a local cluster (no cluster.address: the run would start one)"
    print(f"cluster {where}: {len(report.nodes)} nodes, " + ", ".join(
        f"{amount:g} {name}" for name, amount in {"CPU": 0, "GPU": 0, **resources}.items()))
    for ask in report.asks:
        groups = ", a placement group each" if ask.group_each else (", one group" if ask.strategy != "SPREAD" else "")
        print(f"  asks {ask.count} {ask.role}(s) x {ask.resources} ({ask.strategy}{groups})")
    for node in report.nodes:
        seen = node.seen or {}
        versions = ", ".join(f"{k} {v}" for k, v in seen.get("versions", {}).items()) or "no answer"
        print(f"  node {node.address} ({node.node_id[:8]}) {node.resources}: {versions}")
    for role, nodes in report.placed.items():
        print(f"  {role} -> {', '.join(nodes)}")
    for problem in report.problems:
        console.print(f"[red]problem: {escape(problem)}[/red]", highlight=False, soft_wrap=True)
    print("ok: the cluster can run this config" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.ok else 1
