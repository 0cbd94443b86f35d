"""`benchmarks/real_model.py`, the real model's engine and trainer against plain transformers, at the tiny model:
every measurement runs and prints a row (RESULTS.md has SmolLM2's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_real_model_benchmark_runs_at_the_tiny_model():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_model.py"), "--model", "tiny", "--requests",
                           "3", "--new-tokens", "4", "--train-seqs", "4", "--train-len", "16", "--repeats", "1",
                           "--train-groups", "1", "2"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| engine", "| trainer"))]
    # the engine; the trainer on unrelated sequences, on groups sharing their prompts, and there without sharing
    assert len(rows) == 4 and all(line.rstrip().endswith("x |") for line in rows), done.stdout
