"""Math word and symbol problems, graded by equivalence with math-verify.

Records come from the shipped synthetic set or a user's file in the
dapo-math-17k layout (`prompt`: chat messages, `reward_model.ground_truth`),
or the plainer `{"problem" | "question", "answer"}` layout, which gets the
\\boxed{} instruction added. `MathEnv` asks once; `MathToolEnv` lets the model
run Python in the sandbox first. Both write the same four hooks, shared in `MathHooks`.
`GSM8KEnv` is `MathToolEnv` on the shipped GSM8K rows (real data, MIT; docs/envs.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from relax_gym.env.core import Env
from relax_gym.env.single_turn import SingleTurnEnv
from relax_gym.env.tool_env import ToolEnv
from relax_gym.envs.datasets import DatasetError, load_records, pick, require_gold, shipped_path
from relax_gym.messages import Message, message
from relax_gym.rewards import AnswerFormat, RewardResult, math_reward
from relax_gym.sandbox import SandboxConfig, SandboxFallbackWarning, container_unavailable, shared_sandbox
from relax_gym.tools import ParsedTurn, ToolCall, tool
from relax_gym.tools.parser import code_blocks

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TOOL_SYSTEM_PROMPT = (
    "You can run Python code with the `python` tool; it shows you what the code prints. "
    "When you know the answer, reply without a tool call and put the final answer within \\boxed{}."
)
PROMPT_ROLES = ("system", "user")
#: the language tags of the code blocks `code_fences` runs
PYTHON_TAGS = ("python", "py", "python3")
Split = Literal["train", "test"]


@dataclass(frozen=True)
class MathTask:
    """One problem: its prompt as (role, text) pairs and its exact answer."""

    prompt: tuple[tuple[str, str], ...]
    answer: str
    index: int

    def messages(self, system_prompt: str | None = None) -> list[Message]:
        """Fresh message dicts on every call, so callers may keep or mutate what they get.

        `system_prompt` goes before the record's own system text in one message:
        chat templates accept a single system message, and only first.
        """
        turns = list(self.prompt)
        if system_prompt:
            if turns[0][0] == "system":
                turns[0] = ("system", f"{system_prompt}\n\n{turns[0][1]}")
            else:
                turns.insert(0, ("system", system_prompt))
        return [message(role, content) for role, content in turns]  # type: ignore[arg-type]


def _prompt_turns(raw: Any, where: str) -> tuple[tuple[str, str], ...]:
    """A dapo-style `prompt` (a list of {role, content}) as (role, text) pairs; content may be a str or parts."""
    if not isinstance(raw, list) or not raw:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {raw!r:.80}")
    turns = []
    for i, msg in enumerate(raw):
        role = msg.get("role") if isinstance(msg, dict) else None
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
        if role not in PROMPT_ROLES or not isinstance(content, str) or (role == "system" and i > 0):
            raise DatasetError(
                f"{where}: prompt[{i}] must be a {{'role': 'user' (or 'system' first), 'content': str}} message, "
                f"got {msg!r:.120}"
            )
        turns.append((role, content))
    return tuple(turns)


def _gold(value: Any, where: str, key: str) -> str:
    """The gold answer as text; None, NaN, blank and the text "nan" are refused.

    "nan" is no math answer: it is how pandas and `str()` spell a missing value, and
    math-verify would read it as the product n*a*n, which an answer of "nan" matches.
    """
    require_gold(value, where, key)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DatasetError(f"{where}: {key!r} must be a non-empty string or number, got {value!r:.80}")
    text = str(value).strip()
    if text.casefold() == "nan":
        raise DatasetError(f"{where}: {key!r} is {value!r}, a missing value written as text, not an answer")
    if "####" in text:  # GSM8K puts the answer after '####'
        text = text.rsplit("####", 1)[-1].strip()
        if not text:
            raise DatasetError(f"{where}: {key!r} has nothing after its '####', got {value!r:.80}")
    return text


def parse_record(record: Any, index: int, source: str | Path) -> MathTask:
    """Maps one record of either supported layout to a task, or raises DatasetError naming it."""
    where = f"{source}: record {index}"
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    record = {k: v for k, v in record.items() if v is not None}  # parquet fills a row's absent columns with None
    if "prompt" in record and "reward_model" in record:
        reward_model = record["reward_model"]
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise DatasetError(f"{where}: 'reward_model' needs a 'ground_truth', got {reward_model!r:.80}")
        gold = _gold(reward_model["ground_truth"], where, "reward_model.ground_truth")
        return MathTask(_prompt_turns(record["prompt"], where), gold, index)
    question = record.get("problem") or record.get("question")
    if isinstance(question, str) and question.strip() and "answer" in record:
        gold = _gold(record["answer"], where, "answer")
        return MathTask((("user", f"{question.strip()}\n\n{INSTRUCTION}"),), gold, index)
    raise DatasetError(
        f"{where}: expected dapo-math fields 'prompt' + 'reward_model.ground_truth', or 'problem'/'question' + "
        f"'answer'; the record has {sorted(record)}"
    )


def load_math_tasks(data_path: str | Path | None, split: str) -> list[MathTask]:
    """Every record checked up front, so a bad one fails at `make` time rather than mid-training."""
    if data_path is None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        data_path = shipped_path("math", f"{split}.jsonl")
    records = load_records(data_path)
    if not records:
        raise DatasetError(f"{data_path}: the file has no records")
    return [parse_record(r, i, data_path) for i, r in enumerate(records)]


def _check_answer_format(answer_format: str) -> AnswerFormat:
    """Fails at `make` time; inside the reward a bad format would only show up as error statuses."""
    if answer_format not in get_args(AnswerFormat):
        raise ValueError(f"answer_format must be one of {get_args(AnswerFormat)}, got {answer_format!r}")
    return answer_format  # type: ignore[return-value]


def last_python_fence(text: str) -> str | None:
    """The code of the last closed ```python (```py, ```python3) block of `text` with any code in it, else None."""
    code = [b.body for b in code_blocks(text) if b.language in PYTHON_TAGS and b.body.strip()]
    return code[-1] if code else None


def _task_index(options: dict[str, Any] | None, n_tasks: int) -> int | None:
    """`options={"index": i}` picks a task, for evaluation passes over the whole set."""
    index = (options or {}).get("index")
    if index is None:
        return None
    if not isinstance(index, int) or not 0 <= index < n_tasks:
        raise ValueError(f"options['index'] must be an int in [0, {n_tasks}), got {index!r}")
    return index


class MathHooks:
    """The task hooks both math envs share: a tool env is a single-turn env whose turns may call tools."""

    tasks: list[MathTask]
    system_prompt: str | None
    answer_format: AnswerFormat
    timeout_s: float

    def new_task(self, rng: np.random.Generator, options: dict[str, Any]) -> MathTask:
        index = _task_index(options, len(self.tasks))
        if index is None:
            index, _ = pick(self.tasks, rng)
        return self.tasks[index]

    def prompt_messages(self, task: MathTask) -> list[Message]:
        return task.messages(self.system_prompt)

    def grade(self, task: MathTask, answer: str) -> RewardResult:
        return math_reward(answer, task.answer, answer_format=self.answer_format, timeout_s=self.timeout_s)

    def task_info(self, task: MathTask) -> dict[str, Any]:
        return {"task_index": task.index}


class MathEnv(MathHooks, SingleTurnEnv):
    """Single-turn math: answer in \\boxed{}, graded by math-verify equivalence.

    `split` picks the shipped file and is ignored when `data_path` names the
    user's own; `reset(options={"index": i})` poses task i.
    """

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text",)}  # noqa: RUF012 (see Env.metadata)

    def __init__(
        self,
        data_path: str | Path | None = None,
        split: Split = "train",
        answer_format: AnswerFormat = "auto",
        system_prompt: str | None = None,
        timeout_s: float = 5.0,
    ):
        self.tasks = load_math_tasks(data_path, split)
        self.answer_format = _check_answer_format(answer_format)
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        super().__init__()

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): a boxed answer."""
        return ["The answer is \\boxed{42}."]


class MathToolEnv(MathHooks, ToolEnv):
    """Multi-turn math with a sandboxed `python` tool; final answer in \\boxed{}."""

    metadata: dict[str, Any] = {**ToolEnv.metadata, "modalities": ("text",), "sandbox": True}  # noqa: RUF012 (see Env.metadata)

    def __init__(
        self,
        data_path: str | Path | None = None,
        split: Split = "train",
        max_turns: int = 4,
        require_container: bool = False,
        sandbox_timeout_s: float = 5.0,
        answer_format: AnswerFormat = "auto",
        system_prompt: str | None = TOOL_SYSTEM_PROMPT,
        timeout_s: float = 5.0,
        max_tool_calls_per_turn: int | None = None,
        step_timeout_s: float | None = None,
        code_fences: bool = False,
    ):
        super().__init__(
            max_turns=max_turns, max_tool_calls_per_turn=max_tool_calls_per_turn, step_timeout_s=step_timeout_s
        )
        self.code_fences = code_fences
        self.tasks = load_math_tasks(data_path, split)
        self.sandbox_config = SandboxConfig(require_container=require_container, timeout_s=sandbox_timeout_s)
        if not require_container and (why := container_unavailable(self.sandbox_config)):  # said before any code
            warnings.warn(f"{type(self).__name__}: no container sandbox ({why}); its python tool will run the model's "
                          "code in a plain subprocess on this host, which is not a security boundary "
                          "(require_container=True refuses instead)", SandboxFallbackWarning, stacklevel=2)
        self.answer_format = _check_answer_format(answer_format)
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s

    @tool(concurrent=True)  # each run is a fresh container or temp dir, and Sandbox is thread-safe
    def python(self, code: str) -> str:
        """Runs a Python script in a sandbox and returns its exit code and output.

        Args:
            code: Python source to run as a script; use print() to see values.
        """
        # the process's sandbox for this config, made on first use (an episode that never calls the tool needs no
        # engine) and shared by every episode's env
        return shared_sandbox(self.sandbox_config).run(code).summary()

    def parse_reply(self, action: str) -> ParsedTurn:
        """With `code_fences`, a reply with no tool call and no \\boxed{} answer whose content has a closed
        ```python block calls `python` with its last such block: the tool-integrated reasoning small Qwen2.5
        models write unprompted (docs/envs.md); otherwise the tool format's reading."""
        parsed = super().parse_reply(action)
        if not self.code_fences or parsed.has_tool_calls or "\\boxed" in parsed.content:
            return parsed
        code = last_python_fence(parsed.content)
        if code is None:
            return parsed
        call = ToolCall(name="python", arguments={"code": code}, raw=f"```python\n{code}```")
        return replace(parsed, calls=[call])

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`, benchmarks/env_step.py): a `python` call, then an answer."""
        return [self.tool_format.write_calls([("python", {"code": "print(6*7)"})]), "\\boxed{42}"]

class GSM8KEnv(MathToolEnv):
    """GSM8K word problems (100 rows of its test split, MIT; docs/envs.md) with the sandboxed `python` tool.

    `split` picks the shipped file: 70 rows to train on, 30 held out. Code fences are read as
    `python` calls by default, as the small Qwen2.5 models write them (see `MathToolEnv.parse_reply`).
    """

    def __init__(self, split: Split = "train", *, code_fences: bool = True, **kwargs: Any):
        if split not in get_args(Split):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if "data_path" in kwargs:
            raise TypeError("relax/GSM8K-v0 reads its shipped rows; use relax/MathTool-v0 with data_path= for a file")
        super().__init__(data_path=shipped_path("gsm8k", f"{split}.jsonl"), split=split, code_fences=code_fences,
                         **kwargs)
