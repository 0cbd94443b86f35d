"""DeepEyes-47k style records: finding the file, reading the task, decoding the image.

A record has `prompt` (a chat list whose last user message holds an `<image>`
placeholder and the question), `images` (one entry: `{"bytes": ...}` as in the
parquet release, `{"path": ...}` or a plain path string, paths relative to the
data file) and `reward_model.ground_truth`; `extra_info.question` and
`extra_info.choices` are used when present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from relax_gym.envs.datasets import DatasetError, read_image, require, require_gold, shipped_path

IMAGE_PLACEHOLDER = "<image>"
SUFFIXES = (".parquet", ".jsonl", ".json")


def data_file(data_path: str | Path | None, split: str) -> Path:
    """`data_path` itself, else `<data_path>/<split>.{parquet,jsonl,json}`, else the shipped split."""
    if data_path is None:
        return shipped_path("deepeyes", f"{split}.jsonl")
    path = Path(data_path).expanduser()
    if not path.is_dir():
        return path
    for suffix in SUFFIXES:
        if (path / f"{split}{suffix}").is_file():
            return path / f"{split}{suffix}"
    raise DatasetError(f"{path} holds no {split}{{{','.join(SUFFIXES)}}} file")


def validate(records: list[dict[str, Any]], source: Path) -> None:
    """Checks the fields every record needs up front, so a bad file fails at construction."""
    if not records:
        raise DatasetError(f"{source}: the file has no records")
    for i, record in enumerate(records):
        where = f"{source} record {i}"
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: expected an object, got {type(record).__name__}")
        require(record, ("prompt", "images", "reward_model"), where)
        if not isinstance(record["reward_model"], dict) or "ground_truth" not in record["reward_model"]:
            raise DatasetError(f"{where}: reward_model needs a 'ground_truth'")
        require_gold(record["reward_model"]["ground_truth"], where, "reward_model.ground_truth")
        if not isinstance(record["images"], list | tuple) or len(record["images"]) != 1:
            raise DatasetError(f"{where}: expected exactly one image in 'images', got {record['images']!r:.80}")


def _user_text(prompt: Any) -> str:
    """The last user message's text; list contents keep their image part as a placeholder."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise DatasetError("prompt has no user message")
    content = users[-1].get("content", "")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if p.get("type") == "text" else IMAGE_PLACEHOLDER for p in content)


def task_from_record(record: dict[str, Any], index: int) -> dict[str, Any]:
    """The JSON-serialisable task an episode keeps; the image stays out (see `load_image`)."""
    try:
        text = _user_text(record["prompt"])
    except (DatasetError, AttributeError, TypeError) as err:
        raise DatasetError(f"record {index}: unreadable prompt: {err}") from err
    extra = record.get("extra_info") or {}
    question = extra.get("question") or text.replace(IMAGE_PLACEHOLDER, "").strip()
    choices = extra.get("choices")
    return {
        "index": index,
        "data_source": str(record.get("data_source", "")),
        "text": text,
        "question": str(question),
        "gold": str(record["reward_model"]["ground_truth"]),
        "choices": [str(c) for c in choices] if choices else None,
    }


def load_image(record: dict[str, Any], index: int, source: Path) -> Image.Image:
    """The record's image as RGB; a missing or corrupt file raises DatasetError naming record and file."""
    return read_image(record["images"][0], source.parent, f"{source} record {index}")
