"""`EngineRouter`: sticky episodes, least-loaded placement, exact re-send on an outage, waiting for an engine;
then two real `relax-gym serve` servers behind a router built from the config, one stopped mid-run."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.engine_doubles import FakeEngine
from support.engines import KEY, served

from relax_gym.engines import EngineGoneError, EngineRouter, EngineUnavailableError, RequestError, make_engine
from relax_gym.engines.base import API_KEY_ENV, GenerateRequest, SamplingParams
from relax_gym.models import load_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.trainer.config import ConfigError, load_rollout_config


def req(rid: str | None) -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(), rid=rid)


def served_by(router: EngineRouter, request: GenerateRequest) -> str:
    return next(name for name, engine in router.members.items() if request in getattr(engine, "seen", ()))


def test_episodes_stick_and_new_ones_go_to_the_least_loaded():
    async def run():
        a, b = FakeEngine(), FakeEngine()
        router = EngineRouter({"b": b, "a": a})
        a.gate, b.gate = asyncio.Event(), asyncio.Event()
        first = [asyncio.create_task(router.generate(req(f"g#0/{m}/0"))) for m in range(2)]
        await asyncio.sleep(0)
        assert (len(a.seen), len(b.seen)) == (1, 1)  # ties by name, then the one with nothing in flight
        assert router.stats()["members"]["a"]["inflight"] == 1
        a.gate.set(), b.gate.set()
        await asyncio.gather(*first)
        owner = {m: served_by(router, t) for m, t in ((0, a.seen[0]), (1, b.seen[0]))}
        for turn in (1, 2):
            for member in (0, 1):
                request = req(f"g#0/{member}/{turn}")
                await router.generate(request)
                assert served_by(router, request) == owner[member]
        anonymous = req(None)
        await router.generate(anonymous)
        assert served_by(router, anonymous) == "a"
        stats = router.stats()
        assert stats["members"]["a"]["served"] == 4 and stats["members"]["b"]["served"] == 3
        assert stats["episodes"] == 2 and stats["failovers"] == 0

    asyncio.run(run())


@pytest.mark.parametrize("error", [EngineGoneError("actor died"), EngineUnavailableError("503 for 2 s"),
                                   httpx.ConnectError("refused"), ConnectionResetError("reset"), OSError("gone")])
def test_an_outage_re_sends_the_same_request_elsewhere(error):
    async def run():
        a, b = FakeEngine(), FakeEngine()
        router = EngineRouter({"a": a, "b": b}, retry_down_after_s=60)
        a.fail = error
        request = req("g#0/0/0")
        out = await router.generate(request)
        assert out.output_ids == [1]
        assert a.seen == [request] and b.seen[0] is request  # the very same object, whole prefix and all
        assert router.failovers == 1
        stats = router.stats()["members"]
        assert stats["a"] == {"inflight": 0, "served": 0, "failures": 1, "down": True}
        assert stats["b"]["served"] == 1 and not stats["b"]["down"]
        a.fail = None
        nxt = req("g#0/0/1")
        await router.generate(nxt)
        assert b.seen[-1] is nxt  # re-stuck to b
        fresh = req("g#1/0/0")
        await router.generate(fresh)
        assert b.seen[-1] is fresh  # a stays down for retry_down_after_s

    asyncio.run(run())


@pytest.mark.parametrize("error", [RequestError("sampling.top_p: invalid"), ValueError("a bug")])
def test_a_bad_request_or_a_bug_is_re_raised_not_failed_over(error):
    async def run():
        a, b = FakeEngine(), FakeEngine()
        router = EngineRouter({"a": a, "b": b})
        a.fail = error
        with pytest.raises(type(error)):
            await router.generate(req("g#0/0/0"))
        assert not b.seen and router.failovers == 0
        assert not router.stats()["members"]["a"]["down"]

    asyncio.run(run())


def test_a_request_waits_for_set_members_to_bring_an_engine():
    async def run():
        a, b = FakeEngine(), FakeEngine()
        a.fail = EngineGoneError("actor died")
        router = EngineRouter({"a": a}, wait_s=10, retry_down_after_s=60)
        request = req("g#0/0/0")
        task = asyncio.create_task(router.generate(request))
        await asyncio.sleep(0.05)
        assert not task.done() and router.stats()["members"]["a"]["down"]
        router.set_members({"a": a, "b": b})
        await asyncio.wait_for(task, 1)  # woken by set_members: wait_s (10 s) would not end it in time
        assert b.seen == [request] and router.failovers == 1

    asyncio.run(run())


def test_no_engine_for_wait_s_is_engine_unavailable():
    async def run():
        router = EngineRouter({}, wait_s=1.0)
        waiting = asyncio.create_task(router.generate(req("g#0/0/0")))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # it waits for an engine before giving up
        with pytest.raises(EngineUnavailableError, match=r"no live engine for 1s \(members: none\)"):
            await asyncio.wait_for(waiting, 5)
        router.wait_s = 0.2
        a = FakeEngine()
        a.fail = EngineGoneError("actor died")
        router.set_members({"a": a})
        with pytest.raises(EngineUnavailableError, match=r"members: a down\); last error: a: EngineGoneError"):
            await router.generate(req("g#0/0/0"))
        assert router.weight_version == 0

    asyncio.run(run())


def test_a_drained_member_finishes_its_call_and_the_episode_moves():
    async def run():
        a, b = FakeEngine(), FakeEngine()
        router = EngineRouter({"a": a, "b": b})
        a.gate = asyncio.Event()
        running = asyncio.create_task(router.generate(req("g#0/0/0")))
        await asyncio.sleep(0)
        router.set_members({"b": b})  # drained: no new work, the call in flight goes on
        a.gate.set()
        assert (await running).output_ids == [1] and len(a.seen) == 1
        nxt = req("g#0/0/1")
        await router.generate(nxt)
        assert b.seen == [nxt] and router.failovers == 0
        assert set(router.stats()["members"]) == {"b"} and not a.closed

    asyncio.run(run())


def test_a_down_member_is_tried_again_after_retry_down_after_s_or_when_replaced():
    async def run():
        a = FakeEngine()
        a.fail = EngineGoneError("restarting")
        router = EngineRouter({"a": a}, wait_s=5, retry_down_after_s=0.2)
        task = asyncio.create_task(router.generate(req("g#0/0/0")))
        await asyncio.sleep(0.05)
        assert router.stats()["members"]["a"]["down"] and not task.done()
        a.fail = None  # the server came back: the wait ends when the down mark expires
        await asyncio.wait_for(task, 2)  # within wait_s (5 s): woken by the mark's expiry (0.2 s)
        assert router.failovers == 1
        assert not router.stats()["members"]["a"]["down"]

        router.retry_down_after_s = 60
        a.fail = EngineGoneError("dead for good")
        b = FakeEngine()
        router.set_members({"a": a, "b": b})
        await router.generate(req("g#1/0/0"))  # a fails, b serves
        assert router.stats()["members"]["a"]["down"]
        router.set_members({"a": a, "b": b})  # the same object: still down
        assert router.stats()["members"]["a"]["down"]
        a2 = FakeEngine()
        router.set_members({"a": a2, "b": b})  # recreated: up at once, its name's counts carried on
        assert router.stats()["members"]["a"] == {"inflight": 0, "served": 1, "failures": 2, "down": False}
        request = req("g#2/0/0")
        await router.generate(request)
        assert a2.seen == [request]

    asyncio.run(run())


def test_the_sticky_map_is_bounded():
    async def run():
        router = EngineRouter({"a": FakeEngine()})
        router.MAX_EPISODES = 3
        for i in range(10):
            await router.generate(req(f"g#{i}/0/0"))
        assert router.stats()["episodes"] == 3

    asyncio.run(run())


def test_broadcasts_need_one_member_to_succeed():
    async def run():
        a, b = FakeEngine(), FakeEngine()
        router = EngineRouter({"a": a, "b": b}, retry_down_after_s=60)
        assert await router.health()
        assert (await router.connect())["members"] == ["a", "b"]
        b.fail = EngineGoneError("actor died")
        await router.update_weights({}, 3)  # b missed it: marked down, training goes on
        assert (a.version, b.version) == (3, 0) and router.stats()["members"]["b"]["down"]
        assert router.weight_version == 3  # the minimum over members that are up
        await router.pause()
        await router.resume()
        assert (await router.connect())["members"] == ["a"]
        assert await router.health()
        b.fail = None
        assert (await router.connect())["members"] == ["a", "b"]  # answering brings it back at once
        assert not router.stats()["members"]["b"]["down"] and router.weight_version == 0
        a.fail = b.fail = RequestError("update_weights: expected a folder path or a state dict")
        with pytest.raises(RequestError):
            await router.update_weights(object(), 4)
        assert not any(m["down"] for m in router.stats()["members"].values())  # a bad call downs no engine
        a.fail = b.fail = EngineGoneError("both gone")
        with pytest.raises(EngineGoneError):
            await router.connect()
        assert not await router.health()
        await router.close()
        assert a.closed and b.closed and router.members == {}
        with pytest.raises(EngineUnavailableError, match="no engines"):
            await router.pause()

    asyncio.run(run())


# --- two real servers --------------------------------------------------------------------------------


def test_config_keys_engine_url_and_engine_urls_are_exclusive():
    with pytest.raises(ConfigError, match=r"rollout.engine_url and rollout.engine_urls are mutually exclusive"):
        load_rollout_config({}, ["rollout.engine=sglang", "rollout.engine_url=http://h:1",
                                 "rollout.engine_urls=[http://h:2]"])
    with pytest.raises(ConfigError, match=r"needs rollout.engine_url or rollout.engine_urls"):
        load_rollout_config({}, ["rollout.engine=sglang"])


def test_two_servers_one_stopped_mid_run_no_episode_is_lost(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    loaded = load_model("tiny")
    with served(loaded) as one, served(loaded) as two:
        url1, url2 = one.url, two.url
        cfg = load_rollout_config({}, ["rollout.engine=sglang", f"rollout.engine_urls=[{url1}, {url2}]",
                                       "rollout.engine_outage_timeout_s=20", "rollout.max_new_tokens=12"])
        assert cfg.engine_urls == [url1, url2]
        # the first name in order gets each group's first episode: stop that one, so a failover must happen
        stopped = min(one, two, key=lambda s: s.url)
        first = stopped.url

        async def run():
            router = make_engine(loaded, cfg)
            assert isinstance(router, EngineRouter) and sorted(router.members) == sorted([url1, url2])
            manager = RolloutManager(router, loaded, sampling=cfg.sampling_params(),
                                     limits=RolloutLimits(max_turns=2, max_total_tokens=1024), sampling_seed=0)
            trajectories = []
            try:
                assert sorted((await router.connect())["members"]) == sorted([url1, url2])
                for seed in range(5):
                    if seed == 2:
                        await asyncio.to_thread(stopped.stop)
                    trajectories += await manager.run_group("relax/Arithmetic-v0", seed, 2)
                return trajectories, router.stats()
            finally:
                await manager.close()
                await router.close()

        trajectories, stats = asyncio.run(run())
    assert len(trajectories) == 10
    assert all(t.status in ("completed", "truncated") for t in trajectories), [
        (t.status, t.status_reason) for t in trajectories]
    assert stats["failovers"] >= 1
    assert stats["members"][first]["failures"] >= 1
    other = url2 if first == url1 else url1
    assert stats["members"][other]["served"] >= 6  # after the stop, every episode went to the live server
