"""The client side of a training run's control API (`relax-gym cluster ...`): where its server is, its token, calls.

Only httpx: talking to a run needs neither the trainer's modules nor Ray (the `__init__` files above this one import
nothing). The server (`control_api`, beside it) writes `control.json` (its URL) and, when it generated the token,
`control_token` into the run folder; this module reads them back, so `--run-dir` is all an operator on the same
machine needs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from relax_gym.errors import StartupError
from relax_gym.web.client import bearer, error_body, error_message
from relax_gym.web.keys import CONTROL_TOKEN_ENV, key_from_env

#: in the run folder: the generated bearer token (mode 0600), and the running server's {"url", "pid"}
TOKEN_FILE = "control_token"
CONTROL_FILE = "control.json"
#: states after which an operation's record no longer changes
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
#: each `relax-gym cluster` action's method and path (`ControlClient.call`); `op` is `ops` given an operation's id
ROUTES: dict[str, tuple[str, str]] = {
    "status": ("GET", "/v1/status"), "engines": ("GET", "/v1/engines"), "ops": ("GET", "/v1/ops"),
    "op": ("GET", "/v1/ops/{op_id}"), "scale-out": ("POST", "/v1/engines/scale_out"),
    "scale-in": ("POST", "/v1/engines/scale_in"), "cancel": ("POST", "/v1/ops/{op_id}/cancel"),
}


def locate(run_dir: str | os.PathLike[str] | None, url: str | None, token: str | None) -> tuple[str, str]:
    """The control API's URL and token: `url` / `token` when given, else `$RELAX_GYM_CONTROL_TOKEN` for the token,
    else the run folder's `control.json` and `control_token`. A StartupError says what is missing."""
    folder = Path(run_dir) if run_dir is not None else None
    if url is None:
        if folder is None:
            raise StartupError("give --run-dir (a run started with the control API) or --url")
        try:
            url = str(json.loads((folder / CONTROL_FILE).read_text())["url"])
        except FileNotFoundError:
            raise StartupError(f"{folder / CONTROL_FILE} does not exist: is the run started (with the control API "
                               "on), and is this its run folder?") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise StartupError(f"{folder / CONTROL_FILE}: cannot read the server's URL ({err})") from None
    token = token or key_from_env(CONTROL_TOKEN_ENV)
    if token is None and folder is not None and (folder / TOKEN_FILE).exists():
        try:
            token = (folder / TOKEN_FILE).read_text().strip() or None
        except OSError as err:
            raise StartupError(f"{folder / TOKEN_FILE}: {err.strerror or err}") from None
    if token is None:
        where = f" or {folder / TOKEN_FILE}" if folder is not None else " (or --run-dir, for its control_token)"
        raise StartupError(f"no control token: set {CONTROL_TOKEN_ENV}, pass --token{where}")
    return url.rstrip("/"), token


def refusal(response: httpx.Response) -> str:
    """A non-2xx answer as one line: the status and the server's message (and the operation that is running)."""
    message = error_message(response)
    running = error_body(response).get("running_op_id")
    extra = f" (running operation: {running})" if running and running not in message else ""
    return f"{response.status_code} {response.reason_phrase}: {message}{extra}"


class ControlClient:
    """Calls to one control API; every method returns the `httpx.Response` (the caller judges its status) and
    lets httpx's transport errors (connection refused, timeouts) through."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=bearer(token), timeout=timeout_s)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> httpx.Response:
        return self._http.get(path)

    def post(self, path: str, body: dict[str, Any] | None = None, idempotency_key: str | None = None) -> httpx.Response:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._http.post(path, json=body, headers=headers)

    def call(self, action: str, op_id: str | None = None, body: dict[str, Any] | None = None,
             idempotency_key: str | None = None) -> httpx.Response:
        """One action by its name in ROUTES, so the CLI's action names are the API's; a POST's body leaves out its
        None values (the server's defaults apply)."""
        method, path = ROUTES["op" if action == "ops" and op_id else action]
        path = path.format(op_id=op_id)
        if method == "GET":
            return self.get(path)
        return self.post(path, {k: v for k, v in (body or {}).items() if v is not None}, idempotency_key)

    @staticmethod
    def started_op(response: httpx.Response) -> str | None:
        """The id of the operation a successful answer started (a scale's), else None: what `wait` follows."""
        record = response.json() if response.is_success else None
        return str(record["op_id"]) if isinstance(record, dict) and "op_id" in record else None

    def wait(self, op_id: str, poll_s: float = 0.25,
             on_state: Callable[[dict[str, Any]], None] | None = None) -> httpx.Response:
        """Polls the operation until its state is terminal (or an answer is not 200); `on_state` sees each change."""
        seen = None
        while True:
            response = self.call("op", op_id)
            if response.status_code != 200:
                return response
            record = response.json()
            if record.get("state") != seen and on_state is not None:
                on_state(record)
            seen = record.get("state")
            if seen in TERMINAL_STATES:
                return response
            time.sleep(poll_s)
