"""Where the suite's real models are made once per machine, and how a folder gets there: one home for both
`make_smollm2.py` and `make_qwen_coder.py` (each imports it from this folder)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def model_cache() -> Path:
    """`$RELAX_GYM_MODEL_CACHE`, default `~/.cache/relax_gym/models`: outside any clone."""
    return Path(os.environ.get("RELAX_GYM_MODEL_CACHE", Path.home() / ".cache" / "relax_gym" / "models"))


def made_once(name: str, build: Callable[[Path], Path]) -> Path:
    """`model_cache() / name`, made by `build(scratch)` (which saves the folder under the scratch folder it is
    given and returns it) when it has no config.json yet. The folder is built beside its final name and renamed
    into place, so an interrupted make leaves nothing that looks finished; one made meanwhile by another process
    is kept, as it is as good."""
    target = model_cache() / name
    if (target / "config.json").is_file():
        return target
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as scratch:
        folder = build(Path(scratch))
        if not target.exists():
            folder.rename(target)
    return target
