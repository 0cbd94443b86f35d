"""The OpenAI-compatible endpoint agents are trained through: one session per episode, exact tokens recorded.

An agent program (its own code, an agent framework) calls `/s/{session}/v1/chat/completions` with an
`openai` client, as it would call any OpenAI-style API. The proxy renders the messages with the policy's chat
template, generates on the rollout's engine, answers in OpenAI's shape (tool calls parsed by the model
family's parser) and records every call's exact prompt and completion tokens, logprobs and policy versions.
`/s/{session}/v1/responses` takes OpenAI's Responses API the same way: each call is translated to the chat call
(`relax_gym.engines.responses_api`) and recorded as one, so Responses calls chain as chat calls do.

Calls chain: when a call's messages are the previous call's, then the reply it got, then new messages (tool
results, a user turn), its prompt is the previous tokens, the generated ones and the template delta of the
new messages (`ConversationTokens`: never a re-render), so the episode is one sequence whose loss mask covers
the model's tokens only. A call that does not continue an earlier one (the agent rewrote its history, changed
tools) starts another chain; each chain becomes its own sample, and the episode says how many it made.

Sampling is the run's (temperature, top-p, top-k): the trainer's logprobs are taken at the rollout's
temperature, so an agent's own `temperature` is not used; its `max_tokens` (capped by the run's) and `stop` are.
`n` must be 1 (one reply continues an episode). A run with a sampling seed seeds each call from (that seed, the
task, the member of its group, the call), as it seeds an env episode's turns; otherwise an agent's own `seed` is
used. The run's limits hold: a call may generate no more than the tokens its chain has left of
`max_total_tokens`, an episode makes at most `max_turns` calls over all its chains, and past either a call is
refused (400) and the episode ends `truncated` with that reason, as an env episode would, whatever the agent
does next. Images come as `image_url` data URLs, bounded as `relax-gym serve` bounds them. A call whose text
could not fit the episode's token budget is refused before it is rendered, and decoding, rendering and
tokenizing run in a thread, so one agent's huge call does not stall the loop every episode runs on. With routing
replay on, each call asks the engine for its routed experts and a chain keeps its last call's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_gym.engines.base import Engine, RequestError, SamplingParams, request_seed
from relax_gym.engines.openai_api import (
    ChatCompletionIn,
    choice_of,
    offered_tools,
    text_chars,
    to_messages,
)
from relax_gym.engines.server_limits import ServerLimits
from relax_gym.engines.server_media import image_reader
from relax_gym.models import LoadedModel
from relax_gym.models.moe_routing import request_routes
from relax_gym.rollout.config import RolloutLimits
from relax_gym.rollout.tokens import ConversationTokens
from relax_gym.tools.formats import tool_format_of
from relax_gym.web import bounds

if TYPE_CHECKING:
    from relax_gym.web.serve import InLoopServer


@dataclass
class Chain:
    """One sequence of calls that continue each other: its tokens, and the last request and reply as sent."""

    conv: ConversationTokens
    request: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: dict[str, Any] | None = None
    #: with routing replay, the last call's routed experts: [tokens, layers, top_k]
    routes: np.ndarray | None = None


@dataclass
class AgentSession:
    """One episode's calls."""

    chains: list[Chain] = field(default_factory=list)
    calls: int = 0
    #: what seeds each call with the call's number: (the run's sampling seed, task seed, member), or None
    seed_key: tuple[Any, ...] | None = None
    #: the run's limit that ended the episode (`token_budget`, `max_turns`), if one did
    truncated: str = ""
    #: why the first call was refused: its prompt alone is over the budget (the episode fails with this)
    refused: str = ""
    #: the last call's failure, if a call failed (the episode reports it)
    error: str = ""
    #: one call's messages at a time become tokens (that work runs in a thread, off the rollout's loop)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _plain(messages: list[Any]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in messages]


def _same_reply(sent: dict[str, Any], ours: dict[str, Any] | None) -> bool:
    """Whether the agent's assistant message is the reply it got (content and tool calls, arguments as data)."""
    if ours is None or sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "") != (ours.get("content") or ""):
        return False

    def calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
        out = []
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with contextlib.suppress(json.JSONDecodeError):
                    arguments = json.loads(arguments)
            out.append((function.get("name"), arguments))
        return out

    return calls(sent) == calls(ours)


class AgentProxy:
    """Chat completions for agent sessions over `engine` (see the module docstring); serve it with `app()`."""

    def __init__(self, engine: Engine, loaded: LoadedModel, sampling: SamplingParams, limits: RolloutLimits, *,
                 routes_top_k: int | None = None):
        """`routes_top_k`: ask every call for its routed experts (routing replay), `top_k` per token."""
        self.engine, self.loaded, self.sampling, self.limits = engine, loaded, sampling, limits
        self.routes_top_k = routes_top_k
        self.tool_format = tool_format_of(loaded)
        self.eos_ids = loaded.stop_token_ids()
        self.sessions: dict[str, AgentSession] = {}
        self.api_key = secrets.token_urlsafe(24)
        #: a chat with more text than the episode's token budget could hold is refused before it is rendered
        self.max_chars = limits.max_total_tokens * loaded.max_token_chars

    def open(self, seed_key: tuple[Any, ...] | None = None) -> str:
        sid = secrets.token_urlsafe(12)
        self.sessions[sid] = AgentSession(seed_key=seed_key)
        return sid

    def close(self, sid: str) -> AgentSession:
        return self.sessions.pop(sid)

    def _chain(self, session: AgentSession, body: ChatCompletionIn) -> Chain:
        sent, tools = _plain(body.messages), offered_tools(body)
        # one call's images, bounded as `relax-gym serve` bounds a request's: the model's modalities, the item cap
        _image = image_reader(self.loaded.name, self.loaded.modalities, ServerLimits())
        for chain in reversed(session.chains):
            known = len(chain.request)
            if (tools == chain.tools and len(sent) > known + 1 and sent[:known] == chain.request
                    and _same_reply(sent[known], chain.reply)
                    and all(m.get("role") != "assistant" for m in sent[known + 1:])):
                chain.conv.append_observation(to_messages(replace_messages(body, sent[known + 1:]), _image))
                chain.request = sent
                return chain
        conv = ConversationTokens.start(self.loaded, to_messages(body, _image), tools)
        chain = Chain(conv, sent, tools)
        session.chains.append(chain)
        return chain

    async def complete(self, sid: str, body: ChatCompletionIn) -> dict[str, Any]:
        """One call of session `sid`, recorded; the OpenAI completion."""
        session = self.sessions.get(sid)
        if session is None:
            raise RequestError(f"no agent session {sid!r} (the episode is over)")
        if body.n != 1:
            raise RequestError("n must be 1 in a training episode: one reply continues it")
        session.calls += 1
        turns = sum(c.conv.turns for c in session.chains)
        if (chars := text_chars(body)) > self.max_chars:  # the budget is spent whatever the tokens would be
            over = (f"the agent's messages are {chars} characters, more than rollout.max_total_tokens "
                    f"({self.limits.max_total_tokens}) tokens can hold")
            if turns:
                session.truncated = session.truncated or "token_budget"
            else:
                session.refused = f"prompt over max_total_tokens: {over}"
            raise RequestError(over)
        try:  # decoding images, rendering and tokenizing take the loop's time from every episode: a thread's
            async with session.lock:
                chain = await asyncio.to_thread(self._chain, session, body)
        except ValueError as err:  # messages the policy cannot take (an image for a text model, a bad template)
            raise RequestError(str(err)) from None
        budget = self.limits.max_total_tokens - len(chain.conv.token_ids)
        turns = sum(c.conv.turns for c in session.chains)
        if budget <= 0 and not turns:  # the agent's first prompt alone: the run is set up too small for it
            session.refused = (f"prompt over max_total_tokens: the agent's first prompt is {len(chain.conv.token_ids)} "
                               f"tokens (chat template and tools included), rollout.max_total_tokens is "
                               f"{self.limits.max_total_tokens}")
            raise RequestError(session.refused)
        if budget <= 0 or turns >= self.limits.max_turns:
            spent = (f"max_total_tokens ({self.limits.max_total_tokens})" if budget <= 0
                     else f"max_turns ({self.limits.max_turns})")
            session.truncated = session.truncated or ("token_budget" if budget <= 0 else "max_turns")
            raise RequestError(f"the episode's {spent} is spent: no more calls in this training episode")
        limit = min(body.max_completion_tokens or body.max_tokens or self.sampling.max_new_tokens,
                    self.sampling.max_new_tokens, budget)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        seed = body.seed if session.seed_key is None else request_seed(*session.seed_key, session.calls)
        sampling = replace(self.sampling, max_new_tokens=limit, stop=stop or self.sampling.stop, seed=seed)
        request = chain.conv.request(sampling, f"agent/{sid}/{session.calls}",
                                     return_routed_experts=self.routes_top_k is not None)
        out = await self.engine.generate(request)
        if self.routes_top_k is not None:  # ValueError: the call fails (500) saying why
            chain.routes = request_routes(request, out, self.routes_top_k)
        chain.conv.append_generation(out.output_ids, out.logprobs, out.versions(), self.eos_ids)
        if out.finish_reason == "length" and limit == budget:  # the reply was cut where the budget ends
            session.truncated = session.truncated or "token_budget"
        choice = choice_of(self.loaded, out, 0, self.tool_format, self.eos_ids, body.logprobs)
        chain.reply = choice["message"]
        return {"id": f"chatcmpl-{sid}-{session.calls}", "object": "chat.completion", "created": 0,
                "model": self.loaded.name, "choices": [choice],
                "usage": {"prompt_tokens": len(request.input_ids), "completion_tokens": len(out.output_ids),
                          "total_tokens": len(request.input_ids) + len(out.output_ids)}}

    def app(self) -> Any:
        """The ASGI app: /s/{session}/v1/chat/completions, /s/{session}/v1/responses and /s/{session}/v1/models
        (`openai_routes`, as `relax-gym serve` answers them), behind the proxy's key."""
        from fastapi import FastAPI, Request
        from fastapi.responses import Response

        from relax_gym.engines.openai_routes import openai_router
        from relax_gym.web.errors import error_response, install_error_handlers
        from relax_gym.web.guard import Guard

        app = FastAPI(title="relax-gym agent proxy")
        install_error_handlers(app)

        @app.exception_handler(RequestError)
        async def _bad(request: Any, exc: RequestError) -> Any:
            return error_response(400, str(exc))

        async def completed(body: ChatCompletionIn, request: Request) -> dict[str, Any] | Response:
            """The call of the session the path names, recorded (`complete`); a failure that is not the call's own
            is the session's error, which the agent hears too."""
            sid = request.path_params["sid"]
            try:
                return await self.complete(sid, body)
            except RequestError:
                raise
            except Exception as err:  # the engine or the template failed this call: the agent sees why
                if sid in self.sessions:
                    self.sessions[sid].error = f"{type(err).__name__}: {err}"
                return error_response(500, f"{type(err).__name__}: {err}")

        app.include_router(openai_router(completed, lambda: [{"id": self.loaded.name}], prefix="/s/{sid}"))
        return Guard(app, api_key=self.api_key, max_body_bytes=bounds.AGENT_PROXY.max_body_bytes,
                     key_hint="the key the rollout manager gave the agent's client")


def replace_messages(body: ChatCompletionIn, messages: list[dict[str, Any]]) -> ChatCompletionIn:
    return body.model_copy(update={"messages": [type(body.messages[0]).model_validate(m) for m in messages]})


class ProxyServer:
    """A rollout manager's agent proxy, served on the manager's loop by its first agent episode (the episodes of a
    group arrive together: the first starts it while the others wait), and again on a later loop."""

    def __init__(self, engine: Engine, loaded: LoadedModel, sampling: SamplingParams, limits: RolloutLimits, *,
                 routes_top_k: int | None = None):
        self.engine, self.loaded, self.sampling, self.limits = engine, loaded, sampling, limits
        self.routes_top_k = routes_top_k
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None  # a lock belongs to one loop
        self._served: tuple[AgentProxy, InLoopServer] | None = None

    async def get(self) -> tuple[AgentProxy, str]:
        """The proxy and its URL, started here if it is not running on this loop."""
        from relax_gym.web.serve import InLoopServer  # here: a run without agents never imports uvicorn

        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        async with self._lock[1]:
            if self._served is None or not self._served[1].running_here():
                proxy = AgentProxy(self.engine, self.loaded, self.sampling, self.limits,
                                   routes_top_k=self.routes_top_k)
                server = InLoopServer(proxy.app(), bounds.AGENT_PROXY, name="agent proxy")
                await server.start()
                self._served = (proxy, server)
        return self._served[0], self._served[1].url

    async def stop(self) -> None:
        """Stops the server if it runs on this loop (one on a finished loop is gone with it)."""
        served, self._served = self._served, None
        if served is not None:
            await served[1].stop()
