import json
import subprocess
import sys
import textwrap

import gymnasium
import pytest

import relax_gym
from relax_gym.env.conformance import resolve
from relax_gym.env.registration import EnvArgumentError, EnvTargetError, UnknownEnvError, resolve_env_id
from relax_gym.envs import BUNDLED


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


def test_a_namespace_builds_its_ids_on_first_lookup():
    relax_gym.register_namespace("echoes", Echo, "prefix")
    assert "echoes/Loud-v0" not in relax_gym.list_envs()
    env = relax_gym.make("echoes/Loud-v0")
    assert env.prefix == "Loud-v0"
    assert relax_gym.spec("echoes/Loud-v0").kwargs == {"prefix": "Loud-v0"}
    assert "echoes/Loud-v0" in relax_gym.list_envs()
    assert resolve_env_id("echoes/game:Quiet-v0-easy") == "echoes/game:Quiet-v0-easy"  # ':' after a '/' is a name
    assert gymnasium.make("echoes/Loud-v0").unwrapped.prefix == "Loud-v0"  # once looked up, gymnasium has it too
    with pytest.raises(UnknownEnvError):
        relax_gym.make("noechoes/Loud-v0")
    with pytest.raises(ValueError, match="one path segment"):
        relax_gym.register_namespace("a/b", Echo, "prefix")


def test_the_bundled_namespaces_name_their_envs_keyword():
    assert relax_gym.spec("textarena/TicTacToe-v0").kwargs == {"game": "TicTacToe-v0"}
    assert relax_gym.spec("gem/game:Sudoku-v0-easy").kwargs == {"gem_id": "game:Sudoku-v0-easy"}


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


PLUGIN = textwrap.dedent("""
    import relax_gym

    class Hello(relax_gym.Env):
        \"\"\"Says hello.\"\"\"
        def __init__(self):
            print("Hello was constructed")
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return [relax_gym.messages.user("hello")], {}
        def step(self, action):
            return [], 1.0, True, False, {}

    def register():
        relax_gym.register("thirdparty/Hello-v0", Hello)

    def register_nothing():
        pass
""")


def _plugin_dist(tmp_path, entry_points: str, package: str = "thirdparty_envs", source: str = PLUGIN) -> dict[str, str]:
    """A real installed-looking distribution on PYTHONPATH: a package plus its dist-info with entry points."""
    pkg = tmp_path / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text(source)
    dist = tmp_path / f"{package}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[relax_gym.envs]\n{entry_points}\n")
    return {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}


def test_third_party_entry_point_registers_envs(tmp_path):
    env = _plugin_dist(tmp_path, "hello = thirdparty_envs:register")
    code = (
        "import relax_gym, gymnasium; print('thirdparty/Hello-v0' in relax_gym.list_envs()); "
        "print(gymnasium.make('thirdparty/Hello-v0').unwrapped.__class__.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "Hello", "was", "constructed", "Hello"]
    assert "registered no env" not in out.stderr


def test_entry_points_that_register_nothing_are_named_in_a_warning(tmp_path):
    env = _plugin_dist(tmp_path, "byclass = thirdparty_envs:Hello\nidle = thirdparty_envs:register_nothing")
    out = subprocess.run([sys.executable, "-m", "relax_gym.cli", "envs", "--json"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "Hello was constructed" not in out.stdout  # a class is not called as if it were a register function
    warned = out.stderr.splitlines()
    byclass = [w for w in warned if "`byclass = thirdparty_envs:Hello`" in w]
    assert len(byclass) == 1 and "thirdparty-envs" in byclass[0] and "registered no env" in byclass[0]
    assert "names the class Hello, not a register function, so relax_gym did not call it" in byclass[0]
    idle = [w for w in warned if "`idle = thirdparty_envs:register_nothing`" in w]
    assert len(idle) == 1 and "did not call relax_gym.register" in idle[0]
    assert {r["id"] for r in json.loads(out.stdout)} == set(BUNDLED)


LAZY_PLUGIN = textwrap.dedent("""
    import threading
    import time

    import relax_gym

    calls = []

    class Lazy(relax_gym.Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return [relax_gym.messages.user("hi")], {}

        def step(self, action):
            return [], 0.0, True, False, {}

    def register():
        calls.append(threading.get_ident())
        time.sleep(0.2)  # a second thread looking ids up meanwhile must wait, not load the plugins again
        relax_gym.register("lazy/Lazy-v0", Lazy)

    def explode():
        raise RuntimeError("boom")
""")

IMPORT_THEN_LOOK_UP = textwrap.dedent("""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import relax_gym.engines, relax_gym.models, relax_gym.rewards, relax_gym.trainer

    print(sorted(m for m in sys.modules if m.startswith("relax_gym.envs.") or m.startswith("lazy_plugin")))
    print("--- looking up", file=sys.stderr, flush=True)
    import relax_gym

    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(relax_gym.spec, ["lazy/Lazy-v0"] * 4))
    print(len(sys.modules["lazy_plugin"].calls), len({s.id for s in found}), "lazy/Lazy-v0" in relax_gym.list_envs())
    print(sorted(m for m in sys.modules if m.startswith("relax_gym.envs.")))
""")


def test_importing_a_submodule_loads_no_env_and_no_plugin_until_an_id_is_looked_up(tmp_path):
    """torchrun followers import the engines and trainer: they must not run env modules or third-party code."""
    env = _plugin_dist(tmp_path, "lazy = lazy_plugin:register\nbroken = lazy_plugin:explode", "lazy_plugin",
                       LAZY_PLUGIN)
    out = subprocess.run([sys.executable, "-c", IMPORT_THEN_LOOK_UP], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    at_import, counts, envs_after = out.stdout.splitlines()
    assert at_import == "[]"  # no relax_gym.envs.<module> (math, procedural, deepeyes, ...) and no plugin module
    assert counts == "1 1 True"  # loaded once although four threads looked up at the same time
    assert envs_after == "[]"  # a lookup (even one that loads plugins) imports no bundled env module
    before, _, after = out.stderr.partition("--- looking up")
    assert "could not load" not in before  # no entry point ran at import
    broken = [line for line in after.splitlines() if "could not load env plugin `broken = lazy_plugin:explode`" in line]
    assert len(broken) == 1 and "(from lazy-plugin): RuntimeError: boom" in broken[0]


def test_describe_reports_modalities_and_tools_without_building():
    info = relax_gym.describe("relax/DeepEyes-v0")
    assert set(info["modalities"]) == {"text", "image"}
    assert {"image_zoom_in", "image_rotate"} <= set(info["tools"])


# --- env targets: what `check`, `rollout --env` and `train`'s envs[].id accept ----------------------------------------
def _env_file(path, *ids: str) -> str:
    """A file defining an env class per id and registering each."""
    lines = ["import relax_gym", "from relax_gym.messages import user", ""]
    for n, env_id in enumerate(ids):
        lines += [
            f"class Env{n}(relax_gym.Env):",
            "    def reset(self, *, seed=None, options=None):",
            "        super().reset(seed=seed)",
            "        return [user('hi')], {}",
            "    def step(self, action):",
            "        return [], 0.0, True, False, {}",
            f"relax_gym.register({env_id!r}, Env{n})",
        ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_resolve_env_id_takes_ids_files_and_modules(tmp_path, monkeypatch):
    assert resolve_env_id("relax/Math-v0") == "relax/Math-v0"
    one = _env_file(tmp_path / "one_env.py", "files/One-v0")
    assert resolve_env_id(one) == "files/One-v0"
    assert resolve_env_id(one) == "files/One-v0"  # imported once; the second call still knows its id
    assert resolve_env_id(f"{one}:Env0") == "files/One-v0"  # the class registered under exactly one id
    monkeypatch.syspath_prepend(str(tmp_path))
    _env_file(tmp_path / "module_envs.py", "modules/Mod-v0")
    assert resolve_env_id("module_envs") == "modules/Mod-v0"
    assert resolve_env_id("module_envs:modules/Mod-v0") == "modules/Mod-v0"


def test_resolve_env_id_file_with_several_ids_asks_for_one(tmp_path):
    two = _env_file(tmp_path / "two_envs.py", "files/A-v0", "files/B-v0")
    with pytest.raises(EnvTargetError, match=r"registers 2 envs \(files/A-v0, files/B-v0\): name one as .*:ID"):
        resolve_env_id(two)
    assert resolve_env_id(f"{two}:files/B-v0") == "files/B-v0"
    assert [name for name, _ in resolve(two)] == ["files/A-v0", "files/B-v0"]  # check takes them all
    assert [name for name, _ in resolve(two)] == ["files/A-v0", "files/B-v0"]  # and again: same import, same ids


@pytest.mark.parametrize(
    ("content", "target", "error", "needle"),
    [
        (None, "{dir}/missing.py", EnvTargetError, "no such file: .*missing.py"),
        ("x = 1\n", "{file}", EnvTargetError, "registered no env: call relax_gym.register"),
        ("x = 1\ny = 1 / 0\n", "{file}", EnvTargetError, r"importing .* failed: ZeroDivisionError: .*\(at \w+\.py:2\)"),
        ("x = 1\n", "{file}:Nope", EnvTargetError, "'Nope' is neither a registered id nor defined in"),
        (None, "no_such_module_xyz:Env", EnvTargetError, "no module named 'no_such_module_xyz'"),
        (None, "relax/Maths-v0", UnknownEnvError, "Did you mean 'relax/Math-v0'"),
    ],
)
def test_resolve_env_id_errors_name_the_cause(tmp_path, content, target, error, needle):
    path = tmp_path / f"target_{abs(hash(target)) % 10**6}.py"
    if content is not None:
        path.write_text(content)
    with pytest.raises(error, match=needle):
        resolve_env_id(target.format(dir=tmp_path, file=path))


def test_a_file_named_like_a_stdlib_module_does_not_shadow_it(tmp_path):
    path = _env_file(tmp_path / "json.py", "files/Json-v0")
    assert resolve_env_id(path) == "files/Json-v0"
    assert sys.modules["json"] is json and json.dumps([1]) == "[1]"
