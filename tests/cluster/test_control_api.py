"""The elastic rollout control API: scale operations on a fake fleet, the HTTP routes and their token, the CLI.

`FakeFleet` stands in for the controller: engines take `start_s` to come up (or wait on a gate), fail on demand,
and hold `inflight` counts the test sets. The app is driven in-process (httpx over ASGI, one event loop per test);
one test serves it over real HTTP on loopback and drives it with `relax-gym cluster`.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from relax_gym.cli import main
from relax_gym.trainer.cluster.control_api import ControlServer, create_control_app, resolve_control_token
from relax_gym.trainer.cluster.control_client import CONTROL_TOKEN_ENV
from relax_gym.trainer.cluster.scale import EngineState, EngineView, ScaleManager

TOKEN = "sesame"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FakeFleet:
    """Engines that take `start_s` to start (or wait on `gate`), fail with the messages in `fail_next`, and drain
    as the test lowers their `inflight`."""

    def __init__(self, initial: int = 2, min_engines: int = 1, start_s: float = 0.0) -> None:
        self.min_engines = min_engines
        self.start_s = start_s
        self.version = 7
        self.fail_next: list[str] = []
        self.gate: asyncio.Event | None = None
        self.views: dict[str, EngineView] = {}
        self.cancelled: list[str] = []
        self.drained: list[str] = []
        self.removed: list[str] = []
        for _ in range(initial):
            view = self._new(None)
            view.state, view.version, view.initial = "ACTIVE", self.version, True

    def _new(self, url: str | None) -> EngineView:
        n = len(self.views)
        view = EngineView(f"e{n}", "http" if url else "embedded", url, "STARTING", 0, 0, 0, False, 1000.0 + n)
        self.views[view.engine_id] = view
        return view

    def engines(self) -> list[EngineView]:
        return [v for v in self.views.values() if v.state != "REMOVED"]

    def status(self) -> dict[str, Any]:
        return {"step": 3, "weight_version": self.version}

    async def add_engine(self, url: str | None = None,
                         on_state: Callable[[EngineState], None] | None = None) -> str:
        view = self._new(url)
        report = on_state or (lambda state: None)
        try:
            for state in ("STARTING", "HEALTH_CHECKING", "WEIGHT_SYNCING"):
                view.state = state
                report(view.state)
                if self.gate is not None:
                    await self.gate.wait()
                await asyncio.sleep(self.start_s / 3)
            if self.fail_next:
                raise RuntimeError(self.fail_next.pop(0))
        except asyncio.CancelledError:
            self.cancelled.append(view.engine_id)
            view.state = "REMOVED"
            raise
        except Exception:
            view.state = "REMOVED"
            raise
        view.state, view.version = "ACTIVE", self.version
        report("ACTIVE")
        return view.engine_id

    async def drain_engine(self, engine_id: str, timeout_s: float) -> int:
        view = self.views[engine_id]
        view.state = "DRAINING"
        self.drained.append(engine_id)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while view.inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        return view.inflight

    async def remove_engine(self, engine_id: str) -> None:
        self.views[engine_id].state = "REMOVED"
        self.removed.append(engine_id)


def run_app(test: Callable[[httpx.AsyncClient, FakeFleet, ScaleManager], Awaitable[None]], **fleet_kwargs: Any) -> None:
    """Runs `test` with a client on the app over a fresh fleet (authorized: `AUTH` on every request)."""

    async def go() -> None:
        fleet = FakeFleet(**fleet_kwargs)
        manager = ScaleManager(fleet)
        app = create_control_app(fleet, manager, TOKEN)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://control",
                                     headers=AUTH) as client:
            await test(client, fleet, manager)

    asyncio.run(go())


async def settled(client: httpx.AsyncClient, op_id: str) -> dict[str, Any]:
    for _ in range(400):
        record = (await client.get(f"/v1/ops/{op_id}")).json()
        if record["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
            return record
        await asyncio.sleep(0.005)
    raise AssertionError(f"operation {op_id} did not finish: {record}")


ROUTES = [("GET", "/v1/status"), ("GET", "/v1/engines"), ("GET", "/v1/ops"), ("GET", "/v1/ops/x"),
          ("POST", "/v1/engines/scale_out"), ("POST", "/v1/engines/scale_in"), ("POST", "/v1/ops/x/cancel")]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": "Bearer"}, {"Authorization": f"Bearer {TOKEN}x"}])
def test_every_route_but_health_needs_the_token(headers):
    async def go() -> None:
        fleet = FakeFleet()
        manager = ScaleManager(fleet)
        transport = httpx.ASGITransport(app=create_control_app(fleet, manager, TOKEN))
        async with httpx.AsyncClient(transport=transport, base_url="http://control", headers=headers) as client:
            for method, path in ROUTES:
                response = await client.request(method, path, json={"num_engines": 5})
                assert response.status_code == 401, (method, path)
                assert response.headers["www-authenticate"] == "Bearer"
                assert "control token" in response.json()["error"]["message"]
            health = await client.get("/v1/health")
            assert health.status_code == 200 and health.json() == {"ok": True}
        assert len(fleet.engines()) == 2 and manager.ops() == []  # nothing was started

    asyncio.run(go())


def test_status_and_engines():
    async def test(client, fleet, manager):
        status = (await client.get("/v1/status")).json()
        assert status == {"step": 3, "weight_version": 7, "engines": {"ACTIVE": 2}, "running_op_id": None}
        engines = (await client.get("/v1/engines")).json()
        assert [e["engine_id"] for e in engines] == ["e0", "e1"] and engines[0]["initial"] is True

    run_app(test)


def test_scale_out_to_a_target_then_noop():
    async def test(client, fleet, manager):
        response = await client.post("/v1/engines/scale_out", json={"num_engines": 4})
        assert response.status_code == 202
        started = response.json()
        assert started["state"] in ("PENDING", "STARTING") and started["kind"] == "scale_out"
        record = await settled(client, started["op_id"])
        assert record["state"] == "COMPLETED" and record["failed"] == [] and record["error"] is None
        assert sorted(record["engine_ids"]) == ["e2", "e3"]
        assert record["version_on_activate"] == {"e2": 7, "e3": 7}
        assert [p["state"] for p in record["progress"]] == ["ACTIVE", "ACTIVE"]
        assert [e.state for e in fleet.engines()] == ["ACTIVE"] * 4
        again = await client.post("/v1/engines/scale_out", json={"num_engines": 4})
        assert again.status_code == 200 and again.json()["state"] == "NOOP"
        assert (await client.post("/v1/engines/scale_out", json={"num_engines": 3})).json()["state"] == "NOOP"
        assert [op["op_id"] for op in (await client.get("/v1/ops")).json()] == [started["op_id"]]

    run_app(test, start_s=0.03)


def test_scale_out_urls_skips_registered_ones():
    async def test(client, fleet, manager):
        response = await client.post("/v1/engines/scale_out", json={"engine_urls": ["http://h1:30000/"]})
        record = await settled(client, response.json()["op_id"])
        assert record["state"] == "COMPLETED" and fleet.views[record["engine_ids"][0]].url == "http://h1:30000"
        again = await client.post("/v1/engines/scale_out", json={"engine_urls": ["http://h1:30000"]})
        assert again.status_code == 200 and again.json()["state"] == "NOOP"
        both = await client.post("/v1/engines/scale_out", json={"engine_urls": ["http://h1:30000", "http://h2:1"]})
        assert [p["url"] for p in both.json()["progress"]] == ["http://h2:1"]

    run_app(test)


@pytest.mark.parametrize("body", [{}, {"num_engines": 3, "engine_urls": ["http://h:1"]}, {"num_engines": 0},
                                  {"num_engines": "3"}, {"num_engines": 3, "bogus": 1}, {"engine_urls": ["ftp://x"]},
                                  {"engine_urls": []}, {"num_engines": 3, "timeout_s": -1},
                                  {"num_engines": 3, "timeout_s": 1e9}])
def test_scale_out_bad_requests_are_400(body):
    async def test(client, fleet, manager):
        response = await client.post("/v1/engines/scale_out", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"]
        assert manager.ops() == []

    run_app(test)


@pytest.mark.parametrize("body", [b"{}", b'{"num_engines": 1, "engine_ids": ["e1"]}', b'{"engine_ids": []}',
                                  b'{"num_engines": 1, "drain_timeout_s": NaN}', b'{"num_engines": 1, "force": 1}',
                                  b'{"num_engines": 1, "drain_timeout_s": -1}', b'{"num_engines": 1, "dry": true}',
                                  b'{"num_engines": 9223372036854775808}', b'{"num_engines": -1}',
                                  b'{"num_engines": 1, "drain_timeout_s": 1e300}'])
def test_scale_in_bad_requests_are_400(body):
    async def test(client, fleet, manager):
        response = await client.post("/v1/engines/scale_in", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert fleet.drained == [] and manager.ops() == []

    run_app(test)


@pytest.mark.parametrize("body", [b'{"num_engines": 9223372036854775808}', b'{"num_engines": 2000}',
                                  b'{"num_engines": 2, "timeout_s": 0}',
                                  b'{"engine_urls": ' + json.dumps(["http://127.0.0.1:1"] * 1100).encode() + b'}'])
def test_scale_out_numbers_past_their_bounds_are_400_not_500(body):
    async def test(client, fleet, manager):
        response = await client.post("/v1/engines/scale_out", content=body,
                                     headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert manager.ops() == []

    run_app(test)


def test_not_json_is_400():
    async def test(client, fleet, manager):
        response = await client.post("/v1/engines/scale_in", content=b"{nope",
                                     headers={"content-type": "application/json"})
        assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]

    run_app(test)


def test_partial_and_total_failure():
    async def test(client, fleet, manager):
        fleet.fail_next = ["no GPU left"]
        record = await settled(client, (await client.post("/v1/engines/scale_out", json={"num_engines": 4})).json()[
            "op_id"])
        assert record["state"] == "COMPLETED" and len(record["engine_ids"]) == 1
        assert len(record["failed"]) == 1 and "no GPU left" in record["failed"][0]["error"]
        assert "no GPU left" in record["error"]
        fleet.fail_next = ["health check failed"]
        record = await settled(client, (await client.post("/v1/engines/scale_out", json={"num_engines": 4})).json()[
            "op_id"])
        assert record["state"] == "FAILED" and record["engine_ids"] == [] and "health check" in record["error"]
        assert len(fleet.engines()) == 3

    run_app(test)


def test_start_timeout_cancels_the_engine():
    async def test(client, fleet, manager):
        fleet.gate = asyncio.Event()  # never set: the engine never comes up
        response = await client.post("/v1/engines/scale_out", json={"num_engines": 3, "timeout_s": 0.05})
        record = await settled(client, response.json()["op_id"])
        assert record["state"] == "FAILED" and "within 0.05 s" in record["failed"][0]["error"]
        assert "STARTING" in record["failed"][0]["error"]
        assert fleet.cancelled == ["e2"] and len(fleet.engines()) == 2

    run_app(test)


def test_one_operation_at_a_time():
    async def test(client, fleet, manager):
        fleet.gate = asyncio.Event()
        first = (await client.post("/v1/engines/scale_out", json={"num_engines": 3})).json()
        for path, body in (("/v1/engines/scale_out", {"num_engines": 5}), ("/v1/engines/scale_in", {"num_engines": 1})):
            busy = await client.post(path, json=body)
            assert busy.status_code == 409
            refusal = busy.json()["error"]
            assert refusal["running_op_id"] == first["op_id"] and first["op_id"] in refusal["message"]
        assert (await client.get("/v1/status")).json()["running_op_id"] == first["op_id"]
        dry = await client.post("/v1/engines/scale_in", json={"num_engines": 1, "dry_run": True})
        assert dry.status_code == 200 and dry.json()["state"] == "DRY_RUN"  # a dry run changes nothing: allowed
        fleet.gate.set()
        assert (await settled(client, first["op_id"]))["state"] == "COMPLETED"
        assert (await client.post("/v1/engines/scale_out", json={"num_engines": 4})).status_code == 202

    run_app(test)


def test_idempotency_key_returns_the_first_operation():
    async def test(client, fleet, manager):
        fleet.gate = asyncio.Event()
        key = {"Idempotency-Key": "deploy-42"}
        first = await client.post("/v1/engines/scale_out", json={"num_engines": 3}, headers=key)
        assert first.status_code == 202
        retry = await client.post("/v1/engines/scale_out", json={"num_engines": 3}, headers=key)
        assert retry.status_code == 200 and retry.json()["op_id"] == first.json()["op_id"]  # not 409: the same op
        other = await client.post("/v1/engines/scale_out", json={"num_engines": 5}, headers=key)
        assert other.status_code == 400 and "different request" in other.json()["error"]["message"]
        fleet.gate.set()
        await settled(client, first.json()["op_id"])
        after = await client.post("/v1/engines/scale_out", json={"num_engines": 3}, headers=key)
        assert after.status_code == 200 and after.json()["state"] == "COMPLETED"
        assert len(manager.ops()) == 1 and len(fleet.engines()) == 3

    run_app(test)


def test_cancel_while_starting_then_refused_after_the_end():
    async def test(client, fleet, manager):
        fleet.gate = asyncio.Event()
        op_id = (await client.post("/v1/engines/scale_out", json={"num_engines": 4})).json()["op_id"]
        await asyncio.sleep(0.01)
        assert (await client.get(f"/v1/ops/{op_id}")).json()["state"] == "STARTING"
        response = await client.post(f"/v1/ops/{op_id}/cancel")
        assert response.status_code == 200
        record = response.json()
        assert record["state"] == "CANCELLED" and record["engine_ids"] == []
        assert sorted(fleet.cancelled) == ["e2", "e3"] and len(fleet.engines()) == 2  # the fleet cleaned up
        assert {p["state"] for p in record["progress"]} == {"CANCELLED"}
        again = await client.post(f"/v1/ops/{op_id}/cancel")
        assert again.status_code == 409 and "CANCELLED" in again.json()["error"]["message"]
        done = (await client.post("/v1/engines/scale_out", json={"num_engines": 3})).json()["op_id"]
        fleet.gate.set()
        await settled(client, done)
        assert (await client.post(f"/v1/ops/{done}/cancel")).status_code == 409
        assert (await client.post("/v1/ops/op-nope/cancel")).status_code == 404
        assert (await client.get("/v1/ops/op-nope")).status_code == 404

    run_app(test)


def test_cancel_while_pending():
    async def test(client, fleet, manager):
        result = await manager.scale_out(num_engines=3)
        record = await manager.cancel(result.record["op_id"])  # before its task ever ran
        assert record["state"] == "CANCELLED" and len(fleet.engines()) == 2 and fleet.cancelled == []

    run_app(test)


def test_scale_in_removes_the_newest_first():
    async def test(client, fleet, manager):
        await settled(client, (await client.post("/v1/engines/scale_out", json={"num_engines": 4})).json()["op_id"])
        fleet.views["e1"].added_at = 5000.0  # the newest now: LIFO by added_at, not by id
        response = await client.post("/v1/engines/scale_in", json={"num_engines": 2})
        assert response.status_code == 202 and response.json()["kind"] == "scale_in"
        record = await settled(client, response.json()["op_id"])
        assert record["state"] == "COMPLETED" and sorted(record["engine_ids"]) == ["e1", "e3"]
        assert sorted(fleet.drained) == ["e1", "e3"] and sorted(fleet.removed) == ["e1", "e3"]
        assert record["aborted"] == {"e1": 0, "e3": 0}
        assert [e.engine_id for e in fleet.engines()] == ["e0", "e2"]
        noop = await client.post("/v1/engines/scale_in", json={"num_engines": 2})
        assert noop.status_code == 200 and noop.json()["state"] == "NOOP"

    run_app(test)


def test_scale_in_never_below_the_minimum_nor_unknown_ids():
    async def test(client, fleet, manager):
        low = await client.post("/v1/engines/scale_in", json={"num_engines": 1})
        assert low.status_code == 400 and "min_engines: 2" in low.json()["error"]["message"]
        both = await client.post("/v1/engines/scale_in", json={"engine_ids": ["e0"]})
        assert both.status_code == 400 and "min_engines: 2" in both.json()["error"]["message"]
        unknown = await client.post("/v1/engines/scale_in", json={"engine_ids": ["e9"]})
        assert unknown.status_code == 400 and "e9" in unknown.json()["error"]["message"]
        assert fleet.drained == [] and manager.ops() == []

    run_app(test, min_engines=2)


def test_drain_waits_for_inflight_requests():
    async def test(client, fleet, manager):
        fleet.views["e1"].inflight = 3

        async def finish_requests() -> None:
            while fleet.views["e1"].state != "DRAINING":
                await asyncio.sleep(0.005)
            for _ in range(3):
                await asyncio.sleep(0.01)
                fleet.views["e1"].inflight -= 1

        finishing = asyncio.ensure_future(finish_requests())
        response = await client.post("/v1/engines/scale_in", json={"engine_ids": ["e1"], "drain_timeout_s": 5})
        record = await settled(client, response.json()["op_id"])
        await finishing
        assert record["state"] == "COMPLETED" and record["aborted"] == {"e1": 0} and fleet.removed == ["e1"]
        assert fleet.views["e1"].state == "REMOVED"

    run_app(test)


def test_drain_timeout_reports_the_aborted_requests_and_force_skips_the_drain():
    async def test(client, fleet, manager):
        fleet.views["e1"].inflight = 2
        response = await client.post("/v1/engines/scale_in", json={"num_engines": 1, "drain_timeout_s": 0.05})
        record = await settled(client, response.json()["op_id"])
        assert record["state"] == "COMPLETED" and record["aborted"] == {"e1": 2} and fleet.removed == ["e1"]
        fleet.views["e0"].inflight = 4
        fleet.min_engines = 0
        response = await client.post("/v1/engines/scale_in", json={"engine_ids": ["e0"], "force": True})
        record = await settled(client, response.json()["op_id"])
        assert record["aborted"] == {"e0": 4} and fleet.drained == ["e1"] and fleet.removed == ["e1", "e0"]

    run_app(test)


def test_dry_run_changes_nothing():
    async def test(client, fleet, manager):
        response = await client.post("/v1/engines/scale_in", json={"num_engines": 1, "dry_run": True})
        assert response.status_code == 200
        body = response.json()
        assert body["state"] == "DRY_RUN" and body["engine_ids"] == ["e1"] and body["remaining"] == 1
        assert [e.state for e in fleet.engines()] == ["ACTIVE", "ACTIVE"] and manager.ops() == []
        assert fleet.drained == fleet.removed == []

    run_app(test)


def test_token_file_is_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(CONTROL_TOKEN_ENV, raising=False)
    run_dir = tmp_path / "run"
    token = resolve_control_token(run_dir, None)
    path = run_dir / "control_token"
    assert len(token) >= 32 and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_control_token(run_dir, None) == token  # a resumed run keeps its token
    assert resolve_control_token(run_dir, "configured") == "configured"
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "from-env")
    assert resolve_control_token(run_dir, None) == "from-env"
    assert path.read_text().strip() == token


def test_cli_without_a_server_says_so_in_one_line(tmp_path, capsys):
    assert main(["cluster", "status", "--run-dir", str(tmp_path)]) == 2
    assert "control.json does not exist" in capsys.readouterr().out
    assert main(["cluster", "status", "--url", "http://127.0.0.1:9", "--token", "t"]) == 1
    out = capsys.readouterr().out
    assert "cannot reach the control API at http://127.0.0.1:9" in out and "Traceback" not in out


def test_over_real_http_with_the_cli(tmp_path, capsys, monkeypatch):
    """ControlServer on loopback in this loop; `relax-gym cluster` in a thread, finding it from the run folder."""
    monkeypatch.delenv(CONTROL_TOKEN_ENV, raising=False)

    def cli(*argv: str) -> tuple[int, str]:
        code = main(["cluster", *argv])
        return code, capsys.readouterr().out

    async def go() -> None:
        fleet = FakeFleet(start_s=0.03)
        manager = ScaleManager(fleet)
        token = resolve_control_token(tmp_path, None)
        server = ControlServer(create_control_app(fleet, manager, token), run_dir=tmp_path)
        assert server.host == "127.0.0.1"
        async with server:
            assert server.url.startswith("http://127.0.0.1:") and not server.url.endswith(":0")
            assert json.loads((tmp_path / "control.json").read_text()) == {"url": server.url, "pid": os.getpid()}
            code, out = await asyncio.to_thread(cli, "status", "--run-dir", str(tmp_path))
            assert code == 0 and json.loads(out)["engines"] == {"ACTIVE": 2}
            code, out = await asyncio.to_thread(cli, "status", "--run-dir", str(tmp_path), "--token", "wrong")
            assert code == 1 and "401" in out and "control token" in out and len(out.strip().splitlines()) == 1
            code, out = await asyncio.to_thread(cli, "scale-out", "--run-dir", str(tmp_path), "--engines", "3",
                                                "--wait")
            record = json.loads(out)
            assert code == 0 and record["state"] == "COMPLETED" and record["engine_ids"] == ["e2"]
            code, out = await asyncio.to_thread(cli, "scale-in", "--url", server.url, "--token", token, "--engines",
                                                "1", "--dry-run")
            assert code == 0 and json.loads(out)["engine_ids"] == ["e2", "e1"]
            code, out = await asyncio.to_thread(cli, "scale-in", "--run-dir", str(tmp_path), "--engines", "0")
            assert code == 1 and "400" in out and "min_engines: 1" in out
            code, out = await asyncio.to_thread(cli, "ops", "--run-dir", str(tmp_path), record["op_id"])
            assert code == 0 and json.loads(out)["op_id"] == record["op_id"]
            code, out = await asyncio.to_thread(cli, "engines", "--run-dir", str(tmp_path))
            assert code == 0 and len(json.loads(out)) == 3
        assert not (tmp_path / "control.json").exists()

    asyncio.run(go())


def test_a_taken_port_is_an_error_not_an_exit(tmp_path):
    async def go() -> None:
        app = create_control_app(FakeFleet(), ScaleManager(FakeFleet()), TOKEN)
        async with ControlServer(app) as first:
            port = int(first.url.rsplit(":", 1)[1])
            with pytest.raises(OSError):
                await ControlServer(app, port=port).start()
            async with httpx.AsyncClient() as client:  # the first one still serves
                assert (await client.get(f"{first.url}/v1/health")).json() == {"ok": True}

    asyncio.run(go())
