"""The staleness guarantee of the data bus under random rollout and training latencies.

The producer here is a stand-in for the rollout manager (it measures the bus,
not a model): each group takes several turns with random latency, and every
turn's tokens carry the version the weights had at that moment, as the real
engine reports them. An end-to-end test with the real trainer lives in
test_train_loop.py.
"""

import asyncio
import random

import pytest

from relax_gym.trainer.databus import DataBus, group_staleness
from relax_gym.trajectory import Trajectory


def trajectory(versions: list[int], seed: int, reward: float = 0.0) -> Trajectory:
    n = len(versions)
    return Trajectory(token_ids=[1] * (n + 1), prompt_len=1, loss_mask=[0] + [1] * n,
                      rollout_logprobs=[0.0] + [-1.0] * n, versions=[-1, *versions], reward=reward,
                      step_rewards=[reward], status="completed", seed=seed)


async def simulate(k: int, groups_per_step: int, steps: int, seed: int, keep=None):
    rng = random.Random(seed)
    bus = DataBus(groups_per_step, k, keep=keep)
    trained: list[int] = []
    admitted_at: list[int] = []

    async def episode(task: int) -> None:
        versions = []
        for _ in range(rng.randint(1, 4)):  # turns
            await asyncio.sleep(rng.random() * 0.004)
            versions += [bus.version] * rng.randint(1, 3)
        await bus.put([trajectory(versions, task, reward=float(rng.random() < 0.5))])

    async def produce() -> None:
        task = 0
        jobs = []
        while await bus.admit():
            admitted_at.append(bus.version)
            jobs.append(asyncio.create_task(episode(task)))
            task += 1
        for j in jobs:
            j.cancel()

    producer = asyncio.create_task(produce())
    for _ in range(steps):
        batch = await bus.take()
        trained += [group_staleness(g, bus.version) for g in batch]
        await asyncio.sleep(rng.random() * 0.006)  # training
        await bus.advance(bus.version + 1)
    await bus.close()
    await producer
    return bus, trained, admitted_at


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_trained_group_exceeds_k(k, seed):
    bus, trained, _ = asyncio.run(simulate(k, groups_per_step=4, steps=12, seed=seed))
    assert len(trained) == 12 * 4
    assert max(trained) <= k
    assert sum(bus.staleness_histogram.values()) == len(trained)
    if k == 0:
        assert bus.dropped_stale == 0  # admission alone keeps k = 0 on-policy


def test_k0_admits_one_step_of_groups_per_version():
    _, _, admitted_at = asyncio.run(simulate(0, groups_per_step=3, steps=5, seed=0))
    # exactly 3 groups start under each version: the synchronous schedule
    assert admitted_at[:15] == [v for v in range(5) for _ in range(3)]


def test_larger_k_lets_rollouts_run_ahead():
    _, _, admitted_at = asyncio.run(simulate(2, groups_per_step=2, steps=4, seed=0))
    assert admitted_at[:6] == [0] * 6  # (0 + 2 + 1) * 2 groups before the first step


def test_filtered_groups_free_their_slot_so_the_trainer_never_starves():
    keep = lambda group: group[0].reward > 0.5  # noqa: E731  (drops about half the groups)
    bus, trained, _ = asyncio.run(simulate(0, groups_per_step=2, steps=6, seed=3, keep=keep))
    assert len(trained) == 12 and bus.filtered > 0
    assert max(trained) == 0


def test_a_group_that_is_too_stale_is_dropped_and_counted():
    async def run():
        bus = DataBus(1, 0)
        await bus.admit()
        await bus.advance(3)  # the weights moved on while the group was out
        await bus.put([trajectory([0, 0], seed=0)])
        await bus.admit()
        await bus.put([trajectory([3], seed=1)])
        batch = await bus.take()
        return bus, batch

    bus, batch = asyncio.run(run())
    assert bus.dropped_stale == 1 and batch[0][0].seed == 1


def test_closing_the_bus_ends_a_waiting_consumer():
    async def run():
        bus = DataBus(2, 0)
        waiter = asyncio.create_task(bus.take())
        await asyncio.sleep(0)
        await bus.close()
        with pytest.raises(EOFError):
            await waiter

    asyncio.run(run())


def test_restored_counters_admit_what_the_uninterrupted_bus_would():
    async def run() -> tuple[int, int]:
        bus = DataBus(groups_per_step=2, max_staleness=1)
        admitted = 0
        while admitted < 4:  # (0 + 1 + 1) * 2 groups may start at version 0
            assert await bus.admit()
            admitted += 1
        for task in range(2):
            await bus.put([trajectory([0], task)])
        assert len(await bus.take()) == 2
        state = bus.state()
        # a new process resumes at version 1 with the 2 started-but-untrained groups to play again
        resumed = DataBus(groups_per_step=2, max_staleness=1)
        resumed.restore(state, version=1, unfinished=2)
        starts = 0
        while resumed._may_start():
            assert await resumed.admit()
            starts += 1
        bus.version = 1
        fresh = 0
        while bus._may_start():
            assert await bus.admit()
            fresh += 1
        return starts, fresh

    starts, fresh = asyncio.run(run())
    assert starts == fresh + 2  # the same new admissions, plus the two lost in flight


def test_a_failed_producer_ends_take_with_its_error():
    async def run() -> None:
        bus = DataBus(groups_per_step=2, max_staleness=0)
        await bus.put([trajectory([0], 0)])
        await bus.fail(RuntimeError("env broke"))
        assert not await bus.admit()
        with pytest.raises(RuntimeError, match="env broke"):
            await bus.take()

    asyncio.run(run())


def test_a_take_at_the_next_version_before_advancing_takes_what_it_would_after():
    """The trainer takes its next step's groups while it trains the current one: the same groups and the same
    counters as a take after `advance`."""
    keep = lambda group: group[0].reward > 0.5  # noqa: E731
    arrivals = [[trajectory([0], 0, reward=1.0)],  # stale at version 2 (k = 1)
                [trajectory([1], 1, reward=0.0)],  # filtered
                [trajectory([2], 2, reward=1.0)],
                [trajectory([1], 3, reward=1.0)],
                [trajectory([2], 4, reward=1.0)]]  # left for the step after

    async def run() -> tuple[DataBus, DataBus, list, list]:
        early, late = DataBus(2, 1, keep=keep), DataBus(2, 1, keep=keep)
        for bus in (early, late):
            await bus.advance(1)
            for group in arrivals:
                await bus.put(group)
        ahead = await early.take(version=2)
        await late.advance(2)
        return early, late, ahead, await late.take()

    early, late, ahead, taken = asyncio.run(run())
    assert [g[0].seed for g in ahead] == [g[0].seed for g in taken] == [2, 3]
    assert early.state() == late.state() and early.state()["dropped_stale"] == early.state()["filtered"] == 1
    assert [g[0].seed for g in early._ready] == [4] and early.version == 1
