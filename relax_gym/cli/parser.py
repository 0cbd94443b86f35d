"""The `relax-gym` parser, put together from each command module's subparser, in the order `--help` lists them.

The command modules import only argparse and rich at their top; what a command needs loads inside it, so building
this parser (and `relax-gym --help`) stays fast.
"""

from __future__ import annotations

import argparse

from relax_gym.cli import cluster, envs, preflight, rollout, serve, train, view

#: each subcommand's parser, in the order `relax-gym --help` lists them
SUBCOMMANDS = (envs.add_envs_parser, envs.add_check_parser, rollout.add_rollout_parser, rollout.add_eval_parser,
               train.add_sft_parser, view.add_view_parser, preflight.add_preflight_parser, train.add_train_parser,
               train.add_export_parser, serve.add_serve_parser, serve.add_env_server_parser,
               cluster.add_cluster_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relax-gym", description="The `relax-gym` command line.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser
