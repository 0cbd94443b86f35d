"""`relax-gym preflight`: whether a model's chat template keeps multi-turn tokens exact (appending a turn gives the
tokens a full re-render would)."""

from __future__ import annotations

import argparse
import json

from relax_gym.cli.console import console
from relax_gym.cli.flags import Subcommands, add_template_flags, load_model_flags


def cmd_preflight(args: argparse.Namespace) -> int:
    from relax_gym.rollout.preflight import preflight, report_dict

    loaded = load_model_flags(args)
    results = preflight(loaded)
    report = report_dict(loaded, results)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            mark = ("[green]match[/green]" if r.match else "[cyan]differs as expected[/cyan]" if r.expected
                    else "[red]DIFFERS[/red]")
            console.print(f"{mark} {r.case}: {r.appended_tokens} appended vs {r.rerendered_tokens} re-rendered tokens")
            if r.error:
                console.print(f"    {r.error}", highlight=False)
            elif not r.match:
                console.print(f"    first difference at token {r.first_diff}", highlight=False)
                console.print(f"    appended:    {r.appended_context!r}", highlight=False)
                console.print(f"    re-rendered: {r.rerendered_context!r}", highlight=False)
        console.print(f"strategy: {report['strategy']}", highlight=False, soft_wrap=True)
        for w in report["warnings"]:
            console.print(f"[yellow]warning[/yellow]: {w}", highlight=False, soft_wrap=True)
        verdict = "certified" if report["certified"] else "NOT certified: see the differing cases above"
        console.print(f"{args.model}: {verdict}")
    return 0 if report["certified"] else 1


def add_preflight_parser(sub: Subcommands) -> None:
    p = sub.add_parser("preflight", help="certify a chat template for exact multi-turn token continuity")
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", action="store_true")
    add_template_flags(p)
    p.set_defaults(func=cmd_preflight)
