"""Chat templates of the major model families, with tokenizers and tiny random-weight checkpoints.

The templates (templates/<family>.jinja) were written for these fixtures from each family's
documented behaviour -- what is rendered where, what is stripped, which special tokens, what the
generation prompt is -- so the project's multi-turn token bookkeeping is tested against behaviour
it did not write. Usage from a test module (tests/conftest.py puts tests/ on sys.path):

    from support.families import FAMILIES, Family

    loaded = FAMILIES["llama3"].loaded()           # a relax_gym.models.LoadedModel, cached
    folder = FAMILIES["mistral"].save(tmp_path)    # a folder relax_gym.models.load_model reads
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relax_gym.models import LoadedModel, save_model

from . import build

__all__ = ["FAMILIES", "Family"]

QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")


@dataclass(frozen=True)
class Family:
    """One model family's chat template and token conventions."""

    name: str
    chat_template: str
    tool_format: str  # "hermes", "llama3", "mistral", "deepseek", "harmony", or "none" (the template ignores tools)
    modalities: tuple[str, ...]
    stop_tokens: tuple[str, ...]  # as the family's generation_config lists them
    rewrites_history: bool  # a full re-render differs from appending turn by turn
    notes: str

    def loaded(self) -> LoadedModel:
        """The tiny model, tokenizer and processor; built once per process and shared (do not mutate)."""
        return build.load(self.name, _VOCAB_OF[self.name], self.stop_tokens)

    def save(self, folder: Path) -> Path:
        """Writes the tiny checkpoint to `folder`, which `relax_gym.models.load_model(folder)` loads."""
        return save_model(self.loaded(), Path(folder))


_VOCAB_OF = {
    "qwen3": "qwen3",
    "qwen3-vl": "qwen3",
    "qwen2.5": "qwen2.5",
    "qwen2.5-vl": "qwen2.5",
    "llama3": "llama3",
    "mistral": "mistral",
    "deepseek-r1": "deepseek-r1",
    "gpt-oss": "gpt-oss",
    "gemma": "gemma",
}


def _family(name: str, **fields: object) -> Family:
    return Family(name=name, chat_template=build.template(name), **fields)  # type: ignore[arg-type]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family(
            "qwen3",
            tool_format="hermes",
            modalities=("text",),
            stop_tokens=QWEN_STOPS,
            rewrites_history=True,
            notes="ChatML; reasoning of assistant turns before the last user query is dropped, and a last "
            "assistant turn without reasoning gets an empty <think> block that vanishes once a message follows; "
            "tool results are user turns of <tool_response> blocks; non-string content renders as ''",
        ),
        _family(
            "qwen2.5",
            tool_format="hermes",
            modalities=("text",),
            stop_tokens=QWEN_STOPS,
            rewrites_history=False,
            notes="ChatML with a default system turn when none is given; history verbatim (no <think> handling, "
            "<think> is not a token); tool-call arguments always tojson'd, so a string is JSON-quoted",
        ),
        _family(
            "qwen2.5-vl",
            tool_format="none",
            modalities=("text", "image", "video"),
            stop_tokens=QWEN_STOPS,
            rewrites_history=False,
            notes="ChatML with default system 'You are a helpful assistant.'; image parts become "
            "<|vision_start|><|image_pad|><|vision_end|> in place; `tools` and tool_calls are ignored and a tool "
            "message is a plain 'tool' turn",
        ),
        _family(
            "qwen3-vl",
            tool_format="hermes",
            modalities=("text", "image", "video"),
            stop_tokens=QWEN_STOPS,
            rewrites_history=True,
            notes="qwen3's reasoning and tool rules over string or part-list content; image parts become "
            "<|vision_start|><|image_pad|><|vision_end|> in place, tool results included",
        ),
        _family(
            "llama3",
            tool_format="llama3",
            modalities=("text",),
            stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
            rewrites_history=False,
            notes="BOS + header blocks; a system block with knowledge/today dates always; tools fold into the first "
            "user message; every content is trimmed; one tool call per turn as {name, parameters}; tool results "
            "under the ipython header, JSON-quoted even when a string",
        ),
        _family(
            "mistral",
            tool_format="mistral",
            modalities=("text",),
            stop_tokens=("</s>",),
            rewrites_history=True,
            notes="BOS + [INST] turns; the system text and [AVAILABLE_TOOLS] sit before the LAST user message, so "
            "they move as the chat grows; replies render as ' ' + trimmed text + </s>; no generation prompt; "
            "9-char alphanumeric tool-call ids; strict alternation",
        ),
        _family(
            "deepseek-r1",
            tool_format="deepseek",
            modalities=("text",),
            stop_tokens=("<｜end▁of▁sentence｜>",),
            rewrites_history=True,
            notes="BOS + bare system text, <｜User｜>/<｜Assistant｜> turns; every assistant turn loses the text up to "
            "its last </think>; the generation prompt opens '<think>\\n' for the model; pad is the EOS token",
        ),
        _family(
            "gpt-oss",
            tool_format="harmony",
            modalities=("text",),
            stop_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
            rewrites_history=True,
            notes="harmony: system (dates, reasoning effort) + developer (# Instructions, tools namespace) messages; "
            "analysis kept only after the last user message; a last final answer ends <|return|>, <|end|> in "
            "history; tool calls end <|call|>; generation prompt '<|start|>assistant' (the model writes the channel)",
        ),
        _family(
            "gemma",
            tool_format="none",
            modalities=("text",),
            stop_tokens=("<eos>", "<end_of_turn>"),
            rewrites_history=False,
            notes="BOS + <start_of_turn>user|model turns; the system text is prepended to the first user message; "
            "content trimmed; strict user/model alternation; tools ignored, tool messages raise",
        ),
    )
}
