"""The foundation under the four servers (`relax_gym.web`): one key per service, one error shape and its reader,
the in-loop server on a socket bound before it starts, the retry backoff."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.testclient import TestClient

from relax_gym.errors import StartupError
from relax_gym.web import bounds
from relax_gym.web.client import backoff_delay, bearer, error_body, error_message
from relax_gym.web.errors import error_response, install_error_handlers
from relax_gym.web.guard import Guard
from relax_gym.web.keys import (
    CONTROL_TOKEN_ENV,
    ENGINE_KEY_ENV,
    ENV_SERVER_KEY_ENV,
    JUDGE_KEY_ENV,
    resolve_server_key,
)
from relax_gym.web.serve import InLoopServer

ALL_KEYS = (ENGINE_KEY_ENV, ENV_SERVER_KEY_ENV, JUDGE_KEY_ENV, CONTROL_TOKEN_ENV)


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[str | None]]]:
    """A loopback server that refuses every request (401, the one error shape) and records its Authorization."""
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"error": {"message": "missing or wrong API key", "code": 401}}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_sends_only_its_own_services_key(recorder, monkeypatch) -> None:
    """With every service's variable set, each client sends its own; with only the engine's set, the env server and
    the judge get no key at all (the engine's key never leaves for another service)."""
    from relax_gym import RemoteEnv, RemoteEnvError
    from relax_gym.engines.sglang import SGLangEngine
    from relax_gym.rewards.judge import JudgeReward

    url, seen = recorder
    for variable in ALL_KEYS:
        monkeypatch.setenv(variable, f"key-of-{variable}")
    with pytest.raises(RemoteEnvError, match="answered 401: missing or wrong API key"):
        RemoteEnv(url)
    with pytest.raises(ValueError, match="refused the key given"):
        JudgeReward(url).probe()
    assert seen == [f"Bearer key-of-{ENV_SERVER_KEY_ENV}", f"Bearer key-of-{JUDGE_KEY_ENV}"]
    engine = SGLangEngine(url)
    assert engine._client.headers["authorization"] == f"Bearer key-of-{ENGINE_KEY_ENV}"
    asyncio.run(engine.close())

    seen.clear()
    for variable in ALL_KEYS[1:]:
        monkeypatch.delenv(variable)
    with pytest.raises(RemoteEnvError):
        RemoteEnv(url)
    with pytest.raises(ValueError, match=rf"no key \(none given, \${JUDGE_KEY_ENV} unset\)"):
        JudgeReward(url).probe()
    assert seen == [None, None]


def test_a_server_reads_its_own_variable_and_generates_a_key_only_on_loopback(tmp_path, monkeypatch) -> None:
    for variable in ALL_KEYS:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(ENGINE_KEY_ENV, "engine-key")
    assert resolve_server_key("127.0.0.1", None, ENGINE_KEY_ENV) == ("engine-key", False)
    key, generated = resolve_server_key("127.0.0.1", None, ENV_SERVER_KEY_ENV)  # the engine's is not the env's
    assert generated and key != "engine-key" and len(key) >= 32
    with pytest.raises(StartupError, match=f"needs an API key the clients know: set {ENV_SERVER_KEY_ENV}"):
        resolve_server_key("0.0.0.0", None, ENV_SERVER_KEY_ENV)
    (tmp_path / "key").write_text("from-file\n")
    assert resolve_server_key("0.0.0.0", tmp_path / "key", ENV_SERVER_KEY_ENV) == ("from-file", False)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(StartupError, match="the file is empty"):
        resolve_server_key("127.0.0.1", tmp_path / "empty", ENGINE_KEY_ENV)


class Body(BaseModel):
    n: int


def _app(**guard: object) -> Guard:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(body: Body) -> dict[str, int]:
        return {"n": body.n}

    @app.get("/health")
    async def health() -> str:
        return "ok"

    return Guard(app, **{"api_key": "k", "max_body_bytes": 64, "open_routes": {"/health"}, **guard})  # type: ignore[arg-type]


def test_the_guard_and_the_validation_handler_answer_in_the_one_shape() -> None:
    client = TestClient(_app(key_hint="see $SOME_KEY", cap_hint="max_body_mb"))
    assert client.get("/health").status_code == 200  # an open route
    refused = client.post("/echo", json={"n": 1})
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert error_body(refused) == {"message": "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                              "(see $SOME_KEY)", "code": 401}
    auth = bearer("k")
    assert client.post("/echo", json={"n": 1}, headers=auth).json() == {"n": 1}
    big = client.post("/echo", content=b"x" * 65, headers={**auth, "content-type": "application/json"})
    assert big.status_code == 413 and error_message(big).endswith("limit of 64 (max_body_mb)")
    invalid = client.post("/echo", json={"n": "many"}, headers=auth)
    assert invalid.status_code == 400 and error_message(invalid).startswith("n: Input should be a valid integer")
    broken = client.post("/echo", content=b"{", headers={**auth, "content-type": "application/json"})
    assert broken.status_code == 400 and error_message(broken).startswith("body: not valid JSON")


def test_the_frameworks_own_errors_take_the_one_shape_too() -> None:
    """JSON nested past Python's recursion limit fails in FastAPI's parser, before validation: it was a bare
    `{"detail"}` naming nothing; an unknown route or method was too."""
    client = TestClient(_app(max_body_bytes=1 << 20))
    auth = {**bearer("k"), "content-type": "application/json"}
    deep = client.post("/echo", content=b'{"n": ' + b"[" * 5000 + b"]" * 5000 + b"}", headers=auth)
    assert deep.status_code == 400 and error_body(deep) == {"message": "body: not parseable as JSON", "code": 400}
    assert error_body(client.get("/nowhere", headers=auth)) == {"message": "Not Found", "code": 404}
    wrong = client.get("/echo", headers=auth)
    assert wrong.status_code == 405 and error_message(wrong) == "Method Not Allowed" and "allow" in wrong.headers


def test_the_error_reader_takes_every_shape_a_server_answers_with() -> None:
    def answer(status: int, **kwargs: object) -> httpx.Response:
        return httpx.Response(status, request=httpx.Request("GET", "http://x"), **kwargs)  # type: ignore[arg-type]

    ours = error_response(409, "busy", extra={"running_op_id": "op-1"})
    response = answer(409, content=ours.body, headers={"content-type": "application/json"})
    assert error_message(response) == "busy" and error_body(response)["running_op_id"] == "op-1"
    assert error_message(answer(400, json={"success": False, "message": "SGLang's weight route"})) == \
        "SGLang's weight route"
    assert error_message(answer(400, json={"error": "flat\n  text"})) == "flat text"
    assert error_message(answer(404, json={"detail": "Not Found"})) == "Not Found"
    assert error_message(answer(502, text="Bad Gateway from a proxy")) == "Bad Gateway from a proxy"
    assert error_message(answer(500, text="")) == "Internal Server Error"
    assert error_body(answer(404, json={"detail": "Not Found"})) == {}


def test_an_in_loop_server_binds_before_it_serves_and_stops_cleanly() -> None:
    async def main() -> None:
        first = InLoopServer(_app(api_key=None), bounds.CONTROL_API, name="test server")
        url = await first.start()
        assert first.running_here()
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{url}/health")).text == '"ok"'
        port = int(url.rsplit(":", 1)[1])
        taken = InLoopServer(_app(api_key=None), bounds.CONTROL_API, port=port, name="second server")
        with pytest.raises(OSError):  # the port is held: an error to the caller, never uvicorn's sys.exit
            await taken.start()
        await first.stop()
        await first.stop()  # idempotent
        assert not first.running_here()
        with pytest.raises(RuntimeError, match="the test server is not started"):
            first.url  # noqa: B018
        with socket.socket() as probe:  # the port is free again
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))

    asyncio.run(main())


def test_backoff_doubles_from_the_first_delay_up_to_the_cap() -> None:
    """Moved from test_engine_http: the SGLang client and the judge share it."""
    assert [backoff_delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert [backoff_delay(n, first_s=0.1, cap_s=0.3) for n in (1, 2, 3)] == pytest.approx([0.1, 0.2, 0.3])
    assert backoff_delay(10**6, first_s=1e-9, cap_s=2.0) == 2.0  # no overflow however long the outage
    with pytest.raises(ValueError, match="attempt counts from 1"):
        backoff_delay(0)


def test_a_key_sent_in_a_query_string_never_reaches_the_access_log(caplog) -> None:
    """No route reads a query string, but uvicorn logs it: the access line keeps the path and drops the query."""
    import logging

    from relax_gym.web.serve import uvicorn_config

    uvicorn_config(_app(api_key=None), "127.0.0.1", 0, bounds.CONTROL_API)  # installs the filter
    access = logging.getLogger("uvicorn.access")  # uvicorn's config stops it propagating: listen on it directly
    access.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "POST", "/generate?api_key=s3cret", "1.1", 401)
            access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/health", "1.1", 200)
    finally:
        access.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert lines == ['127.0.0.1:5 - "POST /generate?<query not logged> HTTP/1.1" 401',
                     '127.0.0.1:5 - "GET /health HTTP/1.1" 200']


def test_a_flood_of_idle_sockets_never_locks_a_real_request_out() -> None:
    """Past `max_connections` the oldest idle connection is closed for the new one: twelve sockets that never send
    a byte against a cap of four, and the health probe and an authenticated request are still answered."""
    from relax_gym.web.bounds import Bounds

    async def main() -> tuple[int, int, int]:
        server = InLoopServer(_app(), Bounds(max_body_bytes=1024, read_timeout_s=30.0, max_connections=4),
                              name="capped server")
        url = await server.start()
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        await asyncio.sleep(0.5)  # the server accepts them all, closing the oldest as it goes
        async with httpx.AsyncClient() as client:
            health = (await client.get(f"{url}/health")).status_code
            echo = (await client.post(f"{url}/echo", json={"n": 3}, headers=bearer("k"))).status_code
        still_open = 0
        for sock in idle:
            sock.setblocking(False)
            try:
                still_open += sock.recv(1) != b""
            except BlockingIOError:
                still_open += 1
            sock.close()
        await server.stop()
        return health, echo, still_open

    health, echo, still_open = asyncio.run(main())
    assert (health, echo) == (200, 200) and still_open <= 3
