"""`benchmarks/lora_base_dtype.py` runs on the tiny model and prints both bases' times and their logprob gap
(RESULTS.md has SmolLM2's and the 0.5B model's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_the_lora_base_dtype_benchmark_prints_both_bases_and_the_gap():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_base_dtype.py"), "--model", "tiny",
                           "--rows", "2", "--len", "16"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"float32 base [\d.]+ s, bfloat16 base [\d.]+ s \(bf16 / fp32 = [\d.]+x\)", done.stdout)
    gap = re.search(r"max ([\d.]+), mean ([\d.]+)", done.stdout)
    assert gap and 0 < float(gap[1]) < 5, done.stdout  # bfloat16 moves logprobs, but not wildly on a tiny model
