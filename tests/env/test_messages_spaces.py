import numpy as np
import pytest
from PIL import Image

from relax_gym.env.spaces import ActionText, MessageSpace
from relax_gym.messages import (
    MessageError,
    audio,
    image,
    message,
    modalities,
    text_content,
    user,
    validate_messages,
)


def test_builders_make_hf_shaped_messages():
    img = Image.new("RGB", (8, 8))
    msg = user("look:", image(img), audio(np.zeros(10), 16000))
    assert msg["role"] == "user"
    assert [p["type"] for p in msg["content"]] == ["text", "image", "audio"]
    assert msg["content"][2]["audio"].dtype == np.float32
    assert text_content(msg) == "look:"
    assert modalities([msg]) == {"text", "image", "audio"}


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"role": "robot", "content": []}, "role"),
        ({"role": "user", "content": "plain string"}, "list of parts"),
        ({"role": "user", "content": [{"type": "hologram"}]}, "unknown part type"),
        ({"role": "user", "content": [{"type": "video", "video": [np.zeros((2, 2, 3))]}]}, "needs a relax_gym Video"),
        ({"role": "user", "content": [{"type": "image", "image": np.zeros((2, 2))}]}, "PIL.Image"),
        ({"role": "user", "content": [{"type": "audio", "audio": np.zeros((2, 2)), "sampling_rate": 16000}]}, "1-D"),
        ({"role": "user", "content": [{"type": "audio", "audio": np.zeros(4, np.float32), "sampling_rate": 0}]},
         "sampling_rate"),
        ({"role": "user", "content": [{"type": "audio", "audio": np.array([np.nan], np.float32),
                                        "sampling_rate": 8000}]}, "non-finite"),
        ({"role": "user", "content": [{"type": "text", "text": 3}]}, "str"),
    ],
)
def test_validation_names_the_problem(bad, needle):
    with pytest.raises(MessageError, match=needle):
        validate_messages([bad])
    assert not MessageSpace(modalities=("text", "image", "audio")).contains([bad])


def test_message_space_enforces_declared_modalities_and_roles():
    space = MessageSpace(modalities=("text",))
    img_msg = user(image(Image.new("RGB", (4, 4))))
    assert space.contains([user("hi")])
    assert not space.contains([img_msg])
    assert "declares modalities" in space.explain([img_msg])
    assert not space.contains([message("assistant", "I am the policy")])
    assert space.contains([])  # a terminal step may add no messages
    assert not space.contains("not a list")


def test_message_space_samples_are_members_and_seeded():
    space = MessageSpace(seed=3)
    samples = [space.sample() for _ in range(20)]
    assert all(space.contains(s) for s in samples)
    again = MessageSpace(seed=3)
    assert [again.sample() for _ in range(20)] == samples


def test_action_text_accepts_any_unicode_within_length():
    space = ActionText(max_length=10, seed=0)
    assert space.contains("héllo ✓")
    assert space.contains("")
    assert not space.contains("x" * 11)
    assert not space.contains(b"bytes")
    assert all(space.contains(space.sample()) for _ in range(50))


def test_unknown_modality_is_rejected_at_construction():
    with pytest.raises(ValueError, match="smell"):
        MessageSpace(modalities=("smell",))
