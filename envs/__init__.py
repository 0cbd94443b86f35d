"""Bundled environments, registered under the `relax/` namespace.

`import relax_gym` imports this package once, which registers every id below
(gymnasium's way: the package registers its own envs; entry points are for
third-party packages). Entry points are strings, so registering imports no env
module; each loads when its env is first made.
"""

from relax_gym.env.registration import register, register_namespace

# An editable install puts the repo root on sys.path, where this folder is also `envs`: one name, one copy.
if __name__ != "relax_gym.envs":
    raise ImportError(f"this folder is the relax_gym.envs package: import relax_gym.envs, not {__name__}")

BUNDLED: dict[str, str] = {
    "relax/Math-v0": "relax_gym.envs.math:MathEnv",
    "relax/MathTool-v0": "relax_gym.envs.math:MathToolEnv",
    "relax/GSM8K-v0": "relax_gym.envs.math:GSM8KEnv",
    "relax/GSM8KSteps-v0": "relax_gym.envs.gsm8k_steps:GSM8KStepsEnv",
    "relax/DeepEyes-v0": "relax_gym.envs.deepeyes:DeepEyesEnv",
    "relax/AudioQA-v0": "relax_gym.envs.audio_qa:AudioQAEnv",
    "relax/VideoQA-v0": "relax_gym.envs.video_qa:VideoQAEnv",
    "relax/AVQA-v0": "relax_gym.envs.av_qa:AVQAEnv",
    "relax/Remote-v0": "relax_gym.env.remote_env:RemoteEnv",
    "relax/JudgedQA-v0": "relax_gym.envs.judged_qa:JudgedQAEnv",
    "relax/Arithmetic-v0": "relax_gym.envs.procedural:ArithmeticEnv",
    "relax/Countdown-v0": "relax_gym.envs.procedural:CountdownEnv",
    "relax/GuessNumber-v0": "relax_gym.envs.procedural:GuessNumberEnv",
    "relax/ReasoningGym-v0": "relax_gym.envs.reasoning_gym:ReasoningGymEnv",
    "relax/NeMoGym-v0": "relax_gym.envs.nemo_gym:NeMoGymEnv",
    "relax/TextArena-v0": "relax_gym.envs.textarena:TextArenaEnv",
    "relax/GEM-v0": "relax_gym.envs.gem:GemEnv",
    "relax/Verifiers-v0": "relax_gym.envs.verifiers_env:VerifiersEnv",
    "relax/OpenEnv-v0": "relax_gym.envs.openenv:OpenEnvEnv",
}

#: ecosystems whose every game is an id: `textarena/TicTacToe-v0` is relax/TextArena-v0 with game="TicTacToe-v0",
#: `gem/game:Sudoku-v0-easy` is relax/GEM-v0 with gem_id="game:Sudoku-v0-easy" (the GEM id verbatim)
NAMESPACES: dict[str, tuple[str, str]] = {
    "textarena": ("relax_gym.envs.textarena:TextArenaEnv", "game"),
    "gem": ("relax_gym.envs.gem:GemEnv", "gem_id"),
}


def register_envs() -> None:
    """Registers the bundled ids and namespaces; calling it again re-registers the same specs, which changes
    nothing."""
    for env_id, entry_point in BUNDLED.items():
        register(env_id, entry_point)
    for namespace, (entry_point, keyword) in NAMESPACES.items():
        register_namespace(namespace, entry_point, keyword)


register_envs()
