"""Loading task records from users' local files and the shipped data.

Public RL datasets come as parquet or JSON lines (dapo-math-17k, DeepEyes-47k,
AVQA); pyarrow reads parquet, the standard library reads the rest. Records are
plain dicts; each env maps its format's fields to a task.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from relax_gym.rewards.result import is_missing


class DatasetError(ValueError):
    """A data file is missing, unreadable or lacks a field an env needs."""


def shipped_path(*parts: str) -> Path:
    """A file under the package's `data/` folder (works from a wheel as well as a checkout)."""
    return Path(str(resources.files("relax_gym.envs").joinpath("data", *parts)))


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Reads `.jsonl`, `.json` (a list) or `.parquet` into a list of dicts."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if suffix == ".jsonl":
            records = []
            with path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError as err:
                            raise DatasetError(f"{path}:{lineno}: invalid JSON: {err.msg}") from err
            return records
        if suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise DatasetError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
            return data
    except DatasetError:
        raise
    except Exception as err:
        raise DatasetError(f"could not read {path}: {type(err).__name__}: {err}") from err
    raise DatasetError(f"{path}: unsupported data format {suffix!r}; use .jsonl, .json or .parquet")


def require(record: dict[str, Any], keys: Sequence[str], where: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise DatasetError(f"{where}: record lacks field(s) {missing}; it has {sorted(record)}")


def require_gold(value: Any, where: str, key: str) -> Any:
    """`value` unchanged, or DatasetError: a missing gold would let a blank, "None" or "nan" reply score."""
    if is_missing(value):
        raise DatasetError(f"{where}: {key!r} is missing or empty (got {value!r}); a record needs a non-empty answer")
    return value


def record_index(options: dict[str, Any], count: int, rng: Any) -> int:
    """The record an episode plays: `options["index"]` when given (checked against the `count` records), else a
    seeded draw."""
    index = options.get("index")
    if index is None:
        return int(rng.integers(count))
    if not isinstance(index, int | np.integer) or not 0 <= index < count:
        raise ValueError(f"options['index'] must be an int in [0, {count}), got {index!r}")
    return int(index)


def pick(records: Sequence[Any], rng: Any) -> tuple[int, Any]:
    """A seeded draw of one record with its index."""
    if not records:
        raise DatasetError("the dataset is empty")
    index = int(rng.integers(len(records)))
    return index, records[index]


def read_image(entry: Any, base_dir: Path, where: str) -> Image.Image:
    """A record's image as RGB, from a path (relative to `base_dir`, the data file's folder), bytes, or a Hugging
    Face `Image` feature dict (`{"bytes": ..., "path": ...}`); DatasetError naming `where` and the file else."""
    try:
        origin = _image_source(entry, base_dir)
    except DatasetError as err:
        raise DatasetError(f"{where}: {err}") from err
    name = f"{len(origin)} bytes of embedded image" if isinstance(origin, bytes) else str(origin)
    try:
        with Image.open(io.BytesIO(origin) if isinstance(origin, bytes) else origin) as img:
            return to_rgb(img)
    except Exception as err:  # decoders raise OSError, SyntaxError, ValueError...: all mean a bad file
        raise DatasetError(f"{where}: cannot read image {name}: {type(err).__name__}: {err}") from err


def _image_source(entry: Any, base: Path) -> bytes | Path:
    if isinstance(entry, dict) and entry.get("bytes"):
        return bytes(entry["bytes"])
    path = entry.get("path") if isinstance(entry, dict) else entry
    if not isinstance(path, str | Path) or not str(path):
        raise DatasetError(f"image entry has neither 'bytes' nor a 'path': {entry!r:.80}")
    path = Path(path).expanduser()
    return path if path.is_absolute() else base / path


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB with transparent pixels laid over white.

    A plain convert drops alpha, and the colour hidden under transparent pixels (often
    black) would show a logo or a cut-out as a black block.
    """
    if img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in img.info:  # info: P, L, RGB with tRNS
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba).convert("RGB")
    return img.convert("RGB")
