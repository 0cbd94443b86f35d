"""LLM-as-judge rewards (GenRM): a second model grades each answer, and says so when it could not.

`JudgeReward` fills a prompt template with the question, the answer and (optionally) a reference, asks the
judge, and parses a score from its reply (`<score>7</score>` by default, out of `max_score`, scaled to 0..1).
The judge is either any OpenAI-compatible server (`url`: `relax-gym serve`, SGLang, vLLM, a hosted API: POST
{url}/v1/chat/completions) or an `Engine` in this process with the judge model's `LoadedModel` (its chat
template renders the prompt). Every call has a timeout and retries with backoff; what the reward says is the
usual `RewardResult`: `ok` with the score, `timeout` when the judge never answered in time, `error` when it
failed or its reply held no score, never a silent 0. A refused key (401, 403) is reported at once, not
retried: it would be refused again. `probe()` asks a server once, before a run, whether it answers and takes
the key (`relax/JudgedQA-v0` probes its judge when it is made, so `relax-gym train` and `check` stop at
start-up).

Calls from many episodes run concurrently on the judge's own event loop (at most `max_concurrency` at
once), so a batching judge server (the embedded engine, SGLang) batches them across episodes. A sync call
(`judge(...)`, from an env's `grade`) blocks its thread only: envs that grade with a judge step in worker
threads (`Env.blocking`).
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import TYPE_CHECKING, Any

import httpx

from relax_gym.rewards.result import RewardResult
from relax_gym.web.client import backoff_delay, bearer, error_message
from relax_gym.web.keys import JUDGE_KEY_ENV, key_from_env

if TYPE_CHECKING:
    from relax_gym.engines.base import Engine
    from relax_gym.models import LoadedModel

#: answers that no retry changes: the key is wrong or missing
REFUSED = (401, 403)
#: answers that no retry changes either: the question itself was refused (too long, malformed)
UNASKABLE = (400, 413, 422)

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n{reference}\n\n"
    "Answer to grade:\n{response}\n\nHow correct and complete is the answer, from 0 to 10? Think briefly, then "
    "end with the score as <score>N</score>."
)
DEFAULT_PATTERN = r"<score>\s*(-?\d+(?:\.\d+)?)\s*</score>"


class JudgeRefusedError(RuntimeError):
    """The judge refused the key or the question: asking again cannot help."""


class JudgeReward:
    """A judge model's score of an answer (see the module docstring)."""

    def __init__(self, url: str | None = None, *, engine: Engine | None = None, model: LoadedModel | None = None,
                 model_name: str | None = None, api_key: str | None = None, template: str = DEFAULT_TEMPLATE,
                 pattern: str = DEFAULT_PATTERN, max_score: float = 10.0, temperature: float = 0.0,
                 max_tokens: int = 256, timeout_s: float = 30.0, retries: int = 2, max_concurrency: int = 64):
        if (url is None) == (engine is None):
            raise ValueError("JudgeReward needs exactly one judge: url= (an OpenAI-compatible server) or engine=")
        if engine is not None and model is None:
            raise ValueError("JudgeReward(engine=...) needs model= (the judge's LoadedModel, whose template renders "
                             "the prompt)")
        if max_score <= 0 or timeout_s <= 0 or retries < 0 or max_concurrency < 1:
            raise ValueError("JudgeReward: max_score and timeout_s must be positive, retries >= 0, "
                             "max_concurrency >= 1")
        if "{response}" not in template:
            raise ValueError("JudgeReward template lacks {response}: the judge would not see the answer")
        self.url = None if url is None else url.rstrip("/")
        self.engine, self.model = engine, model
        self.model_name = model_name
        #: the judge's own key (default `$RELAX_GYM_JUDGE_KEY`): never the engine's, which a third party must not get
        self.api_key = api_key if api_key is not None else key_from_env(JUDGE_KEY_ENV)
        self.template, self.pattern = template, re.compile(pattern, re.S)
        self.max_score, self.temperature, self.max_tokens = max_score, temperature, max_tokens
        self.timeout_s, self.retries, self.max_concurrency = timeout_s, retries, max_concurrency
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._client: httpx.AsyncClient | None = None
        self._probed = False  # envs sharing this judge ask once

    # --- scoring ---------------------------------------------------------------------------
    def __call__(self, prompt: str, response: str, reference: str = "") -> RewardResult:
        """The score, from any thread (the call runs on the judge's own loop; this thread waits for it)."""
        future = asyncio.run_coroutine_threadsafe(self.ascore(prompt, response, reference), self._own_loop())
        return future.result()

    async def ascore(self, prompt: str, response: str, reference: str = "") -> RewardResult:
        """The score, on the caller's loop or the judge's own."""
        question = self.template.format(prompt=prompt, response=response, reference=reference or "(none given)")
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(backoff_delay(attempt))
            try:
                reply = await asyncio.wait_for(self._ask(question), self.timeout_s)
            except TimeoutError:
                last = "timeout"
                continue
            except JudgeRefusedError as err:
                return RewardResult(0.0, "error", str(err)[:400])
            except Exception as err:  # the judge failed this attempt: retried, then reported
                last = f"{type(err).__name__}: {err}"
                continue
            return self.parse(reply)
        if last == "timeout":
            return RewardResult(0.0, "timeout", f"the judge gave no answer within {self.timeout_s:g} s, "
                                                f"{self.retries + 1} attempts")
        return RewardResult(0.0, "error", f"the judge failed {self.retries + 1} times; last: {last[:300]}")

    def parse(self, reply: str) -> RewardResult:
        """The last score in `reply`, scaled to 0..1 (clamped); `error` when there is none."""
        found = self.pattern.findall(reply)
        if not found:
            return RewardResult(0.0, "error", f"the judge's reply holds no score: {reply[-200:]!r}")
        value = float(found[-1] if isinstance(found[-1], str) else found[-1][0])
        return RewardResult(min(max(value / self.max_score, 0.0), 1.0), extracted=str(value))

    async def _ask(self, question: str) -> str:
        slots = self._slots_here()
        async with slots:
            if self.url is not None:
                return await self._ask_server(question)
            return await self._ask_engine(question)

    async def _ask_server(self, question: str) -> str:
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self._headers(), timeout=None)  # wait_for bounds each attempt
        body: dict[str, Any] = {"messages": [{"role": "user", "content": question}], "temperature": self.temperature,
                                "max_tokens": self.max_tokens}
        if self.model_name:
            body["model"] = self.model_name
        answer = await self._client.post(f"{self.url}/v1/chat/completions", json=body)
        if answer.status_code in REFUSED:
            raise JudgeRefusedError(self._refused(answer))
        if answer.status_code in UNASKABLE:
            raise JudgeRefusedError(f"{self.url} refused the question ({answer.status_code}): "
                                    f"{error_message(answer)[:200]}")
        if answer.status_code >= 400:
            raise RuntimeError(f"{self.url} answered {answer.status_code}: {error_message(answer)[:200]}")
        return str(answer.json()["choices"][0]["message"].get("content") or "")

    async def _ask_engine(self, question: str) -> str:
        from relax_gym.engines.base import GenerateRequest, RequestError, SamplingParams
        from relax_gym.messages import message
        from relax_gym.models import render_ids

        assert self.engine is not None and self.model is not None  # __init__: the engine path has both
        context = getattr(self.engine, "context_length", None)
        if context is not None and len(question) > context * self.model.max_token_chars:  # before tokenizing it
            raise JudgeRefusedError(f"the judge's question has {len(question)} characters, more than its "
                                    f"{context}-token context can hold: shorten the prompt, response or reference")
        ids = render_ids(self.model, [message("user", question)])
        try:
            out = await self.engine.generate(GenerateRequest(ids, SamplingParams(temperature=self.temperature,
                                                                                 max_new_tokens=self.max_tokens)))
        except RequestError as err:  # the question cannot be asked: asking again will not help
            raise JudgeRefusedError(f"the judge's engine refused the question: {err}") from None
        return self.model.decode(out.output_ids, skip_special_tokens=True)

    def probe(self) -> None:
        """Asks a server's `/v1/models`, once until it passes: ValueError, naming the URL, when nothing answers
        there or it refuses the key (an in-process engine, or a server without that route, passes)."""
        if self._probed or self.url is None:
            return
        try:
            answer = httpx.get(f"{self.url}/v1/models", headers=self._headers(), timeout=self.timeout_s)
        except httpx.HTTPError as err:
            raise ValueError(f"JudgeReward: no judge answers at {self.url} ({type(err).__name__}: {err})") from None
        if answer.status_code in REFUSED:
            raise ValueError(f"JudgeReward: {self._refused(answer)}")
        self._probed = True

    def _headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    def _refused(self, answer: httpx.Response) -> str:
        given = "the key given" if self.api_key else f"no key (none given, ${JUDGE_KEY_ENV} unset)"
        return (f"{self.url} refused {given}: it answered {answer.status_code}; set ${JUDGE_KEY_ENV} (or the "
                f"judge's api_key) to the key its server printed")

    # --- the judge's event loop ------------------------------------------------------------------
    def _slots_here(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or getattr(self._slots, "_relax_loop", None) is not loop:
            self._slots = asyncio.Semaphore(self.max_concurrency)
            self._slots._relax_loop = loop  # type: ignore[attr-defined]  # which loop it belongs to
            self._client = None  # an httpx client belongs to its loop too
        return self._slots

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="relax-judge", daemon=True).start()
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Stops the judge's own loop (a later sync call starts another)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            if self._client is not None:
                asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result(timeout=5)
            loop.call_soon_threadsafe(loop.stop)


_shared: dict[str, JudgeReward] = {}
_shared_lock = threading.Lock()


def shared_judge(**kwargs: Any) -> JudgeReward:
    """One `JudgeReward` per distinct settings in this process: the envs of a rollout share it (and its event
    loop, client and concurrency bound) instead of each starting its own."""
    key = repr(sorted(kwargs.items()))
    with _shared_lock:
        if key not in _shared:
            _shared[key] = JudgeReward(**kwargs)
        return _shared[key]
