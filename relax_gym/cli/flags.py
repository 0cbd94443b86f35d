"""What the commands share to declare and read their flags: the subcommand table they join, `KEY=VALUE` pairs, the
chat-template flags and the model those flags load."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TypeAlias

#: what each command module adds its parser to (`relax_gym.cli.parser` makes it); a string, as argparse's class
#: takes no type argument at run time
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def key_values(pairs: Sequence[str]) -> dict[str, object]:
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


def load_model_flags(args: argparse.Namespace) -> Any:
    """The model named by `--model`, with `--chat-template`, `--template-kwarg` and `--tool-format` applied."""
    from relax_gym.models import load_model

    return load_model(args.model, chat_template=args.chat_template, template_kwargs=key_values(args.template_kwarg),
                      tool_format=args.tool_format)


def add_template_flags(p: argparse.ArgumentParser) -> None:
    """The flags `load_model_flags` reads besides `--model`."""
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the checkpoint's, or a bundled one by name: "
                        "chatml-tools (ChatML with tool schemas, for models whose template ignores tools)")
    p.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to every chat-template render, e.g. enable_thinking=false (repeatable)")
    p.add_argument("--tool-format", default="auto",
                   help="how tool calls are read from the model's text: auto (from the tokenizer) or "
                        "hermes | hermes-loose | llama3 | mistral | deepseek | harmony")
