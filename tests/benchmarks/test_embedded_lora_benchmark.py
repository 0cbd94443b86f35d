"""`benchmarks/embedded_lora.py` runs on the tiny model and prints both ways' decode rates and push times
(RESULTS.md has SmolLM2's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_the_embedded_lora_benchmark_prints_merged_and_unmerged_rates_and_pushes():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "embedded_lora.py"), "--model", "tiny",
                           "--rows", "2", "--new", "4", "--repeats", "2"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"decode: merged [\d.]+ tok/s, unmerged [\d.]+ tok/s \(unmerged / merged = [\d.]+x\)",
                     done.stdout), done.stdout
    assert re.search(r"push: merged \d+ ms, unmerged \d+ ms", done.stdout), done.stdout
