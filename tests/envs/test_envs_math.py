"""relax/Math-v0 and relax/MathTool-v0: data loading, grading, the sandboxed python tool."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gymnasium.utils.env_checker import check_env

import relax_gym
from relax_gym.env.core import EpisodeOverError
from relax_gym.envs.datasets import DatasetError, load_records, shipped_path
from relax_gym.envs.math import MathEnv, load_math_tasks
from relax_gym.rewards import math_reward

ROOT = Path(__file__).resolve().parents[2]
FILE_IDS = ["relax/Math-v0", "relax/MathTool-v0"]  # the envs that read a user's file
IDS = [*FILE_IDS, "relax/GSM8K-v0"]
MALFORMED = ["", "garbage %$#@!", "\\boxed{", "\\boxed{}", "Answer:", "<answer></answer>", "9" * 200_000]
# The fallback is the point of these tests (no container engine needed); its warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore::relax_gym.sandbox.SandboxFallbackWarning")

DAPO_RECORDS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "What is 2+2? Remember to put your answer after 'Answer:'."}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "4", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "Half of 3?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "\\frac{3}{2}", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "b"},
    },
]
SIMPLE_RECORDS = [{"problem": "What is 6*7?", "answer": "42"}, {"question": "Tom has 3+4 pens.", "answer": "so #### 7"}]


def gold_of(env, info: dict) -> str:
    return env.unwrapped.tasks[info["task_index"]].answer


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    """Columns are the union of the records' keys; a row lacking one holds null, as in real exports."""
    keys = dict.fromkeys(k for r in records for k in r)
    pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in records] for k in keys}), path)
    return path


# --- contract ---------------------------------------------------------------------


@pytest.mark.parametrize("env_id", IDS)
def test_check_env(env_id):
    env = relax_gym.make(env_id)
    check_env(env)
    env.close()


@pytest.mark.parametrize("env_id", IDS)
def test_reset_is_deterministic_per_seed(env_id):
    env = relax_gym.make(env_id)
    first = [env.reset(seed=s) for s in range(5)]
    again = [env.reset(seed=s) for s in range(5)]
    assert first == again
    assert len({json.dumps(info) for _, info in first}) > 1  # different seeds, different tasks
    assert first[0][0] is not again[0][0]


@pytest.mark.parametrize("env_id", IDS)
def test_correct_answer_scores_one_wrong_scores_zero(env_id):
    env = relax_gym.make(env_id)
    _, info = env.reset(seed=7)
    gold = gold_of(env, info)
    obs, reward, terminated, truncated, info = env.step(f"Thinking... so the answer is \\boxed{{{gold}}}.")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["reward"]["status"] == "ok" and info["reward"]["extracted"] == gold
    env.reset(seed=7)
    _, reward, terminated, _, info = env.step("\\boxed{123456789}")
    assert (reward, terminated, info["reward"]["status"]) == (0.0, True, "ok")
    json.dumps(info)


@pytest.mark.parametrize("env_id", IDS)
@pytest.mark.parametrize("action", MALFORMED, ids=lambda a: f"{a[:12]!r}..{len(a)}")
def test_malformed_answers_never_raise(env_id, action):
    env = relax_gym.make(env_id)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(action)
    assert reward == 0.0 and terminated and not truncated
    assert info["reward"]["status"] in ("ok", "timeout", "error")
    json.dumps(info)


def test_step_outside_an_episode_raises_clearly():
    env = relax_gym.make("relax/Math-v0")
    with pytest.raises(EpisodeOverError):
        env.step("\\boxed{1}")
    env.reset(seed=0)
    env.step("\\boxed{1}")
    with pytest.raises(EpisodeOverError):
        env.step("\\boxed{1}")


def test_options_index_selects_the_task_and_system_prompt_is_first():
    env = relax_gym.make("relax/Math-v0", split="test", system_prompt="Be brief.")
    obs, info = env.reset(seed=0, options={"index": 3})
    assert info["task_index"] == 3
    assert [m["role"] for m in obs] == ["system", "user"] and obs[0]["content"][0]["text"] == "Be brief."
    with pytest.raises(ValueError, match="index"):
        env.reset(options={"index": 10_000})


def test_timeout_and_format_kwargs_reach_the_reward():
    env = relax_gym.make("relax/Math-v0", answer_format="boxed", timeout_s=2.0)
    _, info = env.reset(seed=1)
    _, reward, *_ = env.step(f"Answer: {gold_of(env, info)}")  # a dapo line, but boxed is required
    assert reward == 0.0


# --- data ---------------------------------------------------------------------------


def test_shipped_data_is_small_well_formed_and_exact():
    sizes = {}
    for split in ("train", "test"):
        path = shipped_path("math", f"{split}.jsonl")
        sizes[split] = path.stat().st_size
        tasks = load_math_tasks(None, split)
        assert all("\\boxed{}" in t.prompt[-1][1] for t in tasks)
        for task in tasks:  # every gold parses and matches itself: the grader can score it
            assert math_reward(f"\\boxed{{{task.answer}}}", task.answer).score == 1.0, task
    assert len(load_records(shipped_path("math", "train.jsonl"))) == 400
    assert len(load_records(shipped_path("math", "test.jsonl"))) == 100
    assert sum(sizes.values()) < 300_000
    train = {t.prompt for t in load_math_tasks(None, "train")}
    assert not train & {t.prompt for t in load_math_tasks(None, "test")}


def test_generator_script_reproduces_the_shipped_files():
    spec = importlib.util.spec_from_file_location("make_math_data", ROOT / "scripts" / "make_math_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for split, records in module.generate(0, 400, 100).items():
        assert records == load_records(shipped_path("math", f"{split}.jsonl"))
    assert {r["extra_info"]["kind"] for r in records} == set(module.KINDS)


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
@pytest.mark.parametrize("records", [DAPO_RECORDS, SIMPLE_RECORDS], ids=["dapo", "simple"])
def test_users_local_file_is_read(tmp_path, writer, records):
    path = writer(tmp_path / f"data.{'jsonl' if writer is write_jsonl else 'parquet'}", records)
    for env_id in FILE_IDS:
        env = relax_gym.make(env_id, data_path=str(path))
        assert len(env.unwrapped.tasks) == 2
        check_env(env)
        obs, _ = env.reset(seed=0, options={"index": 1})
        assert obs[-1]["role"] == "user"
        gold = env.unwrapped.tasks[1].answer
        assert gold in ("\\frac{3}{2}", "7")  # GSM8K's '#### 7' is cut to its answer
        _, reward, *_ = env.step(f"\\boxed{{{gold}}}")
        assert reward == 1.0


def test_dapo_answer_line_scores_with_auto_format(tmp_path):
    env = MathEnv(data_path=write_jsonl(tmp_path / "d.jsonl", DAPO_RECORDS))
    obs, _ = env.reset(seed=0, options={"index": 0})
    assert obs[0]["content"][0]["text"].startswith("What is 2+2?")
    assert env.step("2+2 is four.\nAnswer: 4")[1] == 1.0


def test_simple_records_get_the_boxed_instruction_and_numeric_answers(tmp_path):
    env = MathEnv(data_path=write_jsonl(tmp_path / "s.jsonl", [{"problem": "What is 6*7?", "answer": 42}]))
    obs, _ = env.reset(seed=0)
    assert obs[0]["content"][0]["text"].endswith("\\boxed{}.")
    assert env.step("\\boxed{42}")[1] == 1.0


def test_record_system_message_is_merged_with_system_prompt(tmp_path):
    record = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
              "reward_model": {"ground_truth": "1"}}  # fmt: skip
    env = MathEnv(data_path=write_jsonl(tmp_path / "sys.jsonl", [record]), system_prompt="P")
    obs, _ = env.reset(seed=0)
    assert [(m["role"], m["content"][0]["text"]) for m in obs] == [("system", "P\n\nS"), ("user", "Q")]


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"problem": "no answer here"}, "expected dapo-math fields"),
        ({"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"style": "rule"}}, "ground_truth"),
        ({"prompt": [], "reward_model": {"ground_truth": "1"}}, "non-empty list"),
        ({"prompt": [{"role": "assistant", "content": "A"}], "reward_model": {"ground_truth": "1"}}, "prompt\\[0\\]"),
        ({"problem": "Q", "answer": ""}, "non-empty"),
    ],
)
def test_bad_record_raises_dataset_error_naming_it(tmp_path, writer, bad, message):
    good = {"problem": "What is 1+1?", "answer": "2"}
    path = writer(tmp_path / f"bad.{'jsonl' if writer is write_jsonl else 'parquet'}", [good, bad])
    with pytest.raises(DatasetError, match=message) as err:
        relax_gym.make("relax/Math-v0", data_path=str(path))
    assert f"{path}: record 1" in str(err.value)


NAN = float("nan")


def dapo(gold) -> dict:
    return {"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"ground_truth": gold}}


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
@pytest.mark.parametrize(
    ("records", "key"),
    [
        ([dapo("1"), dapo(None)], "reward_model.ground_truth"),
        ([dapo(1.0), dapo(NAN)], "reward_model.ground_truth"),  # a float column, as pandas exports numbers
        ([dapo("1"), dapo("  ")], "reward_model.ground_truth"),
        ([dapo("1"), dapo("nan")], "reward_model.ground_truth"),  # NaN gone through str()
        ([{"problem": "Q", "answer": 1.0}, {"problem": "Q", "answer": NAN}], "answer"),
        ([{"problem": "Q", "answer": "1"}, {"problem": "Q", "answer": "NaN"}], "answer"),
        ([{"problem": "Q", "answer": "1"}, {"problem": "Q", "answer": "steps ####"}], "answer"),
    ],
    ids=["none", "nan", "blank", "nan-text", "simple-nan", "simple-nan-text", "gsm8k-empty"],
)
def test_missing_gold_is_refused_naming_file_record_and_key(tmp_path, writer, records, key):
    """Otherwise str(NaN) == "nan" becomes the gold, and the answer \\boxed{nan} scores 1.0."""
    path = writer(tmp_path / f"gold.{'jsonl' if writer is write_jsonl else 'parquet'}", records)
    stored = load_records(path)[1]
    stored = stored["reward_model"]["ground_truth"] if key != "answer" else stored["answer"]
    bad = records[1]["reward_model"]["ground_truth"] if key != "answer" else records[1]["answer"]
    assert stored == bad or (stored != stored and bad != bad)  # a NaN is read back as NaN, not as null
    for env_id in FILE_IDS:
        with pytest.raises(DatasetError) as err:
            relax_gym.make(env_id, data_path=str(path))
        assert f"{path}: record 1" in str(err.value) and repr(key) in str(err.value)


def test_missing_file_empty_file_and_bad_split(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        MathEnv(data_path=tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match="no records"):
        MathEnv(data_path=tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="split"):
        MathEnv(split="validation")


# --- the python tool ----------------------------------------------------------------


def test_tool_schema_comes_from_the_docstring():
    env = relax_gym.make("relax/MathTool-v0")
    (schema,) = env.tool_schemas
    assert schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["required"] == ["code"]
    assert env.metadata["sandbox"] is True and env.metadata["tools"] == ("python",)


def run_scripted_episode(env) -> list:
    _, info = env.reset(seed=11)
    gold = gold_of(env, info)
    call = {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    first = env.step(f"Let me compute.\n<tool_call>{json.dumps(call)}</tool_call>")
    second = env.step(f"The tool agrees. \\boxed{{{gold}}}")
    return [info, first, second]


def test_scripted_tool_episode_computes_then_answers():
    env = relax_gym.make("relax/MathTool-v0", sandbox_timeout_s=10.0)
    info, (obs, reward, terminated, truncated, step_info), last = run_scripted_episode(env)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert [m["role"] for m in obs] == ["tool"] and "42" in obs[0]["content"][0]["text"]
    assert step_info["tool_calls"] == 1 and step_info["tool_errors"] == 0
    obs, reward, terminated, truncated, step_info = last
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert step_info["turn"] == 2 and step_info["reward"]["status"] == "ok"
    assert run_scripted_episode(env) == [info, *run_scripted_episode(env)[1:]]  # info is deterministic
    env.close()
    env.close()  # closing twice is allowed


def test_tool_errors_and_turn_limit():
    env = relax_gym.make("relax/MathTool-v0", max_turns=2)
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step('<tool_call>{"name": "python", "arguments": {}}</tool_call>')
    assert not (terminated or truncated) and info["tool_errors"] == 1 and "Error" in obs[0]["content"][0]["text"]
    call = '<tool_call>{"name": "python", "arguments": {"code": "raise SystemExit(3)"}}</tool_call>'
    obs, reward, terminated, truncated, _ = env.step(call)
    assert "exit code: 3" in obs[0]["content"][0]["text"]
    assert (reward, terminated, truncated) == (0.0, False, True)
    env.close()


def test_state_round_trip_resumes_identically():
    env = relax_gym.make("relax/MathTool-v0")
    _, info = env.reset(seed=5)
    env.step("<tool_call>not json</tool_call>")
    state = env.get_state()
    final = f"\\boxed{{{gold_of(env, info)}}}"
    expected = env.step(final)
    other = relax_gym.make("relax/MathTool-v0")
    other.set_state(state)
    assert other.step(final) == expected


def test_math_tool_says_it_would_run_code_unsandboxed_when_it_is_made_not_at_the_first_call(monkeypatch):
    from relax_gym.sandbox import SandboxFallbackWarning

    monkeypatch.setattr("relax_gym.envs.math.container_unavailable", lambda config: "no engine answered")
    with pytest.warns(SandboxFallbackWarning, match="no container sandbox \\(no engine answered\\).*not a security"):
        env = relax_gym.make("relax/MathTool-v0")
    env.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refusing instead of falling back: nothing to warn of
        relax_gym.make("relax/MathTool-v0", require_container=True).close()


# --- relax/GSM8K-v0 ---------------------------------------------------------------


def test_gsm8k_ships_70_training_and_30_held_out_rows_with_their_walkthroughs():
    splits = {split: load_records(shipped_path("gsm8k", f"{split}.jsonl")) for split in ("train", "test")}
    assert [len(rows) for rows in splits.values()] == [70, 30]
    ids = [r["id"] for rows in splits.values() for r in rows]
    assert len(set(ids)) == 100 and all(i.startswith("gsm8k-test-") for i in ids)
    env = relax_gym.make("relax/GSM8K-v0", split="test").unwrapped
    assert [t.answer for t in env.tasks[:3]] == [r["answer"].rsplit("####", 1)[1].strip() for r in splits["test"][:3]]
    assert env.tasks[0].prompt[0][1].startswith(splits["test"][0]["question"])
    with pytest.raises(TypeError, match="relax/MathTool-v0 with data_path"):
        relax_gym.make("relax/GSM8K-v0", data_path="mine.jsonl")
    with pytest.raises(ValueError, match="split"):
        relax_gym.make("relax/GSM8K-v0", split="dev")


FENCED = "Let me compute.\n```python\nprint(6 * 7)\n```\n```output\n41\n```\nSo the total is 41."


def test_gsm8k_runs_a_python_fence_as_a_call_then_grades_the_boxed_answer():
    """Tool-integrated reasoning as small Qwen2.5 models write it: a ```python block (here with the output it
    imagined after it) runs in the sandbox; a reply with a \\boxed{} answer is graded even with a fence in it."""
    env = relax_gym.make("relax/GSM8K-v0", sandbox_timeout_s=10.0)
    _, info = env.reset(seed=3)
    obs, reward, terminated, _, step_info = env.step(FENCED)
    assert (reward, terminated, step_info["tool_calls"]) == (0.0, False, 1)
    assert obs[0]["name"] == "python" and "42" in obs[0]["content"][0]["text"]
    gold = gold_of(env, info)
    _, reward, terminated, _, _ = env.step(f"```python\nprint({gold})\n```\nThe answer is \\boxed{{{gold}}}.")
    assert (reward, terminated) == (1.0, True)
    env.close()


def test_math_tool_reads_fences_only_when_asked():
    plain = relax_gym.make("relax/MathTool-v0")
    plain.reset(seed=0)
    assert plain.step(FENCED)[2]  # graded: the fence is prose
    asked = relax_gym.make("relax/MathTool-v0", code_fences=True, sandbox_timeout_s=10.0)
    asked.reset(seed=0)
    assert asked.step("```python\nprint(1)\n")[2]  # never closed: no call
    asked.reset(seed=0)
    assert not asked.step(FENCED)[2]
    for env in (plain, asked):
        env.close()
