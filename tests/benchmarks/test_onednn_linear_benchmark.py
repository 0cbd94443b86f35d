"""`benchmarks/onednn_linear.py` runs and prints a row per layer shape (RESULTS.md has its figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relax_gym.cpu.onednn_linear import onednn_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not onednn_available(), reason="oneDNN linears apply to x86 CPUs with oneDNN")
@pytest.mark.timeout(120)
def test_the_onednn_linear_benchmark_prints_its_rows():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "onednn_linear.py"), "--rows", "16",
                           "--budget-s", "0.01"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "GFLOP/s" in line]
    assert len(rows) == 5 and all(line.rstrip().endswith("x |") for line in rows), done.stdout
