"""Any OpenEnv environment server (https://github.com/meta-pytorch/OpenEnv) by its URL.

An OpenEnv server publishes its typed Action and Observation at `/schema` and keeps episodes in sessions: each
websocket on `/ws` gets an env instance of its own (the plain `POST /reset` and `/step` make a throwaway instance
per request, so an episode cannot run over them). This env speaks that wire protocol with `websockets` and
`httpx`, without importing the `openenv` package (the server side: its import pulls in FastMCP and takes seconds);
the `openenv` extra is `websockets`. One `OpenEnvEnv` holds at most one session, opened at `reset` and closed when
the server says the episode is done, so the sessions in use are the episodes in flight.

The model's reply goes to one string field of the Action (`action_field`). The model is shown one field of the
Observation (`observation_field`): its `messages` list when it has one (OpenEnv's TextArena server puts the game's
messages there, its `prompt` being the rules alone), else its one string field, else all its fields as `name: value`
lines. Some servers repeat the whole history in every observation (TextArena's through its wrappers); the model has
that history already, so when a step's text starts with the previous one, only what follows it is shown (`deltas`).
Reward and done are the server's. The seed given to `reset` is the server's `reset(seed=...)`: a server that
ignores it fails `relax-gym check`'s seeded replay, and a GRPO group on it would compare different tasks.

A server whose env offers MCP tools (an OpenEnv `MCPEnvironment`) has them offered to the model as tools; the
calls the model writes, in its family's format, run on the episode's session.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import httpx

from relax_gym.env.core import Env, EpisodeOverError, StepResult
from relax_gym.env.spaces import MessageSpace
from relax_gym.envs.textarena import candidate_moves
from relax_gym.messages import Message, message
from relax_gym.tools import ParsedTurn, ToolCallFormat, get_tool_format
from relax_gym.tools.formats import HERMES

INSTALL_HINT = "pip install 'relax-gym[openenv]'"
#: fields every OpenEnv Observation has: reward and done are the step's, metadata is not for the model
BASE_OBSERVATION_FIELDS = frozenset({"done", "reward", "metadata"})
MAX_TOOL_CALLS_PER_TURN = 4


class OpenEnvError(RuntimeError):
    """The OpenEnv server could not be reached, or answered an error (the message names the server and why)."""


class OpenEnvCapacityError(OpenEnvError):
    """The server refused a new session: all of its `max_concurrent_envs` sessions are open."""

    def __init__(self, url: str, max_sessions: int | None, wanted: int | None = None):
        self.max_sessions = max_sessions
        limit = f"allows {max_sessions}" if max_sessions is not None else "has a limit of"
        need = f"; this run needs {wanted} (rollout.concurrency)" if wanted is not None else ""
        super().__init__(f"OpenEnv server at {url} refused a new session: it {limit} concurrent sessions (its "
                         f"max_concurrent_envs) and all are open{need}; run with rollout.concurrency <= "
                         f"{max_sessions if max_sessions is not None else 'that limit'} and no other clients, or "
                         "serve the env with a higher max_concurrent_envs")


def ws_connect() -> Callable[..., Any]:
    """`websockets.sync.client.connect`, imported when an env is made, not when the id is listed."""
    try:
        from websockets.sync.client import connect
    except ImportError as err:
        raise ImportError(f"relax/OpenEnv-v0 needs the websockets package: {INSTALL_HINT}") from err
    return connect


def ws_url_of(url: str) -> str:
    """The session websocket's address on the server at `url` (http -> ws, https -> wss)."""
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(http):
            return f"{ws}{url[len(http):]}/ws"
    return f"{url if '://' in url else 'ws://' + url}/ws"


def _is_string(prop: dict[str, Any]) -> bool:
    """A JSON-schema property that holds a string (`str` or `str | None` in the pydantic model)."""
    kinds = [prop.get("type")] + [p.get("type") for p in prop.get("anyOf", []) if isinstance(p, dict)]
    return "string" in kinds and not (set(kinds) - {"string", "null", None})


def action_field_of(schema: dict[str, Any], wanted: str | None) -> str:
    """The Action field the model's text fills: `wanted`, else the one required string field the schema has."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    listed = ", ".join(f"{name} ({prop.get('type', 'any')})" for name, prop in props.items()) or "none"
    if wanted is not None:
        if wanted not in props:
            raise ValueError(f"the server's Action has no field {wanted!r}; its fields: {listed}")
        field = wanted
    else:
        strings = [n for n in schema.get("required", []) if n in props and _is_string(props[n])]
        if len(strings) != 1:
            raise ValueError(f"the server's Action ({schema.get('title', '?')}) has {len(strings)} required string "
                             f"fields, so which one the model's text goes to is unclear; its fields: {listed}. "
                             "Pass action_field=NAME")
        field = strings[0]
    others = [n for n in schema.get("required", []) if n in props and n != field]
    if others:
        raise ValueError(f"the server's Action also requires {', '.join(others)}, which relax/OpenEnv-v0 cannot fill "
                         f"from the model's text (action_field={field!r})")
    return field


def observation_field_of(schema: dict[str, Any]) -> str | None:
    """The Observation field shown to the model: `messages` when it is a list (OpenEnv's TextArena and chat envs
    send the game's or chat's messages there, and their `prompt` is the rules alone), else its one string field
    besides the base ones; None when it has none or several."""
    props = schema.get("properties") or {}
    if (props.get("messages") or {}).get("type") == "array":
        return "messages"
    strings = [n for n, p in props.items() if n not in BASE_OBSERVATION_FIELDS and _is_string(p)]
    return strings[0] if len(strings) == 1 else None


def is_mcp_action(schema: dict[str, Any]) -> bool:
    """The Action is OpenEnv's `CallToolAction`: the env is driven by tool calls only (no text field)."""
    props = schema.get("properties") or {}
    return "tool_name" in props and "arguments" in props and (props.get("type") or {}).get("const") == "call_tool"


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (`tools/list` entry) as the function schema chat templates take."""
    parameters = dict(tool.get("inputSchema") or tool.get("input_schema") or {})
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": parameters}}


def tool_result_text(result: Any, error: Any = None) -> str:
    """An MCP tool result (fastmcp's `CallToolResult`, serialised) as the text the model reads."""
    if error:
        return f"Error: {error.get('message', error) if isinstance(error, dict) else error}"
    if not isinstance(result, dict):
        return result if isinstance(result, str) else json.dumps(result, default=str)
    texts = [p["text"] for p in result.get("content") or [] if isinstance(p, dict) and p.get("type") == "text"]
    body = "\n".join(texts) if texts else json.dumps(result.get("data", result), default=str)
    return f"Error: {body}" if result.get("is_error") or result.get("isError") else body


def _as_text(value: Any) -> str:
    """A field's value as text; a list of messages (dicts with `content`) as their contents, one a line."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(v, dict) and "content" in v for v in value):
        return "\n".join(_as_text(v["content"]) for v in value)
    return json.dumps(value, default=str)


def render_observation(observation: dict[str, Any], field: str | None) -> str:
    """The observation's text: `field`'s value, else its own fields (else its metadata) as `name: value` lines."""
    if field is not None and field in observation:
        return _as_text(observation[field])
    shown = {k: v for k, v in observation.items() if k not in BASE_OBSERVATION_FIELDS}
    return "\n".join(f"{k}: {_as_text(v)}" for k, v in (shown or observation.get("metadata") or {}).items())


class OpenEnvEnv(Env[list[Message]]):
    """An OpenEnv server's env at `url` (see the module docstring).

    `action_field`: the Action field the reply goes to (default: its one required string field). `observation_field`:
    the Observation field shown (default: a `messages` list, else its one string field, else all of them).
    `deltas=False` shows each observation whole even when it repeats the last. `timeout_s` bounds each answer,
    `connect_timeout_s` each connection. `max_sessions` is the server's session limit once known (OpenEnv
    publishes it only when it refuses one); `check_capacity(n)` finds out whether n episodes can run at once.
    """

    metadata: dict[str, Any] = {**Env.metadata, "modalities": ("text",)}  # noqa: RUF012 (see Env.metadata)
    #: how tool calls are read from the reply; the rollout manager sets its model's format
    tool_format: ToolCallFormat = HERMES

    def __init__(self, url: str, action_field: str | None = None, observation_field: str | None = None, *,
                 deltas: bool = True, timeout_s: float = 120.0, connect_timeout_s: float = 10.0,
                 tool_format: ToolCallFormat | str | None = None):
        self._connect = ws_connect()
        self.url = url.rstrip("/")
        self.ws_url = ws_url_of(self.url)
        self.deltas, self.timeout_s, self.connect_timeout_s = deltas, timeout_s, connect_timeout_s
        if tool_format is not None:
            self.tool_format = get_tool_format(tool_format) if isinstance(tool_format, str) else tool_format
        schema = self._http("GET", "/schema")
        #: driven by tool calls only (the Action is OpenEnv's CallToolAction): every step is a tool call
        self.tools_only = is_mcp_action(schema.get("action") or {})
        self.action_field = None if self.tools_only else action_field_of(schema.get("action") or {}, action_field)
        self._action_schema = (schema.get("action") or {}).get("properties", {}).get(self.action_field or "", {})
        self.observation_field = observation_field or observation_field_of(schema.get("observation") or {})
        self._tool_schemas = [tool_schema(t) for t in self._list_tools()]
        self.metadata = {**type(self).metadata, "tools": tuple(s["function"]["name"] for s in self._tool_schemas)}
        self.observation_space = MessageSpace(modalities=self.metadata["modalities"])
        #: the server's limit of concurrent sessions, once a refusal has told it
        self.max_sessions: int | None = None
        self._ws: Any = None  # the episode's session: a websockets ClientConnection
        self._rpc_id = 0
        self.episode: dict[str, Any] = {}

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self._tool_schemas

    # --- the gymnasium API ----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Resets the session's env with `seed` (without one, a seed from this env's RNG); `options` are more
        keyword arguments of the server's `reset` (e.g. a task-provider env's `split` and `index`)."""
        super().reset(seed=seed)
        server_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        self.episode = {"seed": server_seed, "turn": 0, "done": True, "text": ""}
        answer = self._request({"type": "reset", "data": {**(options or {}), "seed": server_seed}})
        self.episode["done"] = bool(answer.get("done"))
        observation = answer.get("observation") or {}
        text = self._new_text(render_observation(observation, self.observation_field))
        return [message("user", text)], self._info(observation)

    def step(self, action: str) -> StepResult:
        ep = self.episode
        if not ep or ep["done"]:
            raise EpisodeOverError("call reset() before step(); the episode has not started or is over")
        ep["turn"] += 1
        parsed = self.tool_format.parse(action) if self._tool_schemas else None
        if parsed is not None and (parsed.has_tool_calls or parsed.errors):
            return self._call_tools(parsed)
        if self.action_field is None:  # nothing to send a reply without a call to: the episode is over
            self._end()
            return [], 0.0, True, False, {**self._info({}), "ended_by": "reply without a tool call"}
        ep["done"] = True  # until the server answers: a step that raises ends the episode
        observation, reward, done = self._answered({"type": "step", "data": {self.action_field: action}})
        text = self._new_text(render_observation(observation, self.observation_field))
        return [message("user", text)] if text else [], reward, done, False, self._info(observation)

    def close(self) -> None:
        self._end()

    def __del__(self) -> None:  # an env dropped without close() must not hold one of the server's few sessions
        with contextlib.suppress(Exception):
            self._end()

    def task_info(self) -> dict[str, Any]:
        """Facts added to every step's `info`: the server and the seed its env was reset with."""
        return {"url": self.url, "openenv_seed": self.episode.get("seed"), "turn": self.episode.get("turn", 0)}

    def scripted_actions(self) -> list[str]:
        """The `ScriptedEnv` hook (`relax-gym check`): moves that reach the game, so a seed the server ignores
        shows: the values the Action's schema lists for the text field (`enum`, `examples`), else the moves the
        observation lists or bracketed examples it gives (TextArena's "[5]"); [] otherwise, when the checker plays
        random text or calls made from the tool schemas."""
        values = self._action_schema.get("enum") or self._action_schema.get("examples") or []
        return [str(v) for v in values][:8] or candidate_moves([self.episode.get("text", "")])[:8]

    # --- sessions ---------------------------------------------------------------------------------
    def check_capacity(self, sessions: int) -> None:
        """Opens `sessions` sessions at once and closes them: raises `OpenEnvCapacityError`, naming the server's
        limit and `rollout.concurrency`, when the server refuses one. Each costs the server an env instance."""
        opened: list[Any] = []
        try:
            for _ in range(sessions):
                opened.append(self._open())
                try:
                    self._exchange(opened[-1], {"type": "state"})
                except OpenEnvCapacityError as err:
                    raise OpenEnvCapacityError(self.url, err.max_sessions, sessions) from None
                except OpenEnvError:
                    pass  # the session exists: an env whose state fails is not this check's business
        finally:
            for ws in opened:
                self._close(ws)

    def _open(self) -> Any:
        try:  # entered: websockets 17 wants connect() used as a context manager, and _close exits it
            return self._connect(self.ws_url, open_timeout=self.connect_timeout_s, max_size=2**27).__enter__()
        except Exception as err:
            raise OpenEnvError(f"OpenEnv server at {self.url} unreachable: {type(err).__name__}: {err}") from None

    def _close(self, ws: Any) -> None:
        """Closes a session. The server frees its slot before it closes the socket, so waiting for that close
        means a session opened next (by this env or another) is not refused for this one."""
        with contextlib.suppress(Exception):
            ws.send(json.dumps({"type": "close"}))
            while json.loads(ws.recv(timeout=min(self.timeout_s, 10.0))).get("type") != "error":
                pass  # until the server closes (ConnectionClosed), or refuses "close" (an older server)
        with contextlib.suppress(Exception):
            ws.__exit__(None, None, None)

    def _request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Sends one message on the episode's session (opening one if none is open) and returns its answer."""
        if self._ws is None:
            self._ws = self._open()
        try:
            return self._exchange(self._ws, payload)
        except OpenEnvError:
            self._end()  # a session that failed or was refused is not reused
            raise

    def _exchange(self, ws: Any, payload: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        with contextlib.suppress(ConnectionClosed):  # a refused session closes at once, its error frame queued
            ws.send(json.dumps(payload))
        try:
            answer = json.loads(ws.recv(timeout=self.timeout_s))
        except TimeoutError:
            raise OpenEnvError(f"OpenEnv server at {self.url} did not answer {payload['type']} within "
                               f"{self.timeout_s:g} s (timeout_s)") from None
        except ConnectionClosed as err:
            raise OpenEnvError(f"OpenEnv server at {self.url} closed the session: {err}") from None
        data = answer.get("data") or {}
        if answer.get("type") == "error":
            if data.get("code") == "CAPACITY_REACHED":
                self.max_sessions = data.get("max_sessions")
                raise OpenEnvCapacityError(self.url, self.max_sessions)
            raise OpenEnvError(f"OpenEnv server at {self.url} answered {payload['type']} with {data.get('code')}: "
                               f"{data.get('message')}")
        return data

    def _end(self) -> None:
        """Ends the episode and closes its session, freeing the session's slot on the server."""
        ws, self._ws = self._ws, None
        if self.episode:
            self.episode["done"] = True
        if ws is not None:
            self._close(ws)

    def _http(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            response = httpx.request(method, self.url + path, json=body, timeout=self.connect_timeout_s + 30)
            response.raise_for_status()
            return dict(response.json())
        except (httpx.HTTPError, ValueError) as err:
            raise OpenEnvError(f"OpenEnv server at {self.url}: {method} {path} failed: {type(err).__name__}: "
                               f"{err}") from None

    def _list_tools(self) -> list[dict[str, Any]]:
        """The env's MCP tools (`tools/list` on `POST /mcp`, which answers without a session); [] for an env
        without MCP."""
        try:
            answer = self._http("POST", "/mcp", {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 0})
        except OpenEnvError:  # a server older than OpenEnv's MCP routes
            return []
        tools = (answer.get("result") or {}).get("tools") if isinstance(answer.get("result"), dict) else None
        return [t for t in tools or [] if isinstance(t, dict) and isinstance(t.get("name"), str)]

    # --- turns ------------------------------------------------------------------------------------
    def _new_text(self, text: str) -> str:
        """`text`, or only what follows the previous observation's text when it starts with it (`deltas`)."""
        previous, self.episode["text"] = self.episode.get("text", ""), text
        if self.deltas and previous and len(text) > len(previous) and text.startswith(previous):
            return text[len(previous):].lstrip("\n")
        return text

    def _answered(self, payload: dict[str, Any]) -> tuple[dict[str, Any], float, bool]:
        """Sends a step; its (observation, reward, done). An episode the server says is done closes its session."""
        answer = self._request(payload)
        done = bool(answer.get("done"))
        self.episode["done"] = done
        if done:
            self._end()
        return answer.get("observation") or {}, float(answer.get("reward") or 0.0), done

    def _call_tools(self, parsed: ParsedTurn) -> StepResult:
        """Runs the reply's tool calls on the session, in order: as steps when the env is driven by tool calls
        (their rewards add up, and a call that ends the episode ends the turn), else as MCP `tools/call`."""
        ep = self.episode
        ep["done"] = True  # until the calls are answered
        out: list[Message] = [message("tool", f"Error: {e.message}", name="tool_call_parser") for e in parsed.errors]
        reward, done, info = 0.0, False, self._info({})
        calls = parsed.calls[:MAX_TOOL_CALLS_PER_TURN]
        for call in calls:
            if self.tools_only:
                observation, r, done = self._answered({"type": "step", "data": {
                    "type": "call_tool", "tool_name": call.name, "arguments": call.arguments}})
                text = tool_result_text(observation.get("result"), observation.get("error"))
                out.append(message("tool", text, name=call.name))
                reward, info = reward + r, self._info(observation)
                if done:
                    return out, reward, True, False, info
                continue
            self._rpc_id += 1
            rpc = {"jsonrpc": "2.0", "method": "tools/call", "id": self._rpc_id,
                   "params": {"name": call.name, "arguments": call.arguments}}
            answer = self._request({"type": "mcp", "data": rpc})
            text = tool_result_text(answer.get("result"), answer.get("error"))
            out.append(message("tool", text, name=call.name))
        if len(parsed.calls) > len(calls):
            out.append(message("tool", f"Error: {len(parsed.calls) - len(calls)} more tool call(s) were not run: at "
                               f"most {MAX_TOOL_CALLS_PER_TURN} run per turn.", name="tool_call_limit"))
        ep["done"] = False
        return out, reward, False, False, info

    def _info(self, observation: dict[str, Any]) -> dict[str, Any]:
        """The task facts, and the observation's fields besides the text shown (legal moves, scores, metadata)."""
        rest = {k: v for k, v in observation.items() if k != self.observation_field}
        return {**self.task_info(), "observation": rest}
