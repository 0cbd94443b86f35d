"""`benchmarks/train_memory.py`, a run's peak RSS against its state, at the quickstart's tiny model: the CLI run,
the child's peak and the row print (RESULTS.md has SmolLM2's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_memory_benchmark_runs_the_cli_and_reports_its_peak():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_memory.py"), "--config",
                           str(ROOT / "examples" / "configs" / "quickstart.yaml"), "--steps", "2", "--variants", ""],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = [line for line in done.stdout.splitlines() if line.startswith("| as configured")]
    peak = float(row.split("|")[2].split()[0])
    assert 0.1 < peak < 4, row
