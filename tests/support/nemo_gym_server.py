"""A stand-in for NeMo Gym resources servers (NeMo Gym needs Python 3.12; this suite runs on 3.11).

It reproduces the wire behaviour of NeMo Gym's base classes as documented in its `nemo_gym/base_resources_server.py`
and `resources_servers/gymnasium/base.py` (the 0.4 line), not its code:

- sessions: Starlette's `SessionMiddleware` (a signed `session` cookie), plus a middleware that gives each new
  session a `session_id`, as `SimpleServer.setup_session_middleware` does;
- a verify server (`SimpleResourcesServer`): `POST /seed_session` (a body of row fields, extra ones ignored, as
  its pydantic models do), one `POST /<tool>` per tool with the arguments as the JSON body, and `POST /verify`
  taking `{responses_create_params, response, ...row fields}` and answering them back with `reward`; the
  `response` is validated as a Responses object with the fields NeMo Gym's `NeMoGymResponse` requires;
- a gymnasium server (`GymnasiumServer`): `POST /reset` -> `{observation, info}` and `POST /step` taking
  `{responses_create_params, response, ...}` -> `{observation, reward, terminated, truncated, info}`.

The tasks: `get_weather(city)` answers a temperature the session must have asked for before `/verify` counts
the answer (so a lost cookie fails), and a number to guess in the gymnasium server.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict
from starlette.middleware.sessions import SessionMiddleware

SESSION_ID_KEY = "session_id"


class ResponseObject(BaseModel):
    """What NeMo Gym's `NeMoGymResponse` (openai's `Response`) requires of a response."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created_at: float
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    responses_create_params: dict[str, Any]


class VerifyRequest(RunRequest):
    response: ResponseObject


def output_text(response: ResponseObject) -> str:
    """The text of a response's message items, as NeMo Gym's servers read it."""
    return "".join(part.get("text", "") for item in response.output if item.get("type") == "message"
                   for part in item.get("content", []) if part.get("type") == "output_text")


def _sessions(app: FastAPI) -> None:
    @app.middleware("http")
    async def add_session_id(request: Request, call_next: Any) -> Any:
        if SESSION_ID_KEY not in request.session:
            request.session[SESSION_ID_KEY] = str(uuid.uuid4())
        return await call_next(request)

    app.add_middleware(SessionMiddleware, secret_key="nemo-gym-fixture")  # added last: it runs first


def temperature(city: str) -> int:
    return 10 + len(city)


def verify_server() -> FastAPI:
    """A weather resources server: `get_weather` records the city per session; `/verify` rewards 1 for the
    temperature of the row's city, said after asking for it in the same session."""
    app = FastAPI()
    asked: dict[str, set[str]] = {}

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        asked[request.session[SESSION_ID_KEY]] = set()
        return {}

    @app.post("/get_weather")
    async def get_weather(request: Request, body: dict[str, Any]) -> dict[str, Any]:
        session = request.session[SESSION_ID_KEY]
        if session not in asked:
            raise HTTPException(400, "seed_session first")
        city = str(body.get("city", ""))
        asked[session].add(city)
        return {"city": city, "temperature_c": temperature(city)}

    @app.post("/verify")
    async def verify(request: Request, body: VerifyRequest) -> dict[str, Any]:
        extra = body.model_extra or {}
        city = str(extra.get("city", ""))
        said = output_text(body.response)
        right = city in asked.get(request.session[SESSION_ID_KEY], set()) and str(temperature(city)) in said
        return {**body.model_dump(), "reward": 1.0 if right else 0.0}

    _sessions(app)
    return app


def gymnasium_server() -> FastAPI:
    """Guess a row's number: `/step` reads the response's text and says higher or lower; 1.0 when right."""
    app = FastAPI()
    secrets: dict[str, int] = {}

    @app.post("/reset")
    async def reset(request: Request, body: RunRequest) -> dict[str, Any]:
        secrets[request.session[SESSION_ID_KEY]] = int((body.model_extra or {})["secret"])
        return {"observation": "I am thinking of a number from 1 to 100.", "info": {}}

    @app.post("/step")
    async def step(request: Request, body: VerifyRequest) -> dict[str, Any]:
        secret = secrets[request.session[SESSION_ID_KEY]]
        said = output_text(body.response).strip()
        guess = int(said) if said.isdigit() else -1
        if guess == secret:
            return {"observation": None, "reward": 1.0, "terminated": True, "truncated": False, "info": {}}
        hint = "higher" if guess < secret else "lower"
        return {"observation": f"{guess} is wrong: go {hint}.", "reward": 0.0, "terminated": False,
                "truncated": False, "info": {"guess": guess}}

    _sessions(app)
    return app


def rows(kind: str) -> list[str]:
    """NeMo Gym JSONL rows for the two servers."""
    if kind == "verify":
        tool = {"type": "function", "name": "get_weather", "description": "The temperature in a city now.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                               "additionalProperties": False}, "strict": True}
        return [json.dumps({"city": city, "responses_create_params": {"input": [
            {"role": "developer", "content": "Answer with the number of degrees Celsius."},
            {"role": "user", "content": f"How warm is it in {city}?"}], "tools": [tool]}})
            for city in ("Seattle", "Oslo", "Lima")]
    return [json.dumps({"secret": secret, "responses_create_params": {"input": [
        {"role": "user", "content": "Guess my number: reply with the number only."}]}}) for secret in (37, 80)]
