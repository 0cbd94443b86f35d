"""The `relax-gym` command line: `main` here is the console script; each command group is a module of this package
(`parser` puts their subparsers together).

Heavy imports (torch, the trainer) happen inside the command that needs them, so `relax-gym envs` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from rich.markup import escape

from relax_gym.cli.console import console
from relax_gym.cli.parser import build_parser

__all__ = ["build_parser", "main"]


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
