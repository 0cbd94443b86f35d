"""Resuming never runs code planted in a checkpoint, and a checkpoint still restores everything exactly.

A run folder is what people share. Each pickle-based file of a checkpoint gets
a payload (a pickled object whose unpickling runs `touch MARKER`), its manifest
is fixed so that only the payload is tested, and the checkpoint is resumed: the
marker must not appear, and the error must name the file.
"""

from __future__ import annotations

import os
import pickle
import random
import shlex
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.megatron_scripts.common import MEGATRON_WARNINGS

from relax_gym.cli import main
from relax_gym.errors import StartupError
from relax_gym.models import load_model
from relax_gym.trainer.backends import MicroBatch, Sample, TorchBackend
from relax_gym.trainer.checkpoint import CheckpointManager, write_manifest
from relax_gym.trainer.safe_load import UnsafeCheckpointError, safe_load

pytestmark = [pytest.mark.filterwarnings(f) for f in MEGATRON_WARNINGS]

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "checkpoints" / "tiny-arithmetic"
REFUSAL = "refusing to unpickle it"
#: what a training loop puts in `extra` (trainer/loop.py `_checkpoint`), int-keyed histogram included
LOOP_EXTRA = {
    "step": 3, "next_task": 14, "unfinished": [9, 12, 13], "filtered_total": 2,
    "bus": {"started": 15, "discarded": 2, "dropped_stale": 1, "filtered": 1,
            "staleness_histogram": {0: 5, 1: 3, 2: 1}},
}


class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(file: Path, marker: Path) -> None:
    """Rewrites `file` (a dict this test's own code saved) with a payload beside its real contents."""
    contents = torch.load(file, weights_only=False)  # our own file, before the payload
    contents["planted"] = Payload(marker)
    torch.save(contents, file)


def load_error(load: Any) -> BaseException | None:
    try:
        load()
    except Exception as err:
        return err
    return None


def assert_refused(error: BaseException | None, marker: Path, file: Path) -> None:
    assert not marker.exists(), "the payload ran"
    assert isinstance(error, UnsafeCheckpointError), repr(error)
    assert str(file) in str(error) and REFUSAL in str(error)


# --- the torch backend ------------------------------------------------------------------------


def _pg_loss(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    return -(mb.logprobs * mb.advantages * mb.mask).sum() / mb.step_tokens, {}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A checkpoint folder of a tiny TorchBackend after one step (so optimizer.pt holds Adam's states)."""
    backend = TorchBackend(load_model("tiny"), lr=1e-3)
    backend.train_step([Sample(token_ids=[5, 6, 7, 8], loss_mask=[0, 1, 1, 1], rollout_logprobs=[0.0] * 4,
                               advantage=1.0)], _pg_loss)
    folder = tmp_path / "ckpt"
    backend.save_checkpoint(folder, dict(LOOP_EXTRA))
    return folder


@pytest.mark.parametrize("name", ["trainer_state.pt", "optimizer.pt"])
def test_a_payload_in_a_torch_checkpoint_file_never_runs(saved: Path, tmp_path: Path, name: str) -> None:
    marker = tmp_path / "MARKER"
    plant(saved / name, marker)
    backend = TorchBackend(load_model("tiny"), lr=1e-3)
    assert_refused(load_error(lambda: backend.load_checkpoint(saved)), marker, saved / name)
    assert backend.version == 0


@pytest.mark.parametrize("name", ["trainer_state.pt", "optimizer.pt"])
def test_resuming_a_run_with_a_planted_payload_stops_and_names_the_file(capsys, tmp_path: Path, name: str) -> None:
    """The real resume path, `relax-gym train` on the run folder: one line, exit 2, no fall back to step 1."""
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    config = tmp_path / "cfg.yaml"
    config.write_text(f"run_dir: {run}\nmodel: {WARM_START}\nenvs: [{{id: relax/Arithmetic-v0, kwargs: {{digits: 1}}}}]"
                      "\nrollout: {group_size: 2, groups_per_step: 2, max_new_tokens: 4, max_turns: 1}\n"
                      "trainer: {total_steps: 2, checkpoint_every: 1, lr: 1.0e-3}\n")
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    step_2 = run / "checkpoints" / "step_2"
    plant(step_2 / name, marker)
    write_manifest(step_2)  # the manifest matches: only the payload is tested

    code = main(["train", str(config), "trainer.total_steps=3"])
    out = capsys.readouterr()
    out = out.out + out.err
    assert not marker.exists(), "the payload ran"
    assert code == 2, out
    assert str(step_2 / name) in out and REFUSAL in out and "Traceback" not in out
    assert f"resuming {run}" not in out  # the older step_1 is not silently resumed instead
    assert not (run / "checkpoints" / "step_3").exists()


def _old_format_state(folder: Path) -> None:
    """trainer_state.pt as relax_gym wrote it before: numpy's RNG state pickled as it is (an ndarray)."""
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    state["rng"]["numpy"] = np.random.get_state()
    torch.save(state, folder / "trainer_state.pt")


def test_a_checkpoint_of_an_older_relax_gym_is_refused_by_name(tmp_path: Path) -> None:
    backend = TorchBackend(load_model("tiny"), lr=1e-3)
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(backend, 1, {"step": 1})
    manager.save(backend, 2, {"step": 2})
    step_2 = manager.folder(2)
    _old_format_state(step_2)
    write_manifest(step_2)

    # megatron-core registers numpy arrays as weights_only-safe when imported: the allow-list is our own regardless
    keys = np.random.get_state()[1]
    np_globals = [keys.__reduce__()[0], np.ndarray, np.dtype, type(keys.dtype)]
    with torch.serialization.safe_globals(np_globals):
        error = load_error(lambda: safe_load(step_2 / "trainer_state.pt"))
        with pytest.raises(StartupError) as startup:
            manager.load_latest(backend)  # and no fall back to step_1
    assert isinstance(error, UnsafeCheckpointError) and "numpy" in str(error), repr(error)
    message = str(startup.value)
    assert str(step_2 / "trainer_state.pt") in message and REFUSAL in message and "numpy" in message
    assert "older relax_gym" in message and "start the run afresh" in message


@pytest.mark.parametrize("how", ["torch.save, protocol 4", "a bare pickle"])
def test_payloads_in_other_encodings_are_refused(tmp_path: Path, how: str) -> None:
    file, marker = tmp_path / "trainer_state.pt", tmp_path / "MARKER"
    contents = {"version": 1, "planted": Payload(marker)}
    if how == "a bare pickle":
        file.write_bytes(pickle.dumps(contents))
    else:
        torch.save(contents, file, pickle_protocol=4)  # STACK_GLOBAL: a global named at run time
    assert_refused(load_error(lambda: safe_load(file)), marker, file)


def test_extra_that_is_not_plain_data_fails_when_saved(tmp_path: Path) -> None:
    backend = TorchBackend(load_model("tiny"), lr=1e-3)
    with pytest.raises(ValueError, match=r"trainer_state\.pt: would hold .*numpy"):
        backend.save_checkpoint(tmp_path / "ckpt", {"step": np.int64(3)})


def test_a_checkpoint_restores_every_rng_state_and_extra_exactly(tmp_path: Path) -> None:
    backend = TorchBackend(load_model("tiny"), lr=1e-3)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # numpy caches the second Gaussian of a pair: its state has has_gauss = 1
    random.gauss(0, 1)  # and python's caches one too
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    backend.save_checkpoint(tmp_path / "ckpt", LOOP_EXTRA)
    random.random()  # move every generator on
    np.random.rand()
    torch.rand(1)

    extra = TorchBackend(load_model("tiny"), lr=1e-3, seed=7).load_checkpoint(tmp_path / "ckpt")
    assert extra == LOOP_EXTRA
    assert list(extra["bus"]["staleness_histogram"]) == [0, 1, 2]  # int keys stay ints
    assert random.getstate() == states[0]
    numpy_state = np.random.get_state()
    assert numpy_state[0] == states[1][0] and np.array_equal(numpy_state[1], states[1][1])
    assert numpy_state[1].dtype == np.uint32 and numpy_state[2:] == states[1][2:] and numpy_state[3] == 1
    assert torch.equal(torch.get_rng_state(), states[2])


# --- the megatron backend (skipped without the megatron extra) ---------------------------------


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A factory of tiny MegatronBackends (TP=1, in-process), and a checkpoint of one after a step."""
    pytest.importorskip("megatron.core", reason="needs the megatron extra", exc_type=ImportError)
    from support.megatron_scripts.common import loss_fn, make_samples

    from relax_gym.trainer.backends.megatron import MegatronBackend

    def make() -> MegatronBackend:
        return MegatronBackend(load_model("tiny").model, lr=1e-2, micro_batch_tokens=40)

    backend = make()
    backend.train_step(make_samples(), loss_fn)
    np.random.seed(4)
    np.random.standard_normal()  # a cached Gaussian in numpy's state too
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    folder = tmp_path_factory.mktemp("megatron") / "ckpt"
    backend.save_checkpoint(folder, LOOP_EXTRA)
    return {"make": make, "folder": folder, "states": states}


@pytest.mark.parametrize("name", ["meta.pt", "model_tp0_pp0.pt", "rank00000.pt"])
def test_a_payload_in_a_megatron_checkpoint_file_never_runs(megatron, tmp_path: Path, name: str) -> None:
    tampered, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    shutil.copytree(megatron["folder"], tampered)
    plant(tampered / name, marker)
    backend = megatron["make"]()
    assert_refused(load_error(lambda: backend.load_checkpoint(tampered)), marker, tampered / name)


def test_a_megatron_checkpoint_restores_extra_and_rng_states(megatron) -> None:
    backend = megatron["make"]()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    assert backend.load_checkpoint(megatron["folder"]) == LOOP_EXTRA and backend.version == 1
    python, numpy_state, torch_state = megatron["states"]
    assert random.getstate() == python
    restored = np.random.get_state()
    assert restored[0] == numpy_state[0] and np.array_equal(restored[1], numpy_state[1])
    assert restored[2:] == numpy_state[2:] and restored[3] == 1
    assert torch.equal(torch.get_rng_state(), torch_state)
