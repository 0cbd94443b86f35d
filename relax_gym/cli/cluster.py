"""`relax-gym cluster`: a training run's engines through its control API (status, scale out / in, operations), and
the `check` of a cluster before a run (`cluster_check`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from relax_gym.cli.cluster_check import cmd_cluster_check
from relax_gym.cli.console import console
from relax_gym.cli.flags import Subcommands


def cmd_cluster(args: argparse.Namespace) -> int:
    """One call to a training run's control API; its JSON answer on stdout, a refusal as one line and exit 1."""
    if args.action == "check":
        return cmd_cluster_check(args)
    import httpx

    from relax_gym.trainer.cluster.control_client import ControlClient, locate, refusal

    url, token = locate(args.run_dir, args.url, args.token)
    action = args.action
    body: dict[str, Any] | None = None
    if action == "scale-out":
        body = {"num_engines": args.engines, "engine_urls": args.engine_urls, "timeout_s": args.timeout}
    elif action == "scale-in":
        body = {"num_engines": args.engines, "engine_ids": args.engine_ids, "drain_timeout_s": args.drain_timeout,
                "force": args.force, "dry_run": args.dry_run}
    try:
        with ControlClient(url, token) as client:
            response = client.call(action, getattr(args, "op_id", None), body, getattr(args, "idempotency_key", None))
            op_id = client.started_op(response) if getattr(args, "wait", False) else None
            if op_id is not None:
                progress = Console(stderr=True)  # stdout holds only the JSON answer
                try:
                    response = client.wait(op_id, on_state=lambda r: progress.print(
                        f"operation {r['op_id']}: {r['state']}", highlight=False, style="dim"))
                except KeyboardInterrupt:
                    console.print(f"stopped waiting; operation {op_id} goes on (relax-gym cluster ops {op_id})",
                                  highlight=False, soft_wrap=True)
                    return 130
    except httpx.HTTPError as err:
        why = escape(str(err) or type(err).__name__)
        console.print(f"[red]error: cannot reach the control API at {escape(url)}: {why} (is the run still "
                      "running?)[/red]", highlight=False, soft_wrap=True)
        return 1
    if not response.is_success:
        console.print(f"[red]error: {escape(refusal(response))}[/red]", highlight=False, soft_wrap=True)
        return 1
    result = response.json()
    print(json.dumps(result, indent=2))
    failed = action in ("scale-out", "scale-in") and (result.get("state") in ("FAILED", "CANCELLED") or
                                                      (args.wait and bool(result.get("failed"))))
    return 1 if failed else 0


def add_cluster_parser(sub: Subcommands) -> None:
    """The actions that call a run share `--run-dir`, `--url` and `--token` (where the API is, and its token)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", metavar="DIR", help="the run folder (its control.json and control_token)")
    common.add_argument("--url", help="the control API's URL (default: from the run folder's control.json)")
    common.add_argument("--token", help="the control token (default: $RELAX_GYM_CONTROL_TOKEN, else the run folder's "
                                        "control_token); visible to others in `ps`, prefer those")
    p = sub.add_parser("cluster", help="a cluster's preflight; a training run's engines: status, scale out / in, "
                                       "operations")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("status", parents=[common], help="the run's status and its engines by state")
    actions.add_parser("engines", parents=[common], help="every engine: id, state, weight version, requests")
    a = actions.add_parser("scale-out", parents=[common], help="add engines (an absolute target) or external servers")
    which = a.add_mutually_exclusive_group(required=True)
    which.add_argument("--engines", type=int, metavar="N", help="grow to N live engines (a target, not a delta)")
    which.add_argument("--engine-url", dest="engine_urls", action="append", metavar="URL",
                       help="register an external SGLang server at URL (repeatable)")
    a.add_argument("--timeout", type=float, metavar="S", help="seconds each engine has to become ACTIVE (default 300)")
    a = actions.add_parser("scale-in", parents=[common], help="remove engines (newest first), draining them first")
    which = a.add_mutually_exclusive_group(required=True)
    which.add_argument("--engines", type=int, metavar="N", help="shrink to N live engines (newest go first)")
    which.add_argument("--engine-id", dest="engine_ids", action="append", metavar="ID",
                       help="remove this engine (repeatable)")
    a.add_argument("--drain-timeout", type=float, metavar="S", help="seconds to let in-flight requests finish "
                                                                      "(default 30), then they are aborted")
    a.add_argument("--force", action="store_true", help="no drain: abort in-flight requests at once")
    a.add_argument("--dry-run", action="store_true", help="show which engines would go, change nothing")
    for a in (actions.choices["scale-out"], actions.choices["scale-in"]):
        a.add_argument("--wait", action="store_true", help="poll the operation until it ends (exit 1 unless every "
                                                            "engine made it)")
        a.add_argument("--idempotency-key", metavar="KEY", help="a retried request with the same key returns the "
                                                                 "first one's operation instead of starting another")
    a = actions.add_parser("check", help="before a run: whether the cluster has what CONFIG asks, every node runs "
                                         "the same versions and sees its paths, and where Ray places each role")
    a.add_argument("config", metavar="CONFIG", help="the training config (YAML) the run would use")
    a.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, as `relax-gym train` takes them")
    a.add_argument("--json", action="store_true", help="the whole report as JSON")
    a = actions.add_parser("ops", parents=[common], help="the recent operations, or one")
    a.add_argument("op_id", nargs="?", metavar="OP_ID")
    a = actions.add_parser("cancel", parents=[common], help="cancel a scale-out still starting its engines")
    a.add_argument("op_id", metavar="OP_ID")
    p.set_defaults(func=cmd_cluster)
