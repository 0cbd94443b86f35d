import pytest

from relax_gym.trainer.config import ConfigError, load_config

BASE = """
run_dir: runs/x
envs:
  - id: relax/Arithmetic-v0
    kwargs: {digits: 1}
trainer:
  total_steps: 5
"""


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE)
    return path


def test_loads_with_defaults_and_overrides(base):
    cfg = load_config(base, ["trainer.lr=3e-4", "rollout.group_size=4", "envs.0.kwargs.digits=2",
                             "trainer.backend=megatron"])
    assert cfg.trainer.lr == 3e-4 and cfg.rollout.group_size == 4
    assert cfg.envs[0].kwargs == {"digits": 2}
    assert cfg.trainer.backend == "megatron"
    assert cfg.algorithm.name == "grpo"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.lerning_rate=1", "unknown key 'trainer.lerning_rate'"),
        ("trainer.lrr=1", "Did you mean 'trainer.lr'"),
        ("rollout.group_szie=2", "Did you mean 'rollout.group_size'"),
        ("algoritm.name=grpo", "Did you mean 'algorithm'"),
        ("trainer.total_steps=many", "trainer.total_steps"),
        ("trainer.backend=jax", "trainer.backend"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("envs.0.kwarg={}", "Did you mean 'envs.0.kwargs'"),
        ("rollout.engine_device=tpu", "rollout.engine_device"),
        ("rollout.engine_device=cuda:99", "CUDA device(s) on this machine"),
    ],
)
def test_bad_keys_and_values_name_the_key(base, override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(base, [override])
    assert needle in str(err.value)


def test_structural_errors_are_clear(tmp_path, base):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("envs: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(base, ["no_equals_sign"])
    with pytest.raises(ConfigError, match="engine_url"):
        load_config(base, ["rollout.engine=sglang"])


def test_weights_go_to_servers_on_this_host_as_shared_tensors_unless_set(base):
    def as_tensors(*overrides: str) -> bool:
        return load_config(base, ["rollout.engine=sglang", *overrides]).rollout.weights_as_tensors()

    assert as_tensors("rollout.engine_url=http://127.0.0.1:30000")
    assert as_tensors("rollout.engine_urls=[http://localhost:1, 'http://[::1]:2']")
    assert not as_tensors("rollout.engine_urls=[http://localhost:1, http://10.0.0.7:2]")
    assert not as_tensors("rollout.engine_url=http://127.0.0.1:30000", "rollout.weight_sync=disk")
    assert as_tensors("rollout.engine_url=http://gpu-node:30000", "rollout.weight_sync=tensor")


def test_sync_mode_is_on_policy(base):
    assert load_config(base, ["trainer.mode=sync"]).trainer.max_staleness == 0
    with pytest.raises(ConfigError, match=r"mode=sync is on-policy: trainer.max_staleness must be 0, got 3"):
        load_config(base, ["trainer.mode=sync", "trainer.max_staleness=3"])


def test_combinations_that_cannot_learn_are_refused(base):
    with pytest.raises(ConfigError, match=r"group_size=1 with algorithm.name=grpo.*every one would be 0") as err:
        load_config(base, ["rollout.group_size=1"])
    assert "got {" not in str(err.value)  # a whole-config check names its keys, not the whole tree


@pytest.mark.parametrize("content", [b"\x00\x01\xff\xfebinary", "run_dir: caf\xe9\n".encode("latin-1")])
def test_binary_or_latin1_config_is_one_clear_error(tmp_path, content):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"not UTF-8 text|not valid YAML") as err:
        load_config(path)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_bad_override_paths_are_config_errors(base):
    with pytest.raises(ConfigError, match=r"envs\.x"):
        load_config(base, ["envs.x.kwargs={}"])
    with pytest.raises(ConfigError, match=r"envs\.5"):
        load_config(base, ["envs.5.id=a"])


def test_algorithm_section_is_checked_by_the_algorithms_own_config(base):
    cfg = load_config(base, ["algorithm.name=gspo", "algorithm.aggregation=seq-mean-token-mean"])
    algo = cfg.algorithm.to_algorithm_config()
    assert algo.algorithm == "gspo" and algo.aggregation == "seq-mean-token-mean"
    with pytest.raises(ConfigError, match="dual_clip_c"):
        load_config(base, ["algorithm.dual_clip_c=0.5"])


def test_model_is_a_section_with_a_path_shorthand(base, tmp_path):
    assert load_config(base, ["model=/m"]).model.path == "/m"
    cfg = load_config(base, ["model=/m", "model.chat_template=t.jinja", "model.template_kwargs.enable_thinking=false"])
    assert (cfg.model.path, cfg.model.chat_template, cfg.model.template_kwargs) == ("/m", "t.jinja",
                                                                                   {"enable_thinking": False})
    # a later `model=DIR` keeps the template options set before it
    cfg = load_config(base, ["model.tool_format=mistral", "model=/n"])
    assert (cfg.model.path, cfg.model.tool_format) == ("/n", "mistral")
    full = tmp_path / "full.yaml"
    full.write_text(BASE + "model: {path: /p, template_kwargs: {reasoning_effort: low}}\n")
    assert load_config(full).model.template_kwargs == {"reasoning_effort": "low"}
    with pytest.raises(ConfigError, match=r"Did you mean 'model\.chat_template'"):
        load_config(base, ["model.chat_templat=x"])


def test_the_algorithm_section_is_the_algorithms_config_plus_loop_options(base):
    from relax_gym.trainer.algorithms import AlgorithmConfig
    from relax_gym.trainer.config import AlgorithmSection

    assert set(AlgorithmSection.model_fields) - set(AlgorithmConfig.model_fields) == {"recompute_old_logprobs",
                                                                                      "teacher", "routing_replay"}
    cfg = load_config(base, ["algorithm.name=sapo"])
    assert cfg.algorithm.model_dump()["name"] == "sapo"  # the run's config.yaml keeps the users' key
    with pytest.raises(ConfigError, match=r"Did you mean 'algorithm\.name'"):
        load_config(base, ["algorithm.nme=grpo"])
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm\.algorithm'"):
        load_config(base, ["algorithm.algorithm=grpo"])


def test_rollout_defaults_have_one_home():
    from relax_gym.engines.base import SamplingParams
    from relax_gym.rollout import RolloutLimits
    from relax_gym.trainer.config import RolloutConfig

    assert RolloutConfig().sampling_params() == SamplingParams()
    assert RolloutConfig().limits() == RolloutLimits()


def test_rollout_settings_are_the_training_configs_rollout_section(base):
    from relax_gym.trainer.config import load_rollout_config

    cfg = load_rollout_config({"group_size": 1, "temperature": 0.5}, ["rollout.temperature=0.7", "rollout.top_k=5"])
    assert (cfg.group_size, cfg.temperature, cfg.top_k, cfg.max_turns) == (1, 0.7, 5, 8)
    assert load_rollout_config({"temperature": 0}).temperature == 0  # greedy episodes: fine to look at...
    with pytest.raises(ConfigError, match="greedy"):  # ...not to train on
        load_config(base, ["rollout.temperature=0"])
    for settings, needle in ((["rollout.group_szie=2"], "Did you mean 'rollout.group_size'"),
                             (["rollout.temperature=-1"], "rollout.temperature"),
                             (["trainer.lr=1"], "takes rollout.KEY=VALUE"),
                             (["rollout.engine=sglang"], "needs rollout.engine_url")):
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            load_rollout_config({}, settings)
