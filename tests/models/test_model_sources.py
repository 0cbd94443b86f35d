"""Models by the names users type: a hub id read from a real Hugging Face cache layout offline, a GGUF file
written as llama.cpp writes one, and each bad input of that surface ending in one line, exit 2."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from huggingface_hub import constants
from support.engines import KEY, free_port, get
from support.gguf_files import tiny_llama, write_gguf

from relax_gym.cli import main
from relax_gym.engines.base import API_KEY_ENV
from relax_gym.models import ModelLoadError, load_model, save_model

ROOT = Path(__file__).resolve().parents[2]
REPO = "acme/tiny-chat"
COMMIT = "3f6d5c2a1b0e9f8d7c6b5a4f3e2d1c0b9a8f7e6d"
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def lay_out_as_the_hub(folder: Path, cache: Path, repo: str, commit: str, branch: str = "main") -> Path:
    """`folder` as huggingface_hub caches a download of `repo` at `commit`: content-addressed blobs, the
    snapshot's files as relative links to them, and `refs/<branch>` holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache holding the tiny model as `acme/tiny-chat` (branch main at COMMIT)."""
    folder = save_model(load_model("tiny"), tmp_path_factory.mktemp("tiny-chat") / "model")
    cache = tmp_path_factory.mktemp("hub") / "hub"
    lay_out_as_the_hub(folder, cache, REPO, COMMIT)
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    """This process reads `hub_cache` as the Hugging Face cache, offline (HF_HUB_OFFLINE=1, read at import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def _greedy(loaded, new_tokens: int = 12) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                    pad_token_id=loaded.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


# --- hub ids ---------------------------------------------------------------------------------------


def test_a_hub_id_loads_from_the_cache_offline_by_branch_and_by_commit(offline):
    tiny = load_model("tiny")
    for name in (REPO, f"{REPO}@{COMMIT}", f"{REPO}@main"):
        loaded = load_model(name)
        assert Path(loaded.name) == offline / "models--acme--tiny-chat" / "snapshots" / COMMIT, name
        assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(),
                                                      tiny.model.state_dict().values(), strict=True))
        assert loaded.tokenizer.chat_template == tiny.tokenizer.chat_template


def test_a_hub_id_reaches_every_command_that_takes_a_model_and_a_training_config(offline, tmp_path, capsys):
    out = tmp_path / "episodes.jsonl"
    assert main(["rollout", "--env", "relax/Arithmetic-v0", "--model", REPO, "-n", "1", "--out", str(out),
                 "--max-new-tokens", "4", "--max-turns", "1"]) == 0, capsys.readouterr().out
    assert main(["view", str(out), "--model", REPO, "-o", str(tmp_path / "view.html")]) == 0
    assert main(["preflight", "--model", REPO]) == 0, capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", str(ROOT / "examples" / "configs" / "quickstart.yaml"), f"run_dir={run}", f"model={REPO}",
                 "trainer.total_steps=1", "trainer.checkpoint_every=1", "trainer.eval_every=0",
                 "rollout.groups_per_step=2", "rollout.group_size=2"]) == 0, capsys.readouterr().out
    assert (run / "checkpoints" / "step_1").is_dir()


def test_serve_takes_a_hub_id_from_the_cache_named_by_the_environment(hub_cache):
    """`relax-gym serve` in its own process, with the cache and offline mode set as a user sets them."""
    port = free_port()
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", API_KEY_ENV: KEY}
    process = subprocess.Popen([sys.executable, "-m", "relax_gym.cli", "serve", "--model", REPO, "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                info = get(f"http://127.0.0.1:{port}/get_model_info", timeout=2)
                if info.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("serve did not come up")
        assert "models--acme--tiny-chat" in info.json()["model_path"]
    finally:
        process.terminate()
        process.wait(30)


def test_a_hub_id_not_in_the_cache_is_one_line_naming_the_cache_and_both_fixes(offline, tmp_path, capsys):
    code = main(["rollout", "--env", "relax/Arithmetic-v0", "--model", "acme/absent", "-n", "1",
                 "--out", str(tmp_path / "x.jsonl")])
    said = capsys.readouterr().out
    assert code == 2 and said.count("\n") == 1, said
    for part in ("'acme/absent'", "a hub id", str(offline), "HF_HUB_OFFLINE is set", "hf download acme/absent",
                 "local checkpoint folder"):
        assert part in said.replace("\n", ""), (part, said)


def test_a_revision_not_in_the_cache_is_named(offline):
    with pytest.raises(ModelLoadError, match=r"revision 'v2' of acme/tiny-chat is not in the Hugging Face cache.*"
                                             r"hf download acme/tiny-chat --revision v2"):
        load_model(f"{REPO}@v2")


def test_a_mistyped_path_that_looks_like_a_hub_id_says_there_is_no_such_folder_first(offline, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ModelLoadError, match=r"^model 'runs/typo': no folder at runs/typo, and as a hub id, runs/typo "
                                             r"is not in the Hugging Face cache"):
        load_model("runs/typo")


def test_a_folder_without_tokenizer_files_is_one_line_naming_it(tmp_path):
    folder = save_model(load_model("tiny"), tmp_path / "model")
    for file in folder.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            file.unlink()
    with pytest.raises(ModelLoadError, match=rf"^model folder {folder}: .*tokenizer") as caught:
        load_model(str(folder))
    assert "\n" not in str(caught.value)


# --- GGUF ------------------------------------------------------------------------------------------


def test_a_gguf_file_loads_as_the_model_it_was_written_from(tmp_path, caplog):
    """F32: the same weights exactly, so the same greedy tokens, and the chat template from the file."""
    source = tiny_llama()
    file = write_gguf(source, tmp_path / "tiny-llama.F32.gguf")
    with caplog.at_level(logging.WARNING, logger="relax_gym.models.loading"):
        loaded = load_model(str(file))
    assert "a dequantized start" in caplog.text
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.tokenizer.chat_template == source.tokenizer.chat_template
    assert _greedy(loaded) == _greedy(source)
    assert load_model(str(tmp_path)).name == str(file)  # a folder holding one GGUF file


def test_a_quantized_gguf_is_dequantized_into_a_model_that_saves_and_reloads(tmp_path):
    source = tiny_llama()
    file = write_gguf(source, tmp_path / "tiny-llama.Q8_0.gguf", quantization="Q8_0")
    loaded = load_model(str(file))
    for (name, got), want in zip(loaded.model.state_dict().items(), source.model.state_dict().values(), strict=True):
        # Q8_0: 8-bit values with one fp16 scale per block of 32: within a step (the largest value / 127)
        assert (got - want).abs().max() <= want.abs().max() / 127, name
    saved = save_model(loaded, tmp_path / "plain")
    assert "quantization_config" not in (saved / "config.json").read_text()
    again = load_model(str(saved))
    assert _greedy(again) == _greedy(loaded)


@pytest.mark.parametrize("case", ["unsupported architecture", "corrupt", "truncated", "two files", "no reader"])
def test_a_bad_gguf_is_one_line_naming_the_file_and_the_cause(case, tmp_path, monkeypatch, capsys):
    file = tmp_path / "model.gguf"
    if case == "unsupported architecture":
        write_gguf(tiny_llama(), file, architecture="rwkv6")
        cause = "rwkv6"
    elif case == "corrupt":
        file.write_bytes(b"GGUF" + os.urandom(256))
        cause = "cannot load it as GGUF"
    elif case == "truncated":
        data = write_gguf(tiny_llama(), tmp_path / "whole.gguf").read_bytes()
        (tmp_path / "whole.gguf").unlink()
        file.write_bytes(data[: len(data) // 2])
        cause = "cannot load it as GGUF"
    elif case == "two files":
        file.write_bytes(b"")
        (tmp_path / "other.gguf").write_bytes(b"")
        file = tmp_path
        cause = "holds 2 GGUF files (model.gguf, other.gguf)"
    else:
        write_gguf(tiny_llama(), file)
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
        cause = "pip install 'relax-gym[gguf]'"
    code = main(["rollout", "--env", "relax/Arithmetic-v0", "--model", str(file), "-n", "1",
                 "--out", str(tmp_path / "x.jsonl")])
    said = capsys.readouterr().out.replace("\n", "")
    assert code == 2 and cause in said and str(file) in said, said
