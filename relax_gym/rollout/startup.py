"""What must hold before a run starts, checked in seconds so that a run which cannot work never starts.

`relax-gym train` and `relax-gym rollout` call `check_run` after loading the
model and before building anything else: the model has a chat template and an
end-of-turn token; every configured env (train and eval kwargs) builds, resets
and renders its first prompt (tool schemas included) through the model's chat
template, with room left in `max_total_tokens` to generate `max_new_tokens`.
Each failure is a `StartupError` whose one line names the env, key or file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relax_gym.env.registration import make
from relax_gym.env.seats import SeatedGame
from relax_gym.errors import StartupError
from relax_gym.models import LoadedModel
from relax_gym.models.template_traits import template_traits
from relax_gym.rollout.manager import tool_format_of
from relax_gym.rollout.tokens import ConversationTokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvUse:
    """One way a run builds an env: its id, kwargs, and where in the config they come from (for messages)."""

    env_id: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    where: str = "env"


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else '(no message)'}"


def check_model(loaded: LoadedModel) -> None:
    """Multi-turn episodes need the model's chat template and a token that ends an assistant turn."""
    template = getattr(loaded.processor, "chat_template", None) or loaded.tokenizer.chat_template
    if not template:
        raise StartupError(f"model {loaded.name}: it has no chat template (chat_template.jinja or "
                           "tokenizer_config.json's chat_template); add its family's template to the folder")
    if not loaded.stop_token_ids():
        raise StartupError(f"model {loaded.name}: its tokenizer has no end-of-turn token (eos_token, <|im_end|> "
                           "or <|endoftext|>), so no generation could end a turn")
    try:
        tool_format_of(loaded)
    except (KeyError, ValueError) as err:  # an unknown name, or a response_template transformers rejects
        raise StartupError(f"model {loaded.name}: tool format: {err.args[0] if err.args else err}") from None
    try:
        template_traits(loaded)
    except ValueError as err:
        raise StartupError(f"model {loaded.name}: its chat template cannot be used for multi-turn episodes: "
                           f"{_one_line(err)}") from err


def check_env(loaded: LoadedModel, use: EnvUse, *, max_total_tokens: int, max_new_tokens: int,
              seed: int = 0, concurrency: int | None = None) -> int:
    """Builds, resets and renders `use`'s env once; returns its first prompt's length in tokens. A self-play game
    (`SeatedGame`) is reset as the rollout manager resets it, and needs a concurrency slot for each seat; an env
    with `check_capacity(n)` (its episodes hold a server's sessions, as relax/OpenEnv-v0's) is asked for
    `concurrency` of them at once."""
    label = f"{use.where} {use.env_id}" + (f" with kwargs {dict(use.kwargs)}" if use.kwargs else "")
    try:
        env = make(use.env_id, **use.kwargs)
    except Exception as err:
        raise StartupError(f"{label}: cannot be made: {_one_line(err)}") from err
    game = env if isinstance(env, SeatedGame) and env.policy_seats > 1 else None
    seats = game.policy_seats if game is not None else 1
    try:
        if concurrency is not None and seats > concurrency:
            raise StartupError(f"{label}: its games seat the policy {seats} times, and the seats play at once: "
                               f"rollout.concurrency must be >= {seats}, got {concurrency}")
        capacity = getattr(env, "check_capacity", None)  # an env whose episodes hold a server's sessions
        if concurrency is not None and callable(capacity):
            try:
                capacity(concurrency)
            except Exception as err:
                raise StartupError(f"{label}: {_one_line(err)}") from err
        try:
            observation = _first_observation(game, seed) if game is not None else env.reset(seed=seed)[0]
            messages = env.format_observation(observation)
        except Exception as err:
            raise StartupError(f"{label}: reset(seed={seed}) raised {_one_line(err)}") from err
        try:
            conv = ConversationTokens.start(loaded, messages, getattr(env, "tool_schemas", None) or None)
        except Exception as err:
            raise StartupError(f"{label}: its first prompt does not render through the chat template of "
                               f"{loaded.name}: {_one_line(err)}") from err
    finally:
        env.close()
    if conv.tools and conv.traits is not None and conv.traits.ignores_tools:
        log.warning("%s: the chat template of %s ignores `tools`, so the model never sees the schemas of %s; "
                    "pass a template that renders them (model.chat_template / --chat-template: chatml-tools for a "
                    "ChatML model)", label,
                    loaded.name, ", ".join(t.get("function", t).get("name", "?") for t in conv.tools))
    prompt = len(conv.token_ids)
    if prompt + max_new_tokens > max_total_tokens:
        raise StartupError(
            f"{label}: its first prompt is {prompt} tokens (chat template and tool schemas included); with "
            f"max_new_tokens {max_new_tokens} it needs max_total_tokens >= {prompt + max_new_tokens}, "
            f"got {max_total_tokens}")
    return prompt


def _first_observation(game: SeatedGame, seed: int) -> Any:
    """The first seat to move's first observation of a self-play game."""
    game.reset_game(seed, None)
    seat = game.seat_to_move()
    if seat is None:
        raise ValueError("the game was over before its first move")
    return game.observe(seat)


def check_run(loaded: LoadedModel, uses: Iterable[EnvUse], *, max_total_tokens: int, max_new_tokens: int,
              seed: int = 0, concurrency: int | None = None) -> dict[str, int]:
    """`check_model`, then `check_env` for each use; returns each use's first prompt length."""
    check_model(loaded)
    return {f"{u.where} {u.env_id}": check_env(loaded, u, max_total_tokens=max_total_tokens,
                                                max_new_tokens=max_new_tokens, seed=seed,
                                                concurrency=concurrency)
            for u in uses}
