"""Typed Python functions as tools, and tools a task brings as JSON schemas.

The JSON schema comes from type hints and the Google-style docstring through
`transformers.utils.get_json_schema`, the same function chat templates use, and
arguments are validated and coerced by pydantic against the same hints, so the
schema the model sees and the check its call meets cannot drift apart.

A `SchemaTool` goes the other way: the schema is given (a NeMo Gym or verifiers
row carries its own tools), the arguments are checked against it with
`jsonschema`, and a handler (a callable, or `http_handler`'s POST to a route)
runs the call.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import httpx
import jsonschema
import numpy as np
import pydantic
from PIL import Image
from transformers.utils import get_json_schema

from relax_gym.messages import Part, audio, image, text, validate_part
from relax_gym.tools.parser import ToolCall, shown

#: the attribute `@tool` sets on a method; `Env` subclasses collect the marked names (`tool_names`)
TOOL_MARK = "__relax_gym_tool__"
CONCURRENT_MARK = "__relax_gym_tool_concurrent__"
_F = TypeVar("_F", bound=Callable[..., Any])


class ToolError(Exception):
    """Raised inside a tool to tell the model what went wrong, in the tool's own words."""


class ToolDefinitionError(TypeError):
    """A function cannot be offered as a tool (no docstring, undocumented argument, untyped)."""


@overload
def tool(fn: _F, /) -> _F: ...
@overload
def tool(*, concurrent: bool = False) -> Callable[[_F], _F]: ...
def tool(fn: _F | None = None, /, *, concurrent: bool = False) -> _F | Callable[[_F], _F]:
    """Marks a function or method as a tool; `ToolEnv` offers every marked method.

    `@tool(concurrent=True)` declares the tool safe to run at the same time as other
    calls of the same turn (it keeps no order-dependent state, like a sandboxed run);
    unmarked tools run one after another in call order, since they may build on each
    other's effects (a zoom into the previous zoom).
    """

    def mark(f: _F) -> _F:
        setattr(f, TOOL_MARK, True)
        setattr(f, CONCURRENT_MARK, concurrent)
        return f

    return mark if fn is None else mark(fn)


@dataclass(frozen=True)
class ToolResult:
    content: list[Part]
    is_error: bool = False


class Tool:
    """A callable with its JSON schema and a validating invoker."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, *, concurrent: bool | None = None):
        try:
            schema = get_json_schema(fn)
        except Exception as err:  # transformers raises several types; all mean the same here
            raise ToolDefinitionError(f"{getattr(fn, '__qualname__', fn)!r} cannot be a tool: {err}") from err
        if name:
            schema["function"]["name"] = name
        schema["function"].pop("return", None)
        self.fn = fn
        #: whether calls may run alongside the turn's other calls (see `tool`)
        self.concurrent: bool = bool(getattr(fn, CONCURRENT_MARK, False) if concurrent is None else concurrent)
        self.name: str = schema["function"]["name"]
        self.schema: dict[str, Any] = schema
        self._validated = pydantic.validate_call(config={"arbitrary_types_allowed": True})(fn)
        self._params = set(inspect.signature(fn).parameters)

    def __call__(self, **arguments: Any) -> ToolResult:
        """Runs the tool; bad arguments or an exception inside it become an error result."""
        unknown = sorted(set(arguments) - self._params)
        if unknown:
            return _error(f"{self.name}: unknown argument(s) {unknown}; expected {sorted(self._params)}")
        try:
            value = self._validated(**arguments)
        except pydantic.ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}" for e in err.errors()
            )
            return _error(f"{self.name}: invalid arguments: {problems}")
        except Exception as err:
            return _failed(self.name, err)
        return ToolResult(to_parts(value))


def _failed(name: str, err: Exception) -> ToolResult:
    """A tool's exception as the model sees it: a `ToolError` in the tool's own words, anything else named."""
    if isinstance(err, ToolError):
        return _error(f"{name}: {err}")
    return _error(f"{name} failed: {type(err).__name__}: {err}")


def _error(message: str) -> ToolResult:
    return ToolResult([text(f"Error: {message}")], is_error=True)


def to_parts(value: Any) -> list[Part]:
    """Turns a tool's return value into message parts a model can be shown."""
    if isinstance(value, Image.Image):
        return [image(value)]
    if isinstance(value, str):
        return [text(value)]
    if isinstance(value, dict) and value.get("type") in ("text", "image", "audio"):
        validate_part(value)
        return [value]  # type: ignore[list-item]
    if isinstance(value, list | tuple) and value and all(
        isinstance(v, Image.Image) or (isinstance(v, dict) and "type" in v) for v in value
    ):
        return [p for v in value for p in to_parts(v)]
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], np.ndarray):
        return [audio(value[0], int(value[1]))]
    try:
        return [text(json.dumps(value, ensure_ascii=False, default=str))]
    except (TypeError, ValueError):
        return [text(repr(value))]


def function_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The `function` part of a tool schema in any of the shapes in use: chat completions' `{"type": "function",
    "function": {...}}`, the Responses API's flat `{"type": "function", "name", "parameters"}`, or a bare
    `{"name", "parameters"}`."""
    function = schema.get("function", schema)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolDefinitionError(f"a tool schema needs a name: {json.dumps(schema)[:200]}")
    kept = {k: function[k] for k in ("name", "description", "parameters", "strict") if function.get(k) is not None}
    kept.setdefault("parameters", {"type": "object", "properties": {}})
    try:
        jsonschema.validators.validator_for(kept["parameters"]).check_schema(kept["parameters"])
    except jsonschema.SchemaError as err:
        raise ToolDefinitionError(f"tool {kept['name']!r}: its parameters are no JSON schema: {err.message}") from err
    return kept


class SchemaTool:
    """A tool given by its JSON schema, run by `handler(arguments)`: a task's own tools, which no `@tool` method
    of the env's class can declare. Arguments are checked against the schema's `parameters` first."""

    def __init__(self, schema: dict[str, Any], handler: Callable[[dict[str, Any]], Any], *,
                 concurrent: bool = False):
        function = function_schema(schema)
        self.name: str = function["name"]
        self.schema: dict[str, Any] = {"type": "function", "function": function}
        self.handler, self.concurrent = handler, concurrent
        self._validator = jsonschema.validators.validator_for(function["parameters"])(function["parameters"])

    def __call__(self, **arguments: Any) -> ToolResult:
        problems = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if problems:
            where = ".".join(str(p) for p in problems[0].absolute_path) or "arguments"
            return _error(f"{self.name}: invalid arguments: {where}: {problems[0].message}")
        try:
            value = self.handler(arguments)
        except Exception as err:
            return _failed(self.name, err)
        return ToolResult(to_parts(value))


def http_handler(url: str, client: httpx.Client) -> Callable[[dict[str, Any]], Any]:
    """A `SchemaTool` handler that POSTs the arguments as JSON to `url` and returns the answer (JSON when it is
    JSON, else its text); an error status becomes the tool's error, with the server's words."""

    def call(arguments: dict[str, Any]) -> Any:
        answer = client.post(url, json=arguments)
        if answer.is_error:
            raise ToolError(f"{url} answered {answer.status_code}: {answer.text[:300]}")
        try:
            return answer.json()
        except ValueError:
            return answer.text

    return call


class ToolSet:
    """The tools of one env, looked up by name."""

    def __init__(self, fns: Iterable[Callable[..., Any] | Tool | SchemaTool]):
        self.tools: dict[str, Tool | SchemaTool] = {}
        for fn in fns:
            t = fn if isinstance(fn, Tool | SchemaTool) else Tool(fn)
            if t.name in self.tools:
                raise ToolDefinitionError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tools)

    def execute(self, call: ToolCall) -> ToolResult:
        found = self.tools.get(call.name)
        if found is None:
            close = difflib.get_close_matches(call.name, list(self.tools), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            tools = ", ".join(self.tools) or "none"
            return _error(f"unknown tool {shown(call.name, 83)}.{hint} Available tools: {tools}")
        return found(**call.arguments)

    def concurrent(self, call: ToolCall) -> bool:
        """Whether `call` may run alongside others: its tool says so, or there is no such tool (it only errs)."""
        found = self.tools.get(call.name)
        return found is None or found.concurrent
