"""`cpu:` pins the embedded engine's worker thread and the trainer's thread, each to its own cores."""

from __future__ import annotations

import os
import threading
import time

import pytest

from relax_gym.cpu.threads import ThreadPlacement
from relax_gym.engines import EmbeddedEngine
from relax_gym.models import load_model
from relax_gym.trainer.config import ConfigError, load_config

CORE = min(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A thread's `torch.set_num_threads` also becomes the count of threads started after it: put it back."""
    import torch

    count = torch.get_num_threads()
    yield
    restore = threading.Thread(target=torch.set_num_threads, args=(count,))
    restore.start()
    restore.join()


def test_a_placement_pins_only_the_thread_that_applies_it():
    before = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def role() -> None:
        ThreadPlacement((CORE,), 1).apply()
        seen["role"] = os.sched_getaffinity(0)
        import torch

        seen["threads"] = {torch.get_num_threads()}

    thread = threading.Thread(target=role)
    thread.start()
    thread.join()
    assert seen == {"role": {CORE}, "threads": {1}} and os.sched_getaffinity(0) == before


def test_the_engine_worker_runs_on_its_cores():
    engine = EmbeddedEngine(load_model("tiny"), placement=ThreadPlacement((CORE,)))
    try:
        assert os.sched_getaffinity(engine._worker.native_id) == {CORE}
    finally:
        import asyncio

        asyncio.run(engine.close())


def test_the_trainer_thread_is_placed_and_unknown_cores_are_refused(tmp_path):
    from relax_gym.trainer.loop import Trainer

    overrides = [f"run_dir={tmp_path / 'run'}", "envs=[{id: relax/Arithmetic-v0}]", "rollout.max_turns=1",
                 f"cpu.trainer.cores=[{CORE}]", "cpu.trainer.threads=1"]
    trainer = Trainer(load_config(None, overrides))
    try:
        assert trainer._trainer_thread.submit(os.sched_getaffinity, 0).result() == {CORE}
    finally:
        trainer._trainer_thread.shutdown()
        import asyncio

        asyncio.run(trainer._close_engine())
    with pytest.raises(ConfigError, match=r"cpu\.engine\.cores"):
        load_config(None, [*overrides[:3], "cpu.engine.cores=[4096]"])


def _threads_of_this_process() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_thread_that_stops_computing_ends_its_openmp_workers():
    """libgomp keeps a thread's workers after a parallel op; released, they end, and the next op starts new ones."""
    import torch

    from relax_gym.cpu.threads import _libgomp, release_openmp_workers

    if _libgomp() is None:
        pytest.skip("this torch does not run on libgomp (not a Linux wheel)")
    seen: dict[str, int | bool] = {}

    def role() -> None:
        torch.set_num_threads(2)
        before = _threads_of_this_process()
        big = torch.ones(1 << 22)
        big.mul_(2)  # above torch's grain: a parallel region, so a pool
        seen["with workers"] = _threads_of_this_process() - before
        seen["released"] = release_openmp_workers()
        seen["after"] = _threads_of_this_process() - before
        big.mul_(2)
        seen["again"] = _threads_of_this_process() - before
        release_openmp_workers()

    thread = threading.Thread(target=role)
    thread.start()
    thread.join()
    assert seen == {"with workers": 1, "released": True, "after": 0, "again": 1}


def test_the_engine_worker_and_the_thread_that_built_it_let_their_workers_go(monkeypatch):
    """The engine's thread when it goes idle, and the building thread once the worker computes (`cpu_threads`)."""
    import asyncio

    from relax_gym.engines import GenerateRequest, SamplingParams, embedded, scheduler

    callers: list[str] = []
    for module in (embedded, scheduler):  # the builder's call, and the worker's
        monkeypatch.setattr(module, "release_openmp_workers", lambda: callers.append(threading.current_thread().name))
    engine = EmbeddedEngine(load_model("tiny"))

    def worker_calls(count: int) -> None:
        deadline = time.monotonic() + 30
        while callers.count(engine._worker.name) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        worker_calls(1)  # idle from the start
        asyncio.run(engine.generate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2))))
        worker_calls(2)  # idle again after the request
    finally:
        asyncio.run(engine.close())
    assert callers.count(threading.current_thread().name) == 1  # the builder's, whenever the worker's first came
    assert callers.count(engine._worker.name) == 2
