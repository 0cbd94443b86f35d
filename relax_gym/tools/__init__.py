"""Tools: typed functions offered to the model, and the parsers for its calls in each model family's format."""

from relax_gym.tools.formats import (
    TOOL_FORMATS,
    DeepSeekFormat,
    HarmonyFormat,
    HermesFormat,
    Llama3Format,
    MistralFormat,
    ResponseTemplateFormat,
    ToolCallFormat,
    detect_family,
    get_tool_format,
    tool_format_for,
)
from relax_gym.tools.function_tool import (
    TOOL_MARK,
    Tool,
    ToolDefinitionError,
    ToolError,
    ToolResult,
    ToolSet,
    to_parts,
    tool,
)
from relax_gym.tools.parser import MalformedToolCall, ParsedTurn, ToolCall, parse_tool_calls

__all__ = [
    "TOOL_FORMATS",
    "TOOL_MARK",
    "DeepSeekFormat",
    "HarmonyFormat",
    "HermesFormat",
    "Llama3Format",
    "MalformedToolCall",
    "MistralFormat",
    "ParsedTurn",
    "ResponseTemplateFormat",
    "Tool",
    "ToolCall",
    "ToolCallFormat",
    "ToolDefinitionError",
    "ToolError",
    "ToolResult",
    "ToolSet",
    "detect_family",
    "get_tool_format",
    "parse_tool_calls",
    "to_parts",
    "tool",
    "tool_format_for",
]
