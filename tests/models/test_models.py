"""The embedded tiny models, their tokenizer and chat template, and local checkpoint loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from relax_gym import messages as M
from relax_gym.models import (
    CHAT_TEMPLATE,
    TINY_MODELS,
    LoadedModel,
    ModelLoadError,
    build_tiny_audio,
    build_tiny_text,
    build_tiny_vl,
    build_tokenizer,
    chat_text,
    load_model,
    processor_inputs,
    render_ids,
    save_model,
    sequence_inputs,
)
from relax_gym.models.tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression."}},
            "required": ["expression"],
        },
    },
}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tiny() -> dict[str, LoadedModel]:
    return {name: load_model(name) for name in TINY_MODELS}


def _media(name: str, seed: int = 0) -> list[M.Part]:
    """One media part of the model's modality (none for the text model)."""
    rng = np.random.default_rng(seed)
    if name == "tiny-vl":
        return [M.image(Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)))]
    if name == "tiny-audio":
        return [M.audio(rng.standard_normal(12_000).astype(np.float32) * 0.1, 16_000)]
    return []


def _conversation(name: str) -> list[M.Message]:
    """Three assistant turns: a think + tool call, two grouped tool results (one with media), an answer."""
    return [
        M.system("You are terse."),
        M.user("What is 6*7?", *_media(name, 0)),
        M.assistant(f"<think>\nI will use the calculator.\n</think>\n\n{CALL}"),
        M.tool_message("42", name="calculator"),
        M.tool_message("Here is a hint:", *_media(name, 1), name="hint"),
        M.assistant(f"<think>\nCheck it once more.\n</think>\n\n{CALL}"),
        M.tool_message("42", name="calculator"),
        M.assistant("<think>\nDone.\n</think>\n\nThe answer is 42."),
    ]


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_is_deterministic_small_and_byte_level(tmp_path):
    tok, again = build_tokenizer(), build_tokenizer()
    assert tok is not again and tok.get_vocab() == again.get_vocab()
    assert 1000 <= len(tok) <= 2048
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for token in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    text = 'Größe 😀 <think>\nx</think><tool_call>\n{"a": 1}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Markup survives skip_special_tokens (the tool-call parser reads it); control tokens do not.
    assert tok.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")

    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded.encode(text, add_special_tokens=False) == ids
    assert reloaded.chat_template == CHAT_TEMPLATE
    assert reloaded.eos_token_id == tok.eos_token_id and reloaded.pad_token_id == tok.pad_token_id


# --- chat template ---------------------------------------------------------------------------


def test_template_renders_tools_think_calls_and_grouped_responses():
    tok = build_tokenizer()
    conversation = _conversation("tiny")[:5]
    text = tok.apply_chat_template(
        conversation, tools=[CALCULATOR], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(CALCULATOR)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is 6*7?<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\nI will use the calculator.\n</think>\n\n{CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
        "<tool_response>\nHere is a hint:\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_without_tools_string_content_media_and_structured_calls():
    tok = build_tokenizer()
    conversation = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "use it",
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"x": 1}}}],
        },
        {
            "role": "user",
            "content": [M.text("See "), M.image(Image.new("RGB", (8, 8))), M.audio(np.ones(4), 8)],
        },
    ]
    assert tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        '<|im_start|>assistant\n<think>\nuse it\n</think>\n\n<tool_call>\n{"name": "calculator", '
        '"arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nSee <|vision_start|><|image_pad|><|vision_end|>"
        "<|audio_bos|><|AUDIO|><|audio_eos|><|im_end|>\n"
    )


@pytest.mark.parametrize("name", TINY_MODELS)
def test_strict_append_equals_full_render(tiny, name):
    """Tokens built turn by turn, as the rollout manager does (the engine's tokens for assistant
    turns, the chat-template delta for the rest), equal a full re-render of the conversation."""
    loaded = tiny[name]
    conversation = _conversation(name)
    eos = loaded.tokenizer.eos_token_id
    history = conversation[:2]
    ids = render_ids(loaded, history, tools=[CALCULATOR])
    i = 2
    while i < len(conversation):
        if conversation[i]["role"] == "assistant":
            reply = M.text_content(conversation[i])
            ids += [*loaded.tokenizer.encode(reply, add_special_tokens=False), eos]
            history.append(conversation[i])
            i += 1
            continue
        j = i
        while j < len(conversation) and conversation[j]["role"] != "assistant":
            j += 1
        history += conversation[i:j]
        extended = render_ids(loaded, history, tools=[CALCULATOR])
        assert extended[: len(ids)] == ids
        ids += extended[len(ids) :]
        i = j
    full = render_ids(loaded, conversation, tools=[CALCULATOR], add_generation_prompt=False)
    assert full == ids + loaded.tokenizer.encode("\n", add_special_tokens=False)


# --- tiny models -----------------------------------------------------------------------------


@pytest.mark.parametrize("build", [build_tiny_text, build_tiny_vl, build_tiny_audio])
def test_builds_are_seeded_and_leave_the_global_rng_alone(build):
    before = torch.random.get_rng_state()
    first, second, other = build(seed=0)[0], build(seed=0)[0], build(seed=1)[0]
    assert torch.equal(torch.random.get_rng_state(), before)
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert all(p.dtype == torch.float32 for p in first.parameters())
    assert sum(p.numel() for p in first.parameters()) < 1_000_000


@pytest.mark.parametrize("name", TINY_MODELS)
def test_forward_and_generate_on_a_rendered_conversation(tiny, name):
    loaded = tiny[name]
    conversation = _conversation(name)[:5]
    inputs = processor_inputs(loaded, conversation, tools=[CALCULATOR])
    ids = inputs["input_ids"]
    assert ids[0].tolist() == render_ids(loaded, conversation, tools=[CALCULATOR])
    assert ids.shape[1] < 1024
    if name == "tiny-vl":
        config = loaded.model.config
        merge = loaded.processor.image_processor.merge_size
        assert inputs["image_grid_thw"].shape[0] == 2
        expanded = int(inputs["image_grid_thw"].prod(-1).sum()) // merge**2
        assert int((ids == config.image_token_id).sum()) == expanded
        assert inputs["pixel_values"].shape[0] == int(inputs["image_grid_thw"].prod(-1).sum())
    if name == "tiny-audio":
        frames = inputs["feature_attention_mask"].sum(-1)
        per_audio = ((frames - 1) // 2 + 1 - 2) // 2 + 1  # conv stride 2, then pooling stride 2
        assert per_audio.tolist() == [19, 19]  # 0.75 s each at 25 tokens / s
        assert int((ids == loaded.model.config.audio_token_index).sum()) == int(per_audio.sum())
    with torch.no_grad():
        logits = loaded.model(**inputs).logits
    assert logits.shape == (1, ids.shape[1], len(loaded.tokenizer))
    assert torch.isfinite(logits).all()
    out = loaded.model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
    assert torch.equal(out[:, : ids.shape[1]], ids)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_sequence_inputs_of_an_appended_trajectory_equal_the_full_render(tiny, name):
    """What the trainer does: the trajectory's tokens plus each observation's own processor call,
    in turn order, give exactly the inputs (hence logits) of processing the whole conversation."""
    loaded = tiny[name]
    conversation = _conversation(name)
    full = processor_inputs(loaded, conversation, tools=[CALCULATOR])
    per_turn = [processor_inputs(loaded, conversation[:2]), processor_inputs(loaded, conversation[3:5])]
    rebuilt = sequence_inputs(loaded, full["input_ids"][0].tolist(), per_turn)
    assert rebuilt.keys() == full.keys()
    assert all(torch.equal(rebuilt[k], full[k]) for k in full)


def test_vl_image_is_bounded_and_audio_is_resampled(tiny):
    vl, audio = tiny["tiny-vl"], tiny["tiny-audio"]
    big = vl.processor.image_processor([Image.new("RGB", (896, 672))], return_tensors="pt")
    assert big["pixel_values"].shape[0] <= 256
    ids = render_ids(audio, [M.user(M.audio(np.zeros(8000, np.float32), 8000))])
    assert ids.count(audio.model.config.audio_token_index) == 25  # 1 s at 8 kHz, resampled to 16 kHz


def test_text_model_flattens_parts_and_rejects_media(tiny):
    loaded = tiny["tiny"]
    parts = [M.user("What is ", "6*7?")]
    assert chat_text(loaded, parts) == "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="image parts"):
        render_ids(loaded, [M.user("x", M.image(Image.new("RGB", (8, 8))))])


def test_template_is_attached_to_tokenizer_and_processor(tiny):
    for name in ("tiny-vl", "tiny-audio"):
        loaded = tiny[name]
        conversation = _conversation(name)
        assert loaded.processor.chat_template == loaded.tokenizer.chat_template == CHAT_TEMPLATE
        rendered = loaded.processor.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        assert rendered == chat_text(loaded, conversation)


# --- loading and saving ----------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_MODELS)
def test_save_then_load_gives_identical_logits(tiny, name, tmp_path):
    loaded = tiny[name]
    save_model(loaded, tmp_path)
    reloaded = load_model(str(tmp_path))
    assert reloaded.modalities == loaded.modalities and reloaded.name == str(tmp_path)
    assert type(reloaded.model) is type(loaded.model)
    assert reloaded.tokenizer.chat_template == CHAT_TEMPLATE
    if loaded.processor is not None:
        assert type(reloaded.processor).__name__ == type(loaded.processor).__name__
        assert reloaded.processor.chat_template == CHAT_TEMPLATE
    conversation = _conversation(name)
    inputs = processor_inputs(loaded, conversation)
    again = processor_inputs(reloaded, conversation)
    assert inputs.keys() == again.keys() and all(torch.equal(inputs[k], again[k]) for k in inputs)
    with torch.no_grad():
        assert torch.equal(loaded.model(**inputs).logits, reloaded.model(**again).logits)


def test_load_model_dtype_and_unknown_paths(tmp_path):
    assert load_model("tiny", dtype=torch.bfloat16).model.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match=r"no folder at .*nowhere.*tiny, tiny-moe, tiny-vl, tiny-audio"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=r"has no config\.json.*tiny, tiny-moe, tiny-vl, tiny-audio"):
        load_model(str(tmp_path))
