"""`relax-gym sft`: supervised fine-tuning on trajectory files, the warm start before RL.

The data are trajectories as `relax-gym rollout` and a run's `trajectories.jsonl` write them: demonstrations
played by `ScriptedEngine`, or sampled rollouts kept when their reward reaches `min_reward` (rejection
sampling). Each is trained on its own loss mask, the tokens the policy produced in the conversation, exactly
as RL would train it, with the negative log-likelihood instead of a policy loss (`sft_loss_fn`). The result
is a model folder that `model:` / `--model` take, with the chat template the model was loaded with.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from relax_gym.errors import StartupError, first_line
from relax_gym.models import LoadedModel
from relax_gym.models.lora import LoraSpec
from relax_gym.trainer.algorithms import sft_loss_fn
from relax_gym.trainer.batch import Sample
from relax_gym.trajectory import Trajectory, read_jsonl

#: the file beside the saved model with one row per optimizer step
METRICS_FILE = "sft_metrics.jsonl"


@dataclass(frozen=True)
class SftData:
    """The kept trajectories as samples, and what was left out and why (for the one-line summary)."""

    samples: list[Sample]
    read: int
    left_out: dict[str, int]


def sft_data(paths: Sequence[str | Path], vocab_size: int, min_reward: float | None = None) -> SftData:
    """The trajectories of `paths` that can teach: finished (`completed`), with trained tokens, at least
    `min_reward` when given, text only, and tokenized for a vocabulary of `vocab_size`. Raises StartupError
    naming the file for a file that cannot be read, a trajectory of another model's tokens, or no trajectory
    kept at all."""
    samples: list[Sample] = []
    left_out: Counter[str] = Counter()
    read = 0
    for path in map(Path, paths):
        try:
            trajectories: list[Trajectory] = list(read_jsonl(path))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise StartupError(f"sft data {path}: cannot read it as trajectories: {type(err).__name__}: "
                               f"{first_line(err, 200)}") from None
        for line, t in enumerate(trajectories, start=1):
            read += 1
            if t.token_ids and max(t.token_ids) >= vocab_size:
                raise StartupError(f"sft data {path}, record {line}: token id {max(t.token_ids)} is outside the "
                                   f"model's vocabulary ({vocab_size}): these trajectories were made with another "
                                   "tokenizer")
            why = _left_out(t, min_reward)
            if why:
                left_out[why] += 1
                continue
            samples.append(Sample(token_ids=t.token_ids, loss_mask=t.loss_mask, rollout_logprobs=t.rollout_logprobs,
                                  advantage=1.0))
    if not samples:
        raise StartupError(f"sft: none of the {read} trajectories in {', '.join(map(str, paths))} can teach "
                           f"({dict(left_out) or 'the files are empty'})")
    return SftData(samples, read, dict(left_out))


def _left_out(t: Trajectory, min_reward: float | None) -> str | None:
    if t.status != "completed":
        return f"status {t.status}"
    if not any(t.loss_mask):
        return "no trained tokens"
    if t.media:
        return "media (sft takes text trajectories)"
    if min_reward is not None and t.reward < min_reward:
        return f"reward below {min_reward:g}"
    return None


def check_out(out: str | Path) -> Path:
    """`out` as a Path, if it is a new or empty folder (a model folder is never written over)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StartupError(f"sft --out {out}: not a new or empty folder; choose another")
    return out


def sft(loaded: LoadedModel, data: SftData, out: str | Path, *, epochs: int = 2, lr: float = 1e-5,
        batch_size: int = 16, micro_batch_tokens: int = 8192, seed: int = 0, lora: LoraSpec | None = None,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains `loaded` on `data` for `epochs` (batches of `batch_size` samples, shuffled per epoch by `seed`),
    then saves it to `out` (a model folder, with one metrics row per step in `sft_metrics.jsonl`). With `lora`,
    only an adapter trains and `out` is a PEFT adapter folder (`load_model` merges it into its base)."""
    from relax_gym.trainer.backends.torch_backend import TorchBackend

    out = check_out(out)
    backend = TorchBackend(loaded, lr=lr, micro_batch_tokens=micro_batch_tokens, seed=seed, lora=lora)
    loss_fn = sft_loss_fn()
    rows: list[dict[str, Any]] = []
    steps = epochs * -(-len(data.samples) // batch_size)
    start = time.perf_counter()
    for epoch in range(epochs):
        order = list(data.samples)
        random.Random(seed + epoch).shuffle(order)
        for first in range(0, len(order), batch_size):
            metrics = backend.train_step(order[first:first + batch_size], loss_fn)
            rows.append({"step": len(rows) + 1, "epoch": epoch + 1, "time_s": round(time.perf_counter() - start, 3),
                         **{k: float(v) for k, v in metrics.items()}})
            say(f"sft step {len(rows)}/{steps} (epoch {epoch + 1}): loss {rows[-1]['loss']:.4f}")
    out.mkdir(parents=True, exist_ok=True)
    backend.save_model_folder(out)
    with (out / METRICS_FILE).open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return {"out": str(out), "steps": len(rows), "samples": len(data.samples), "read": data.read,
            "left_out": data.left_out, "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "loss_mean_last_epoch": fmean(r["loss"] for r in rows if r["epoch"] == epochs)}
