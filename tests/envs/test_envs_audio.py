"""AudioQA env, its audio decoding and its synthesised data.

The shipped clips are checked against an independent analysis (stdlib `wave`
decoding, an energy envelope, FFT peaks) rather than against the generator's
own parameters, so a generator bug that mislabels a clip fails here.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import warnings
import wave
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile
from gymnasium.utils.env_checker import check_env

import relax_gym
from relax_gym.env.conformance import run_checks
from relax_gym.env.core import EpisodeOverError
from relax_gym.envs.audio_io import decode_bytes, encode_wav, load_audio, resample
from relax_gym.envs.audio_qa import AudioQAEnv
from relax_gym.envs.datasets import DatasetError, load_records, shipped_path

REPO = Path(__file__).resolve().parents[2]
DATA = shipped_path("audioqa")
SR = 16_000
SPLITS = {split: load_records(DATA / f"{split}.jsonl") for split in ("train", "test")}
SHIPPED = [(split, r) for split, records in SPLITS.items() for r in records]


# --- independent signal analysis -------------------------------------------------
def read_pcm(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth()) == (1, 2), f"{path}: expected mono 16-bit PCM"
        return np.frombuffer(f.readframes(f.getnframes()), "<i2") / 32768.0, f.getframerate()


def segments(x: np.ndarray, frame: int = 80, floor: float = 0.01) -> list[np.ndarray]:
    """The sounding stretches of `x`: runs of 5 ms frames whose RMS exceeds `floor`."""
    n = len(x) // frame
    active = np.sqrt(np.mean(x[: n * frame].reshape(n, frame) ** 2, axis=1)) > floor
    edges = np.flatnonzero(np.diff(np.concatenate([[0], active.astype(int), [0]])))
    return [x[a * frame : b * frame] for a, b in zip(edges[::2], edges[1::2], strict=True)]


def spectrum(x: np.ndarray) -> np.ndarray:
    return np.abs(np.fft.rfft(x * np.hanning(len(x)), n=1 << 17))


def peak_hz(x: np.ndarray, rate: int = SR) -> float:
    return float(np.argmax(spectrum(x)) * rate / (1 << 17))


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x**2)))


def same(a: float, b: float, tol: float = 1.1) -> bool:
    return max(a, b) / min(a, b) < tol


def first_second(a: float, b: float, same_text: str) -> str:
    return same_text if same(a, b) else ("the first tone" if a > b else "the second tone")


def contour(freqs: list[float]) -> str:
    steps = ["up" if b > a else "down" for a, b in itertools.pairwise(freqs)]
    if len(freqs) == 2:
        return "it stays the same" if same(*freqs) else {"up": "it rises", "down": "it falls"}[steps[0]]
    return {
        ("up", "up"): "it rises throughout",
        ("down", "down"): "it falls throughout",
        ("up", "down"): "it rises then falls",
        ("down", "up"): "it falls then rises",
    }[tuple(steps)]


def sound_kind(x: np.ndarray) -> str:
    if rms(x) < 1e-4:
        return "silence"
    if len(segments(x)) > 1:
        return "a series of beeps"
    power = spectrum(x) ** 2
    peak = int(np.argmax(power))
    near_peak = power[max(0, peak - 200) : peak + 200].sum() / power.sum()  # ±25 Hz
    return "a steady tone" if near_peak > 0.5 else "noise"


def expected_choice(record: dict, clips: list[np.ndarray]) -> str:
    """The option text that the signal itself supports."""
    task, parts = record["task"], segments(clips[0])
    if task == "count_beeps":
        return str(len(parts))
    if task == "pitch_contour":
        return contour([peak_hz(p) for p in parts])
    if task == "compare_pitch":
        return first_second(peak_hz(parts[0]), peak_hz(parts[1]), "both have the same pitch")
    if task == "compare_duration":
        return first_second(len(parts[0]), len(parts[1]), "both last equally long")
    if task == "compare_loudness":
        return first_second(rms(parts[0]), rms(parts[1]), "both are equally loud")
    if task == "sound_type":
        return sound_kind(clips[0])
    assert task == "multi_clip_pitch", task
    freqs = [peak_hz(c) for c in clips]
    if len(freqs) == 3:
        return f"clip {int(np.argmax(freqs)) + 1}"
    if same(*freqs):
        return "no, they have the same pitch"
    return "yes" if freqs[1] > freqs[0] else "no, it is lower"


def clip_paths(record: dict) -> list[Path]:
    audio = record["audio"]
    return [DATA / p for p in (audio if isinstance(audio, list) else [audio])]


@pytest.mark.parametrize(("split", "record"), SHIPPED, ids=[r["id"] for _, r in SHIPPED])
def test_shipped_clip_encodes_its_answer(split: str, record: dict) -> None:
    clips = []
    for path in clip_paths(record):
        samples, rate = read_pcm(path)
        assert rate == SR and len(samples) <= 2 * SR, f"{path}: {rate} Hz, {len(samples) / rate:.2f} s"
        clips.append(samples)
    gold = record["choices"]["ABCD".index(record["answer"])]
    assert expected_choice(record, clips) == gold, f"{record['id']} ({record['task']})"
    assert 3 <= len(record["choices"]) <= 4 and len(set(record["choices"])) == len(record["choices"])


def test_shipped_data_is_small_and_covers_every_task() -> None:
    size = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert size < 2 * 2**20, f"shipped audio data is {size / 2**20:.2f} MiB"
    assert len(SPLITS["train"]) >= 55 and len(SPLITS["test"]) >= 18
    tasks = {r["task"] for _, r in SHIPPED}
    assert len(tasks) == 7 and all({r["task"] for r in records} == tasks for records in SPLITS.values())
    referenced = {p.name for _, r in SHIPPED for p in clip_paths(r)}
    assert referenced == {p.name for p in (DATA / "clips").iterdir()}, "stale or missing clips"


def test_generator_is_deterministic_and_reproduces_the_shipped_data(tmp_path: Path) -> None:
    script = REPO / "scripts" / "make_audioqa_data.py"
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        subprocess.run([sys.executable, str(script), "--out", str(out), "--train", "8", "--test", "2"],
                       check=True, capture_output=True)
    files = sorted(p.relative_to(runs[0]) for p in runs[0].rglob("*") if p.is_file())
    assert len(files) > 10
    assert files == sorted(p.relative_to(runs[1]) for p in runs[1].rglob("*") if p.is_file())
    for rel in files:
        assert (runs[0] / rel).read_bytes() == (runs[1] / rel).read_bytes(), rel
        if rel.parent.name == "clips":
            assert (runs[0] / rel).read_bytes() == (DATA / rel).read_bytes(), f"shipped {rel} is stale"
    for split, count in (("train", 8), ("test", 2)):
        assert load_records(runs[0] / f"{split}.jsonl") == SPLITS[split][:count]


# --- the env ---------------------------------------------------------------------
def test_check_env_and_conformance_pass() -> None:
    env = relax_gym.make("relax/AudioQA-v0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    # The terminal observation is [] (nothing to append); MessageSpace still asks for >= 1 message.
    unexpected = [str(w.message) for w in caught if "`step()` method is not within" not in str(w.message)]
    assert not unexpected
    report = run_checks("relax/AudioQA-v0", lambda: relax_gym.make("relax/AudioQA-v0"))
    assert report.passed, [r for r in report.results if not r.passed]


def test_prompt_has_audio_then_lettered_question() -> None:
    env = relax_gym.make("relax/AudioQA-v0", split="test", system_prompt="You are a careful listener.")
    obs, info = env.reset(seed=0)
    record = SPLITS["test"][info["index"]]
    assert [m["role"] for m in obs] == ["system", "user"] and info["id"] == record["id"]
    parts = obs[1]["content"]
    assert parts[0]["type"] == "audio" and parts[0]["sampling_rate"] == SR
    expected = read_pcm(clip_paths(record)[0])[0]
    np.testing.assert_allclose(parts[0]["audio"], expected, atol=1e-4)
    question = parts[-1]["text"]
    assert question.startswith(record["question"]) and "<answer></answer>" in question
    for letter, choice in zip("ABCD", record["choices"], strict=False):
        assert f"\n{letter}. {choice}\n" in question


def test_multi_clip_question_gives_labelled_audio_parts_in_order() -> None:
    env = relax_gym.make("relax/AudioQA-v0")
    index = next(i for i, r in enumerate(SPLITS["train"]) if len(clip_paths(r)) == 3)
    obs, info = env.reset(options={"index": index})
    parts = obs[0]["content"]
    assert info["num_clips"] == 3
    assert [p["type"] for p in parts] == ["text", "audio"] * 3 + ["text"]
    assert [parts[k]["text"] for k in (0, 2, 4)] == ["Clip 1:", "Clip 2:", "Clip 3:"]
    for k, path in zip((1, 3, 5), clip_paths(SPLITS["train"][index]), strict=True):
        np.testing.assert_allclose(parts[k]["audio"], read_pcm(path)[0], atol=1e-4)


@pytest.mark.parametrize("index", range(0, 63, 9))
def test_right_letter_scores_one_and_wrong_letter_zero(index: int) -> None:
    env = relax_gym.make("relax/AudioQA-v0")
    gold = SPLITS["train"][index]["answer"]
    env.reset(options={"index": index})
    obs, reward, terminated, truncated, info = env.step(f"I hear it. <answer>{gold}</answer>")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["reward"]["status"] == "ok" and info["answer"] == gold
    json.dumps(info)
    wrong = next(letter for letter in "ABCD" if letter != gold)
    env.reset(options={"index": index})
    assert env.step(f"<answer>{wrong}</answer>")[1] == 0.0


def test_garbage_actions_never_raise() -> None:
    env = relax_gym.make("relax/AudioQA-v0")
    env.action_space.seed(0)
    garbage = ["", "\x00" * 9, "<answer>", "<answer></answer>", "<answer>Z</answer>", "A or B", "\\boxed{"]
    garbage.append("🎵" * 50)
    for i, action in enumerate(garbage + [env.action_space.sample() for _ in range(20)]):
        env.reset(seed=i)
        _, reward, terminated, _, info = env.step(action)
        assert terminated and reward in (0.0, 1.0) and info["reward"]["status"] == "ok"


def test_step_outside_an_episode_raises() -> None:
    env = relax_gym.make("relax/AudioQA-v0")
    with pytest.raises(EpisodeOverError):
        env.step("A")
    env.reset(seed=1)
    env.step("A")
    with pytest.raises(EpisodeOverError):
        env.step("A")


def test_reset_is_seeded_and_observations_are_fresh() -> None:
    env = relax_gym.make("relax/AudioQA-v0")
    first, info = env.reset(seed=5)
    first[0]["content"][0]["audio"][:] = 0.0  # a caller scribbling on its observation
    again, info_again = env.reset(seed=5)
    assert info == info_again
    assert np.any(again[0]["content"][0]["audio"] != 0.0)
    indices = {env.reset(seed=s)[1]["index"] for s in range(30)}
    assert len(indices) > 10
    with pytest.raises(ValueError, match="index"):
        env.reset(options={"index": 10_000})


def test_state_round_trip_resumes_the_same_question() -> None:
    env = relax_gym.make("relax/AudioQA-v0")
    _, info = env.reset(seed=11)
    state = env.get_state()
    fresh = relax_gym.make("relax/AudioQA-v0")
    fresh.set_state(json.loads(json.dumps(state)))
    gold = SPLITS["train"][info["index"]]["answer"]
    assert fresh.step(f"<answer>{gold}</answer>")[1] == 1.0
    with pytest.raises(ValueError, match="outside"):
        fresh.set_state({**state, "episode": {"task": 999, "done": False}})


def test_cache_is_bounded() -> None:
    env = AudioQAEnv(cache_mb=0.05)  # room for about one clip
    for i in range(20):
        env.reset(options={"index": i})
    assert len(env.cache) <= 2 and env.cache.nbytes <= 0.05 * 2**20 + 2 * SR * 4


def test_unknown_split_names_what_exists() -> None:
    with pytest.raises(DatasetError, match=r"'dev'.*test\.jsonl"):
        AudioQAEnv(split="dev")


# --- users' data ------------------------------------------------------------------
def tone(freq: float, seconds: float = 0.3, rate: int = SR) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * freq * np.arange(round(seconds * rate)) / rate)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_user_jsonl_with_relative_paths_and_any_answer_form(tmp_path: Path) -> None:
    (tmp_path / "wavs").mkdir()
    (tmp_path / "wavs" / "low.wav").write_bytes(encode_wav(tone(440), SR))
    (tmp_path / "wavs" / "high.wav").write_bytes(encode_wav(tone(880), SR))
    choices = ["lower", "higher", "the same"]
    answers = ["B", 1, "higher", "(B)", "1"]
    records = [{"id": f"q{i}", "audio": ["wavs/low.wav", "wavs/high.wav"], "question": "Is clip 2 higher?",
                "choices": choices, "answer": a} for i, a in enumerate(answers)]
    env = AudioQAEnv(data_path=write_jsonl(tmp_path / "mine.jsonl", records))
    assert [t.answer for t in env.tasks] == ["B"] * len(answers)
    obs, _ = env.reset(options={"index": 2})
    waves = [p["audio"] for p in obs[0]["content"] if p["type"] == "audio"]
    assert [round(peak_hz(w)) for w in waves] == [440, 880]
    assert env.step("<answer>B</answer>")[1] == 1.0


def test_avqa_field_names_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "clip.wav").write_bytes(encode_wav(tone(500), SR))
    record = {"id": 7, "audio_path": "clip.wav", "question_text": "What is heard?",
              "multi_choice": ["a dog", "a tone", "a car", "rain"], "answer": 1, "question_type": "Come From"}
    task = AudioQAEnv(data_path=write_jsonl(tmp_path / "avqa.jsonl", [record])).tasks[0]
    assert (task.id, task.answer, task.task, task.question) == ("7", "B", "Come From", "What is heard?")


def test_user_parquet_with_audio_bytes(tmp_path: Path) -> None:
    low, high = encode_wav(tone(300), SR), encode_wav(tone(1200), SR)
    table = pa.table({
        "id": ["one", "two"],
        "audio": [
            [{"bytes": low, "path": "low.wav"}],
            [{"bytes": low, "path": "a.wav"}, {"bytes": high, "path": None}],
        ],
        "question": ["Is it a tone?", "Which clip is higher?"],
        "choices": [["yes", "no", "unsure"], ["clip 1", "clip 2", "neither"]],
        "answer": ["A", "clip 2"],
    })
    pq.write_table(table, tmp_path / "data.parquet")
    env = relax_gym.make("relax/AudioQA-v0", data_path=str(tmp_path / "data.parquet"))
    obs, _ = env.reset(options={"index": 1})
    waves = [p["audio"] for p in obs[0]["content"] if p["type"] == "audio"]
    assert [round(peak_hz(w)) for w in waves] == [300, 1200]
    assert env.step("<answer>B</answer>")[1] == 1.0


def test_data_path_folder_picks_the_split(tmp_path: Path) -> None:
    (tmp_path / "c.wav").write_bytes(encode_wav(tone(600), SR))
    record = {"audio": "c.wav", "question": "Tone?", "choices": ["yes", "no", "maybe"], "answer": 0}
    write_jsonl(tmp_path / "train.jsonl", [record])
    write_jsonl(tmp_path / "test.jsonl", [record, record])
    assert len(AudioQAEnv(data_path=tmp_path, split="test").tasks) == 2


def test_inline_arrays_resampled_to_the_target_rate(tmp_path: Path) -> None:
    record = {"audio": {"array": tone(1000, 0.5, 8000).tolist(), "sampling_rate": 8000},
              "question": "Tone?", "choices": ["yes", "no", "maybe"], "answer": "yes"}
    env = AudioQAEnv(data_path=write_jsonl(tmp_path / "inline.jsonl", [record]), target_sampling_rate=SR)
    part = env.reset(seed=0)[0][0]["content"][0]
    assert part["sampling_rate"] == SR and len(part["audio"]) == SR // 2
    assert round(peak_hz(part["audio"])) == 1000


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"audio": "x.wav", "question": "Q?", "choices": ["a", "b"], "answer": 2}, "outside the 2 choices"),
        ({"audio": "x.wav", "question": "Q?", "choices": ["a", "b"], "answer": "c"}, "no letter"),
        ({"audio": "x.wav", "question": "Q?", "answer": "A"}, "lacks 'choices'"),
        ({"audio": [], "question": "Q?", "choices": ["a", "b"], "answer": "A"}, "empty list"),
        ({"audio": "x.wav", "question": "", "choices": ["a", "b"], "answer": "A"}, "non-empty string"),
    ],
)
def test_malformed_records_fail_at_construction(tmp_path: Path, record: dict, match: str) -> None:
    with pytest.raises(DatasetError, match=match):
        AudioQAEnv(data_path=write_jsonl(tmp_path / "bad.jsonl", [record]))


def _truncated() -> bytes:
    data = encode_wav(tone(440), SR)
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"RIFF\x00\x00garbage that is not a wave file at all", "not a readable audio file"),
        (b"this is a text file, not audio\n" * 10, "not a readable audio file"),
        (b"", "empty"),
        (_truncated(), "truncated WAV"),
        (encode_wav(np.zeros(0), SR), "no samples"),
        (None, "not found"),
    ],
    ids=["corrupt", "not-audio", "empty", "truncated", "zero-frames", "missing"],
)
def test_bad_audio_file_raises_dataset_error_naming_it(tmp_path: Path, content: bytes | None, match: str):
    if content is not None:
        (tmp_path / "broken.wav").write_bytes(content)
    record = {"id": "r1", "audio": "broken.wav", "question": "Q?", "choices": ["a", "b"], "answer": "A"}
    env = AudioQAEnv(data_path=write_jsonl(tmp_path / "d.jsonl", [record]))
    with pytest.raises(DatasetError, match=match) as err:
        env.reset(seed=0)
    assert "broken.wav" in str(err.value)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("answer", [None, float("nan"), "", " "], ids=repr)
def test_missing_answer_fails_at_construction_naming_file_and_record(tmp_path: Path, fmt: str, answer) -> None:
    (tmp_path / "c.wav").write_bytes(encode_wav(tone(440), SR))
    # parquet columns have one type: a float column (where NaN lives) or a string one
    good = 0.0 if isinstance(answer, float) else "A"
    records = [{"id": f"q{i}", "audio": "c.wav", "question": "Tone?", "choices": ["yes", "no"], "answer": a}
               for i, a in enumerate([good, answer])]  # fmt: skip
    path = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        write_jsonl(path, records)
    with pytest.raises(DatasetError, match=r"record 1 .*'answer'.* missing|record 1 .*lacks 'answer'") as err:
        AudioQAEnv(data_path=path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("clip", "content", "match"),
    [
        ({"bytes": b"not audio at all" * 8, "path": "dog_bark.wav"}, None, "not a readable audio file"),
        ({"bytes": b"", "path": "dog_bark.wav"}, None, "empty"),
        ({"bytes": None, "path": "dog_bark.wav"}, None, "not found"),
        ({"bytes": None, "path": "dog_bark.wav"}, b"RIFF junk", "not a readable audio file"),
        ("dog_bark.wav", b"RIFF junk", "not a readable audio file"),
    ],
    ids=["parquet-corrupt-bytes", "parquet-empty-bytes", "parquet-missing-path", "parquet-bad-path", "jsonl-path"],
)
def test_audio_errors_name_data_file_record_and_clip(tmp_path: Path, clip, content: bytes | None, match: str) -> None:
    if content is not None:
        (tmp_path / "dog_bark.wav").write_bytes(content)
    (tmp_path / "fine.wav").write_bytes(encode_wav(tone(440), SR))
    good = "fine.wav" if isinstance(clip, str) else {"bytes": encode_wav(tone(440), SR), "path": "fine.wav"}
    records = [{"id": f"q{i}", "audio": [good, c], "question": "Tone?", "choices": ["yes", "no"], "answer": "A"}
               for i, c in enumerate([good, clip])]  # fmt: skip
    if isinstance(clip, str):
        path = write_jsonl(tmp_path / "d.jsonl", records)
    else:
        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    env = AudioQAEnv(data_path=path)
    env.reset(options={"index": 0})
    with pytest.raises(DatasetError, match=match) as err:
        env.reset(options={"index": 1})
    message = str(err.value)
    assert str(path) in message and "record 1 (id 'q1') clip 2" in message and "dog_bark.wav" in message, message


# --- decoding ---------------------------------------------------------------------
def test_stereo_flac_is_downmixed_at_its_own_rate(tmp_path: Path) -> None:
    left, right = tone(440, 0.2, 22050), tone(440, 0.2, 22050) * 0.0
    soundfile.write(tmp_path / "s.flac", np.stack([left, right], axis=1), 22050)
    samples, rate = load_audio("s.flac", base_dir=tmp_path)
    assert rate == 22050 and samples.dtype == np.float32 and samples.ndim == 1
    np.testing.assert_allclose(samples, left / 2, atol=1e-3)


def test_audio_dict_forms(tmp_path: Path) -> None:
    data = encode_wav(tone(700), SR)
    (tmp_path / "p.wav").write_bytes(data)
    from_bytes, _ = load_audio({"bytes": data, "path": "ignored.wav"})
    from_path, _ = load_audio({"bytes": None, "path": "p.wav"}, base_dir=tmp_path)
    np.testing.assert_array_equal(from_bytes, from_path)
    np.testing.assert_array_equal(from_bytes, decode_bytes(data, "x")[0])
    with pytest.raises(DatasetError, match="exceed"):
        load_audio({"array": [0, 1000, -1000], "sampling_rate": SR}, name="int pcm")
    with pytest.raises(DatasetError, match="sampling_rate"):
        load_audio({"array": [0.1, 0.2]}, name="no rate")


def test_resampling_keeps_pitch_and_removes_what_cannot_be_represented() -> None:
    down = resample(tone(1000).astype(np.float32), SR, 8000)
    assert len(down) == 0.3 * 8000 and round(peak_hz(down, 8000)) == 1000
    above_nyquist = resample(tone(6000).astype(np.float32), SR, 8000)
    assert rms(above_nyquist) < 1e-3, "a 6 kHz tone must vanish at 8 kHz, not alias to 2 kHz"
    up = resample(tone(1000).astype(np.float32), SR, 44100)
    assert len(up) == round(0.3 * 44100) and round(peak_hz(up, 44100)) == 1000
