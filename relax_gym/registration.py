"""Moved to relax_gym.env.registration; this path re-exports it for one release."""

from relax_gym.env.registration import (
    ENTRY_POINT_GROUP,
    EnvArgumentError,
    EnvTargetError,
    UnknownEnvError,
    check_kwargs,
    describe,
    env_class,
    import_env_source,
    list_envs,
    make,
    register,
    registry,
    resolve_env_id,
    spec,
    split_env_target,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "EnvArgumentError",
    "EnvTargetError",
    "UnknownEnvError",
    "check_kwargs",
    "describe",
    "env_class",
    "import_env_source",
    "list_envs",
    "make",
    "register",
    "registry",
    "resolve_env_id",
    "spec",
    "split_env_target",
]
