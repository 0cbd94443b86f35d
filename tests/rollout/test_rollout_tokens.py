"""Strict-append token bookkeeping and the preflight certification, on the real tiny models."""

import copy

import pytest

from relax_gym.messages import message
from relax_gym.models import chat_text, load_model
from relax_gym.rollout import ConversationTokens
from relax_gym.rollout.preflight import preflight, report_dict

STRIP_OLD_THINK = (
    "{%- if not loop.last and '</think>' in content -%}{{- content.split('</think>')[-1].lstrip('\\n') -}}"
    "{%- else -%}{{- content -}}{%- endif -%}"
)


@pytest.fixture(scope="module", params=["tiny", "tiny-vl", "tiny-audio"])
def loaded(request):
    return load_model(request.param)


def test_every_preflight_case_certifies_for_the_tiny_models(loaded):
    report = report_dict(loaded, preflight(loaded))
    assert report["certified"], [c for c in report["cases"] if not c["match"]]
    names = {c["case"] for c in report["cases"]}
    assert "tool calls" in names and "think blocks" in names
    if "image" in loaded.modalities:
        assert "images in prompt and tool response" in names
    if "audio" in loaded.modalities:
        assert "audio in prompt and follow-up" in names


def test_a_template_that_strips_old_think_blocks_is_flagged_where_it_differs():
    loaded = copy.deepcopy(load_model("tiny"))
    template = loaded.tokenizer.chat_template
    anchor = "{%- endif -%}\n        {{- content -}}"  # the assistant branch, after its reasoning_content block
    assert template.count(anchor) == 1
    loaded.tokenizer.chat_template = template.replace(anchor, "{%- endif -%}\n" + STRIP_OLD_THINK)
    results = {r.case: r for r in preflight(loaded)}
    assert results["plain multi-turn"].match
    think = results["think blocks"]
    assert not think.match and think.first_diff is not None
    assert "<think>" in think.appended_context and "<think>" not in think.rerendered_context
    assert think.expected  # the template rewrites history: strict appending kept what the model saw
    report = report_dict(loaded, list(results.values()))
    assert report["certified"] and not report["exact"] and "reasoning" in report["rewrites_history"]


def test_segments_masks_and_media_follow_the_turns():
    loaded = load_model("tiny-vl")
    from PIL import Image

    from relax_gym.messages import image

    conv = ConversationTokens.start(loaded, [message("user", image(Image.new("RGB", (64, 64), "red")), "What?")])
    eos = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = loaded.tokenizer("Let me zoom.", add_special_tokens=False)["input_ids"] + [eos]
    text = conv.append_generation(ids, [-0.5] * len(ids), [3] * len(ids), {eos})
    assert text == "Let me zoom."
    conv.append_observation([message("tool", image(Image.new("RGB", (32, 32), "blue")), name="zoom")])
    kinds = [s.kind for s in conv.segments]
    assert kinds == ["prompt", "policy", "glue", "env"]
    assert [s.media for s in conv.segments] == [[0], [], [], [1]]
    assert all(a.end == b.start for a, b in zip(conv.segments, conv.segments[1:], strict=False))
    policy = conv.segments[1]
    assert conv.loss_mask[policy.start:policy.end] == [1] * len(ids)
    assert sum(conv.loss_mask) == len(ids)
    assert conv.versions[policy.start:policy.end] == [3] * len(ids)
    assert conv.mm_inputs()["image_grid_thw"].shape[0] == 2
    # decoding the appended sequence gives the conversation as the template renders it
    rendered = chat_text(loaded, conv.messages, add_generation_prompt=True)
    assert loaded.tokenizer.decode(conv.token_ids) == loaded.tokenizer.decode(
        loaded.processor(text=[rendered], images=conv.media, return_tensors="pt")["input_ids"][0]
    )
    assert conv.rerender_diff() is None


def test_non_canonical_policy_tokens_are_not_mistaken_for_a_template_problem():
    loaded = load_model("tiny")
    tok = loaded.tokenizer
    conv = ConversationTokens.start(loaded, [message("user", "Hi")])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # "hello" spelt one byte-token at a time: the same text, not how the tokenizer would split it
    spelt = [tok.convert_tokens_to_ids(c) for c in "hello"]
    assert spelt != tok("hello", add_special_tokens=False)["input_ids"]
    conv.append_generation([*spelt, eos], [0.0] * 6, [0] * 6, {eos})
    conv.append_observation([message("user", "again")])
    assert conv.rerender_diff() is not None  # the token sequences differ...
    assert conv.template_diff() is None  # ...but the template appended exactly what it renders


def test_a_prompt_cache_renders_a_text_prompt_once_and_never_caches_media():
    from PIL import Image

    from relax_gym.messages import image
    from relax_gym.rollout.tokens import PromptCache

    loaded = load_model("tiny-vl")
    cache = PromptCache(size=2)
    prompt = [message("system", "Be brief."), message("user", "What is 2 + 3?")]
    fresh = ConversationTokens.start(loaded, prompt)
    first, again = (ConversationTokens.start(loaded, prompt, cache=cache) for _ in range(2))
    assert first.token_ids == again.token_ids == fresh.token_ids
    assert again.segments[0].text == fresh.segments[0].text and len(cache._items) == 1
    again.token_ids.append(7)  # a conversation's tokens are its own, not the cache's
    assert ConversationTokens.start(loaded, prompt, cache=cache).token_ids == fresh.token_ids
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with_tools = ConversationTokens.start(loaded, prompt, tools, cache=cache)
    assert with_tools.token_ids == ConversationTokens.start(loaded, prompt, tools).token_ids != fresh.token_ids
    picture = [message("user", image(Image.new("RGB", (64, 64), "red")), "What?")]
    assert PromptCache.key(picture, None) is None
    ConversationTokens.start(loaded, picture, cache=cache)
    assert len(cache._items) == 2  # the text prompt and the one with tools; the least recent goes past `size`
    ConversationTokens.start(loaded, [message("user", "Another?")], cache=cache)
    assert len(cache._items) == 2 and cache.get(PromptCache.key(prompt, None)) is None
