"""One key per service: where each server and its clients read it, and how a generated one is announced.

A key opens one service: the engine's key is never sent to an env server or a judge, so a third-party judge never
learns the key of the engine a run trains. Each service has its own environment variable, which the server reads
when started without a key file and its clients read when given no key:

| service | variable |
|---|---|
| `relax-gym serve`, an SGLang server (`rollout.engine_url`) | `$RELAX_GYM_API_KEY` |
| `relax-gym env-server` (`relax/Remote-v0`) | `$RELAX_GYM_ENV_KEY` |
| an OpenAI-compatible judge (`JudgeReward(url=...)`) | `$RELAX_GYM_JUDGE_KEY` |
| a run's control API (`relax-gym cluster`) | `$RELAX_GYM_CONTROL_TOKEN`, else the run folder's `control_token` |

The agent proxy's key is made per run and handed to the agent's client in process. Keys never come from a command
line flag: other users of the machine read those in `ps`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from relax_gym.errors import StartupError
from relax_gym.web.address import is_loopback

ENGINE_KEY_ENV = "RELAX_GYM_API_KEY"
ENV_SERVER_KEY_ENV = "RELAX_GYM_ENV_KEY"
JUDGE_KEY_ENV = "RELAX_GYM_JUDGE_KEY"
CONTROL_TOKEN_ENV = "RELAX_GYM_CONTROL_TOKEN"


def key_from_env(variable: str) -> str | None:
    """`$variable`, stripped; None when unset or blank."""
    return os.environ.get(variable, "").strip() or None


def new_key() -> str:
    return secrets.token_urlsafe(32)


def resolve_server_key(host: str, key_file: str | os.PathLike[str] | None, variable: str) -> tuple[str, bool]:
    """A server's key from `key_file` or `$variable`, else a new one (only on loopback); and whether it was
    generated. A server bound beyond this machine must be given one its clients know: a StartupError says how."""
    if key_file is not None:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as err:
            raise StartupError(f"--api-key-file {key_file}: {err.strerror or err}") from None
        if not key:
            raise StartupError(f"--api-key-file {key_file}: the file is empty")
        return key, False
    if env_key := key_from_env(variable):
        return env_key, False
    if not is_loopback(host):
        raise StartupError(f"serving on {host}, beyond this machine, needs an API key the clients know: set "
                           f"{variable} or pass --api-key-file")
    return new_key(), True


def announce_generated_key(key: str, variable: str) -> None:
    """Prints a generated key once, with the line its clients need (stdout: the operator's terminal, not a log)."""
    print(f"API key (generated for this run): {key}\n  clients: export {variable}={key}", flush=True)


def write_secret(path: Path, value: str) -> None:
    """Writes `value` to `path`, readable by its owner only (also when the file was there before)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # the mode O_CREAT gives applies only to a new file
        f.write(value + "\n")
