"""The one error shape every relax_gym server answers with, and the one handler for bodies that fail validation.

The shape is SGLang's and OpenAI's, `{"error": {"message": ..., "code": <status>}}`, so an OpenAI client, an SGLang
client and relax_gym's own (`relax_gym.web.client.error_message`) all read it. A server may add fields beside
`message` (the control API names the operation that is running)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

#: FastAPI's detail for a body it could not parse (JSON nested deeper than the recursion limit, say)
FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def error_response(status: int, message: str, headers: dict[str, str] | None = None, *,
                   extra: Mapping[str, Any] | None = None) -> JSONResponse:
    """The error answer, with `extra` fields beside the message; also an ASGI app, so middleware can send it
    before any route runs."""
    return JSONResponse({"error": {"message": message, "code": status, **(extra or {})}}, status_code=status,
                        headers=headers)


def field_error(err: Any) -> str:
    """One validation error as "field.path: problem" (the body itself when it is not JSON)."""
    if err["type"] == "json_invalid":
        return f"body: not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})"
    return f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}"


def install_error_handlers(app: FastAPI) -> None:
    """A body that fails its schema is a 400 in the one shape, every problem named by field (FastAPI's default is a
    422 with a list a client has to format); the framework's own errors (a body it cannot parse, JSON nested past
    Python's recursion limit, an unknown route or method) take the one shape too, where they were `{"detail"}`."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "body: not parseable as JSON" if exc.detail == FASTAPI_PARSE_ERROR else str(exc.detail)
        return error_response(exc.status_code, message, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, "; ".join(field_error(err) for err in exc.errors())[:2000])
