"""The env API: what an env is, and how it is built, registered, checked and served, in one folder.

    core          `Env` (a `gymnasium.Env` over chat messages), `EpisodeState`, `StepResult`, `EpisodeOverError`
    spaces        `ActionText` and `MessageSpace`, the gymnasium spaces of actions and observations
    single_turn   `SingleTurnEnv`: one prompt, one graded answer, written as four hooks
    tool_env      `ToolEnv`: a `SingleTurnEnv` whose turns may call the env's `@tool` methods
    agent_env     `AgentEnv`: an agent program written against an OpenAI-style API, as an env
    registration  ids: `register`, `make`, `spec`, `list_envs`, `describe`, and env targets (`resolve_env_id`)
    conformance   `relax-gym check`: gymnasium's `check_env` plus what the rollout manager relies on
    env_server    `relax-gym env-server`: one registered env served over HTTP, one session per episode
    remote_env    `RemoteEnv`: an `Env` whose episodes run in an env server
    env_wire      messages and infos as JSON, between the env server and `RemoteEnv`

The bundled envs are `relax_gym.envs`; rewards, which grade them, are `relax_gym.rewards`. The public face
(`relax_gym.Env`, `relax_gym.make`, `relax_gym.register`, ...) re-exports from here. This package imports none of
its modules, so importing one of them costs only what it needs (`RemoteEnv`'s HTTP client only with it).
"""
