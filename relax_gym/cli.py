"""The `relax-gym` command line.

Each subcommand is a small function; heavy imports (torch, the trainer) happen
inside the command that needs them so `relax-gym envs` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

console = Console()


def cmd_envs(args: argparse.Namespace) -> int:
    from relax_gym.registration import describe, list_envs

    rows = []
    for env_id in list_envs():
        try:
            rows.append(describe(env_id))
        except Exception as err:  # an env whose module cannot import is listed, not fatal
            rows.append({"id": env_id, "error": f"{type(err).__name__}: {err}"})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="relax_gym environments")
    for col in ("id", "modalities", "tools", "sandbox", "description"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["id"], "", "", "", f"[red]{r['error']}[/red]")
        else:
            table.add_row(r["id"], ", ".join(r["modalities"]), ", ".join(r["tools"]), "yes" if r["sandbox"] else "",
                          r["description"])
    console.print(table)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from relax_gym.conformance import resolve, run_checks

    reports = []
    for target in args.targets:
        try:
            resolved = resolve(target)
        except Exception as err:
            console.print(f"[red]cannot load {target}: {type(err).__name__}: {err}[/red]")
            return 2
        reports += [run_checks(name, factory) for name, factory in resolved]
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for report in reports:
            mark = "[green]PASS[/green]" if report.passed else "[red]FAIL[/red]"
            console.print(f"{mark} {report.target}")
            for r in report.results:
                console.print(f"  {'✓' if r.passed else '✗'} {r.name}: {r.detail}", highlight=False)
            for w in report.warnings:
                console.print(f"  [yellow]warning[/yellow]: {w}", highlight=False)
    return 0 if all(r.passed for r in reports) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relax-gym", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("envs", help="list registered environments")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_envs)

    p = sub.add_parser("check", help="conformance-check environments (exit != 0 on failure)")
    p.add_argument("targets", nargs="+", metavar="ID_OR_MODULE:CLASS",
                   help="a registered id, module:Class, file.py:Class, or file.py (checks the ids it registers)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
