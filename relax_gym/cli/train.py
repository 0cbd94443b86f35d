"""`relax-gym train`, `relax-gym sft` and `relax-gym export`: a model trained (RL or supervised) and its checkpoint
copied out. The trainer is imported inside each command, so the rest of the CLI starts without it."""

from __future__ import annotations

import argparse

from relax_gym.cli.console import console
from relax_gym.cli.flags import Subcommands, add_template_flags, load_model_flags


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
    loaded = load_model_flags(args)
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


def add_sft_parser(sub: Subcommands) -> None:
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
    add_template_flags(p)
    p.set_defaults(func=cmd_sft)


def add_train_parser(sub: Subcommands) -> None:
    p = sub.add_parser("train", help="train a policy (a run folder with metrics, checkpoints, a reward plot)")
    p.add_argument("config", help="a YAML config (see examples/configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.lr=1e-4")
    p.set_defaults(func=cmd_train)


def add_export_parser(sub: Subcommands) -> None:
    p = sub.add_parser("export", help="copy a checkpoint's Hugging Face model files (no training state) to a folder")
    p.add_argument("run", help="a run folder (or its checkpoints folder, its `latest` pointer, a step folder)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    p.add_argument("--merge", action="store_true", help="a LoRA run's checkpoint: write the plain model its adapter "
                   "and base make, not the adapter folder")
    p.add_argument("-o", "--output", required=True, help="a new or empty folder")
    p.set_defaults(func=cmd_export)
