"""Crash-safe checkpoint folders `step_N/`, verified on load, with a fall back to the previous good one.

A checkpoint is written into `.step_N.partial/`, gets a manifest of every
file's size and SHA-256, and is renamed into place; the `latest` pointer is
replaced last. A crash mid-save therefore never wins, and a folder damaged
afterwards (a truncated file, a lost folder, a garbage pointer) fails its
manifest check and is skipped, with a warning, for the newest one that passes.
A checkpoint file that could run code when loaded (a planted pickle, or one
written by a relax_gym that pickled numpy objects) is never skipped past: the
run stops and names it (see `relax_gym.trainer.safe_load`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from relax_gym.errors import StartupError
from relax_gym.models.loading import read_pointer
from relax_gym.trainer.backends.base import TrainBackend
from relax_gym.trainer.safe_load import UnsafeCheckpointError

MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """Records every file under `folder` (size and SHA-256), so damage after the save is detectable."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _digest(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """`folder`'s manifest entries (file -> bytes, sha256); raises OSError, ValueError, KeyError or TypeError."""
    return json.loads((folder / MANIFEST).read_text())["files"]


def manifest_problem(folder: Path) -> str | None:
    """Why `folder` is not the checkpoint its manifest describes, or None when every file matches."""
    if not folder.is_dir():
        return "the folder is missing"
    try:
        entries = read_manifest(folder)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"no readable {MANIFEST} ({type(err).__name__})"
    for name, want in entries.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {want['bytes']}"
        if _digest(path) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


class CheckpointManager:
    def __init__(self, root: Path, keep: int = 3):
        self.root = Path(root)
        self.keep = keep

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def steps(self) -> list[int]:
        """Steps that have a checkpoint folder, oldest first (whether or not they verify)."""
        found = []
        for p in self.root.glob("step_*"):
            suffix = p.name.removeprefix("step_")
            if p.is_dir() and suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)

    def _pointer(self) -> int | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        number = read_pointer(pointer)
        if isinstance(number, str):
            log.warning("%s holds %r, not a step number: ignoring it", pointer, number[:40])
            return None
        return number

    def latest_step(self) -> int:
        """The newest step saved (the pointer, else the newest folder); 0 when there is none."""
        pointer = self._pointer()
        return pointer if pointer is not None else max(self.steps(), default=0)

    def save(self, backend: TrainBackend, step: int, extra: dict[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.folder(step)
        partial = self.root / f".step_{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        backend.save_checkpoint(partial, extra)
        write_manifest(partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        tmp = self.root / ".latest.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, self.root / "latest")
        self._prune()
        return final

    def load_latest(self, backend: TrainBackend) -> tuple[int, dict[str, Any]] | None:
        """Loads the newest checkpoint that verifies: (its step, its `extra`); None when there is none at all.

        Damaged ones are skipped with a warning; if checkpoints exist but none is
        usable, that is an error: starting afresh would silently discard the run.
        So is one whose files the backend refuses to unpickle: falling back past it
        would hide a tampered (or outdated) run folder.
        """
        pointer = self._pointer()
        candidates = sorted({*self.steps(), *([pointer] if pointer else [])}, reverse=True)
        problems = []
        for step in candidates:
            folder = self.folder(step)
            problem = manifest_problem(folder)
            if problem is None:
                try:
                    return step, backend.load_checkpoint(folder)
                except UnsafeCheckpointError as err:
                    raise StartupError(f"{err}. The run does not resume from {folder}; move {self.root} away to "
                                       "start the run afresh") from None
                except Exception as err:  # verified files that still cannot be read: the next older one may
                    problem = f"loading failed: {type(err).__name__}: {str(err)[:200]}"
            problems.append(f"step_{step}: {problem}")
            log.warning("checkpoint %s is damaged (%s); trying the previous one", folder, problem)
        if problems:
            raise StartupError(f"no usable checkpoint in {self.root} ({'; '.join(problems)}); move that folder "
                               "away to start the run afresh")
        return None

    def _prune(self) -> None:
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.folder(old), ignore_errors=True)
