"""Any NeMo Gym resources server (https://github.com/NVIDIA-NeMo/Gym) by URL, with its tasks' JSONL.

NeMo Gym keeps an environment's tools and grader in a *resources server* and its tasks in JSONL rows, each row
a Responses API request (`responses_create_params`: `input` messages and the task's own `tools`) plus the
fields its grader reads. Two kinds of server speak to an agent over HTTP, each episode a cookie session:

- **verify**: `POST /seed_session` starts the session, `POST /<tool>` runs a tool call with its arguments as
  JSON, and `POST /verify` grades the episode from the row and a Responses object holding everything the
  model and the tools said (`{"reward": ...}`).
- **gymnasium**: `POST /reset` starts the session (`{"observation", "info"}`), and `POST /step` takes each
  turn's Responses object and answers `{"observation", "reward", "terminated", "truncated", "info"}`.

`kind="auto"` reads the server's FastAPI route list (`/openapi.json`) to tell them apart. NeMo Gym needs Python
3.12 and its servers run in their own processes, so nothing of it is imported here: this module speaks its wire
format, which tests/support/nemo_gym_server.py reproduces from NeMo Gym's base classes.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from relax_gym.engines.openai_api import to_messages
from relax_gym.engines.responses_api import ResponsesIn, to_chat
from relax_gym.env.core import StepResult
from relax_gym.env.tool_env import ToolEnv
from relax_gym.messages import Message, message, text_content
from relax_gym.rewards import RewardResult
from relax_gym.tools import SchemaTool, Tool, ToolError, http_handler
from relax_gym.tools.parser import ParsedTurn

KINDS = ("auto", "verify", "gymnasium")
#: routes of the resources server itself, never a tool's
SERVER_ROUTES = frozenset({"seed_session", "verify", "reset", "step", "aggregate_metrics", "close_session"})


def read_rows(data: str | Path) -> list[dict[str, Any]]:
    """A NeMo Gym JSONL of tasks; a row without `responses_create_params.input` is named by its line."""
    path = Path(data).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"relax/NeMoGym-v0: no such data file: {data}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON: {err.msg}") from None
        if not isinstance(row, dict) or not (row.get("responses_create_params") or {}).get("input"):
            raise ValueError(f"{path}:{number}: a NeMo Gym row needs responses_create_params.input")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def server_kind(url: str, client: httpx.Client) -> str:
    """"gymnasium" when the server routes /reset and /step, "verify" when it routes /verify."""
    try:
        paths = client.get(f"{url}/openapi.json").raise_for_status().json().get("paths", {})
    except (httpx.HTTPError, ValueError) as err:
        raise ConnectionError(f"relax/NeMoGym-v0: cannot read the routes of {url} ({err}); is the resources "
                              "server running? Or pass kind='verify' or kind='gymnasium'") from err
    if "/reset" in paths and "/step" in paths:
        return "gymnasium"
    if "/verify" in paths:
        return "verify"
    raise ValueError(f"relax/NeMoGym-v0: {url} routes neither /verify nor /reset and /step: {sorted(paths)}")


def no_image(url: str, where: str) -> Any:
    raise ValueError(f"{where}: images in NeMo Gym rows are not taken yet")


def row_messages(params: dict[str, Any]) -> list[Message]:
    """A row's Responses request as chat messages (`developer` is `system`), through the translation the
    Responses route of the agent proxy uses."""
    request = ResponsesIn.model_validate({k: params[k] for k in ("input", "instructions") if k in params})
    return to_messages(to_chat(request), no_image)


def response_object(output: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    """A finished Responses object around `output` items, with the fields NeMo Gym's pydantic model requires."""
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": str(params.get("model") or "relax-gym"), "status": "completed", "output": output,
            "parallel_tool_calls": True, "tool_choice": params.get("tool_choice", "auto"),
            "tools": params.get("tools", [])}


def output_items(parsed: ParsedTurn, call_ids: list[str]) -> list[dict[str, Any]]:
    """One model turn as Responses output items: its text as a message, each tool call as a function_call."""
    items: list[dict[str, Any]] = []
    if parsed.content:
        items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": parsed.content, "annotations": []}]})
    for call, call_id in zip(parsed.calls, call_ids, strict=True):
        items.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                      "call_id": call_id, "name": call.name, "arguments": json.dumps(call.arguments)})
    return items


class NeMoGymEnv(ToolEnv):
    """A NeMo Gym resources server's tasks: each row's messages, its own tools, its server's reward.

    The seed picks the row (`options={"index": i}` picks one directly). A verify server's tool calls go to its
    `POST /<tool>` within the episode's cookie session, and the final reply to `/verify`; a gymnasium server
    gets every turn through `/step`.
    """

    def __init__(self, url: str, data: str, kind: str = "auto", timeout_s: float = 60.0,
                 max_turns: int | None = None, **tool_env_kwargs: Any):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.url = url.rstrip("/")
        self.rows = read_rows(data)
        self.timeout_s = timeout_s
        self._client: httpx.Client | None = None
        with httpx.Client(timeout=timeout_s) as probe:
            self.kind = server_kind(self.url, probe) if kind == "auto" else kind
        super().__init__(max_turns=max_turns, **tool_env_kwargs)

    # --- the task -----------------------------------------------------------------------------------------
    def new_task(self, rng: Any, options: dict[str, Any]) -> dict[str, Any]:
        index = int(options["index"]) if "index" in options else int(rng.integers(len(self.rows)))
        return {"index": index, "row": self.rows[index]}

    def prompt_messages(self, task: dict[str, Any]) -> list[Message]:
        return row_messages(task["row"]["responses_create_params"])

    def task_tools(self, task: dict[str, Any]) -> list[Tool | SchemaTool]:
        """The row's own tools; a verify server runs them at `POST /<name>` in the episode's session."""
        tools: list[Tool | SchemaTool] = []
        for schema in task["row"]["responses_create_params"].get("tools") or []:
            name = schema.get("name") or (schema.get("function") or {}).get("name")
            if name in SERVER_ROUTES:
                raise ValueError(f"row {task['index']}: tool {name!r} would call the server's own /{name}")
            tools.append(SchemaTool(schema, self._tool_route(str(name))))
        return tools

    def task_info(self, task: dict[str, Any]) -> dict[str, Any]:
        return {"row": task["index"], "server": self.url, "kind": self.kind}

    # --- the session ----------------------------------------------------------------------------------------
    def _tool_route(self, name: str) -> Any:
        def call(arguments: dict[str, Any]) -> Any:
            if self.kind == "gymnasium":  # its /step answers the calls
                raise ToolError("this server takes tool calls through /step")
            return http_handler(f"{self.url}/{name}", self._session())(arguments)

        return call

    def _session(self) -> httpx.Client:
        if self._client is None:
            raise RuntimeError("reset() first: the episode's session starts there")
        return self._client

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self._session().post(f"{self.url}/{route}", json=body)
        if answer.is_error:
            raise RuntimeError(f"{self.url}/{route} answered {answer.status_code}: {answer.text[:300]}")
        return answer.json()

    def _row_body(self, **extra: Any) -> dict[str, Any]:
        """The row as NeMo Gym sends it: its request and its grader's fields, plus `extra`."""
        return {**self.task["row"], **extra}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        observation, info = super().reset(seed=seed, options=options)
        if self._client is not None:
            self._client.close()
        self._client = httpx.Client(timeout=self.timeout_s)  # a fresh cookie jar: a fresh server session
        self.episode["output"] = []
        if self.kind == "gymnasium":
            started = self._post("reset", self._row_body())
            if started.get("observation"):
                observation = [*observation, message("user", str(started["observation"]))]
        else:
            self._post("seed_session", self._row_body())
        return observation, info

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().close()

    # --- a turn -----------------------------------------------------------------------------------------------
    def step(self, action: str) -> StepResult:
        episode = self.running_episode()
        parsed = self.tool_format.parse(action)
        turn = episode["turn"] + 1
        call_ids = [call.id or f"call_{turn}_{j}" for j, call in enumerate(parsed.calls)]
        items = output_items(parsed, call_ids)
        if self.kind == "gymnasium":
            return self._gym_step(items)
        episode["output"] += items
        result = super().step(action)
        answers = [m for m in result[0] if m["role"] == "tool" and m.get("name") not in
                   ("tool_call_parser", "tool_call_limit")]
        for call_id, answer in zip(call_ids, answers, strict=False):
            episode["output"].append({"type": "function_call_output", "call_id": call_id,
                                      "output": text_content(answer)})
        return result

    def _gym_step(self, items: list[dict[str, Any]]) -> StepResult:
        episode = self.episode
        episode["turn"] += 1
        params = self.task["row"]["responses_create_params"]
        answer = self._post("step", self._row_body(response=response_object(items, params)))
        reward, terminated = float(answer.get("reward") or 0.0), bool(answer.get("terminated"))
        truncated = bool(answer.get("truncated")) and not terminated
        if not (terminated or truncated) and episode["turn"] >= self.max_turns:
            truncated = True
        episode["done"] = terminated or truncated
        info = self._info(server_info=answer.get("info") or {})
        if truncated:
            info.setdefault("truncated_by", "env" if answer.get("truncated") else "max_turns")
        observation = [message("user", str(answer["observation"]))] if answer.get("observation") else []
        return observation, reward, terminated, truncated, info

    def grade(self, task: dict[str, Any], answer: str) -> RewardResult:
        """`/verify` on the row and the episode's Responses object; a server error is a reward error."""
        params = task["row"]["responses_create_params"]
        try:
            verdict = self._post("verify", self._row_body(response=response_object(self.episode["output"], params)))
            reward = float(verdict["reward"])
        except (RuntimeError, httpx.HTTPError, KeyError, TypeError, ValueError) as err:
            return RewardResult(0.0, "error", f"/verify: {type(err).__name__}: {err}", answer[:200])
        return RewardResult(reward, extracted=answer[:200])

    # --- what a remote episode cannot do ---------------------------------------------------------------------
    @property
    def supports_state(self) -> bool:
        return False  # the episode lives in the server's session

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError("relax/NeMoGym-v0: the episode's state lives in the resources server's session")
