"""The model-family fixtures (tests/support/families): each template's documented behaviour, on rendered text,
and each family's tokenizer and tiny checkpoint (forward pass, save / load round trip, single-id tokens)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from jinja2.exceptions import TemplateError
from PIL import Image
from support.families import FAMILIES, Family
from support.families.build import VOCABS

from relax_gym.messages import image, system, user
from relax_gym.models import load_model, processor_inputs

NAMES = ("qwen3", "qwen2.5", "qwen2.5-vl", "qwen3-vl", "llama3", "mistral", "deepseek-r1", "gpt-oss", "gemma")
VOCAB_OF = {"qwen3-vl": "qwen3", "qwen2.5-vl": "qwen2.5"}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Returns the weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city."},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]
CALL_ID = "abc123XYZ"


def call(arguments: Any = None, name: str = "get_weather", call_id: str = CALL_ID) -> dict[str, Any]:
    args = {"city": "Paris"} if arguments is None else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def msg(role: str, content: str = "", **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


def render(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The family template applied by the family tokenizer, as relax_gym's chat_text does."""
    kwargs.setdefault("add_generation_prompt", False)
    family = FAMILIES[name]
    return family.loaded().tokenizer.apply_chat_template(
        messages, chat_template=family.chat_template, tokenize=False, **kwargs
    )


# --- the registry and the tokenizers ---------------------------------------------------------------------


def test_registry_has_every_family_with_its_declared_traits() -> None:
    assert tuple(FAMILIES) == NAMES
    for name, family in FAMILIES.items():
        assert isinstance(family, Family) and family.name == name
        assert family.tool_format in ("hermes", "llama3", "mistral", "deepseek", "harmony", "none")
        assert family.modalities == (("text", "image", "video") if name.endswith("-vl") else ("text",))
        assert family.notes and "\n" not in family.notes
    assert {n: f.tool_format for n, f in FAMILIES.items()} == {
        "qwen3": "hermes", "qwen2.5": "hermes", "qwen2.5-vl": "none", "qwen3-vl": "hermes", "llama3": "llama3",
        "mistral": "mistral", "deepseek-r1": "deepseek", "gpt-oss": "harmony", "gemma": "none",
    }
    assert {n for n, f in FAMILIES.items() if f.rewrites_history} == {
        "qwen3", "qwen3-vl", "mistral", "deepseek-r1", "gpt-oss"
    }


@pytest.mark.parametrize("name", NAMES)
def test_control_and_markup_tokens_are_single_ids(name: str) -> None:
    family, vocab = FAMILIES[name], VOCABS[VOCAB_OF.get(name, name)]
    tok = family.loaded().tokenizer
    for token in (*vocab.special, *vocab.markup, *family.stop_tokens):
        ids = tok.encode(token, add_special_tokens=False)
        assert ids == [tok.convert_tokens_to_ids(token)], token
        assert ids[0] != tok.unk_token_id or token == tok.unk_token
    assert tok.eos_token == vocab.eos and tok.pad_token == vocab.pad and tok.bos_token == vocab.bos
    assert len(tok) == family.loaded().model.get_input_embeddings().num_embeddings


@pytest.mark.parametrize("name", NAMES)
def test_rendered_chat_decodes_back_to_itself(name: str) -> None:
    """Byte-level BPE plus whole special tokens: encode -> decode(skip_special_tokens=False) is lossless."""
    messages = [msg("system", "Be brief."), msg("user", "What is 12 + 30?"), msg("assistant", "It is 42."),
                msg("user", "Thanks! And 7 * 6?")]
    tok = FAMILIES[name].loaded().tokenizer
    text = render(name, messages, add_generation_prompt=True, current_date="2025-01-01")
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


@pytest.mark.parametrize("name", NAMES)
def test_bos_is_written_by_the_template_and_added_by_the_tokenizer(name: str) -> None:
    """Families with a BOS write it themselves *and* their tokenizers prepend it: `tokenizer(rendered)` doubles it."""
    tok = FAMILIES[name].loaded().tokenizer
    text = render(name, [msg("user", "hi")], add_generation_prompt=True)
    if VOCABS[VOCAB_OF.get(name, name)].bos is None or name == "gpt-oss":
        assert tok(text).input_ids == tok.encode(text, add_special_tokens=False)
        assert tok.bos_token is None or not text.startswith(tok.bos_token)
    else:
        assert text.startswith(tok.bos_token)
        assert tok(text).input_ids[:2] == [tok.bos_token_id] * 2


@pytest.mark.parametrize("name", NAMES)
def test_model_runs_a_forward_pass_and_stops_on_the_family_stop_tokens(name: str) -> None:
    family = FAMILIES[name]
    loaded = family.loaded()
    assert loaded.modalities == family.modalities and loaded.name == name
    tok = loaded.tokenizer
    stop_ids = tok.convert_tokens_to_ids(list(family.stop_tokens))
    assert loaded.model.generation_config.eos_token_id == stop_ids
    assert loaded.model.generation_config.pad_token_id == tok.pad_token_id
    assert set(stop_ids) <= loaded.stop_token_ids()
    assert tok.eos_token_id in stop_ids
    if "image" in family.modalities:
        picture = Image.new("RGB", (64, 96), (200, 10, 10))
        inputs = processor_inputs(loaded, [system("sys"), user("look", image(picture), "now")])
        assert (inputs["input_ids"] == loaded.processor.image_token_id).sum() == 6  # 64x96 px -> 2x3 merged
    else:
        ids = tok.encode(render(name, [msg("user", "hi")], add_generation_prompt=True), add_special_tokens=False)
        inputs = {"input_ids": torch.tensor([ids])}
    with torch.no_grad():
        logits = loaded.model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(tok))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_saved_checkpoint_round_trips_through_load_model(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    family = FAMILIES[name]
    original = family.loaded()
    folder = family.save(tmp_path_factory.mktemp(name))
    loaded = load_model(str(folder))
    assert loaded.modalities == family.modalities
    assert loaded.tokenizer.chat_template == family.chat_template
    if loaded.processor is not None:
        assert loaded.processor.chat_template == family.chat_template
    assert loaded.tokenizer.get_vocab() == original.tokenizer.get_vocab()
    assert loaded.tokenizer.special_tokens_map == original.tokenizer.special_tokens_map
    assert loaded.model.generation_config.eos_token_id == original.tokenizer.convert_tokens_to_ids(
        list(family.stop_tokens)
    )
    assert loaded.stop_token_ids() == original.stop_token_ids()
    messages = [msg("system", "Be brief."), msg("user", "hi")]
    kwargs = {"add_generation_prompt": True, "tokenize": False, "current_date": "2025-01-01"}
    text = original.tokenizer.apply_chat_template(messages, **kwargs)
    assert loaded.tokenizer.apply_chat_template(messages, **kwargs) == text
    assert loaded.tokenizer(text).input_ids == original.tokenizer(text).input_ids


def _prefix_stable(name: str, conversation: list[dict[str, Any]]) -> bool:
    """Whether appending turns as they are generated yields the tokens of one full re-render.

    For each assistant turn: the prompt it was generated from must be a prefix of the turn as rendered
    when it was the newest message, and that (up to the stop token the model wrote) a prefix of the
    final conversation's render.
    """
    stops = FAMILIES[name].stop_tokens
    full = render(name, conversation, add_generation_prompt=True, current_date="2025-01-01")
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = render(name, conversation[:i], add_generation_prompt=True, current_date="2025-01-01")
        newest = render(name, conversation[: i + 1], current_date="2025-01-01")
        if not newest.startswith(prompt):
            return False
        end = min(p for p in (newest.find(s, len(prompt)) for s in stops) if p >= 0)
        if not full.startswith(newest[:end]):
            return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_rewrites_history_matches_turn_by_turn_rendering(name: str) -> None:
    conversation = [
        msg("system", "Be brief."),
        msg("user", "Q1"),
        msg("assistant", "A1", reasoning_content="R1"),
        msg("user", "Q2"),
        msg("assistant", "A2", reasoning_content="R2"),
        msg("user", "Q3"),
    ]
    assert _prefix_stable(name, conversation) is not FAMILIES[name].rewrites_history


# --- qwen3 / qwen3-vl ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen3-vl"])
def test_qwen3_system_and_tools_block(name: str) -> None:
    assert render(name, [msg("system", "S"), msg("user", "U")]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )
    assert render(name, [msg("user", "U")]) == "<|im_start|>user\nU<|im_end|>\n"
    text = render(name, [msg("system", "S"), msg("user", "U")], tools=TOOLS)
    head, rest = text.split("<|im_end|>\n", 1)
    assert head.startswith("<|im_start|>system\nS\n\n# Tools\n\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in head
    assert head.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert rest == "<|im_start|>user\nU<|im_end|>\n"
    assert render(name, [msg("user", "U")], tools=TOOLS).startswith("<|im_start|>system\n# Tools\n\n")


@pytest.mark.parametrize("name", ["qwen3", "qwen3-vl"])
def test_qwen3_reasoning_is_dropped_before_the_last_query_and_kept_after(name: str) -> None:
    messages = [
        msg("user", "Q1"),
        msg("assistant", "<think>\nR1\n</think>\n\nA1"),
        msg("user", "Q2"),
        msg("assistant", "<think>\nR2\n</think>\n\nA2"),
    ]
    assert render(name, messages) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n"
    )
    # reasoning_content wins over the text; the content is then not split
    assert render(name, [msg("user", "Q"), msg("assistant", "A", reasoning_content="\nR\n")]).endswith(
        "<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n"
    )
    # a reasoning-less turn gets an empty think block while it is last, and loses it once a message follows
    last = render(name, [msg("user", "Q"), msg("assistant", "A")])
    assert last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n")
    followed = render(name, [msg("user", "Q"), msg("assistant", "A"), msg("user", "Q2")])
    assert "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nQ2" in followed


@pytest.mark.parametrize("name", ["qwen3", "qwen3-vl"])
def test_qwen3_tool_results_are_not_queries(name: str) -> None:
    messages = [
        msg("user", "Q"),
        msg("assistant", "Let me check.", reasoning_content="R1", tool_calls=[call()]),
        msg("tool", "sunny", name="get_weather"),
        msg("tool", "warm", name="get_weather"),
        msg("assistant", "No reasoning here."),
        msg("user", "<tool_response>\nlate\n</tool_response>"),
        msg("assistant", "<think>R3</think>Done."),
    ]
    text = render(name, messages)
    assert text == (
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR1\n</think>\n\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\nNo reasoning here.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR3\n</think>\n\nDone.<|im_end|>\n"
    )


@pytest.mark.parametrize("name", ["qwen3", "qwen3-vl"])
def test_qwen3_tool_call_rendering(name: str) -> None:
    two = [call(), call('{"city": "Rome"}')]
    text = render(name, [msg("user", "Q"), msg("assistant", "", tool_calls=two), msg("tool", "x")])
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    ) in text


@pytest.mark.parametrize("name", ["qwen3", "qwen3-vl"])
def test_qwen3_generation_prompt(name: str) -> None:
    assert render(name, [msg("user", "Q")], add_generation_prompt=True).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert render(name, [msg("user", "Q")], add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render(name, [msg("user", "Q")], add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n"
    )


def test_qwen3_text_template_renders_part_lists_as_empty() -> None:
    """Qwen3's text template takes string content only (relax_gym's template_messages flattens for it)."""
    parts = [{"type": "text", "text": "hidden"}]
    assert render("qwen3", [{"role": "user", "content": parts}]) == "<|im_start|>user\n<|im_end|>\n"


@pytest.mark.parametrize("name", ["qwen3", "qwen3-vl", "deepseek-r1"])
def test_markup_tokens_survive_skip_special_tokens(name: str) -> None:
    tok = FAMILIES[name].loaded().tokenizer
    markup = VOCABS[VOCAB_OF.get(name, name)].markup
    eos = tok.eos_token
    text = "".join(f"{t}x" for t in markup) + eos
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == text[: -len(eos)]


def test_qwen3_vl_renders_media_parts_in_place() -> None:
    picture = Image.new("RGB", (32, 32))
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "S"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, image(picture), {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<think>r</think>seen"}], "tool_calls": [call()]},
        {"role": "tool", "content": [image(picture), {"type": "text", "text": "zoomed"}], "name": "zoom"},
    ]
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    text = render("qwen3-vl", messages)
    assert text.startswith("<|im_start|>system\nS<|im_end|>\n")
    assert f"<|im_start|>user\na{vision}b<|im_end|>\n" in text
    assert f"<tool_response>\n{vision}zoomed\n</tool_response>" in text
    assert "<think>\nr\n</think>\n\nseen\n<tool_call>" in text  # after the last query: reasoning kept
    numbered = render("qwen3-vl", messages, add_vision_id=True)
    assert f"aPicture 1: {vision}b" in numbered and f"Picture 2: {vision}zoomed" in numbered


# --- qwen2.5 / qwen2.5-vl --------------------------------------------------------------------------------


def test_qwen25_default_system_and_tools() -> None:
    default = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    assert render("qwen2.5", [msg("user", "U")]) == default + "<|im_start|>user\nU<|im_end|>\n"
    assert render("qwen2.5", [msg("system", "S"), msg("user", "U")]).startswith("<|im_start|>system\nS<|im_end|>\n")
    text = render("qwen2.5", [msg("user", "U")], tools=TOOLS)
    assert text.startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    )
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in text


def test_qwen25_history_verbatim_tools_grouped_and_string_arguments_quoted() -> None:
    messages = [
        msg("user", "Q"),
        msg("assistant", "<think>\nR\n</think>\n\nA"),
        msg("user", "Q2"),
        msg("assistant", "checking", tool_calls=[call('{"city": "Rome"}')]),
        msg("tool", "sunny"),
        msg("tool", "warm"),
    ]
    assert render("qwen2.5", messages, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
        '<|im_start|>assistant\nchecking\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok = FAMILIES["qwen2.5"].loaded().tokenizer
    assert len(tok.encode("<think>", add_special_tokens=False)) > 1  # not a token in Qwen2.5
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) == 1


def test_qwen25_vl_default_system_media_and_no_tools() -> None:
    picture = Image.new("RGB", (32, 32))
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    parts = [{"type": "text", "text": "a"}, image(picture), {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    text = render("qwen2.5-vl", messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\na{vision}b<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("qwen2.5-vl", messages, tools=TOOLS) == render("qwen2.5-vl", messages)
    assert f"aPicture 1: {vision}b" in render("qwen2.5-vl", messages, add_vision_id=True)
    with_tools = [msg("system", "S"), msg("user", "Q"), msg("assistant", "A", tool_calls=[call()]),
                  msg("tool", "sunny")]
    assert render("qwen2.5-vl", with_tools) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n"
    )


# --- llama3 ----------------------------------------------------------------------------------------------


def test_llama3_header_blocks_and_system_block() -> None:
    assert render("llama3", [msg("system", " Be brief. "), msg("user", " hi\n"), msg("assistant", "yo ")]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"
    )
    text = render("llama3", [msg("user", "hi")], add_generation_prompt=True, date_string="01 Jan 2025")
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama3_tools_go_into_the_first_user_message() -> None:
    messages = [msg("system", "S"), msg("user", "First?"), msg("assistant", "A"), msg("user", "Second?")]
    text = render("llama3", messages, tools=TOOLS)
    assert "Environment: ipython\nCutting Knowledge Date" in text
    assert text.count("First?") == 1 and text.count("get_weather") == 1
    assert (
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
        "function call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
        + json.dumps(WEATHER, indent=4) + "\n\nFirst?<|eot_id|><|start_header_id|>assistant"
    ) in text
    in_system = render("llama3", messages, tools=TOOLS, tools_in_user_message=False)
    system_block = in_system.split("<|eot_id|>")[0]
    assert json.dumps(WEATHER, indent=4) in system_block and system_block.endswith("S")
    assert "<|start_header_id|>user<|end_header_id|>\n\nFirst?<|eot_id|>" in in_system


def test_llama3_tool_calls_and_ipython_results() -> None:
    messages = [
        msg("user", "Q"),
        msg("assistant", "ignored", tool_calls=[call()]),
        msg("tool", "sunny"),
        msg("ipython", {"temp": 20}),  # type: ignore[arg-type]
    ]
    assert render("llama3", messages, add_generation_prompt=True).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>'  # a string is iterable: JSON-quoted
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 20}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(TemplateError, match="single tool-calls"):
        render("llama3", [msg("user", "Q"), msg("assistant", "", tool_calls=[call(), call()])])
    with pytest.raises(TemplateError, match="no first user message"):
        render("llama3", [msg("system", "S")], tools=TOOLS)


# --- mistral ---------------------------------------------------------------------------------------------


def test_mistral_inst_turns_and_system_on_the_last_user_message() -> None:
    messages = [msg("system", "S"), msg("user", "Q1"), msg("assistant", " A1\n"), msg("user", "Q2")]
    expected = "<s>[INST] Q1[/INST] A1</s>[INST] S\n\nQ2[/INST]"
    assert render("mistral", messages) == expected
    assert render("mistral", messages, add_generation_prompt=True) == expected  # no generation prompt
    assert render("mistral", [*messages, msg("assistant", "A2")]) == expected + " A2</s>"
    assert render("mistral", messages[:2]) == "<s>[INST] S\n\nQ1[/INST]"


@pytest.mark.parametrize(
    "roles",
    [("user", "user"), ("assistant",), ("user", "assistant", "assistant"), ("user", "system")],
)
def test_mistral_roles_must_alternate(roles: tuple[str, ...]) -> None:
    with pytest.raises(TemplateError):
        render("mistral", [msg(role, "x") for role in roles])


def test_mistral_tools_calls_and_results() -> None:
    messages = [
        msg("user", "Q1"),
        msg("assistant", "A1"),
        msg("user", "Q2"),
        msg("assistant", "", tool_calls=[call()]),
        msg("tool", "sunny", tool_call_id=CALL_ID),
        msg("assistant", "It is sunny."),
    ]
    assert render("mistral", messages, tools=TOOLS) == (
        "<s>[INST] Q1[/INST] A1</s>"
        f"[AVAILABLE_TOOLS] [{json.dumps(WEATHER)}][/AVAILABLE_TOOLS][INST] Q2[/INST]"
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{CALL_ID}"}}]</s>'
        f'[TOOL_RESULTS] {{"content": sunny, "call_id": "{CALL_ID}"}}[/TOOL_RESULTS]'
        " It is sunny.</s>"
    )


@pytest.mark.parametrize("bad", ["abc123XY", "abc123XYZ0", "abc-23XYZ", None])
def test_mistral_tool_call_ids_must_be_nine_alphanumerics(bad: str | None) -> None:
    calls = [call(call_id=bad)] if bad else [{"type": "function", "function": call()["function"]}]
    with pytest.raises(TemplateError, match="length 9"):
        render("mistral", [msg("user", "Q"), msg("assistant", "", tool_calls=calls)])
    result = msg("tool", "x", **({"tool_call_id": bad} if bad else {}))
    with pytest.raises(TemplateError, match="length 9"):
        render("mistral", [msg("user", "Q"), msg("assistant", "", tool_calls=[call()]), result])


def test_mistral_tool_calls_token_decodes_visibly() -> None:
    tok = FAMILIES["mistral"].loaded().tokenizer
    text = '[TOOL_CALLS] [{"name": "f"}]</s>'
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == ' [{"name": "f"}]'  # a control token, as in the v3 vocab


# --- deepseek-r1 -----------------------------------------------------------------------------------------


def test_deepseek_r1_turns_strip_reasoning_from_every_assistant_turn() -> None:
    messages = [
        msg("system", "S1"),
        msg("system", "S2"),
        msg("user", "Q1"),
        msg("assistant", "<think>\nR1\n</think>\n\nA1"),
        msg("user", "Q2"),
        msg("assistant", "R2</think>A2"),
    ]
    assert render("deepseek-r1", messages) == (
        "<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>Q1<｜Assistant｜>\n\nA1<｜end▁of▁sentence｜>"
        "<｜User｜>Q2<｜Assistant｜>A2<｜end▁of▁sentence｜>"
    )
    assert render("deepseek-r1", messages[2:3], add_generation_prompt=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>Q1<｜Assistant｜><think>\n"
    )


def test_deepseek_r1_tool_calls_and_grouped_outputs() -> None:
    messages = [
        msg("user", "Q"),
        msg("assistant", "<think>R</think>", tool_calls=[call(), call('{"city": "Rome"}')]),
        msg("tool", "sunny"),
        msg("tool", "rainy"),
    ]
    assert render("deepseek-r1", messages, add_generation_prompt=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>rainy<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        "<｜Assistant｜><think>\n"
    )
    tok = FAMILIES["deepseek-r1"].loaded().tokenizer
    assert tok.pad_token_id == tok.eos_token_id  # as in R1-Distill-Qwen's tokenizer config


# --- gpt-oss ---------------------------------------------------------------------------------------------

GPT_SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-01-01\n\nReasoning: {effort}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.{tools}<|end|>"
)


def test_gpt_oss_system_and_developer_messages() -> None:
    plain = render("gpt-oss", [msg("user", "Q")], add_generation_prompt=True, current_date="2025-01-01")
    assert plain == GPT_SYSTEM.format(effort="medium", tools="") + "<|start|>user<|message|>Q<|end|><|start|>assistant"
    high = render("gpt-oss", [msg("system", "Be brief."), msg("user", "Q")], current_date="2025-01-01",
                  reasoning_effort="high", tools=TOOLS)
    assert high == (
        GPT_SYSTEM.format(effort="high", tools="\nCalls to the tools below go to the commentary channel: 'functions'.")
        + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Returns the weather of a city.\ntype get_weather = (_: {\n// The city.\n"
        'city: string,\nunit?: "c" | "f",\ndays?: number,\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>Q<|end|>"
    )
    today = render("gpt-oss", [msg("user", "Q")])
    assert re.search(r"\nCurrent date: \d{4}-\d{2}-\d{2}\n", today)


def test_gpt_oss_channels_reasoning_and_return() -> None:
    messages = [
        msg("user", "Q1"),
        msg("assistant", "A1", thinking="T1"),
        msg("user", "Q2"),
        msg("assistant", "", reasoning_content="T2", tool_calls=[call()]),
        msg("tool", "sunny"),
        msg("assistant", "A2", thinking="T3"),
    ]
    body = render("gpt-oss", messages, current_date="2025-01-01").split("<|end|>", 1)[1]
    assert body == (
        "<|start|>user<|message|>Q1<|end|>"
        "<|start|>assistant<|channel|>final<|message|>A1<|end|>"  # reasoning before the last user message: dropped
        "<|start|>user<|message|>Q2<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>T2<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant<|channel|>analysis<|message|>T3<|end|>"
        "<|start|>assistant<|channel|>final<|message|>A2<|return|>"
    )
    prompted = render("gpt-oss", messages, current_date="2025-01-01", add_generation_prompt=True)
    assert prompted.endswith("<|channel|>final<|message|>A2<|end|><|start|>assistant")
    named = render("gpt-oss", [msg("user", "Q"), msg("tool", "{}", name="search")])
    assert "<|start|>functions.search to=assistant<|channel|>commentary<|message|>" in named
    with pytest.raises(TemplateError):
        render("gpt-oss", [msg("user", "Q"), msg("tool", "orphan")])


# --- gemma -----------------------------------------------------------------------------------------------


def test_gemma_turns_system_prefix_and_generation_prompt() -> None:
    messages = [msg("system", "S"), msg("user", " Q1 "), msg("assistant", "A1\n"), msg("user", "Q2")]
    expected = (
        "<bos><start_of_turn>user\nS\n\nQ1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
        "<start_of_turn>user\nQ2<end_of_turn>\n"
    )
    assert render("gemma", messages) == expected
    assert render("gemma", messages, add_generation_prompt=True) == expected + "<start_of_turn>model\n"
    assert render("gemma", messages, tools=TOOLS) == expected  # no tool support: tools ignored


@pytest.mark.parametrize(
    "messages",
    [
        [msg("user", "Q"), msg("user", "Q")],
        [msg("assistant", "A")],
        [msg("user", "Q"), msg("assistant", "", tool_calls=[call()]), msg("tool", "sunny")],
        [msg("user", "Q"), msg("tool", "sunny")],
        [msg("system", "S"), msg("user", "Q"), msg("system", "S2")],
    ],
)
def test_gemma_rejects_non_alternating_and_tool_roles(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(TemplateError):
        render("gemma", messages)
