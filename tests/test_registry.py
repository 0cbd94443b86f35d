import subprocess
import sys
import textwrap

import gymnasium
import pytest

import relax_gym
from relax_gym.envs import BUNDLED
from relax_gym.registration import EnvArgumentError, UnknownEnvError


class Echo(relax_gym.Env):
    """Repeats the action back."""

    def __init__(self, prefix: str = "you said: "):
        self.prefix = prefix

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [relax_gym.messages.user("say something")], {}

    def step(self, action):
        return [relax_gym.messages.user(self.prefix + action)], 0.0, False, False, {}


def test_bundled_ids_are_listed_under_the_relax_namespace():
    ids = relax_gym.list_envs()
    assert set(BUNDLED) <= set(ids)
    assert all(i.startswith("relax/") for i in BUNDLED)


def test_register_make_spec_and_kwargs_override():
    relax_gym.register("test/Echo-v0", Echo, prefix="> ")
    env = relax_gym.make("test/Echo-v0")
    env.reset(seed=0)
    assert env.step("hi")[0][0]["content"][0]["text"] == "> hi"
    env2 = relax_gym.make("test/Echo-v0", prefix="! ")
    assert env2.prefix == "! "
    assert env2.spec.kwargs == {"prefix": "! "}
    assert relax_gym.spec("test/Echo-v0").entry_point is Echo


def test_unknown_id_suggests_the_closest():
    with pytest.raises(UnknownEnvError, match="relax/Math-v0"):
        relax_gym.make("relax/Maths-v0")


def test_bad_kwarg_names_it_and_the_closest_valid_one():
    relax_gym.register("test/Echo-v1", Echo)
    with pytest.raises(EnvArgumentError, match=r"'prefx'.*Did you mean 'prefix'"):
        relax_gym.make("test/Echo-v1", prefx="x")


def test_malformed_id_is_refused():
    with pytest.raises(gymnasium.error.Error):
        relax_gym.register("not a valid id!", Echo)


def test_gymnasium_make_works_for_registered_ids():
    relax_gym.register("test/Echo-v2", Echo)
    env = gymnasium.make("test/Echo-v2")
    assert env.unwrapped.prefix == "you said: "
    obs, _ = env.reset(seed=1)
    assert obs[0]["role"] == "user"


def test_gymnasium_make_bundled_env_in_a_fresh_process():
    code = "import gymnasium, relax_gym; e = gymnasium.make('relax/Math-v0'); print(type(e.unwrapped).__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MathEnv"


def test_third_party_entry_point_registers_envs(tmp_path):
    pkg = tmp_path / "thirdparty_envs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import relax_gym

        class Hello(relax_gym.Env):
            \"\"\"Says hello.\"\"\"
            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                return [relax_gym.messages.user("hello")], {}
            def step(self, action):
                return [], 1.0, True, False, {}

        def register():
            relax_gym.register("thirdparty/Hello-v0", Hello)
    """))
    dist = tmp_path / "thirdparty_envs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-envs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[relax_gym.envs]\nhello = thirdparty_envs:register\n")
    code = (
        "import relax_gym, gymnasium; print('thirdparty/Hello-v0' in relax_gym.list_envs()); "
        "print(gymnasium.make('thirdparty/Hello-v0').unwrapped.__class__.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "Hello"]


def test_describe_reports_modalities_and_tools_without_building():
    info = relax_gym.describe("relax/DeepEyes-v0")
    assert set(info["modalities"]) == {"text", "image"}
    assert {"image_zoom_in", "image_rotate"} <= set(info["tools"])
