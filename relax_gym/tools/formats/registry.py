"""The formats known by name (what a model's `tool_format` option names), hermes the project's default."""

from __future__ import annotations

from relax_gym.tools.formats.deepseek import DeepSeekFormat
from relax_gym.tools.formats.harmony import HarmonyFormat
from relax_gym.tools.formats.hermes import HermesFormat
from relax_gym.tools.formats.llama3 import Llama3Format
from relax_gym.tools.formats.mistral import MistralFormat
from relax_gym.tools.formats.shared import ToolCallFormat

HERMES = HermesFormat()
TOOL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": HERMES,
    "hermes-loose": HermesFormat(name="hermes-loose", loose=True),
    "llama3": Llama3Format(),
    "mistral": MistralFormat(),
    "deepseek": DeepSeekFormat(),
    "harmony": HarmonyFormat(),
}


def get_tool_format(name: str) -> ToolCallFormat:
    """The registered format called `name`; KeyError naming the known ones otherwise."""
    try:
        return TOOL_FORMATS[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown tool-call format {name!r}; known formats: {', '.join(TOOL_FORMATS)}") from None
