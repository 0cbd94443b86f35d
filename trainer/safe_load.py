"""Checkpoint files that load without running code from them: `safe_load`, `safe_save`, plain RNG states.

A run folder is what people share, so resuming from one must not be able to
execute code planted in it. Weights are safetensors; everything else a backend
saves (optimizer state, RNG states, the caller's `extra`) is a `torch.save`
file holding only tensors and plain data: None, bools, numbers, strings, and
lists, tuples and dicts of them. `safe_load` reads such a file and refuses any
other, with `UnsafeCheckpointError`, without unpickling it:

1. the pickle inside the archive is read as opcodes, not run, and every global
   it would import must be in `ALLOWED_GLOBALS`: the tensor rebuild function,
   `OrderedDict` (state dicts) and torch's storage types. The list is ours on
   purpose: `torch.load(weights_only=True)` alone also accepts whatever the
   process registered with `torch.serialization.add_safe_globals`, and merely
   importing megatron-core registers numpy arrays, `BytesIO`,
   `argparse.Namespace`, `PosixPath` and more;
2. only then is it loaded, with `torch.load(weights_only=True)`: torch's own
   restricted unpickler, which calls no global it does not allow either.

`safe_save` writes with `torch.save` and checks the file the same way, so a
checkpoint that could not be resumed (say, a numpy scalar in `extra`) fails
when it is written rather than when the run resumes.
"""

from __future__ import annotations

import pickle
import pickletools
import re
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

#: every global a checkpoint's pickle may name (besides torch's storage types, `_STORAGE`)
ALLOWED_GLOBALS = frozenset({
    "torch._utils._rebuild_tensor_v2",  # every tensor
    "collections.OrderedDict",  # state dicts, and the tensor rebuild's (empty) backward hooks
})
_STORAGE = re.compile(r"torch\.[A-Za-z0-9]+Storage")  # a tensor's storage type: a dtype, nothing callable
#: opcodes that name a global at run time, from the stack or copyreg's registry; torch.save never writes them
_DYNAMIC_GLOBALS = frozenset({"STACK_GLOBAL", "EXT1", "EXT2", "EXT4"})
_ZIP_MAGIC = b"PK\x03\x04"  # what torch.save has written since torch 1.6, and what torch.load checks for
#: weights_only could be bypassed before this version (CVE-2025-32434)
_MIN_TORCH = (2, 6)


class UnsafeCheckpointError(Exception):
    """A checkpoint file would import something other than tensors and plain data; it was not unpickled."""


def _refusal(path: Path, why: str) -> str:
    return (f"{path}: refusing to unpickle it, as that could run code from the file: {why}. A relax_gym checkpoint "
            "holds only tensors, None, bools, numbers, strings and lists / tuples / dicts of them; this file was "
            "written by an older relax_gym (before checkpoints were made safe to load) or has been tampered with")


def _pickled_globals(pickled: bytes) -> set[str]:
    """`module.name` of every global the pickle would import, found by reading its opcodes without running them."""
    names = set()
    for opcode, arg, _ in pickletools.genops(pickled):
        if opcode.name in ("GLOBAL", "INST"):  # arg: "module name"
            names.add(str(arg).replace(" ", ".", 1))
        elif opcode.name in _DYNAMIC_GLOBALS:
            names.add(f"<a global named by {opcode.name}>")
    return names


def _disallowed(path: Path, opened: Any) -> list[str]:
    """The globals of `opened` (a torch.save archive) outside the allow-list; raises if it is no such archive."""
    if opened.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
        raise UnsafeCheckpointError(_refusal(path, "it is not the zip archive torch.save writes, so it may be a bare "
                                                   "pickle"))
    opened.seek(0)
    try:  # the archive reader torch.load itself uses, so both read the same data.pkl
        pickled = torch._C.PyTorchFileReader(opened).get_record("data.pkl")
    except RuntimeError as err:
        raise ValueError(f"{path}: not a readable torch.save archive ({str(err).splitlines()[0]})") from None
    try:
        found = _pickled_globals(pickled)
    except Exception as err:  # anything that cannot be checked is refused
        raise UnsafeCheckpointError(_refusal(path, f"its pickle cannot be checked ({err})")) from None
    return sorted(n for n in found if n not in ALLOWED_GLOBALS and not _STORAGE.fullmatch(n))


def _check_torch() -> None:
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if version < _MIN_TORCH:
        raise RuntimeError(f"loading a checkpoint safely needs torch >= {'.'.join(map(str, _MIN_TORCH))} (earlier "
                           "versions' weights_only loading can be made to run code); this is torch "
                           f"{torch.__version__}")


def safe_load(path: str | Path, map_location: str | torch.device | None = None) -> Any:
    """A `torch.save` file's contents, if it holds only tensors and plain data; else `UnsafeCheckpointError`.

    Nothing from a refused file is unpickled. Other damage (a truncated archive)
    raises ValueError or torch's own error, as any unreadable file would.
    """
    _check_torch()
    path = Path(path)
    with path.open("rb") as opened:  # one open file for the check and the load
        bad = _disallowed(path, opened)
        if bad:
            raise UnsafeCheckpointError(_refusal(path, f"it would import {', '.join(bad)}"))
        opened.seek(0)
        try:
            return torch.load(opened, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:  # what the check above let through and torch's unpickler did not
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UnsafeCheckpointError(_refusal(path, f"torch's restricted unpickler refused it: {reason}")) from None


def check_saved(path: str | Path) -> None:
    """Raises ValueError if `safe_load` would refuse the file `torch.save` just wrote at `path`."""
    path = Path(path)
    with path.open("rb") as opened:
        bad = _disallowed(path, opened)
    if bad:
        raise ValueError(f"{path}: would hold {', '.join(bad)}, which resuming refuses to unpickle; a checkpoint may "
                         "hold only tensors, None, bools, numbers, strings and lists / tuples / dicts of them")


def safe_save(obj: Any, path: str | Path) -> None:
    """`torch.save`, then `check_saved`: what it writes, `safe_load` reads."""
    torch.save(obj, path)
    check_saved(path)


def numpy_rng_state() -> dict[str, Any]:
    """numpy's global RNG state as plain data (`np.random.get_state()` holds an ndarray)."""
    # numpy's stubs type the result as either form; legacy=True returns the tuple
    state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
    name, keys, pos, has_gauss, cached_gaussian = state
    return {"bit_generator": str(name), "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian)}


def set_numpy_rng_state(state: dict[str, Any]) -> None:
    """Restores what `numpy_rng_state` returned."""
    np.random.set_state((state["bit_generator"], np.asarray(state["keys"], dtype=np.uint32), int(state["pos"]),
                         int(state["has_gauss"]), float(state["cached_gaussian"])))
