"""Audio decoding for datasets: files, in-memory bytes and inline arrays to mono float32.

Decoding goes through `soundfile` (libsndfile: WAV, FLAC, OGG/Vorbis, MP3, ...)
so user datasets in any common container load the same way. Sources come in the
shapes datasets store them: a path (relative to the data file), raw bytes, or a
Hugging Face `Audio` feature dict (`{"bytes": ..., "path": ...}` in parquet,
`{"array": ..., "sampling_rate": ...}` once decoded). Every failure is a
`DatasetError` naming the file, because a bad clip in a 40k-record dataset is
otherwise found only as a cryptic crash deep inside a rollout.
"""

from __future__ import annotations

import io
import struct
import wave
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from relax_gym.envs.datasets import DatasetError

AudioSource = str | Path | bytes | bytearray | memoryview | Mapping[str, Any]


def load_audio(
    source: AudioSource, *, base_dir: Path | None = None, name: str | None = None
) -> tuple[np.ndarray, int]:
    """Decodes `source` to a (1-D float32 waveform in [-1, 1], sampling rate) pair at the file's own rate.

    Relative paths resolve against `base_dir` (the data file's folder). `name`
    says where the clip sits (data file, record, clip number); errors give it
    together with the clip's own path, so either can be looked up.
    """
    if isinstance(source, str | Path):
        return _load_path(Path(source), base_dir, name)
    if isinstance(source, bytes | bytearray | memoryview):
        return decode_bytes(bytes(source), name or "audio")
    if isinstance(source, Mapping):
        return _load_mapping(source, base_dir, name)
    raise DatasetError(
        f"{name or 'audio'}: unsupported audio source of type {type(source).__name__}; give a path, bytes, "
        "{'bytes': ..., 'path': ...} or {'array': ..., 'sampling_rate': ...}"
    )


def _label(name: str | None, clip: Any) -> str:
    """Where the clip sits and what it is called, for error messages."""
    if name and clip:
        return f"{name} ({clip})"
    return str(name or clip or "audio")


def _load_path(path: Path, base_dir: Path | None, name: str | None) -> tuple[np.ndarray, int]:
    path = path.expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    prefix = f"{name}: " if name else ""
    if not path.is_file():
        raise DatasetError(f"{prefix}audio file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DatasetError(f"{prefix}could not read audio file {path}: {err}") from err
    return decode_bytes(data, _label(name, path))


def _load_mapping(source: Mapping[str, Any], base_dir: Path | None, name: str | None) -> tuple[np.ndarray, int]:
    if source.get("array") is not None:
        return _from_array(source["array"], source.get("sampling_rate"), _label(name, source.get("path")))
    if source.get("bytes") is not None:
        return decode_bytes(bytes(source["bytes"]), _label(name, source.get("path")))
    if source.get("path"):
        return _load_path(Path(source["path"]), base_dir, name)
    raise DatasetError(f"{name or 'audio'}: audio dict has no 'bytes', 'path' or 'array' (keys: {sorted(source)})")


def _from_array(array: Any, sampling_rate: Any, name: str) -> tuple[np.ndarray, int]:
    try:
        samples = np.asarray(array, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise DatasetError(f"{name}: audio 'array' is not numeric: {err}") from err
    if samples.ndim != 1:
        raise DatasetError(f"{name}: audio 'array' must be 1-D (mono samples), got shape {samples.shape}")
    if not valid_rate(sampling_rate):
        raise DatasetError(f"{name}: audio 'array' needs a positive int 'sampling_rate': {sampling_rate!r}")
    _check_samples(samples, name)
    peak = float(np.max(np.abs(samples)))
    if peak > 1.0:
        raise DatasetError(f"{name}: samples exceed [-1, 1] (peak {peak:g}); scale PCM, e.g. int16 / 32768")
    return samples.copy(), int(sampling_rate)


def decode_bytes(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """Decodes an encoded audio file held in memory; `name` says which file in errors."""
    if not data:
        raise DatasetError(f"{name}: audio file is empty (0 bytes)")
    truncated = _riff_truncation(data)
    if truncated:
        raise DatasetError(f"{name}: truncated WAV file ({truncated})")
    try:
        import soundfile
    except ImportError as err:  # a declared dependency; say how to fix a broken install
        raise DatasetError(f"{name}: decoding needs the 'soundfile' package (pip install soundfile)") from err
    try:
        frames, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError, ValueError) as err:
        raise DatasetError(f"{name}: not a readable audio file ({err})") from err
    mono = frames.mean(axis=1, dtype=np.float32) if frames.shape[1] > 1 else frames[:, 0]
    _check_samples(mono, name)
    return np.clip(mono, -1.0, 1.0).astype(np.float32, copy=False), int(rate)


def valid_rate(value: Any) -> bool:
    """A sampling rate: a positive int (bools excluded, numpy ints allowed)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value > 0)


def _check_samples(samples: np.ndarray, name: str) -> None:
    if samples.size == 0:
        raise DatasetError(f"{name}: audio has no samples")
    if not np.all(np.isfinite(samples)):
        raise DatasetError(f"{name}: audio has non-finite (NaN or inf) samples")


def _riff_truncation(data: bytes) -> str | None:
    """Why a RIFF/WAVE file is cut short, or None.

    libsndfile silently reads whatever part of a truncated WAV is present, so a
    half-downloaded clip would otherwise train as a shorter one.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    offset = 12
    while offset + 8 <= len(data):
        chunk_id, size = data[offset : offset + 4], struct.unpack("<I", data[offset + 4 : offset + 8])[0]
        available = len(data) - offset - 8
        if chunk_id == b"data":
            if size != 0xFFFFFFFF and size > available:  # 0xFFFFFFFF: written by a streaming encoder
                return f"header declares {size} data bytes, {available} present"
            return None
        offset += 8 + size + (size & 1)
    return "no 'data' chunk"


def encode_wav(samples: np.ndarray, sampling_rate: int) -> bytes:
    """16-bit PCM mono WAV bytes of float samples in [-1, 1] (stdlib only, byte-for-byte reproducible)."""
    pcm = np.round(np.clip(np.asarray(samples, dtype=np.float64), -1.0, 1.0) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(int(sampling_rate))
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


def resample(samples: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Band-limited resampling by FFT (the method of `scipy.signal.resample`, in numpy only).

    Truncating the spectrum low-pass filters when downsampling, so tones above
    the new Nyquist vanish instead of aliasing the way plain interpolation would.
    """
    if orig_rate == target_rate:
        return samples.astype(np.float32, copy=True)
    n_in = samples.size
    n_out = max(1, round(n_in * target_rate / orig_rate))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    out = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    n = min(n_in, n_out)
    out[: n // 2 + 1] = spectrum[: n // 2 + 1]
    if n % 2 == 0:  # the shared Nyquist bin is one component on one side and two on the other
        out[n // 2] *= 2.0 if n_out < n_in else 0.5
    result = np.fft.irfft(out, n_out) * (n_out / n_in)
    return np.clip(result, -1.0, 1.0).astype(np.float32)
