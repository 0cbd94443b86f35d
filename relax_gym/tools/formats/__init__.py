"""Tool-call formats per model family, and choosing one from a tokenizer.

Each family writes its tool calls its own way; a `ToolCallFormat` reads one family's
generations (decoded with `skip_special_tokens=False`, without the final stop token)
into a `ParsedTurn`, and writes the text such a model generates for given calls.
One module per family:

    hermes             Qwen2.5 / Qwen3 / Hermes `<tool_call>` blocks; `hermes-loose` also reads them untagged
    llama3             Llama 3.1-3.3 JSON calls, optionally after `<|python_tag|>`; Llama 3.2's pythonic list
    mistral            `[TOOL_CALLS]` then a JSON list of calls with ids (v3) or `name[ARGS]{...}` (v11+)
    deepseek           `<｜tool▁call▁begin｜>` calls, R1 / V3 and V3.1 shapes
    harmony            gpt-oss's `<|channel|>commentary to=functions.NAME` messages
    response_template  the tokenizer's own transformers response template

`shared` holds the protocol and the parser helpers, `registry` the formats known by name, and
`lookup` the choice of one for a model or a tokenizer.

Reasoning is kept apart from content: a `<think>` block or the text before a lone `</think>`
(`split_reasoning`; Mistral also `[THINK]...[/THINK]`), harmony's analysis channel. Calls are
read from the content only.

A format may also have a true `call_ids` attribute (Mistral v3): its templates refuse a tool
result without a `tool_call_id`, so `ToolEnv` gives one to every tool message it writes.

Every parser is a total function of untrusted text: malformed calls become `MalformedToolCall`s
the model can read, never exceptions, and all scanning is `str.find` / `str.split` or regexes
without nested quantifiers, so the time is linear in the text.
"""

from relax_gym.tools.formats.deepseek import DeepSeekFormat
from relax_gym.tools.formats.harmony import HarmonyFormat
from relax_gym.tools.formats.hermes import HermesFormat
from relax_gym.tools.formats.llama3 import Llama3Format
from relax_gym.tools.formats.lookup import detect_family, tool_format_for, tool_format_of
from relax_gym.tools.formats.mistral import MistralFormat, make_call_id
from relax_gym.tools.formats.registry import HERMES, TOOL_FORMATS, get_tool_format
from relax_gym.tools.formats.response_template import (
    ResponseTemplateFormat,
    has_response_template,
    message_to_turn,
)
from relax_gym.tools.formats.shared import Calls, ToolCallFormat

__all__ = [
    "HERMES",
    "TOOL_FORMATS",
    "Calls",
    "DeepSeekFormat",
    "HarmonyFormat",
    "HermesFormat",
    "Llama3Format",
    "MistralFormat",
    "ResponseTemplateFormat",
    "ToolCallFormat",
    "detect_family",
    "get_tool_format",
    "has_response_template",
    "make_call_id",
    "message_to_turn",
    "tool_format_for",
    "tool_format_of",
]
