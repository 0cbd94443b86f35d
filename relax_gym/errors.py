"""The two ways a run ends early without a bug (it could not start, or it stopped), and every exception relax_gym has.

The CLI turns `StartupError` and `RunStopped` into one line and an exit code (2
and 1), never a traceback: the message names the cause (the env, the key, the
file, the record). Library users catch them like any exception.

Every exception class relax_gym defines, under its base, with the module that
defines it and, in brackets, a shorter path that re-exports it
(tests/themes/test_exception_tree.py keeps this drawing true):

    Exception
      NotExercised                  relax_gym.env.conformance
      Refused                       relax_gym.env.env_server  (the env server answers its status: 400, 404, 500, 503)
      ToolError                     relax_gym.tools.function_tool [relax_gym.tools]
      UnsafeCheckpointError         relax_gym.trainer.safe_load
      AssertionError
        CheckFailure                relax_gym.env.conformance
      LookupError
        UnknownEnvError             relax_gym.env.registration [relax_gym]  (also a gymnasium.error.Error)
          EnvTargetError            relax_gym.env.registration
      TypeError
        EnvArgumentError            relax_gym.env.registration [relax_gym]  (also a gymnasium.error.Error)
        ToolDefinitionError         relax_gym.tools.function_tool [relax_gym.tools]
      ValueError
        StartupError                relax_gym.errors  (the CLI's exit 2)
          ConfigError               relax_gym.trainer.config
          ExportError               relax_gym.trainer.export
          LoraError                 relax_gym.models.lora  (a trainer.lora setting or an adapter that does not fit)
          ModelLoadError            relax_gym.models.loading [relax_gym.models]
        BadRequest                  relax_gym.engines.server_schemas  (the HTTP server answers 400)
        ChatTemplateError           relax_gym.models.inputs [relax_gym.models]
        DatasetError                relax_gym.envs.datasets
        GGUFError                   relax_gym.models.gguf_checkpoint  (load_model says it as a ModelLoadError)
        HubModelError               relax_gym.models.hub  (load_model says it as a ModelLoadError)
        MediaError                  relax_gym.engines.server_media
        MessageError                relax_gym.messages
        ScaleRejected               relax_gym.trainer.cluster.scale  (the control API answers its status: 400, 404, 409)
        TemplateError               relax_gym.models.template_traits [relax_gym.rollout]
        VideoError                  relax_gym.video
      RuntimeError
        EngineError                 relax_gym.engines.base [relax_gym.engines]
          EngineUnavailableError    relax_gym.engines.base [relax_gym.engines]
            EngineGoneError         relax_gym.engines.base [relax_gym.engines]
          EngineStartError          relax_gym.trainer.cluster.fleet
          RequestError              relax_gym.engines.base [relax_gym.engines]
          ScriptError               relax_gym.engines.scripted [relax_gym.engines]
        EpisodeOverError            relax_gym.env.core [relax_gym]
        GameEndedError              relax_gym.env.seats  (a self-play game ended before this seat moved)
        JudgeRefusedError           relax_gym.rewards.judge  (the judge refused the key: not retried)
        OpenEnvError                relax_gym.envs.openenv  (the OpenEnv server is unreachable or answered an error)
          OpenEnvCapacityError      relax_gym.envs.openenv  (all its max_concurrent_envs sessions are open)
        PlacementError              relax_gym.trainer.cluster.placement  (no room for a role's reservation)
        RemoteEnvError              relax_gym.env.remote_env [relax_gym]  (the env server is unreachable or refused)
        RunStopped                  relax_gym.errors  (the CLI's exit 1)
          TrainerProcessError       relax_gym.trainer.backends.process  (trainer.own_process: the child died)
        SandboxError                relax_gym.sandbox.result [relax_gym.sandbox]
          SandboxUnavailableError   relax_gym.sandbox.result [relax_gym.sandbox]
        StalledGame                 relax_gym.envs.textarena  (the scripted seats never gave the policy its turn)
        TrainerLost                 relax_gym.trainer.cluster.ray_handles  (the controller restarts the trainer)
        VerifiersError              relax_gym.envs.verifiers_env  (verifiers recorded the episode as failed)
        WeightsLost                 relax_gym.trainer.cluster.ray_handles  (published weights lost: a TrainerLost)
        WorkerError                 relax_gym.rewards._pool  (private: the reward pool's worker broke)
    Warning
      RuntimeWarning
        SandboxFallbackWarning      relax_gym.sandbox
"""

from __future__ import annotations


class StartupError(ValueError):
    """What the run was given cannot work (a config key, an env, a data file, a model); nothing was started."""


class RunStopped(RuntimeError):
    """A started run cannot go on (it cannot learn, or its engine is gone); what it made so far is kept."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """The first line of `err`'s message, cut at `limit` characters: what a one-line error quotes of a cause
    (a library's exception can run to pages)."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else "(no message)"
