"""`relax-gym export`: a checkpoint's Hugging Face model files, verified, in a clean folder of their own.

A `step_N/` folder already is a model folder (see
`relax_gym.trainer.backends.hf_folder`), but it also holds the training state
(optimizer, RNG, per-rank Megatron shards: every such file is a `.pt`) and the
manifest. Export copies the rest, the files `from_pretrained` reads, checking
each against the manifest while copying into a hidden folder beside the
destination that is renamed into place only once every file has matched, so
a damaged checkpoint never becomes a model folder that looks fine.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from relax_gym.errors import StartupError
from relax_gym.models.loading import ModelLoadError, load_model, resolve_checkpoint, save_model
from relax_gym.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from relax_gym.trainer.checkpoint import MANIFEST, CheckpointManager, read_manifest

#: suffixes of a step folder's training state, which a model folder leaves out (both backends write only .pt)
TRAINING_STATE_SUFFIXES = (".pt",)


class ExportError(StartupError):
    """A checkpoint that cannot be exported, or a destination that would be overwritten; the message says which."""


@dataclass
class Exported:
    source: Path  # the step folder
    destination: Path
    files: list[str]  # relative to both


def model_files(manifest: dict[str, dict[str, object]]) -> list[str]:
    """The manifest's entries that make up the model folder: all but the training state."""
    return sorted(name for name in manifest if not name.endswith(TRAINING_STATE_SUFFIXES))


def step_folder(run: Path, step: int | None) -> Path:
    """The checkpoint to export: `run`'s step `step`, else the one its `latest` pointer names.

    `run` is a run folder, its `checkpoints` folder, the pointer itself or a step folder.
    """
    if step is None:
        return Path(resolve_checkpoint(str(run)))
    checkpoints = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    folder = checkpoints / f"step_{step}"
    if not folder.is_dir():
        steps = CheckpointManager(checkpoints).steps()
        raise ExportError(f"{folder} is missing; {checkpoints} holds steps {steps or 'none'}")
    return folder


def export_checkpoint(run: str | Path, destination: str | Path, step: int | None = None, *,
                      merge: bool = False) -> Exported:
    """Copies a checkpoint's model files (no training state, no manifest) to `destination`, verified.

    A LoRA run's checkpoint is a PEFT adapter folder, exported as such; `merge` writes instead the plain model
    its adapter and base make (`load_model` merges them), from the verified adapter files.
    `destination` must be new or empty: an export never mixes with, or
    replaces, files already there.
    """
    source = step_folder(Path(run).expanduser(), step)
    if not source.is_dir():
        raise ExportError(f"no checkpoint at {source}: pass a run folder, its checkpoints folder or a step folder")
    destination = Path(destination).expanduser().resolve()
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ExportError(f"{destination} exists and is not an empty folder; export into a new or empty one")
    try:
        manifest = read_manifest(source)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{source}: no readable {MANIFEST} ({type(err).__name__}), so its files cannot be "
                          "verified; is it a relax-gym checkpoint?") from None
    files = model_files(manifest)
    adapter = ADAPTER_CONFIG in files and ADAPTER_WEIGHTS in files
    if merge and not adapter:
        raise ExportError(f"--merge: {source} holds full weights (its run had no trainer.lora), so there is no "
                          "adapter to merge: export it without --merge")
    if not adapter and ("config.json" not in files or not any(f.endswith(".safetensors") for f in files)):
        raise ExportError(f"{source} holds no Hugging Face model (config.json and *.safetensors): it was written "
                          "before checkpoints were model folders; a run resumed from it writes them from its next "
                          "checkpoint on")
    partial = destination.parent / f".{destination.name}.export-partial"
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        for name in files:
            _copy_verified(source / name, partial / name, manifest[name])
        if merge:
            files = _merged_into(partial, partial.with_name(partial.name + "-merged"))
        partial.replace(destination)  # an empty destination folder is replaced as a whole
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        raise ExportError(f"export to {destination} failed: {err.strerror or err}{where}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Exported(source, destination, files)


def _merged_into(adapter: Path, scratch: Path) -> list[str]:
    """Replaces the verified adapter folder `adapter` by the model it and its base make; returns its files."""
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        save_model(load_model(str(adapter)), scratch)
    except ModelLoadError as err:
        shutil.rmtree(scratch, ignore_errors=True)
        raise ExportError(f"--merge: {err}") from None
    shutil.rmtree(adapter)
    scratch.replace(adapter)
    return sorted(str(p.relative_to(adapter)) for p in adapter.rglob("*") if p.is_file())


def _copy_verified(src: Path, dst: Path, want: dict[str, object]) -> None:
    """Copies `src` to `dst`, hashing the bytes copied; raises ExportError unless they are the manifest's."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    try:
        reader = src.open("rb")
    except FileNotFoundError:
        raise ExportError(f"{src} is missing, though the manifest lists it: the checkpoint is damaged") from None
    with reader, dst.open("wb") as writer:
        for block in iter(lambda: reader.read(1 << 20), b""):
            digest.update(block)
            writer.write(block)
            size += len(block)
    if size != want["bytes"] or digest.hexdigest() != want["sha256"]:
        raise ExportError(f"{src} does not match its manifest entry ({size} bytes, the manifest says "
                          f"{want['bytes']}): the checkpoint is damaged; export another step with --step")
