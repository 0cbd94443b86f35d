"""`relax-gym rollout` and `relax-gym eval`: episodes of an env against a model, written as trajectories or scored as
pass@k; both take a training config's rollout section, as flags or `rollout.KEY=VALUE`."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape

from relax_gym.cli.console import console
from relax_gym.cli.flags import Subcommands, add_template_flags, key_values, load_model_flags

#: `relax-gym rollout`'s flags that are aliases of a rollout-section field: (flag, field, type, what it is)
ROLLOUT_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--group", "group_size", int, "episodes per task (same seed)"),
    ("--temperature", "temperature", float, "sampling temperature, 0 = greedy"),
    ("--max-new-tokens", "max_new_tokens", int, "tokens per generation"),
    ("--max-turns", "max_turns", int, "policy turns per episode (an env may stop sooner by its own rule)"),
    ("--max-total-tokens", "max_total_tokens", int, "tokens per episode"),
    ("--concurrency", "concurrency", int, "episodes at once"),
)
#: where `relax-gym rollout` departs from the section's defaults: one episode per task, a look rather than a batch
ROLLOUT_COMMAND_DEFAULTS: dict[str, object] = {"group_size": 1}


def _rollout_given(args: argparse.Namespace) -> dict[str, object]:
    """The rollout-section fields the command's defaults and its alias flags set (only flags given)."""
    given = dict(ROLLOUT_COMMAND_DEFAULTS)
    given |= {field: getattr(args, field) for _, field, _, _ in ROLLOUT_FLAGS if getattr(args, field) is not None}
    if args.engine_url is not None:
        given |= {"engine": "sglang", "engine_url": args.engine_url}
    return given


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def cmd_rollout(args: argparse.Namespace) -> int:
    import asyncio

    from relax_gym.rollout.run import rollout_to_file
    from relax_gym.trainer.config import load_rollout_config

    rollout = load_rollout_config(_rollout_given(args), args.settings)
    if "groups_per_step" in rollout.model_fields_set:
        from relax_gym.errors import StartupError

        raise StartupError("rollout.groups_per_step is a training setting (groups per optimizer step); "
                           "relax-gym rollout plays -n tasks")
    summary = asyncio.run(rollout_to_file(env_id=args.env, model=load_model_flags(args), n=args.n, out=args.out,
                                          seed=args.seed, rollout=rollout, env_kwargs=key_values(args.env_arg)))
    console.print(f"wrote {args.out}")
    for env_id, s in summary.items():
        console.print(f"[bold]{env_id}[/bold]: {s['episodes']} episodes, mean reward {s['reward_mean']:.3f}, "
                      f"status {s['status']}", highlight=False)
        console.print(f"  turns {s['turns_mean']:.1f}, tool calls {s['tool_calls_mean']:.1f}, tokens "
                      f"{s['tokens_mean']:.0f} ({s['generated_tokens_mean']:.0f} generated); time generating "
                      f"{s['generate_s']:.1f} s, in env {s['env_s']:.1f} s (summed over concurrent episodes)",
                      highlight=False)
        for label in ("failures", "truncations", "reward_failures"):
            if s[label]:
                console.print(f"  {label}: {s[label]}", highlight=False)
        for kind, reason in s["failure_examples"].items():
            if reason != kind:
                console.print(f"    e.g. {escape(reason[:300])}", highlight=False, soft_wrap=True)
        if s["truncations"].get("max_new_tokens"):
            console.print(f"  [yellow]{s['truncations']['max_new_tokens']} episodes hit --max-new-tokens before "
                          "ending their turn, so they were not graded (reward 0)[/yellow]", soft_wrap=True)
        if s["rerender_mismatches"]:
            console.print(f"  [yellow]{_count(s['rerender_mismatches'], 'trajectory differs', 'trajectories differ')} "
                          "from a full re-render "
                          "(see metrics.rerender_first_diff_char)[/yellow]")
        if s["rerender_expected_diffs"]:
            console.print(f"  {_count(s['rerender_expected_diffs'], 'trajectory differs', 'trajectories differ')} "
                          "from a full re-render, as expected: "
                          "the chat template rewrites earlier turns, and the tokens the model saw are kept",
                          highlight=False, soft_wrap=True)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import tempfile

    from relax_gym.errors import StartupError
    from relax_gym.rollout.run import eval_to_file
    from relax_gym.trainer.config import load_rollout_config

    samples = args.samples or args.k
    if args.k < 1 or samples < args.k:
        raise StartupError(f"--k {args.k} and --samples {samples}: pass@k needs 1 <= k <= samples per task")
    given = _rollout_given(args) | {"group_size": samples}
    if args.temperature is None:
        given["temperature"] = 0.0 if samples == 1 else 1.0
    rollout = load_rollout_config(given, args.settings)
    out = args.out
    if out is None:
        handle, out = tempfile.mkstemp(prefix="relax-gym-eval-", suffix=".jsonl")
        os.close(handle)
    report = asyncio.run(eval_to_file(env_id=args.env, model=load_model_flags(args), n=args.n, out=out, rollout=rollout,
                                      k=args.k, env_kwargs=key_values(args.env_arg), pass_reward=args.pass_reward))
    if args.json:
        print(json.dumps({"model": args.model, **report.row(), "temperature": rollout.temperature, "out": out}))
        return 0
    low, high = report.pass_at_1_ci
    console.print(f"[bold]{report.env_id}[/bold] ({args.model}): {report.tasks} held-out tasks x {samples} "
                  f"sample{'s' if samples > 1 else ''} at temperature {rollout.temperature:g}", highlight=False,
                  soft_wrap=True)
    console.print(f"  pass@1 {report.pass_at_1:.3f} [{low:.3f}, {high:.3f}]", highlight=False, end="")
    if args.k > 1:
        low, high = report.pass_at_k_ci
        console.print(f", pass@{args.k} {report.pass_at_k:.3f} [{low:.3f}, {high:.3f}]", highlight=False, end="")
    console.print(f" (95 % intervals), mean reward {report.reward_mean:.3f}", highlight=False)
    console.print(f"  status {report.status}, {report.generated_tokens_mean:.1f} generated tokens per episode",
                  highlight=False)
    console.print(f"  trajectories: {out}", highlight=False, soft_wrap=True)
    return 0


def add_rollout_parser(sub: Subcommands) -> None:
    p = sub.add_parser("rollout", help="run episodes and write trajectories as JSONL")
    p.add_argument("settings", nargs="*", metavar="rollout.KEY=VALUE",
                   help="the rollout section of a training config, as `relax-gym train` takes it, e.g. "
                        "rollout.temperature=0.7 rollout.max_turns=4; applied after the flags")
    p.add_argument("--env", required=True,
                   help="a registered env id, a file.py or module that registers one, or file.py:ID")
    p.add_argument("--model", default="tiny",
                   help="tiny | tiny-moe | tiny-vl | tiny-audio | tiny-omni | a local HF checkpoint folder | "
                        "a .gguf file | ORG/NAME[@REVISION] (the Hugging Face cache)")
    p.add_argument("-n", type=int, default=8, help="number of tasks")
    p.add_argument("--out", required=True, help="output .jsonl (written as groups finish)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-url", default=None, help="an SGLang (or relax-gym serve) server instead of in-process: "
                                                      "rollout.engine=sglang rollout.engine_url=URL")
    for flag, field, kind, what in ROLLOUT_FLAGS:
        default = ROLLOUT_COMMAND_DEFAULTS.get(field, "the rollout section's")
        p.add_argument(flag, dest=field, type=kind, default=None, metavar=kind.__name__.upper(),
                       help=f"{what}: rollout.{field} (default {default})")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE", help="env kwarg (repeatable)")
    add_template_flags(p)
    p.set_defaults(func=cmd_rollout)


def add_eval_parser(sub: Subcommands) -> None:
    p = sub.add_parser("eval", help="pass@1 / pass@k on held-out tasks (the draw a training run's eval uses)")
    p.add_argument("settings", nargs="*", metavar="rollout.KEY=VALUE",
                   help="the rollout section of a training config, e.g. rollout.max_turns=4; applied after the flags")
    p.add_argument("--env", required=True,
                   help="a registered env id, a file.py or module that registers one, or file.py:ID")
    p.add_argument("--model", default="tiny", help="as `rollout --model` takes it; a run folder evaluates its latest "
                                                   "checkpoint")
    p.add_argument("-n", type=int, default=32, help="held-out tasks (default 32, trainer.eval_tasks' default)")
    p.add_argument("--k", type=int, default=1, help="pass@k's k (default 1)")
    p.add_argument("--samples", type=int, default=None, help="samples per task (default k)")
    p.add_argument("--pass-reward", type=float, default=1.0,
                   help="the reward at which a sample passes (default 1.0, full credit)")
    p.add_argument("--out", default=None, help="trajectories .jsonl (default: a new temporary file, printed)")
    p.add_argument("--json", action="store_true", help="print one JSON row")
    p.add_argument("--engine-url", default=None, help="an SGLang (or relax-gym serve) server instead of in-process")
    for flag, field, kind, what in ROLLOUT_FLAGS:
        if field == "group_size":
            continue  # --samples
        default = "0 for one sample per task, else 1" if field == "temperature" else "the rollout section's"
        p.add_argument(flag, dest=field, type=kind, default=None, metavar=kind.__name__.upper(),
                       help=f"{what}: rollout.{field} (default {default})")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE", help="env kwarg (repeatable)")
    add_template_flags(p)
    p.set_defaults(func=cmd_eval, group_size=None)
