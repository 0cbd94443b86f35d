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


def _key_values(pairs: Sequence[str]) -> dict[str, object]:
    """`k=v` pairs with YAML-typed values (`digits=2` is an int, `x=[1,2]` a list)."""
    import yaml

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected key=value, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def cmd_rollout(args: argparse.Namespace) -> int:
    import asyncio

    from relax_gym.rollout.run import rollout_to_file

    summary = asyncio.run(rollout_to_file(
        env_id=args.env, model=args.model, n=args.n, group=args.group, out=args.out, seed=args.seed,
        engine_url=args.engine_url, env_kwargs=_key_values(args.env_arg), temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, max_total_tokens=args.max_total_tokens,
        concurrency=args.concurrency,
    ))
    console.print(f"wrote {args.out}")
    for env_id, s in summary.items():
        console.print(f"[bold]{env_id}[/bold]: {s['episodes']} episodes, mean reward {s['reward_mean']:.3f}, "
                      f"status {s['status']}", highlight=False)
        console.print(f"  turns {s['turns_mean']:.1f}, tool calls {s['tool_calls_mean']:.1f}, tokens "
                      f"{s['tokens_mean']:.0f} ({s['generated_tokens_mean']:.0f} generated); time generating "
                      f"{s['generate_s']:.1f} s, in env {s['env_s']:.1f} s", highlight=False)
        for label in ("failures", "truncations"):
            if s[label]:
                console.print(f"  {label}: {s[label]}", highlight=False)
        if s["rerender_mismatches"]:
            console.print(f"  [yellow]{s['rerender_mismatches']} trajectories differ from a full re-render "
                          "(see metrics.rerender_first_diff_char)[/yellow]")
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from relax_gym.models import load_model
    from relax_gym.rollout.preflight import preflight, report_dict

    results = preflight(load_model(args.model))
    report = report_dict(results)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            mark = "[green]match[/green]" if r.match else "[red]DIFFERS[/red]"
            console.print(f"{mark} {r.case}: {r.appended_tokens} appended vs {r.rerendered_tokens} re-rendered tokens")
            if r.error:
                console.print(f"    {r.error}", highlight=False)
            elif not r.match:
                console.print(f"    first difference at token {r.first_diff}", highlight=False)
                console.print(f"    appended:    {r.appended_context!r}", highlight=False)
                console.print(f"    re-rendered: {r.rerendered_context!r}", highlight=False)
        verdict = "certified" if report["certified"] else "NOT certified: see the differing cases above"
        console.print(f"{args.model}: {verdict}")
    return 0 if report["certified"] else 1


def cmd_view(args: argparse.Namespace) -> int:
    from relax_gym.viewer import write_html

    tokenizer = None
    if args.model:
        from relax_gym.models import load_model

        tokenizer = load_model(args.model).tokenizer
    out = write_html(args.jsonl, args.output, tokenizer=tokenizer)
    console.print(f"wrote {out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from relax_gym.trainer.config import ConfigError, load_config
    from relax_gym.trainer.loop import train

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]", highlight=False)
        return 2
    summary = train(cfg)
    if "rank" in summary:  # a follower rank under torchrun: rank 0 reports
        return 0
    console.print(
        f"run folder {summary['run_dir']}: {summary['steps']} steps, reward {summary['reward_first_tenth']:.3f}"
        f" (first tenth) -> {summary['reward_last_tenth']:.3f} (last tenth); plot {summary['plot']}",
        highlight=False,
    )
    return 130 if summary.get("interrupted") else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from relax_gym.engines.server import serve

    serve(args.model, host=args.host, port=args.port)
    return 0


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

    p = sub.add_parser("rollout", help="run episodes and write trajectories as JSONL")
    p.add_argument("--env", required=True, help="a registered env id")
    p.add_argument("--model", default="tiny", help="tiny | tiny-vl | tiny-audio | a local HF checkpoint folder")
    p.add_argument("-n", type=int, default=8, help="number of tasks")
    p.add_argument("--group", type=int, default=1, help="episodes per task (same seed)")
    p.add_argument("--out", required=True, help="output .jsonl (written as groups finish)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-url", default=None, help="an SGLang (or relax-gym serve) server instead of in-process")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE", help="env kwarg (repeatable)")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("view", help="render trajectories as an HTML page")
    p.add_argument("jsonl")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--model", default=None, help="decode per-token spans with this model's tokenizer")
    p.set_defaults(func=cmd_view)

    p = sub.add_parser("preflight", help="certify a chat template for exact multi-turn token continuity")
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("train", help="train a policy (a run folder with metrics, checkpoints, a reward plot)")
    p.add_argument("config", help="a YAML config (see examples/configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.lr=1e-4")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("serve", help="the embedded engine over SGLang-native HTTP")
    p.add_argument("--model", default="tiny")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
