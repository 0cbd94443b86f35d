"""`relax_gym.__all__` is the public face: a name added or dropped is a decision, so the list is pinned here."""

import relax_gym

EXPORTED = [
    "Env",
    "EnvArgumentError",
    "EpisodeOverError",
    "EpisodeState",
    "RemoteEnv",
    "RemoteEnvError",
    "RewardResult",
    "SingleTurnEnv",
    "StepResult",
    "Tool",
    "ToolEnv",
    "UnknownEnvError",
    "__version__",
    "describe",
    "list_envs",
    "make",
    "register",
    "register_namespace",
    "registry",
    "spec",
    "tool",
]


def test_all_is_the_pinned_sorted_list():
    assert relax_gym.__all__ == EXPORTED == sorted(EXPORTED)


def test_every_exported_name_is_an_attribute():
    missing = [name for name in relax_gym.__all__ if not hasattr(relax_gym, name)]
    assert not missing, missing


def test_the_engine_errors_are_exported_from_relax_gym_engines():
    import relax_gym.engines as engines
    from relax_gym.engines import base

    for name in ("EngineError", "EngineGoneError", "EngineUnavailableError", "RequestError"):
        assert name in engines.__all__ and getattr(engines, name) is getattr(base, name), name
    assert issubclass(engines.EngineGoneError, engines.EngineUnavailableError)
    assert engines.EngineRouter.__module__ == "relax_gym.engines.router"
