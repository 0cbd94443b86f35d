"""The verifiers plugins relax/Verifiers-v0 brings: an in-process chat harness and a tiny offline taskset.

verifiers names a harness or taskset by a top-level module (`reverse-text` imports `reverse_text`) and takes
the one `Harness` / `Taskset` subclass in its `__all__`; a dotted name cannot be one. So this module, imported
only when verifiers is in use, is also registered under the flat names `relax_gym_chat` and `relax_gym_words`:
`relax-gym-chat` is the harness, `relax-gym-words` the taskset (whose default harness is the chat one, since
its module exports a harness).

`ChatHarness` is the plain chat loop run in this process: the task's messages go to the model once and its
reply ends the segment (a user-sim env resumes it on the grown conversation). verifiers' own `null` harness is
the same loop as a program: `uv` builds it an environment and each episode starts a Python process, with the
interception's secret on its command line. In process there is nothing to install or start, and the secret
stays in memory.
"""

from __future__ import annotations

import sys
from typing import Any

import openai
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE

from relax_gym.envs.verifiers_env import HARNESS_ID, TASKSET_ID

__all__ = ["ChatHarness", "WordsTaskset"]

WORDS = ("apple", "river", "candle", "orbit", "maple", "violet", "harbor", "pebble")

for _name in (HARNESS_ID, TASKSET_ID):
    sys.modules.setdefault(_name.replace("-", "_"), sys.modules[__name__])


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat call, in this process, through the rollout's interception (see the module docstring)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str,
                     secret: str, mcp_urls: dict[str, str], data: vf.TaskData) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            try:
                await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
            except openai.APIConnectionError as err:
                return vf.ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", str(err))
            except openai.APIStatusError as err:  # a refusal (a limit, a @stop): the trace has the cause
                return vf.ProgramResult(1, "", f"model call answered {err.status_code}: {err.message}")
        return vf.ProgramResult(0, "", "")


class WordData(vf.TaskData):
    word: str


class WordTask(vf.Task[WordData]):
    @vf.reward
    async def said_the_word(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip().strip(".!'\"").lower() == self.data.word)


class WordsTaskset(vf.Taskset[WordTask, vf.TasksetConfig]):
    """Say one word: the default taskset, so relax/Verifiers-v0 makes and runs with no package of tasks."""

    def load(self) -> list[WordTask]:
        return [WordTask(WordData(prompt=f"Reply with the word {word} and nothing else.", word=word),
                         self.config.task) for word in WORDS]
