"""Which format reads a model's tool calls: the one its options name, else the one its tokenizer implies."""

from __future__ import annotations

import contextlib
from typing import Any

from relax_gym.tools.formats.deepseek import DS_CALL_BEGIN, DS_CALLS_BEGIN, DS_SEP, DeepSeekFormat
from relax_gym.tools.formats.harmony import H_CHANNEL, H_CONSTRAIN
from relax_gym.tools.formats.llama3 import PYTHON_TAG
from relax_gym.tools.formats.mistral import ARGS, TOOL_CALLS, MistralFormat
from relax_gym.tools.formats.registry import HERMES, TOOL_FORMATS, get_tool_format
from relax_gym.tools.formats.response_template import ResponseTemplateFormat, has_response_template
from relax_gym.tools.formats.shared import ToolCallFormat
from relax_gym.tools.parser import OPEN

# Detection, first match wins. The chat template is checked before the vocabulary, as it is how
# the model was taught to write calls (a Hermes fine-tune of Llama keeps `<|eot_id|>` in its
# vocabulary but renders `<tool_call>`); each is checked in this family order:
#   mistral   `[TOOL_CALLS]`
#   deepseek  `<｜tool▁calls▁begin｜>` (template: also `<｜tool▁call▁begin｜>`), vocabulary also `<｜Assistant｜>`;
#             before hermes and llama3, as R1 distills of Qwen and Llama keep those vocabularies
#   harmony   template `<|channel|>`; vocabulary `<|channel|>` and `<|constrain|>` both
#   hermes    `<tool_call>`; before llama3, whose `<|eot_id|>` every Llama fine-tune inherits
#   llama3    `<|python_tag|>`, vocabulary also `<|eot_id|>`
# and hermes, the project's default, when nothing matches. Each entry lists alternatives, each
# alternative the tokens that must all be present.
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("mistral", ((TOOL_CALLS,),)),
    ("deepseek", ((DS_CALLS_BEGIN,), (DS_CALL_BEGIN,))),
    ("harmony", ((H_CHANNEL,),)),
    ("hermes", ((OPEN,),)),
    ("llama3", ((PYTHON_TAG,),)),
)
_VOCAB_MARKERS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("mistral", ((TOOL_CALLS,),)),
    ("deepseek", ((DS_CALLS_BEGIN,), ("<｜Assistant｜>",))),
    ("harmony", ((H_CHANNEL, H_CONSTRAIN),)),
    ("hermes", ((OPEN,),)),
    ("llama3", ((PYTHON_TAG,), ("<|eot_id|>",))),
)


def _chat_template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _vocabulary(tokenizer: Any) -> set[str]:
    tokens: set[str] = set()
    with contextlib.suppress(Exception):  # a tokenizer without a usable get_vocab: detect from the rest
        tokens.update(tokenizer.get_vocab())
    for attr in ("added_tokens_encoder", "all_special_tokens"):
        with contextlib.suppress(Exception):
            tokens.update(str(t) for t in getattr(tokenizer, attr, None) or ())
    return tokens


def _family(name: str, vocab: set[str], template: str) -> ToolCallFormat:
    if name == "mistral":
        return MistralFormat(style="v11" if ARGS in vocab or ARGS in template else "v3")
    if name == "deepseek":
        v31 = bool(template) and "```json" not in template and DS_SEP in template
        return DeepSeekFormat(style="v3.1" if v31 else "r1")
    return TOOL_FORMATS[name]


def detect_family(tokenizer: Any) -> ToolCallFormat:
    """The family format from the tokenizer's chat template, then its vocabulary; hermes if nothing matches."""
    template = _chat_template_text(tokenizer)
    vocab = _vocabulary(tokenizer)
    for where, table in ((template, _TEMPLATE_MARKERS), (vocab, _VOCAB_MARKERS)):
        for name, alternatives in table:
            if any(all(token in where for token in tokens) for tokens in alternatives):
                return _family(name, vocab, template)
    return HERMES


def tool_format_of(loaded: Any) -> ToolCallFormat:
    """How a `LoadedModel`'s tool calls are read: the format its options name, else the one its tokenizer implies."""
    if loaded.tool_format == "auto":
        return tool_format_for(loaded.tokenizer)
    return get_tool_format(loaded.tool_format)


def tool_format_for(tokenizer: Any) -> ToolCallFormat:
    """The format to read this tokenizer's model with.

    A tokenizer carrying a transformers response template its `parse_response` uses
    (`response_template`; with older transformers, `response_schema`; see
    `has_response_template`) is parsed by it (`ResponseTemplateFormat`, writing with the
    detected family); otherwise the family is detected from the chat template and the
    vocabulary (see `detect_family`).
    """
    family = detect_family(tokenizer)
    if has_response_template(tokenizer):
        return ResponseTemplateFormat(tokenizer, writer=family)
    return family
