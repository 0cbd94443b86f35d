"""SGLang's `serialized_named_tensors` (`relax_gym.engines.tensor_ipc`): a state dict shared by one process is
read by another without copies through the payload, the sender's own tensors stay private, the pickle uses only
what SGLang's `SafeUnpickler` allows, and the receiving side refuses anything but shared named tensors."""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from relax_gym.engines import tensor_ipc

#: the globals SGLang 0.5.23's `SafeUnpickler.ALLOWED_GLOBALS` (sglang/srt/utils/common.py) lets a CPU or CUDA
#: tensor pickle name, beside dtypes and storage classes: what our payload may use so that SGLang opens it
SGLANG_ALLOWED = {
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch.nn.parameter", "Parameter"),
    *(("torch.multiprocessing.reductions", name) for name in (
        "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
        "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")),
}


def _weights() -> dict[str, torch.Tensor]:
    embed = torch.randn(6, 4)
    return {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: one tensor under two names
        "model.norm.weight": torch.randn(4).to(torch.bfloat16),
        "transposed": torch.randn(3, 5).t(),  # not contiguous
        "steps": torch.arange(7),
        "empty": torch.empty(0, 4),
    }


def _globals(entry: str) -> set[tuple[str, str]]:
    """The globals the pickle names, read without calling any: a process may not open its own CUDA IPC handle
    ("invalid device context", seen on an H100), so every global is a stub that builds nothing."""
    found: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            found.add((module, name))
            return lambda *args, **kwargs: None

    Recording(io.BytesIO(base64.b64decode(entry))).load()
    return found


def test_a_state_dict_shared_by_one_process_is_read_by_another(tmp_path):
    weights = _weights()
    entries = tensor_ipc.serialize(tensor_ipc.pack(weights), tp_size=2)
    assert len(entries) == 2 and entries[0] == entries[1]
    assert len(entries[0]) < 4096  # names and a segment handle, not the tensors' bytes
    child = ("import sys, torch; from relax_gym.engines import tensor_ipc; "
             "got = {k: v.clone() for k, v in tensor_ipc.load(sys.stdin.read()).items()}; "
             f"torch.save(got, {str(tmp_path / 'got.pt')!r})")
    done = subprocess.run([sys.executable, "-c", child], input=entries[1], text=True, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    got = torch.load(tmp_path / "got.pt")
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_the_senders_tensors_stay_private_and_the_pickle_is_one_sglang_opens():
    weights = _weights()
    packed = tensor_ipc.pack(weights)
    entry = tensor_ipc.serialize(packed)[0]
    assert not any(t.is_shared() for t in weights.values())  # copies went to shared memory, not the model's own
    assert len({t.untyped_storage().data_ptr() for _, t in packed}) == 1  # one segment for the whole state dict
    dtypes = {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
    assert _globals(entry) <= SGLANG_ALLOWED | dtypes


def _pickled(obj: object, pickler: type[pickle.Pickler] = pickle.Pickler) -> str:
    buffer = io.BytesIO()
    pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


class _Forged:
    """Unpickles as `rebuild_storage_filename` on `handle` through the manager socket `manager`."""

    def __init__(self, manager: bytes, handle: bytes) -> None:
        self.manager, self.handle = manager, handle

    def __reduce__(self):
        from torch.multiprocessing import reductions

        return reductions.rebuild_storage_filename, (torch.UntypedStorage, self.manager, self.handle, 8)


MANAGER = b"/tmp/torch-shm-dir-Ab12/manager.sock"


@pytest.mark.parametrize(("entry", "message"), [
    (_pickled([("x", os.system)]), r"posix\.system is not allowed"),
    (_pickled(_Forged(MANAGER, b"/etc_passwd")), r"b'/etc_passwd' is not a segment torch shares"),
    (_pickled(_Forged(b"/run/docker.sock", b"/torch_1_2_3")), r"b'/run/docker.sock' is not the socket of torch"),
    (_pickled([("x", torch.ones(2))], ForkingPickler), r"shared by file descriptor.*file_system"),
    (_pickled({"x": 1}), r"not a list of \(name, tensor\) pairs"),
    ("!!", r"not a pickle"),
])
def test_anything_but_shared_named_tensors_is_refused(entry, message):
    with pytest.raises(ValueError, match=message):
        tensor_ipc.load(entry)


def test_a_later_state_dict_of_the_same_layout_refills_the_same_segment():
    weights = _weights()
    first = tensor_ipc.pack(weights)
    later = {name: tensor + 1 if tensor.is_floating_point() else tensor * 2 for name, tensor in weights.items()}
    again = tensor_ipc.pack(later, into=first)
    assert again is first and all(torch.equal(view, later[name]) for name, view in again)
    other = tensor_ipc.pack({**later, "steps": torch.arange(8)}, into=first)  # another shape: a new segment
    assert other is not first and torch.equal(dict(other)["steps"], torch.arange(8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_state_dict_travels_as_cuda_ipc_handles(tmp_path):
    """GPU tensors are shared as CUDA IPC handles (no copy to the host): another process maps the same memory."""
    weights = {name: tensor.cuda() for name, tensor in _weights().items()}
    packed = tensor_ipc.pack(weights)
    assert all(t.is_cuda for _, t in packed)
    entry = tensor_ipc.serialize(packed)[0]
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in _globals(entry)
    child = ("import sys, torch; from relax_gym.engines import tensor_ipc; "
             "got = {k: v.cpu() for k, v in tensor_ipc.load(sys.stdin.read()).items()}; "
             f"torch.save(got, {str(tmp_path / 'got.pt')!r})")
    done = subprocess.run([sys.executable, "-c", child], input=entry, text=True, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = torch.load(tmp_path / "got.pt")
    assert all(torch.equal(got[name], tensor.cpu()) for name, tensor in weights.items())
