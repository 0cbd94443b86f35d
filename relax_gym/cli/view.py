"""`relax-gym view`: trajectories as one HTML page."""

from __future__ import annotations

import argparse

from relax_gym.cli.console import console
from relax_gym.cli.flags import Subcommands


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


def add_view_parser(sub: Subcommands) -> None:
    p = sub.add_parser("view", help="render trajectories as an HTML page")
    p.add_argument("jsonl")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--model", default=None, help="decode per-token spans with this model's tokenizer")
    p.set_defaults(func=cmd_view)
