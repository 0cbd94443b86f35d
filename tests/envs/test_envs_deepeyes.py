"""DeepEyes env: zoom/rotate geometry against direct crops, rewards, judges, user data, snapshots."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gymnasium.utils.env_checker import check_env
from PIL import Image

import relax_gym
from relax_gym.envs.datasets import DatasetError, shipped_path
from relax_gym.envs.deepeyes import DeepEyesEnv
from relax_gym.rewards import RewardResult

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_deepeyes_data.py"
BICUBIC = Image.Resampling.BICUBIC


def call(name: str, arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def zoom(bbox: list[float], **extra: Any) -> str:
    return call("image_zoom_in", {"bbox_2d": bbox, **extra})


def images_of(observation: list[dict]) -> list[Image.Image]:
    return [p["image"] for m in observation for p in m["content"] if p["type"] == "image"]


def texts_of(observation: list[dict]) -> str:
    return " ".join(p["text"] for m in observation for p in m["content"] if p["type"] == "text")


def original(env: DeepEyesEnv, index: int) -> Image.Image:
    path = env.source.parent / env.records[index]["images"][0]["path"]
    with Image.open(path) as img:
        return img.convert("RGB")


def same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


def first_index(env: DeepEyesEnv, task_type: str) -> int:
    return next(i for i, r in enumerate(env.records) if r["extra_info"]["task_type"] == task_type)


def short_side_224(w: int, h: int) -> tuple[int, int]:
    """The zoom display rule at the defaults, for crops smaller than 224 on their short side."""
    scale = 224 / min(w, h)
    return round(w * scale), round(h * scale)


@pytest.fixture
def env() -> DeepEyesEnv:
    return relax_gym.make("relax/DeepEyes-v0")  # type: ignore[return-value]


def test_check_env_passes(env: DeepEyesEnv) -> None:
    check_env(env)
    assert env.metadata["modalities"] == ("text", "image")
    assert set(env.metadata["tools"]) == {"image_zoom_in", "image_rotate"}


def test_reset_shows_system_prompt_then_image_and_question(env: DeepEyesEnv) -> None:
    obs, info = env.reset(options={"index": 0})
    assert [m["role"] for m in obs] == ["system", "user"]
    assert "<answer>" in obs[0]["content"][0]["text"] and "image_zoom_in" in obs[0]["content"][0]["text"]
    kinds = [p["type"] for p in obs[1]["content"]]
    assert kinds == ["image", "text"]
    assert same_pixels(obs[1]["content"][0]["image"], original(env, 0))
    assert obs[1]["content"][1]["text"] == env.records[0]["extra_info"]["question"]
    assert info["view"] == {"box": [0, 0, 896, 672], "rotation": 0}
    json.dumps(info)
    again, _ = env.reset(options={"index": 0})
    assert again[1]["content"][0]["image"] is not obs[1]["content"][0]["image"]  # fresh objects


def test_zoom_on_target_gives_the_exact_crop_and_full_reward(env: DeepEyesEnv) -> None:
    index = first_index(env, "code")
    env.reset(options={"index": index})
    record = env.records[index]
    x1, y1, x2, y2 = record["extra_info"]["target_bbox"]
    obs, reward, terminated, truncated, info = env.step(zoom([x1, y1, x2, y2], label="the sign"))
    assert (reward, terminated, truncated) == (0.0, False, False)
    (shown,) = images_of(obs)
    expected = original(env, index).crop((x1, y1, x2, y2)).resize(short_side_224(x2 - x1, y2 - y1), BICUBIC)
    assert same_pixels(shown, expected)
    assert min(shown.size) == 224
    assert info["view"]["box"] == [x1, y1, x2, y2]
    assert str([x1, y1, x2, y2]) in texts_of(obs)

    gold = record["reward_model"]["ground_truth"]
    obs, reward, terminated, truncated, info = env.step(
        f"<think>It reads {gold}.</think><answer>{gold}</answer>"
    )
    assert obs == [] and terminated and not truncated
    assert reward == pytest.approx(1.0 + 0.1 + 0.2)
    assert info["reward_parts"] == {"accuracy": 1.0, "format": 1.0, "tool": 1.0}
    assert info["reward"]["status"] == "ok" and info["reward"]["extracted"] == gold
    json.dumps(info)


def test_compound_zoom_maps_back_to_original_pixels(env: DeepEyesEnv) -> None:
    env.reset(options={"index": 0})
    obs, *_ = env.step(zoom([100, 100, 212, 184]))  # 112x84 crop, shown at 299x224
    assert images_of(obs)[0].size == (299, 224)
    obs, _, _, _, info = env.step(zoom([30, 56, 180, 168]))
    # x: 100 + [30, 180] * 112/299 = [111.24, 167.42] -> [111, 168]; y: 100 + [56, 168] * 84/224 = [121, 163]
    assert info["view"]["box"] == [111, 121, 168, 163]
    expected = original(env, 0).crop((111, 121, 168, 163)).resize(short_side_224(57, 42), BICUBIC)
    assert same_pixels(images_of(obs)[0], expected)


def test_normalized_bbox_is_relative_to_the_current_view() -> None:
    env = relax_gym.make("relax/DeepEyes-v0", bbox_format="normalized")
    env.reset(options={"index": 0})
    assert "0 to 1000" in env.system_prompt
    *_, info = env.step(zoom([250, 250, 500, 500]))
    assert info["view"]["box"] == [224, 168, 448, 336]
    *_, info = env.step(zoom([0, 500, 1000, 1000]))  # lower half of the 224x168 view
    assert info["view"]["box"] == [224, 252, 448, 336]


def test_rotate_turns_the_view_and_later_zooms_follow_it(env: DeepEyesEnv) -> None:
    env.reset(options={"index": 0})
    full = original(env, 0)
    obs, *_, info = env.step(call("image_rotate", {"angle": 90}))
    assert same_pixels(images_of(obs)[0], full.transpose(Image.Transpose.ROTATE_90))
    assert info["view"] == {"box": [0, 0, 896, 672], "rotation": 90}
    # In the 672x896 view turned 90 degrees counter-clockwise, (u, v) shows original (896 - v, u).
    obs, *_, info = env.step(zoom([0, 0, 100, 200]))
    assert info["view"] == {"box": [696, 0, 896, 100], "rotation": 90}
    expected = full.crop((696, 0, 896, 100)).resize((448, 224), BICUBIC).transpose(Image.Transpose.ROTATE_90)
    assert same_pixels(images_of(obs)[0], expected)
    *_, info = env.step(call("image_rotate", {"angle": 270}))
    assert info["view"] == {"box": [696, 0, 896, 100], "rotation": 0}


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (zoom([300, 300, 200, 400]), "x2 > x1"),
        (zoom([900, 10, 990, 60]), "outside the image"),
        (zoom([10, 10, 13, 13]), "at least 8"),
        (zoom([10, 10, 400]), "4 numbers"),
        (
            '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [NaN, 1, 50, 50]}}</tool_call>',
            "finite",
        ),
        (call("image_zoom_in", {"bbox_2d": "the sign"}), "invalid arguments"),
        (call("image_rotate", {"angle": 45}), "90, 180 or 270"),
        (call("image_rotate", {"angle": "sideways"}), "invalid arguments"),
        (call("image_zoom", {"bbox_2d": [0, 0, 50, 50]}), "unknown tool"),
        ("<tool_call>{not json}</tool_call>", "malformed JSON"),
    ],
)
def test_bad_calls_become_error_observations(env: DeepEyesEnv, action: str, message: str) -> None:
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert images_of(obs) == [] and "Error" in texts_of(obs) and message in texts_of(obs)
    assert info["tool_errors"] == 1 and info["view"] == {"box": [0, 0, 896, 672], "rotation": 0}
    *_, info = env.step(zoom([0, 0, 448, 336]))  # the episode goes on
    assert info["view"]["box"] == [0, 0, 448, 336]


def test_boxes_past_the_edge_are_clipped(env: DeepEyesEnv) -> None:
    env.reset(options={"index": 0})
    *_, info = env.step(zoom([-20, 600, 100, 700]))
    assert info["view"]["box"] == [0, 600, 100, 672]


def test_correct_answer_without_a_successful_tool_call_gets_no_tool_bonus(env: DeepEyesEnv) -> None:
    gold = env.records[0]["reward_model"]["ground_truth"]
    env.reset(options={"index": 0})
    _, reward, *_, info = env.step(f"<answer>{gold}</answer>")
    assert reward == pytest.approx(1.1) and info["reward_parts"]["tool"] == 0.0

    env.reset(options={"index": 0})
    env.step(zoom([5, 5, 1, 1]))  # a failed call earns nothing
    _, reward, *_, info = env.step(f"<answer>{gold}</answer>")
    assert reward == pytest.approx(1.1)


def test_wrong_or_untagged_answers(env: DeepEyesEnv) -> None:
    gold = env.records[0]["reward_model"]["ground_truth"]
    env.reset(options={"index": 0})
    env.step(zoom([0, 0, 448, 336]))
    _, reward, *_, info = env.step("<answer>0000</answer>")
    assert reward == pytest.approx(0.1)  # format only: the tool bonus needs a right answer
    assert info["reward_parts"] == {"accuracy": 0.0, "format": 1.0, "tool": 0.0}

    env.reset(options={"index": 0})
    _, reward, *_, info = env.step(gold)
    assert reward == pytest.approx(1.0) and "format" in info["reward"]["detail"]


def test_multiple_choice_record_is_graded_by_letter(env: DeepEyesEnv) -> None:
    index = first_index(env, "arrow")
    extra = env.records[index]["extra_info"]
    letter = env.records[index]["reward_model"]["ground_truth"]
    wrong = next(c for c in "ABCD" if c != letter)
    env.reset(options={"index": index})
    assert env.step(f"<answer>{letter}</answer>")[1] == pytest.approx(1.1)
    env.reset(options={"index": index})
    option_text = extra["choices"]["ABCD".index(letter)]
    assert env.step(f"<answer>{option_text}</answer>")[1] == pytest.approx(1.1)
    env.reset(options={"index": index})
    assert env.step(f"<answer>{wrong}</answer>")[1] == pytest.approx(0.1)


def test_weights_are_configurable() -> None:
    env = relax_gym.make("relax/DeepEyes-v0", acc_weight=0.8, format_weight=0.2, tool_weight=1.2)
    gold = env.records[0]["reward_model"]["ground_truth"]
    env.reset(options={"index": 0})
    env.step(zoom([0, 0, 448, 336]))
    assert env.step(f"<answer>{gold}</answer>")[1] == pytest.approx(2.2)


def test_judge_replaces_the_accuracy_check() -> None:
    seen: list[tuple[str, str, str]] = []

    def judge(question: str, gold: str, prediction: str) -> float:
        seen.append((question, gold, prediction))
        return 1.0

    env = relax_gym.make("relax/DeepEyes-v0", judge=judge)
    env.reset(options={"index": 0})
    _, reward, *_, info = env.step("<answer>a red sign says something</answer>")
    record = env.records[0]
    assert seen == [
        (
            record["extra_info"]["question"],
            record["reward_model"]["ground_truth"],
            "a red sign says something",
        )
    ]
    assert reward == pytest.approx(1.1) and info["reward"]["status"] == "ok"

    env = relax_gym.make("relax/DeepEyes-v0", judge=lambda q, g, p: RewardResult(0.5, detail="half right"))
    env.reset(options={"index": 0})
    _, reward, *_, info = env.step("<answer>x</answer>")
    assert reward == pytest.approx(0.6) and "half right" in info["reward"]["detail"]


@pytest.mark.parametrize(
    ("judge", "reason"),
    [
        (lambda q, g, p: 1 / 0, "ZeroDivisionError"),
        (lambda q, g, p: "yes", "not a number"),
        (lambda q, g, p: 7.0, "outside [0, 1]"),
        (lambda q, g, p: RewardResult(0.0, "timeout", "judge took too long"), "too long"),
    ],
)
def test_failing_judge_is_recorded_not_raised(judge: Any, reason: str) -> None:
    env = relax_gym.make("relax/DeepEyes-v0", judge=judge)
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<answer>1234</answer>")
    assert (obs, reward, terminated, truncated) == ([], 0.0, True, False)
    assert info["reward"]["status"] in ("error", "timeout") and reason in info["reward"]["detail"]
    json.dumps(info)


def test_turn_limit_truncates() -> None:
    env = relax_gym.make("relax/DeepEyes-v0", max_turns=2)
    env.reset(options={"index": 0})
    assert env.step(zoom([0, 0, 448, 336]))[3] is False
    _, reward, terminated, truncated, info = env.step(zoom([0, 0, 224, 168]))
    assert (reward, terminated, truncated, info["truncated_by"]) == (0.0, False, True, "max_turns")


def test_state_round_trip_resumes_the_same_crop(env: DeepEyesEnv) -> None:
    env.reset(seed=3)
    env.step(zoom([100, 100, 500, 400]))
    state = env.get_state()
    other = DeepEyesEnv()
    other.set_state(state)
    first = env.step(zoom([10, 20, 200, 150], label="inner"))
    second = other.step(zoom([10, 20, 200, 150], label="inner"))
    assert first[4] == second[4] and first[4]["view"]["box"] != [100, 100, 500, 400]
    assert same_pixels(images_of(first[0])[0], images_of(second[0])[0])
    assert texts_of(first[0]) == texts_of(second[0])


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def user_record(image_entry: Any, answer: str = "7") -> dict[str, Any]:
    return {
        "data_source": "user",
        "prompt": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Look: <image>\nHow many?"},
        ],
        "images": [image_entry],
        "reward_model": {"style": "model", "ground_truth": answer},
        "extra_info": {"index": 0},
    }


def picture(size: tuple[int, int] = (448, 336)) -> Image.Image:
    image = Image.new("RGB", size, (10, 20, 30))
    image.paste((200, 50, 50), (40, 30, 90, 80))
    return image


def test_user_parquet_with_image_bytes_loads(tmp_path: Path) -> None:
    pic = picture()
    records = [user_record({"bytes": png_bytes(pic), "path": None}, answer=str(i)) for i in range(3)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet")
    for data_path in (tmp_path / "train.parquet", tmp_path):  # a file, or a folder holding <split>.parquet
        env = DeepEyesEnv(data_path=data_path)
        obs, _ = env.reset(options={"index": 2})
        assert [p["type"] for p in obs[1]["content"]] == ["text", "image", "text"]
        assert obs[1]["content"][0]["text"] == "Look:" and obs[1]["content"][2]["text"] == "How many?"
        assert same_pixels(obs[1]["content"][1]["image"], pic)
        assert env.step("<answer>2</answer>")[1] == pytest.approx(1.1)


def test_user_jsonl_with_relative_paths_loads(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    picture().save(tmp_path / "imgs" / "a.png")
    lines = [json.dumps(user_record("imgs/a.png")), json.dumps(user_record({"path": "imgs/a.png"}))]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    env = DeepEyesEnv(data_path=tmp_path / "data.jsonl")
    for index in (0, 1):
        obs, _ = env.reset(options={"index": index})
        assert same_pixels(images_of(obs)[0], picture())
        *_, info = env.step(zoom([40, 30, 90, 80]))
        assert info["view"]["box"] == [40, 30, 90, 80]


def test_large_user_image_is_shown_downscaled_and_zooms_map_back(tmp_path: Path) -> None:
    picture((2000, 1000)).save(tmp_path / "big.png")
    (tmp_path / "data.jsonl").write_text(json.dumps(user_record("big.png")) + "\n")
    env = DeepEyesEnv(data_path=tmp_path / "data.jsonl", max_image_side=1000)
    obs, _ = env.reset()
    assert images_of(obs)[0].size == (1000, 500)
    *_, info = env.step(zoom([100, 50, 300, 250]))
    assert info["view"]["box"] == [200, 100, 600, 500]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing"])
def test_bad_image_file_raises_dataset_error_at_reset(tmp_path: Path, damage: str) -> None:
    good = png_bytes(picture())
    if damage != "missing":
        (tmp_path / "bad.png").write_bytes(
            b"\x89PNG\r\n\x1a\nnot really" if damage == "garbage" else good[:200]
        )
    (tmp_path / "data.jsonl").write_text(json.dumps(user_record({"path": "bad.png"})) + "\n")
    env = DeepEyesEnv(data_path=tmp_path / "data.jsonl")
    with pytest.raises(DatasetError, match=r"record 0.*bad\.png"):
        env.reset()


def test_bad_records_and_arguments_fail_clearly(tmp_path: Path) -> None:
    record = user_record("a.png")
    del record["reward_model"]
    (tmp_path / "data.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(DatasetError, match="reward_model"):
        DeepEyesEnv(data_path=tmp_path / "data.jsonl")
    with pytest.raises(DatasetError, match="not found"):
        DeepEyesEnv(data_path=tmp_path / "nope.parquet")
    with pytest.raises(ValueError, match="bbox_format"):
        DeepEyesEnv(bbox_format="relative")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="index"):
        DeepEyesEnv().reset(options={"index": 10_000})


def test_shipped_data_targets_are_small_and_inside_the_image() -> None:
    folder = shipped_path("deepeyes")
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 3 * 2**20
    for split, count in (("train", 48), ("test", 16)):
        env = DeepEyesEnv(split=split)
        assert len(env.records) == count
        kinds = {r["extra_info"]["task_type"] for r in env.records}
        assert kinds == {"code", "word", "shape_colour", "dot_count", "arrow"}
        for record in env.records:
            x1, y1, x2, y2 = record["extra_info"]["target_bbox"]
            assert 0 <= x1 < x2 <= 896 and 0 <= y1 < y2 <= 672
            assert max(x2 - x1, y2 - y1) <= 56  # about two 28-pixel patches: too small without a zoom


def test_generator_is_deterministic(tmp_path: Path) -> None:
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / name
        cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--train", "5", "--test", "1", "--seed", "7"]
        subprocess.run(cmd, check=True, capture_output=True)
        outputs.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == 2 + 6
    records = [json.loads(line) for line in outputs[0][Path("train.jsonl")].decode().splitlines()]
    assert [r["images"][0]["path"] for r in records] == [f"images/train_{i:03d}.png" for i in range(5)]


def write_records(path: Path, records: list[dict[str, Any]]) -> Path:
    """JSON lines, or parquet written by pyarrow (which keeps a float NaN as NaN)."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))  # json writes NaN as the literal NaN
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("gold", [None, float("nan"), "", "  "], ids=repr)
def test_missing_ground_truth_fails_at_construction_naming_file_and_record(
    tmp_path: Path, suffix: str, gold: Any
) -> None:
    picture().save(tmp_path / "a.png")
    # A float column for NaN (parquet columns have one type), a string one otherwise.
    good = 7.0 if isinstance(gold, float) else "7"
    path = write_records(tmp_path / f"data{suffix}", [user_record("a.png", good), user_record("a.png", gold)])
    with pytest.raises(DatasetError, match=r"ground_truth.*missing") as err:
        DeepEyesEnv(data_path=path)
    assert f"{path} record 1" in str(err.value)


@pytest.mark.parametrize("gold", ["", "  "], ids=repr)
def test_blank_gold_never_scores_whatever_the_answer(env: DeepEyesEnv, gold: str) -> None:
    """The grader checks too (tasks can come from snapshots): a blank gold is an error, never 1.1."""
    for answer in ("<answer>None</answer>", "<answer>nan</answer>", "<answer></answer>"):
        env.reset(seed=0)
        env.episode["task"]["gold"] = gold
        _, reward, terminated, _, info = env.step(answer)
        assert (reward, terminated, info["reward"]["status"]) == (0.0, True, "error"), (answer, info)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_empty_data_file_fails_at_make_naming_it(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"empty{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    else:
        path.write_text("[]" if suffix == ".json" else "")
    with pytest.raises(DatasetError, match="no records") as err:
        relax_gym.make("relax/DeepEyes-v0", data_path=str(path))
    assert str(path) in str(err.value)


def test_transparent_png_is_shown_over_white_not_black(tmp_path: Path) -> None:
    rgba = np.zeros((336, 448, 4), np.uint8)  # fully transparent, its hidden colour black
    rgba[30:80, 40:90] = (200, 50, 50, 255)  # an opaque red patch
    rgba[100:150, 100:150] = (0, 0, 255, 128)  # half-transparent blue
    Image.fromarray(rgba, "RGBA").save(tmp_path / "logo.png")
    # A palette PNG whose black entry is marked transparent (tRNS), as GIF-style logos are.
    palette = Image.fromarray(rgba[..., :3]).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    palette.save(tmp_path / "palette.png", transparency=palette.getpixel((0, 0)))
    write_records(tmp_path / "data.jsonl", [user_record("logo.png"), user_record("palette.png")])
    env = DeepEyesEnv(data_path=tmp_path / "data.jsonl")
    for index in (0, 1):
        obs, _ = env.reset(options={"index": index})
        shown = np.asarray(images_of(obs)[0])
        assert shown.shape == (336, 448, 3)
        assert tuple(shown[0, 0]) == (255, 255, 255) and tuple(shown[300, 400]) == (255, 255, 255)
        assert tuple(shown[50, 60]) == (200, 50, 50)
    obs, _ = env.reset(options={"index": 0})
    assert tuple(np.asarray(images_of(obs)[0])[120, 120]) == (127, 127, 255)  # blue at half over white
    *_, info = env.step(zoom([0, 0, 40, 30]))  # a zoom into the transparent corner is white too
    assert not info["tool_errors"]
