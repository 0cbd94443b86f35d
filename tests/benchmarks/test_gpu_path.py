"""`benchmarks/gpu_path.py`, the GPU path's benchmark that `scripts/gpu_check.sh` runs on real shapes, at its
tiny shape on this machine: every measurement runs and prints (on a GPU it also reports MFU and the longest
trainable sequence)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_gpu_path_benchmark_runs_at_its_tiny_shape():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_path.py"), "--shape", "tiny",
                           "--device", "cpu"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in done.stdout.splitlines()[2:]]
    rows = {name: value for name, value in cells}
    assert rows["device"] == "cpu", done.stdout
    for measure in ("engine tokens/s, N=4 (continuous batching)", "HF generate tokens/s, N=4 (one batch)",
                    "trainer tokens/s (fwd + bwd + AdamW)", "logprob gap engine vs trainer, N=4, max",
                    "weight sync, in-process state dict",
                    "Megatron trainer tokens/s (bf16 on a GPU, fwd + bwd + distributed Adam)"):
        assert measure in rows, (measure, done.stdout)
    # fp32 on a CPU: the engine's logprobs are the trainer's
    assert float(rows["logprob gap engine vs trainer, N=4, max"]) < 1e-3
