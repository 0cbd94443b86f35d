"""`relax-gym serve` and `relax-gym env-server`: the embedded engine and one env, each behind its HTTP server."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from relax_gym.cli.flags import Subcommands, key_values


def _first_error(err: Any) -> str:
    """A pydantic ValidationError's first problem, as the flag that caused it."""
    first = err.errors()[0]
    return f"--{'-'.join(str(p) for p in first['loc']).replace('_', '-')}: {first['msg']}"


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

    serve_env(resolve_env_id(args.env), key_values(args.env_arg), host=args.host, port=args.port,
              api_key_file=args.api_key_file, max_sessions=args.max_sessions,
              session_timeout_s=args.session_timeout_s, allow_unsandboxed_code=args.allow_unsandboxed_code)
    return 0


def add_serve_parser(sub: Subcommands) -> None:
    """Its limits' flags come from `ServerLimits`' fields, so a new limit is a flag with no edit here."""
    from relax_gym.engines.server_limits import ServerLimits
    from relax_gym.web.keys import ENGINE_KEY_ENV

    p = sub.add_parser("serve", help="the embedded engine over SGLang-native HTTP")
    p.add_argument("--model", default="tiny")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto",
                   help="auto (the first GPU, in bfloat16, where torch sees one; else the CPU), cpu, cuda or cuda:N")
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


def add_env_server_parser(sub: Subcommands) -> None:
    from relax_gym.web.keys import ENV_SERVER_KEY_ENV

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
