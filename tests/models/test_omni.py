"""The omni model (`tiny-omni`, Qwen3-Omni's thinker) and the audio-visual env (`relax/AVQA-v0`): text, images,
audio and video in one conversation through the stock Qwen3-Omni processor, batched in the trainer as alone,
a saved folder that reloads as it was, routing replay on its experts, and AVQA's drawn tasks and its loader for
AVQA-R1-6K files (EchoInk-R1's layout)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from relax_gym.engines import EmbeddedEngine, GenerateRequest, SamplingParams
from relax_gym.env.registration import make
from relax_gym.envs.datasets import DatasetError
from relax_gym.messages import audio, image, user, video
from relax_gym.models import load_model, processor_inputs, save_model
from relax_gym.models.moe_routing import recording, routers
from relax_gym.trainer.backends.torch_backend import TorchBackend
from relax_gym.trainer.batch import Sample


@pytest.fixture(scope="module")
def omni():
    return load_model("tiny-omni")


def _frames(seed: int, n: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(n)]


def _tone(seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(16_000 * seconds)) / 16_000)).astype(np.float32)


def _conversation(seed: int, seconds: float, frames: int):
    return [user(image(_frames(seed, 1)[0]), audio(_tone(seconds), 16_000), video(_frames(seed + 1, frames), 2.0),
                 "What do you see and hear?")]


def test_one_conversation_takes_every_modality_and_a_saved_folder_reloads_it(omni, tmp_path):
    assert omni.modalities == ("text", "image", "audio", "video") and len(routers(omni.model)) == 2
    inputs = processor_inputs(omni, _conversation(0, 1.5, 4))
    ids = inputs["input_ids"][0]
    for token in ("image_token_id", "audio_token_id", "video_token_id"):
        assert int((ids == getattr(omni.processor, token)).sum()) > 0, token
    logits = omni.model(**inputs).logits
    save_model(omni, tmp_path)
    again = load_model(str(tmp_path))
    assert type(again.processor).__name__ == "Qwen3OmniMoeProcessor" and again.modalities == omni.modalities
    inputs_again = processor_inputs(again, _conversation(0, 1.5, 4))
    assert torch.equal(inputs_again["input_ids"], inputs["input_ids"])
    assert torch.allclose(again.model(**inputs_again).logits, logits, atol=1e-5)


def test_the_trainer_batches_clips_of_different_lengths_as_it_runs_them_alone(omni):
    """Audio features of different lengths pad in time to concatenate (the model reads lengths from the mask)."""
    samples = []
    for seed, (seconds, frames) in enumerate(((0.5, 4), (2.5, 6))):
        inputs = processor_inputs(omni, _conversation(seed, seconds, frames))
        ids = [*inputs["input_ids"][0].tolist(), 11, 12, 13]
        media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        samples.append(Sample(ids, [0] * (len(ids) - 3) + [1] * 3, [0.0] * len(ids), mm_inputs=media))
    assert samples[0].mm_inputs["input_features"].shape[-1] != samples[1].mm_inputs["input_features"].shape[-1]
    backend = TorchBackend(load_model("tiny-omni"))
    together = backend.logprobs(samples)
    for sample, batched in zip(samples, together, strict=True):
        alone = backend.logprobs([sample])[0]
        assert torch.allclose(batched.logprobs, alone.logprobs, atol=1e-5)


def test_the_engine_routes_omni_tokens_and_the_trainer_replays_them(omni):
    inputs = processor_inputs(omni, _conversation(3, 1.0, 4))
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    request = GenerateRequest(inputs["input_ids"][0].tolist(), SamplingParams(max_new_tokens=4), mm_inputs=media,
                              return_routed_experts=True)

    async def generate():
        engine = EmbeddedEngine(load_model("tiny-omni"))
        try:
            return await engine.generate(request)
        finally:
            await engine.close()

    out = asyncio.run(generate())
    ids = request.input_ids + out.output_ids
    routes = out.routed_experts.reshape(len(ids) - 1, 2, 2)
    backend = TorchBackend(load_model("tiny-omni"), replay_routes=True)
    sample = Sample(ids, [0] * len(request.input_ids) + [1] * len(out.output_ids), [0.0] * len(ids),
                    mm_inputs=media, routed_experts=routes)
    with recording(backend.model) as taken:
        backend.logprobs([sample])
    replayed = torch.stack([layer[0] for layer in taken], dim=1)[: len(routes)]
    assert torch.equal(replayed, torch.as_tensor(routes).long())


def test_avqa_drawn_answers_need_the_picture_and_the_sound():
    env = make("relax/AVQA-v0")
    for seed in range(6):
        obs, info = env.reset(seed=seed)
        parts = obs[-1]["content"]
        picture = next(p["image"] for p in parts if p["type"] == "image")
        wave = next(p["audio"] for p in parts if p["type"] == "audio")
        pixels = np.asarray(picture, np.int32)
        shape = pixels[31, 18]  # inside the first square
        colour = min({"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
                      "yellow": (230, 200, 30)}.items(), key=lambda kv: np.abs(shape - kv[1]).sum())[0]
        loud = np.sqrt((wave[: len(wave) // 160 * 160].reshape(-1, 160) ** 2).mean(axis=1)) > 0.1  # 10 ms windows
        beeps = int(np.sum(loud[1:] & ~loud[:-1]) + loud[0])
        question = next(p["text"] for p in parts if p["type"] == "text")
        right = f"{colour} shapes, {beeps} beep{'s' * (beeps > 1)}"
        letter = next(line[0] for line in question.splitlines() if line[3:] == right)
        assert info["answer"] == letter
        assert env.step(f"<answer>{letter}</answer>")[1] == 1.0


def _echoink_folder(tmp_path, records):
    (tmp_path / "images").mkdir(parents=True)
    (tmp_path / "audios").mkdir()
    Image.new("RGB", (40, 30), "red").save(tmp_path / "images" / "sample_0.jpg")
    soundfile.write(tmp_path / "audios" / "sample_0.wav", _tone(0.5), 16_000)
    (tmp_path / "omni_rl_format_train.json").write_text(json.dumps(records))
    return tmp_path


ECHOINK = {
    "problem_id": 7, "problem": "What is making the sound?", "data_type": "image_audio",
    "problem_type": "multiple choice", "options": ["A. a dog", "B. a car", "C. a bell", "D. rain"],
    "solution": "<answer>C</answer>", "path": {"image": "images/sample_0.jpg", "audio": "audios/sample_0.wav"},
    "data_source": "OmniInstruct_v1-AVQA",
}


def test_avqa_reads_avqa_r1_6k_files(tmp_path):
    folder = _echoink_folder(tmp_path, [ECHOINK])
    env = make("relax/AVQA-v0", data_path=str(folder), split="train")
    obs, info = env.reset(seed=0)
    parts = obs[-1]["content"]
    assert [p["type"] for p in parts] == ["image", "audio", "text"]
    assert parts[0]["image"].size == (40, 30) and parts[1]["sampling_rate"] == 16_000
    assert "C. a bell" in parts[2]["text"] and "C. C." not in parts[2]["text"]
    assert info == {"id": "7", "answer": "C", "index": 0}
    assert env.step("It rings. <answer>C</answer>")[1] == 1.0


def test_avqa_names_the_record_and_the_file_of_bad_data(tmp_path):
    with pytest.raises(DatasetError, match=r"record 0 \(id 7\).*'solution'"):
        make("relax/AVQA-v0", data_path=str(_echoink_folder(tmp_path / "a", [{**ECHOINK, "solution": ""}])))
    with pytest.raises(DatasetError, match=r"record 0 .*needs an image and an audio"):
        make("relax/AVQA-v0", data_path=str(_echoink_folder(tmp_path / "b", [{**ECHOINK, "path": {}}])))
    broken = {**ECHOINK, "path": {"image": "images/missing.jpg", "audio": "audios/sample_0.wav"}}
    env = make("relax/AVQA-v0", data_path=str(_echoink_folder(tmp_path / "c", [broken])))
    with pytest.raises(DatasetError, match=r"record 0 .*missing\.jpg"):
        env.reset(seed=0)
