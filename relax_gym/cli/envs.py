"""`relax-gym envs` and `relax-gym check`: the registered environments, and their conformance checks."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.table import Table

from relax_gym.cli.console import console
from relax_gym.cli.flags import Subcommands, key_values


def _print_namespaces() -> None:
    """The namespaces whose ids build on first lookup (`register_namespace`): the table lists only those made."""
    from relax_gym.env.registration import namespaces

    for namespace, (entry, keyword) in sorted(namespaces.items()):
        where = entry if isinstance(entry, str) else getattr(entry, "__qualname__", repr(entry))
        console.print(f"{namespace}/NAME  {escape(where)} with {keyword}=NAME", highlight=False)


def cmd_envs(args: argparse.Namespace) -> int:
    from relax_gym.env.registration import describe, list_envs

    rows = []
    for env_id in list_envs():
        try:
            rows.append(describe(env_id))
        except Exception as err:  # an env whose module cannot import is listed, not fatal
            rows.append({"id": env_id, "error": f"{type(err).__name__}: {err}"})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cells = [(r["id"], "", "", "", r["error"]) if "error" in r else (
        r["id"], ", ".join(r["modalities"]), ", ".join(r["tools"]), "yes" if r["sandbox"] else "", r["description"]
    ) for r in rows]
    # Every cell is escaped: descriptions say things like "[low, high]", which rich would take for markup.
    table = Table(title="relax_gym environments")
    table.add_column("id", no_wrap=True, overflow="fold")  # an id is copied into commands: never cut it
    for col in ("modalities", "tools", "sandbox", "description"):
        table.add_column(col, overflow="fold")
    for c, r in zip(cells, rows, strict=True):
        table.add_row(*map(escape, c[:4]), f"[red]{escape(c[4])}[/red]" if "error" in r else escape(c[4]))
    if console.measure(table, options=console.options.update_width(10**6)).maximum <= console.width:
        console.print(table)
        _print_namespaces()
        return 0
    # Too narrow for the table unwrapped (80 columns when piped): one block per env, ids whole on their own line.
    console.print("relax_gym environments", style="bold")
    for (env_id, mods, tools, sandbox, description), r in zip(cells, rows, strict=True):
        console.print(escape(env_id), style="bold", soft_wrap=True, highlight=False)
        if "error" in r:
            console.print(f"    [red]{escape(description)}[/red]", highlight=False)
            continue
        facts = [mods, f"tools: {tools}" if tools else "no tools", "sandbox" if sandbox else ""]
        console.print(escape(f"    {' | '.join(f for f in facts if f)}"), highlight=False)
        if description:
            console.print(escape(f"    {description}"), highlight=False)
    _print_namespaces()
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from relax_gym.env.conformance import FAILED, NOT_EXERCISED, resolve, run_checks
    from relax_gym.env.registration import EnvArgumentError, UnknownEnvError
    from relax_gym.rollout.agent_check import check_agent

    env_kwargs: dict[str, object] = {}
    for pair in args.env_arg:  # one at a time, so an error names the pair
        try:
            env_kwargs |= key_values([pair])
        except Exception as err:  # a StartupError naming the pair
            console.print(f"[red]bad --env-arg {escape(repr(pair))}: {escape(' '.join(str(err).split()))}[/red]",
                          highlight=False, soft_wrap=True)
            return 2
    reports = []
    for target in args.targets:
        try:
            resolved = resolve(target, env_kwargs)
        except (UnknownEnvError, EnvArgumentError) as err:  # their messages name the target and the fix
            console.print(f"[red]cannot check {escape(target)}: {escape(str(err))}[/red]", highlight=False,
                          soft_wrap=True)
            return 2
        except Exception as err:
            console.print(f"[red]cannot load {escape(target)}: {type(err).__name__}: {escape(str(err))}[/red]",
                          highlight=False, soft_wrap=True)
            return 2
        for name, factory in resolved:
            report = run_checks(name, factory)
            agent = check_agent(name, factory)  # None unless it makes an AgentEnv
            if agent is not None:
                report.results.append(agent)
            reports.append(report)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        marks = {FAILED: "✗", NOT_EXERCISED: "[yellow]?[/yellow]"}
        for report in reports:
            mark = "[green]PASS[/green]" if report.passed else "[red]FAIL[/red]"
            idle = f" [yellow]({len(report.not_exercised)} not exercised)[/yellow]" if report.not_exercised else ""
            console.print(f"{mark} {escape(report.target)}{idle}", highlight=False, soft_wrap=True)
            for r in report.results:
                detail = escape(r.detail)
                if r.status == NOT_EXERCISED:  # not a failure, but a check that proved nothing must be seen
                    detail = f"[yellow]not exercised[/yellow]: {detail}"
                console.print(f"  {marks.get(r.status, '✓')} {escape(r.name)}: {detail}", highlight=False,
                              soft_wrap=True)
            for w in report.warnings:
                console.print(f"  [yellow]warning[/yellow]: {escape(w)}", highlight=False, soft_wrap=True)
    return 0 if all(r.passed for r in reports) else 1


def add_envs_parser(sub: Subcommands) -> None:
    p = sub.add_parser("envs", help="list registered environments")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_envs)


def add_check_parser(sub: Subcommands) -> None:
    p = sub.add_parser("check", help="conformance-check environments (exit != 0 on failure)")
    p.add_argument("targets", nargs="+", metavar="ID_OR_MODULE:CLASS",
                   help="a registered id, module:Class, file.py:Class, or file.py (checks the ids it registers)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="env kwarg passed to every target's constructor (repeatable; YAML-typed: digits=2 is an int)")
    p.set_defaults(func=cmd_check)
