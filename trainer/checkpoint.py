"""Checkpoint folders `step_N/` and a `latest` pointer written last, so a crash mid-save never wins."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from relax_gym.trainer.backends.base import TrainBackend


class CheckpointManager:
    def __init__(self, root: Path, keep: int = 3):
        self.root = Path(root)
        self.keep = keep

    def latest_step(self) -> int:
        pointer = self.root / "latest"
        return int(pointer.read_text().strip()) if pointer.is_file() else 0

    def save(self, backend: TrainBackend, step: int, extra: dict[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        partial = self.root / f".step_{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        backend.save_checkpoint(partial, extra)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        tmp = self.root / ".latest.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, self.root / "latest")
        self._prune()
        return final

    def load_latest(self, backend: TrainBackend) -> dict[str, Any] | None:
        step = self.latest_step()
        if step == 0:
            return None
        return backend.load_checkpoint(self.root / f"step_{step}")

    def _prune(self) -> None:
        steps = sorted(int(p.name.split("_")[1]) for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep]:
            shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
