#!/usr/bin/env python
"""Synthesises the bundled AudioQA data: short tone clips whose answers follow from the signal.

Every question is about a property the generator controls exactly (how many
beeps, which tone is higher / longer / louder, tone vs noise vs silence), so
the gold answers are verifiable by signal analysis and the shipped set needs no
licence or download. Each record draws from its own seed `(seed, split, index)`,
so a run with fewer records reproduces the first records of a larger one byte
for byte. Output: `clips/*.wav` (16 kHz mono 16-bit PCM) plus `train.jsonl`
and `test.jsonl` in an AVQA-like record style.

    python scripts/make_audioqa_data.py [--out DIR] [--seed N] [--train N] [--test N]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from relax_gym.envs.audio_io import encode_wav

SR = 16_000
FADE_S = 0.005  # raised-cosine fades so tone edges do not click
PAD_S = 0.03  # silence around each clip's content
SPLITS = {"train": 0, "test": 1}
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "envs" / "data" / "audioqa"

Clips = list[np.ndarray]
Question = tuple[Clips, str, list[str], int]  # clips, question, choices, index of the right choice
FIRST_SECOND = ("the first tone", "the second tone")


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * SR))


def tone(freq: float, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * SR)) / SR
    return amp * np.sin(2 * np.pi * freq * t) * _fade(t.size)


def _fade(n: int) -> np.ndarray:
    ramp = min(round(FADE_S * SR), n // 2)
    env = np.ones(n)
    edge = 0.5 - 0.5 * np.cos(np.pi * np.arange(ramp) / ramp)
    env[:ramp], env[n - ramp:] = edge, edge[::-1]
    return env


def sequence(*segments: np.ndarray, gap: float = 0.08) -> np.ndarray:
    """Segments separated by `gap` seconds of silence, padded at both ends."""
    parts = [silence(PAD_S)]
    for i, seg in enumerate(segments):
        parts += [silence(gap)] if i else []
        parts.append(seg)
    return np.concatenate([*parts, silence(PAD_S)])


def log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(np.exp(rng.uniform(np.log(low), np.log(high))))


def beeps(rng: np.random.Generator, count: int) -> np.ndarray:
    freq = log_uniform(rng, 500, 1500)
    return sequence(*[tone(freq, 0.06) for _ in range(count)], gap=0.09)


def count_beeps(rng: np.random.Generator) -> Question:
    count = int(rng.integers(1, 6))
    others = rng.choice([k for k in range(1, 6) if k != count], size=3, replace=False)
    choices = [str(k) for k in [count, *others]]
    return [beeps(rng, count)], "How many beeps do you hear in this clip?", choices, 0


def pitch_contour(rng: np.random.Generator) -> Question:
    low, step = log_uniform(rng, 300, 600), rng.uniform(1.3, 1.6)
    lo, mid, hi = low, low * step, low * step**2
    if rng.random() < 0.4:
        choices = ["it rises", "it falls", "it stays the same"]
        answer = int(rng.integers(3))
        freqs = [(lo, hi), (hi, lo), (mid, mid)][answer]
    else:
        choices = ["it rises throughout", "it falls throughout", "it rises then falls", "it falls then rises"]
        answer = int(rng.integers(4))
        up_down = [(lo, hi, mid), (mid, hi, lo)]
        shapes = [[(lo, mid, hi)], [(hi, mid, lo)], up_down, [(hi, lo, mid), (mid, lo, hi)]]
        freqs = shapes[answer][int(rng.integers(len(shapes[answer])))]
    clip = sequence(*[tone(f, 0.15) for f in freqs])
    return [clip], "How does the pitch change from one tone to the next?", choices, answer


def _first_second_same(rng: np.random.Generator) -> int:
    """0: the first tone wins, 1: the second, 2: neither (a fifth of the time)."""
    return 2 if rng.random() < 0.2 else int(rng.integers(2))


def compare_pitch(rng: np.random.Generator) -> Question:
    answer = _first_second_same(rng)
    low = log_uniform(rng, 300, 800)
    high = low if answer == 2 else low * rng.uniform(1.25, 1.8)
    freqs = (high, low) if answer == 0 else (low, high)
    clip = sequence(*[tone(f, 0.18) for f in freqs], gap=0.1)
    choices = [*FIRST_SECOND, "both have the same pitch"]
    return [clip], "Which tone is higher in pitch?", choices, answer


def compare_duration(rng: np.random.Generator) -> Question:
    answer = _first_second_same(rng)
    freq, short = log_uniform(rng, 400, 1200), rng.uniform(0.1, 0.15)
    long = short if answer == 2 else short * rng.uniform(2.0, 2.5)
    durations = (long, short) if answer == 0 else (short, long)
    clip = sequence(*[tone(freq, d) for d in durations], gap=0.1)
    choices = [*FIRST_SECOND, "both last equally long"]
    return [clip], "Which tone lasts longer?", choices, answer


def compare_loudness(rng: np.random.Generator) -> Question:
    answer = _first_second_same(rng)
    freq, loud = log_uniform(rng, 400, 1200), rng.uniform(0.5, 0.8)
    quiet = loud if answer == 2 else loud / rng.uniform(3.0, 5.0)
    amps = (loud, quiet) if answer == 0 else (quiet, loud)
    clip = sequence(*[tone(freq, 0.18, a) for a in amps], gap=0.1)
    choices = [*FIRST_SECOND, "both are equally loud"]
    return [clip], "Which tone is louder?", choices, answer


def sound_type(rng: np.random.Generator) -> Question:
    answer = int(rng.integers(4))
    if answer == 0:
        clip = sequence(tone(log_uniform(rng, 300, 1500), 0.4))
    elif answer == 1:
        clip = silence(0.4 + 2 * PAD_S)
    elif answer == 2:
        noise = np.clip(rng.normal(0.0, 0.2, round(0.4 * SR)), -1, 1) * _fade(round(0.4 * SR))
        clip = sequence(noise)
    else:
        clip = beeps(rng, int(rng.integers(2, 5)))
    choices = ["a steady tone", "silence", "noise", "a series of beeps"]
    return [clip], "What does this clip contain?", choices, answer


def multi_clip_pitch(rng: np.random.Generator) -> Question:
    if rng.random() < 0.6:
        answer = int(rng.integers(3))
        low = log_uniform(rng, 300, 800)
        high = low if answer == 2 else low * rng.uniform(1.25, 1.8)
        freqs = [(low, high), (high, low), (low, low)][answer]
        choices = ["yes", "no, it is lower", "no, they have the same pitch"]
        question = "Is clip 2 higher in pitch than clip 1?"
    else:
        low, step = log_uniform(rng, 300, 600), rng.uniform(1.3, 1.6)
        freqs = [float(f) for f in rng.permutation([low, low * step, low * step**2])]
        answer = int(np.argmax(freqs))
        choices = ["clip 1", "clip 2", "clip 3"]
        question = "Which clip has the highest pitch?"
    return [sequence(tone(f, 0.25)) for f in freqs], question, choices, answer


TASKS: dict[str, Callable[[np.random.Generator], Question]] = {
    f.__name__: f
    for f in (count_beeps, pitch_contour, compare_pitch, compare_duration, compare_loudness, sound_type,
              multi_clip_pitch)
}


def make_record(seed: int, split: str, index: int, out: Path) -> dict:
    """Builds record `index` of `split`, writing its clips under `out/clips/`."""
    rng = np.random.default_rng([seed, SPLITS[split], index])
    task = list(TASKS)[index % len(TASKS)]
    clips, question, choices, answer = TASKS[task](rng)
    order = [int(i) for i in rng.permutation(len(choices))]  # balances the letters of right answers
    record_id = f"{split}-{index:03d}"
    paths = []
    for j, clip in enumerate(clips, 1):
        rel = f"clips/{record_id}.wav" if len(clips) == 1 else f"clips/{record_id}-{j}.wav"
        (out / rel).write_bytes(encode_wav(clip, SR))
        paths.append(rel)
    return {
        "id": record_id,
        "task": task,
        "audio": paths[0] if len(paths) == 1 else paths,
        "question": question,
        "choices": [choices[i] for i in order],
        "answer": "ABCD"[order.index(answer)],
    }


def write_split(seed: int, split: str, count: int, out: Path) -> None:
    for stale in (out / "clips").glob(f"{split}-*.wav"):
        stale.unlink()
    records = [make_record(seed, split, i, out) for i in range(count)]
    with (out / f"{split}.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=2025)
    parser.add_argument("--train", type=int, default=63)
    parser.add_argument("--test", type=int, default=21)
    args = parser.parse_args(argv)
    (args.out / "clips").mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        write_split(args.seed, split, getattr(args, split), args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.train} train + {args.test} test records to {args.out} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
