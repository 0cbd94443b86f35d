"""Video: clips in messages (`relax_gym.video`), their preprocessing without torchvision
(`FramesVideoProcessor`, held to the stock `Qwen3VLVideoProcessor`'s outputs), and a clip's way through
the stack: the template, the processor, the rollout, the trajectory's JSONL and the viewer.

tests/fixtures/qwen_video_reference.npz is the stock processor's output on random frames (and the whole stock
Qwen3-VL processor's prompt ids), made by tests/fixtures/make_qwen_video_reference.py in a venv with torchvision.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relax_gym.engines import EmbeddedEngine, SamplingParams
from relax_gym.env.registration import make
from relax_gym.messages import MessageError, user, video
from relax_gym.models import FramesVideoProcessor, load_model, processor_inputs, save_model
from relax_gym.rollout import RolloutLimits, RolloutManager
from relax_gym.trajectory import read_jsonl, write_jsonl
from relax_gym.video import Video, VideoError, read_video, video_from_frames
from relax_gym.viewer.render import render_html

REFERENCE = np.load(Path(__file__).resolve().parents[1] / "fixtures" / "qwen_video_reference.npz")
#: the reference's processor settings (tiny-vl's patch and merge, a small pixel budget)
SIZE = {"shortest_edge": 4 * 32 * 32, "longest_edge": 2 * 16 * 32 * 32}


@pytest.fixture(scope="module")
def tiny_vl():
    return load_model("tiny-vl")


@pytest.mark.parametrize("clip", ["odd", "big"])
def test_frames_give_the_stock_processors_patches_and_grid(clip):
    """"odd": 5 frames upscaled (the last frame repeats to fill the temporal patch); "big": 4 frames downscaled."""
    frames = REFERENCE[f"{clip}_frames"]
    out = FramesVideoProcessor(size=SIZE)([video_from_frames(list(frames), 2.0)], return_tensors="np")
    stock = REFERENCE[f"{clip}_pixel_values_videos_u8"].astype(np.float32) / 255 * 2 - 1
    assert np.array_equal(out["video_grid_thw"], REFERENCE[f"{clip}_video_grid_thw"])
    np.testing.assert_allclose(out["pixel_values_videos"], stock, atol=1e-6)


def test_tiny_vl_prompt_ids_equal_the_stock_qwen3_vl_processors(tiny_vl):
    """Timestamps, vision tags and placeholder counts: the stock processor's expansion of the same clip."""
    messages = [user(video(list(REFERENCE["odd_frames"]), fps=2.0), "what moved?")]
    inputs = processor_inputs(tiny_vl, messages)
    assert inputs["input_ids"][0].tolist() == REFERENCE["vl_input_ids"].tolist()
    assert inputs["video_grid_thw"].tolist() == REFERENCE["vl_video_grid_thw"].tolist()
    types = inputs["mm_token_type_ids"][0]
    assert int((types == 2).sum()) == int((inputs["input_ids"][0] == tiny_vl.processor.video_token_id).sum()) > 0


def test_a_clip_is_checked_where_it_is_made():
    frame = Image.new("RGB", (32, 24))
    with pytest.raises(VideoError, match="at most 4"):
        video_from_frames([frame] * 5, 2.0, max_frames=4)
    with pytest.raises(VideoError, match="pixels: at most 1000"):
        video_from_frames([frame] * 2, 2.0, max_pixels=1000)
    with pytest.raises(VideoError, match="share one size"):
        video_from_frames([frame, Image.new("RGB", (24, 32))], 2.0)
    with pytest.raises(VideoError, match="fps"):
        video_from_frames([frame], 0.0)
    with pytest.raises(VideoError, match="at least one frame"):
        video_from_frames([], 2.0)
    with pytest.raises(MessageError, match="rate is needed"):
        video([frame])
    with pytest.raises(MessageError, match="needs a relax_gym Video"):
        user({"type": "video", "video": [frame]})
    clip = video_from_frames([np.zeros((24, 32, 3), np.uint8)] * 3, 4.0)
    assert clip.frames[0].mode == "RGB" and clip.duration_s == 0.75


def test_read_video_decodes_a_file_at_the_asked_rate_and_names_a_bad_file(tmp_path):
    import av

    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(20):  # 2 s at 10 fps: a bright bar moving right
            pixels = np.zeros((48, 64, 3), np.uint8)
            pixels[:, 3 * i: 3 * i + 4] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    clip = read_video(path, fps=2.0)
    assert len(clip.frames) == 4 and clip.frames[0].size == (64, 48) and clip.fps == pytest.approx(2.0)
    bars = [int(np.asarray(f.convert("L")).mean(axis=0).argmax()) for f in clip.frames]
    assert bars == sorted(bars) and bars[0] < bars[-1]  # the frames come in order
    assert len(read_video(path, fps=30.0, max_frames=8).frames) == 8
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    with pytest.raises(VideoError, match=r"bad\.mp4"):
        read_video(tmp_path / "bad.mp4")


def test_video_qa_rolls_out_on_tiny_vl_and_its_clips_survive_jsonl_and_show_in_the_viewer(tiny_vl, tmp_path):
    manager = RolloutManager(EmbeddedEngine(load_model("tiny-vl")), tiny_vl, sampling_seed=0,
                             sampling=SamplingParams(max_new_tokens=6), limits=RolloutLimits(max_turns=1))
    trajs = asyncio.run(manager.run("relax/VideoQA-v0", 2, 2))
    assert all(t.status in ("completed", "truncated") for t in trajs)
    assert all(t.metrics["rerender_match"] for t in trajs)  # the processor expands the re-render too
    assert all(isinstance(t.media[0], Video) and "pixel_values_videos" in t.mm_inputs for t in trajs)
    write_jsonl(trajs, tmp_path / "v.jsonl")
    back = list(read_jsonl(tmp_path / "v.jsonl"))
    original, restored = trajs[0].media[0], back[0].media[0]
    assert restored.fps == original.fps and len(restored.frames) == len(original.frames)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(original.frames, restored.frames,
                                                                            strict=True))  # PNG: lossless
    html = render_html(back, title="v")
    assert html.count('class="strip"') == len(back) and "8 frames · 2 fps" in html


def test_a_saved_tiny_vl_folder_loads_with_its_video_processor(tiny_vl, tmp_path):
    save_model(tiny_vl, tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())["video_processor"]
    assert saved["video_processor_type"] == "Qwen3VLVideoProcessor" and saved["do_sample_frames"] is False
    loaded = load_model(str(tmp_path))
    assert isinstance(loaded.processor.video_processor, FramesVideoProcessor)
    assert loaded.processor.video_processor.to_dict() == tiny_vl.processor.video_processor.to_dict()
    assert loaded.modalities == ("text", "image", "video")
    messages = [user(video(list(REFERENCE["big_frames"]), fps=2.0), "?")]
    assert processor_inputs(loaded, messages)["input_ids"].tolist() == \
        processor_inputs(tiny_vl, messages)["input_ids"].tolist()


def test_video_qa_answers_follow_from_the_clip():
    env = make("relax/VideoQA-v0", kinds=["direction"])
    for seed in range(6):
        obs, info = env.reset(seed=seed)
        clip = next(p["video"] for p in obs[-1]["content"] if p["type"] == "video")
        first, last = (np.asarray(f.convert("L"), np.float32) for f in (clip.frames[0], clip.frames[-1]))
        (y0, x0), (y1, x1) = (np.argwhere(f < 200).mean(axis=0) for f in (first, last))
        seen = ("right" if x1 > x0 else "left") if abs(x1 - x0) > abs(y1 - y0) else ("down" if y1 > y0 else "up")
        question = next(p["text"] for p in obs[-1]["content"] if p["type"] == "text")
        letter = next(line[0] for line in question.splitlines() if line[1:3] == ". " and line[3:] == seen)
        assert info["answer"] == letter
        assert env.step(f"<answer>{letter}</answer>")[1] == 1.0
    with pytest.raises(ValueError, match="kinds"):
        make("relax/VideoQA-v0", kinds=["colour"])


def test_a_model_without_video_refuses_a_clip():
    audio_model = load_model("tiny-audio")
    with pytest.raises(ValueError, match="takes no video"):
        processor_inputs(audio_model, [user(video([Image.new("RGB", (32, 32))] * 2, fps=1.0), "?")])


def test_a_server_decodes_every_frame_of_a_lossless_clip_and_refuses_others(tmp_path):
    """What the SGLang client sends (`video_data_url`) comes back frame for frame at its rate; a codec off the
    list, too many frames or frames too large are refused before or while decoding, naming the field."""
    import av

    from relax_gym.engines.server_media import MediaError, decode_video
    from relax_gym.engines.sglang import video_data_url

    rng = np.random.default_rng(1)
    clip = video_from_frames([Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)) for _ in range(5)],
                             2.5)
    back = decode_video(video_data_url(clip), "video_data[0]", max_frames=8, max_pixels=32 * 24)
    assert back.fps == 2.5 and all(np.array_equal(np.asarray(a), np.asarray(b))
                                   for a, b in zip(clip.frames, back.frames, strict=True))
    with pytest.raises(MediaError, match=r"video_data\[0\]: .*more than 4 frames"):
        decode_video(video_data_url(clip), "video_data[0]", max_frames=4, max_pixels=32 * 24)
    with pytest.raises(MediaError, match="over 100 pixels"):
        decode_video(video_data_url(clip), "video_data[0]", max_frames=8, max_pixels=100)
    path = tmp_path / "clip.avi"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=2)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuvj420p"
        for frame in clip.frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame).reformat(format="yuvj420p")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    mjpeg = "data:video/avi;base64," + base64.b64encode(path.read_bytes()).decode()
    with pytest.raises(MediaError, match="codec 'mjpeg' is not one of"):
        decode_video(mjpeg, "video_data[0]", max_frames=8, max_pixels=32 * 24)
