"""`cpu:` pins the embedded engine's worker thread and the trainer's thread, each to its own cores."""

from __future__ import annotations

import os
import threading

import pytest

from relax_gym.cpu_threads import ThreadPlacement
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
