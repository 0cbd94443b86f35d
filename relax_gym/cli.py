"""The `relax-gym` command line.

Each subcommand is a small function; heavy imports (torch, the trainer) happen
inside the command that needs them so `relax-gym envs` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_args

from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()


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
            env_kwargs |= _key_values([pair])
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


def _key_values(pairs: Sequence[str]) -> dict[str, object]:
    """`k=v` pairs with YAML-typed values (`digits=2` is an int, `x=[1,2]` a list)."""
    import yaml

    from relax_gym.errors import StartupError

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise StartupError(f"expected key=value, got {pair!r}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise StartupError(f"{pair!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return out


def _load(args: argparse.Namespace) -> Any:
    """The model named by `--model`, with `--chat-template`, `--template-kwarg` and `--tool-format` applied."""
    from relax_gym.models import load_model

    return load_model(args.model, chat_template=args.chat_template, template_kwargs=_key_values(args.template_kwarg),
                      tool_format=args.tool_format)


def _template_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the checkpoint's, or a bundled one by name: "
                        "chatml-tools (ChatML with tool schemas, for models whose template ignores tools)")
    p.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to every chat-template render, e.g. enable_thinking=false (repeatable)")
    p.add_argument("--tool-format", default="auto",
                   help="how tool calls are read from the model's text: auto (from the tokenizer) or "
                        "hermes | hermes-loose | llama3 | mistral | deepseek | harmony")


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


def cmd_rollout(args: argparse.Namespace) -> int:
    import asyncio

    from relax_gym.rollout.run import rollout_to_file
    from relax_gym.trainer.config import load_rollout_config

    rollout = load_rollout_config(_rollout_given(args), args.settings)
    if "groups_per_step" in rollout.model_fields_set:
        from relax_gym.errors import StartupError

        raise StartupError("rollout.groups_per_step is a training setting (groups per optimizer step); "
                           "relax-gym rollout plays -n tasks")
    summary = asyncio.run(rollout_to_file(env_id=args.env, model=_load(args), n=args.n, out=args.out, seed=args.seed,
                                          rollout=rollout, env_kwargs=_key_values(args.env_arg)))
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
    report = asyncio.run(eval_to_file(env_id=args.env, model=_load(args), n=args.n, out=out, rollout=rollout,
                                      k=args.k, env_kwargs=_key_values(args.env_arg), pass_reward=args.pass_reward))
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


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1 (argparse then names the flag and exits 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_sft(args: argparse.Namespace) -> int:
    from relax_gym.models.lora import ALL_LINEAR, LoraSpec
    from relax_gym.trainer.sft import check_out, sft, sft_data

    check_out(args.out)  # before minutes of loading and reading
    loaded = _load(args)
    data = sft_data(args.data, loaded.model.get_input_embeddings().num_embeddings, args.min_reward)
    console.print(f"sft: {len(data.samples)} of {data.read} trajectories kept"
                  + (f" (left out: {data.left_out})" if data.left_out else ""), highlight=False)
    lora = None if args.lora_rank is None else LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha,
                                                         target_modules=args.lora_target or ALL_LINEAR)
    result = sft(loaded, data, args.out, epochs=args.epochs, lr=args.lr, batch_size=args.batch,
                 micro_batch_tokens=args.micro_batch_tokens, seed=args.seed, lora=lora,
                 say=lambda line: console.print(line, highlight=False))
    console.print(f"wrote {result['out']}: {result['steps']} steps, loss {result['loss_first']:.4f} -> "
                  f"{result['loss_last']:.4f}; train from it with model={result['out']}", highlight=False,
                  soft_wrap=True)
    return 0


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def cmd_preflight(args: argparse.Namespace) -> int:
    from relax_gym.rollout.preflight import preflight, report_dict

    loaded = _load(args)
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


def cmd_view(args: argparse.Namespace) -> int:
    from pathlib import Path

    from relax_gym.errors import StartupError
    from relax_gym.viewer import write_html

    decoder = None
    if args.model:
        from relax_gym.models import load_model

        decoder = load_model(args.model)  # its `decode` is the tokenizer's, typed for one sequence
    if not Path(args.jsonl).is_file():
        raise StartupError(f"{args.jsonl}: no such file (a trajectories JSONL from `relax-gym rollout --out` or a "
                           "run's trajectories.jsonl)")
    try:
        out = write_html(args.jsonl, args.output, tokenizer=decoder)
    except (OSError, ValueError) as err:  # a line that is no trajectory, an unwritable output: one line, exit 2
        raise StartupError(str(err)) from None
    console.print(f"wrote {out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from relax_gym.trainer.config import load_config
    from relax_gym.trainer.launch import train

    try:
        summary = train(load_config(args.config, args.overrides))
    except KeyboardInterrupt:  # before the first step (once training, the run itself finishes the step and exits)
        console.print("[yellow]interrupted while starting: nothing was trained[/yellow]", highlight=False)
        return 130
    if "rank" in summary:  # a follower rank under torchrun: rank 0 reports
        return 0
    if summary.get("eval_failures"):
        console.print(f"[yellow]{summary['eval_failures']} evals failed: see the eval rows with an 'error' in "
                      f"{summary['run_dir']}/metrics.jsonl[/yellow]", highlight=False)
    held_out = ""
    if summary.get("eval_first") and summary["eval_last"] != summary["eval_first"]:
        (first_step, first), (last_step, last) = summary["eval_first"], summary["eval_last"]
        held_out = f"; held-out eval {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})"
    console.print(
        f"run folder {summary['run_dir']}: {summary['steps']} steps, training reward "
        f"{summary['reward_first_tenth']:.3f} (first tenth) -> {summary['reward_last_tenth']:.3f} (last tenth)"
        f"{held_out}; plot {summary['plot']}",
        highlight=False,
    )
    return 130 if summary.get("interrupted") else 0


def cmd_export(args: argparse.Namespace) -> int:
    from relax_gym.trainer.export import export_checkpoint

    exported = export_checkpoint(args.run, args.output, step=args.step, merge=args.merge)
    console.print(f"exported {exported.source} ({len(exported.files)} files, verified against its manifest) to "
                  f"{exported.destination}", highlight=False, soft_wrap=True)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pydantic import ValidationError

    from relax_gym.engines.embedded import engine_device
    from relax_gym.engines.server import serve
    from relax_gym.engines.server_limits import ServerLimits
    from relax_gym.errors import StartupError

    given = {name: getattr(args, name) for name in ServerLimits.model_fields if getattr(args, name) is not None}
    try:
        limits = ServerLimits(**given)
    except ValidationError as err:
        raise StartupError(f"relax-gym serve: {_first_error(err)}") from None
    try:
        engine_device(args.device)
    except ValueError as err:
        raise StartupError(f"relax-gym serve --device: {err}") from None
    adapters: dict[str, str] = {}
    for given in args.lora_paths:  # SGLang's forms: NAME=FOLDER, or FOLDER named by its last part
        name, named, folder = given.partition("=")
        if not named:
            name, folder = Path(given).name, given
        if not name or not folder or name in adapters:
            raise StartupError(f"relax-gym serve --lora-paths: {given!r}: give NAME=FOLDER, each NAME once")
        adapters[name] = folder
    serve(args.model, host=args.host, port=args.port, device=args.device, api_key_file=args.api_key_file,
          limits=limits, adapters=adapters)
    return 0


def cmd_env_server(args: argparse.Namespace) -> int:
    from relax_gym.env.env_server import serve_env
    from relax_gym.env.registration import resolve_env_id

    serve_env(resolve_env_id(args.env), _key_values(args.env_arg), host=args.host, port=args.port,
              api_key_file=args.api_key_file, max_sessions=args.max_sessions,
              session_timeout_s=args.session_timeout_s, allow_unsandboxed_code=args.allow_unsandboxed_code)
    return 0


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


def cmd_cluster(args: argparse.Namespace) -> int:
    """One call to a training run's control API; its JSON answer on stdout, a refusal as one line and exit 1."""
    if args.action == "check":
        return cmd_cluster_check(args)
    import httpx

    from relax_gym.control_client import ControlClient, locate, refusal

    url, token = locate(args.run_dir, args.url, args.token)
    action = args.action
    body: dict[str, Any] | None = None
    if action == "scale-out":
        body = {"num_engines": args.engines, "engine_urls": args.engine_urls, "timeout_s": args.timeout}
    elif action == "scale-in":
        body = {"num_engines": args.engines, "engine_ids": args.engine_ids, "drain_timeout_s": args.drain_timeout,
                "force": args.force, "dry_run": args.dry_run}
    paths = {"status": "/v1/status", "engines": "/v1/engines", "scale-out": "/v1/engines/scale_out",
             "scale-in": "/v1/engines/scale_in", "cancel": f"/v1/ops/{getattr(args, 'op_id', '')}/cancel",
             "ops": f"/v1/ops/{args.op_id}" if getattr(args, "op_id", None) else "/v1/ops"}
    try:
        with ControlClient(url, token) as client:
            if action in ("scale-out", "scale-in", "cancel"):
                key = getattr(args, "idempotency_key", None)
                response = client.post(paths[action], {k: v for k, v in (body or {}).items() if v is not None}, key)
            else:
                response = client.get(paths[action])
            if response.is_success and getattr(args, "wait", False) and "op_id" in response.json():
                progress = Console(stderr=True)  # stdout holds only the JSON answer
                op_id = response.json()["op_id"]
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


def _first_error(err: Any) -> str:
    """A pydantic ValidationError's first problem, as the flag that caused it."""
    first = err.errors()[0]
    return f"--{'-'.join(str(p) for p in first['loc']).replace('_', '-')}: {first['msg']}"


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
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="env kwarg passed to every target's constructor (repeatable; YAML-typed: digits=2 is an int)")
    p.set_defaults(func=cmd_check)

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
    _template_flags(p)
    p.set_defaults(func=cmd_rollout)

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
    _template_flags(p)
    p.set_defaults(func=cmd_eval, group_size=None)

    p = sub.add_parser("sft", help="fine-tune a model on trajectory files (demonstrations, or rollouts kept by reward)")
    p.add_argument("data", nargs="+", metavar="TRAJECTORIES.jsonl",
                   help="what `relax-gym rollout` or a run's trajectories.jsonl holds")
    p.add_argument("--model", default="tiny", help="as `rollout --model` takes it")
    p.add_argument("--out", required=True, help="the fine-tuned model folder (new or empty)")
    p.add_argument("--min-reward", type=float, default=None,
                   help="keep only episodes with at least this reward (rejection sampling); default: every "
                        "completed one")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--batch", type=int, default=16, help="trajectories per optimizer step")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-rank", type=_positive, default=None, metavar="R",
                   help="train a LoRA adapter of rank R (--out is then a PEFT adapter folder); default: all weights")
    p.add_argument("--lora-alpha", type=_positive, default=None, help="the adapter's scale (default: 2 x rank)")
    p.add_argument("--lora-target", nargs="+", default=None, metavar="NAME",
                   help="the layers adapted, by leaf name (default: every linear layer but the output head)")
    _template_flags(p)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("view", help="render trajectories as an HTML page")
    p.add_argument("jsonl")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--model", default=None, help="decode per-token spans with this model's tokenizer")
    p.set_defaults(func=cmd_view)

    p = sub.add_parser("preflight", help="certify a chat template for exact multi-turn token continuity")
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", action="store_true")
    _template_flags(p)
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("train", help="train a policy (a run folder with metrics, checkpoints, a reward plot)")
    p.add_argument("config", help="a YAML config (see examples/configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.lr=1e-4")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="copy a checkpoint's Hugging Face model files (no training state) to a folder")
    p.add_argument("run", help="a run folder (or its checkpoints folder, its `latest` pointer, a step folder)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    p.add_argument("--merge", action="store_true", help="a LoRA run's checkpoint: write the plain model its adapter "
                   "and base make, not the adapter folder")
    p.add_argument("-o", "--output", required=True, help="a new or empty folder")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="the embedded engine over SGLang-native HTTP")
    p.add_argument("--model", default="tiny")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto",
                   help="auto (the first GPU, in bfloat16, where torch sees one; else the CPU), cpu, cuda or cuda:N")
    from relax_gym.engines.server_limits import ServerLimits
    from relax_gym.web.keys import ENGINE_KEY_ENV, ENV_SERVER_KEY_ENV

    p.add_argument("--api-key-file", metavar="PATH",
                   help=f"file holding the API key (default: ${ENGINE_KEY_ENV}, else one is generated and printed; "
                        "required beyond loopback)")
    p.add_argument("--lora-paths", nargs="+", default=[], metavar="NAME=FOLDER",
                   help="PEFT adapter folders to load at start, by name, as SGLang's flag takes them (more load and "
                        "unload at runtime through /load_lora_adapter and /unload_lora_adapter)")
    for name, limit in ServerLimits.model_fields.items():
        kind = int if limit.annotation is int or int in get_args(limit.annotation) else float
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar=kind.__name__.upper(),
                       help=f"{limit.description} (default {limit.default})")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("env-server", help="serve one env over HTTP (one session per episode) for RemoteEnv")
    p.add_argument("env", help="a registered env id, or a file.py / module that registers one")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword argument of every session's env (value parsed as YAML; repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key-file", metavar="PATH",
                   help=f"file holding the env server's key (default: ${ENV_SERVER_KEY_ENV}, else one is generated "
                        "and printed; required beyond loopback)")
    p.add_argument("--max-sessions", type=int, default=1024, help="open sessions at most (default 1024)")
    p.add_argument("--allow-unsandboxed-code", action="store_true",
                   help="serve an env that runs model-written code even where no container sandbox works (the "
                        "code then runs in a subprocess on this host, which is not a security boundary)")
    p.add_argument("--session-timeout-s", type=float, default=600.0,
                   help="an idle session is closed after this many seconds (default 600)")
    p.set_defaults(func=cmd_env_server)

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
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user's input can cause (a config key, an env, a data file, a model): one line, exit 2."""
    from relax_gym.env.registration import EnvArgumentError, UnknownEnvError
    from relax_gym.envs.datasets import DatasetError
    from relax_gym.errors import StartupError

    return StartupError, UnknownEnvError, EnvArgumentError, DatasetError


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a subcommand; a user error is one line and exit 2, a run that stopped one line and exit 1."""
    from relax_gym.cpu.process import prepare_process
    from relax_gym.errors import RunStopped

    prepare_process()  # before any thread: one heap for the engine's and the trainer's threads, large blocks kept

    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except RunStopped as err:
        console.print(f"[red]run stopped: {escape(str(err))}[/red]", highlight=False, soft_wrap=True)
        return 1
    except _user_errors() as err:
        console.print(f"[red]error: {escape(str(err))}[/red]", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
